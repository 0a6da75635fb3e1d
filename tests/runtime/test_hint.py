"""Payloads -> calls, the target's call formats, text renderings and re-tokenization seams."""

import json

from pipeline.payload import gold_payload
from pipeline.runtime.hint import BARE_COMPACT, FENCED, call_formats, hint_calls, openings, render, seam_tokens, \
    suffix_for, template_format

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"]}}},
         {"type": "function", "function": {"name": "calculate", "parameters": {
             "type": "object", "properties": {"expression": {"type": "string"}}}}}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "f"}}


def test_hint_calls_accept_valid_payloads_and_explain_the_rest():
    assert hint_calls({"tool_index": 0, "arguments": {"city": "Paris"}}, TOOLS) == (
        {"get_weather": {"name": "get_weather", "arguments": {"city": "Paris"}}}, "")
    assert list(hint_calls({"tool_index": 0, "name": "calculate", "arguments": {}}, TOOLS)[0]) == ["calculate"]
    both = {"tool_index": 1, "arguments": {}, "others": {"0": {"city": "Oslo"}}}  # the top tool first
    assert list(hint_calls(both, TOOLS)[0]) == ["calculate", "get_weather"]
    for bad, why in [("garbage", "expected an object"), ({"tool_index": 2, "arguments": {}}, "not an index"),
                     ({"tool_index": True, "arguments": {}}, "not an index"),
                     ({"tool_index": 0, "arguments": "city=Paris"}, "expected an object"),
                     ({"tool_index": 0, "arguments": {"unit": "kelvin"}}, "do not fit the schema"),
                     ({"tool_index": 1, "arguments": {}, "others": {"0": {"unit": "kelvin"}}}, "get_weather"),
                     ({"tool_index": 1, "arguments": {}, "others": {"5": {}}}, "others key 5"),
                     ({"name": "nope", "arguments": {}}, "unknown tool")]:
        calls, msg = hint_calls(bad, TOOLS)
        assert calls == {} and why in msg, (bad, msg)
    assert hint_calls({"tool_index": 0, "arguments": {"unit": "kelvin"}}, TOOLS, validate=False)[0]


def test_template_format_is_probed_from_the_chat_template(tok):
    fmt = template_format(tok)
    assert (fmt.prefix, fmt.suffix, fmt.style.indent, fmt.style.colon) == ("<tool_call>\n", "\n</tool_call>", 0, " ")
    names = [f.name for f in call_formats(tok)]
    assert names == ["template", "fenced", "indented", "compact"]
    rendered = render(CALL, fmt)
    assert rendered == "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>"
    assert render(CALL, FENCED) == "```json\n" + json.dumps(CALL, indent=2) + "\n```"
    assert render(CALL, BARE_COMPACT) == json.dumps(CALL)


def test_openings_and_suffixes_follow_what_the_output_wrote(tok):
    formats = call_formats(tok)
    assert [(f.name, rest) for f, rest in openings("", formats)] == [
        ("template", "<tool_call>\n"), ("fenced", "```json\n"), ("indented", ""), ("compact", "")]
    assert [(f.name, rest) for f, rest in openings("``", formats)] == [("fenced", "`json\n")]
    assert [(f.name, rest) for f, rest in openings("Sure! ```js", formats)] == [("fenced", "on\n")]  # re-joined
    assert openings("The weather is", formats) == []
    assert suffix_for("```json\n", formats) == "\n```" and suffix_for("<tool_call>\n", formats) == "\n</tool_call>"
    assert suffix_for("", formats) == ""


def test_seam_tokens_split_where_the_committed_tokens_end(tok):
    text = "```json\n" + json.dumps(CALL, indent=2) + "\n```"
    full = tok.encode(text, add_special_tokens=False)
    for k in range(1, len(full)):  # at every token boundary of the canonical tokenization: the canonical rest
        cut = len(tok.decode(full[:k]))
        assert seam_tokens(tok, full[:k], text[cut:]) == full[k:]
    # the target wrote the key's closing quote as its own token, so `":` (one token in the canonical
    # tokenization of the whole text) cannot come next: the continuation starts with ':'
    committed = tok.encode('{"city', add_special_tokens=False) + tok.encode('"', add_special_tokens=False)
    assert tok.encode('{"city": "Paris"', add_special_tokens=False)[2] == tok.convert_tokens_to_ids('":')
    ids = seam_tokens(tok, committed, ': "Paris"}')
    assert tok.decode(ids) == ': "Paris"}' and tok.decode(ids[:1]) == ":"
    # special tokens in the committed tail re-tokenize as themselves
    tagged = tok.encode("<tool_call>\n", add_special_tokens=False)
    assert tok.decode(seam_tokens(tok, tagged, '{"name"')) == '{"name"'
    assert seam_tokens(tok, [], "") == []


def test_gold_payload_is_the_first_gold_call():
    assert gold_payload({"tools": TOOLS, "gold": [{"name": "calculate", "arguments": {"expression": "2"}}]}) == {
        "tool_index": 1, "arguments": {"expression": "2"}}
    assert gold_payload({"tools": TOOLS, "gold": []}) is None


# --- the hint drafter in the loop: every tool's draft, partial drafts, lossless ----------------------------------

def _fenced(call):
    return "```json\n" + json.dumps(call, indent=2) + "\n```"


def test_hint_drafter_switches_to_the_tool_the_output_names(tok, requests):
    from pipeline.runtime.drafters import Context, HintDrafter
    from pipeline.runtime.sidecar_client import Ready

    req = requests[0]  # get_weather(city, unit), calculate(expression, precision); gold get_weather(Paris, fahrenheit)
    payload = {"tool_index": 1, "arguments": {"expression": "1+1"},
               "others": {"0": {"city": "Paris", "unit": "fahrenheit"}}}
    hint = HintDrafter(req, call_formats(tok), Ready(payload), 0.0)

    def texts(text):
        ctx = Context(tok, [], tok.encode(text, add_special_tokens=False), tok.eos_token_id, 64, text)
        return [tok.decode(c) for c in hint.propose(ctx)]

    assert '"name": "calculate"' in texts("")[0] and hint.other_tool is False  # the top tool first
    assert texts('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "c')[0] == \
        'ity": "Paris",\n    "unit": "fahrenheit"\n  }\n}\n```<|im_end|>'
    assert hint.other_tool is True and hint.error is None and hint.top == "calculate"
    assert texts('```json\n{\n  "name": "calculate",\n  "arguments": {\n    "')[0].startswith('expression": "1+1"')
    assert hint.other_tool is False
    only_top = HintDrafter(req, call_formats(tok), Ready({"tool_index": 1, "arguments": {}}), 0.0)
    ctx = Context(tok, [], [], tok.eos_token_id, 64, '```json\n{\n  "name": "get_weather"')
    assert only_top.propose(ctx) == [] and only_top.other_tool is False  # no draft for that tool: nothing


def test_replay_accepts_hint_tokens_of_a_tool_that_is_not_the_top_one(tok, requests):
    from pipeline.runtime import Ready, generate
    from pipeline.runtime.drafters import History
    from pipeline.runtime.replay import ReplayTarget

    req = requests[0]
    target = ReplayTarget(tok, {req["id"]: _fenced(req["gold"][0])})
    top_only = {"tool_index": 1, "arguments": {"expression": "1+1"}}
    with_others = dict(top_only, others={"0": {"city": "Paris", "unit": "fahrenheit"}})
    runs = {name: generate(target, req, "ooo", sidecar=Ready(p), max_new_tokens=200, history=History())
            for name, p in (("top", top_only), ("others", with_others))}
    assert runs["top"].token_ids == runs["others"].token_ids == target.outputs[req["id"]]
    assert runs["others"].stats.hint_tokens >= runs["top"].stats.hint_tokens + 8  # "Paris", "fahrenheit", closing
    assert runs["others"].stats.forwards < runs["top"].stats.forwards
    assert runs["others"].stats.payload_bytes == len(json.dumps(with_others, separators=(",", ":")))


def test_partial_hint_without_a_required_slot_is_used_and_lossless(tok, requests, targets):
    from pipeline.runtime import Ready, generate
    from pipeline.runtime.drafters import History
    from pipeline.runtime.replay import ReplayTarget

    req = requests[0]  # get_weather requires city; the hint leaves it to the target
    partial = {"tool_index": 0, "arguments": {"unit": "fahrenheit"}}
    replay = ReplayTarget(tok, {req["id"]: _fenced(req["gold"][0])})
    res = generate(replay, req, "ooo", sidecar=Ready(partial), max_new_tokens=200, history=History())
    assert res.token_ids == replay.outputs[req["id"]] and res.stats.hint_error is None
    assert res.stats.hint_shared_tokens > 0  # the partial draft is proposed and accepted (the enum: schema too)
    for family, target in targets.items():  # float64 tiny targets: the output is ar's, token for token
        ar = generate(target, req, "ar", max_new_tokens=20)
        ooo = generate(target, req, "ooo", sidecar=Ready(partial), max_new_tokens=20)
        assert ooo.token_ids == ar.token_ids and ooo.text == ar.text, family
        assert ooo.stats.hint_error is None and ooo.stats.hint_ready_s is not None, family


def test_replay_realigns_a_hint_value_the_target_writes_otherwise(tok, requests, monkeypatch):
    """The hint's value lacks the target's first words: the realigned hint drafts the rest of it once the output has
    copied a few characters of it; without the realign drafter the hint gives nothing until the value ends."""
    import dataclasses

    from pipeline.methods import METHOD_TABLE
    from pipeline.runtime import Ready, generate
    from pipeline.runtime.drafters import History
    from pipeline.runtime.replay import ReplayTarget

    req = dict(requests[0], id="fixture/realign", tools=[{"type": "function", "function": {
        "name": "send_email", "parameters": {"type": "object", "properties": {
            "to": {"type": "string"}, "body": {"type": "string"}}, "required": ["to", "body"]}}}])
    body = "our review is now on friday. could you send me the slides before then? thanks"
    call = {"name": "send_email", "arguments": {"to": "ann lee", "body": "hi ann, " + body}}
    hint = {"tool_index": 0, "arguments": {"to": "ann lee", "body": body}}
    runs = {}
    for name in ("realign", "aligned only"):
        if name == "aligned only":
            ooo = METHOD_TABLE["ooo"]
            monkeypatch.setitem(METHOD_TABLE, "ooo", dataclasses.replace(
                ooo, drafters=tuple(d for d in ooo.drafters if d != "realign")))
        target = ReplayTarget(tok, {req["id"]: _fenced(call)})
        runs[name] = generate(target, req, "ooo", sidecar=Ready(hint), max_new_tokens=300, history=History())
        assert runs[name].token_ids == target.outputs[req["id"]], name
    st, base = runs["realign"].stats, runs["aligned only"].stats
    assert st.hint_tokens >= base.hint_tokens + 20, (st.hint_tokens, base.hint_tokens)
    assert st.forwards <= base.forwards - 5, (st.forwards, base.forwards)
