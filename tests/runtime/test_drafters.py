"""Drafters on token contexts: prompt lookup, history, the schema state machine, the hint (polled, validated)."""

import json
import time

from pipeline.runtime.drafters import Context, HintDrafter, History, HistoryDrafter, NgramIndex, PromptLookup, \
    SchemaDrafter
from pipeline.runtime.hint import call_formats
from pipeline.runtime.sidecar_client import Ready


def _ctx(tok, text, prompt=(), max_depth=64):
    output = tok.encode(text, add_special_tokens=False)
    return Context(tok, list(prompt), output, tok.eos_token_id, max_depth, text)


def _texts(tok, cands):
    return [tok.decode(c) for c in cands]


def test_ngram_lookup_prefers_long_and_recent_matches():
    idx = NgramIndex(n_max=3, n_min=1)
    idx.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3])
    assert idx.lookup([7, 2, 3], k=2, max_cands=2) == [[5, 6], [4, 9]]  # most recent 2-gram match first
    assert idx.lookup([8, 1, 2, 3], k=3, max_cands=1) == [[4, 9, 2]]  # the 3-gram wins over the 2-gram
    assert idx.lookup([42], k=3, max_cands=3) == []


def test_prompt_lookup_copies_from_prompt_and_output(tok):
    prompt = tok.encode("weather in Paris in fahrenheit please", add_special_tokens=False)
    pl = PromptLookup(prompt, k=4, max_cands=1)
    ctx = _ctx(tok, '"city": "Paris in', prompt)
    assert _texts(tok, pl.propose(ctx))[0].startswith(" fahrenheit")


def test_history_matches_earlier_outputs_and_learns_the_call_format(tok):
    hist = History()
    first = "```json\n" + json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}, indent=2) + "\n```"
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    hist.add(prompt, tok.encode(first, add_special_tokens=False), first)
    drafter = HistoryDrafter(hist, k=64)
    assert _texts(tok, drafter.propose(_ctx(tok, "", prompt)))[0] == first  # the opening of a new answer
    ctx = _ctx(tok, '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "', prompt)
    assert _texts(tok, drafter.propose(ctx))[0].startswith('city": "Paris"\n  }\n}')
    formats = hist.formats(call_formats(tok))
    assert formats[0].name == "observed" and formats[0].prefix == "```json\n" and formats[0].style.indent == 2
    assert [f.name for f in formats[1:]] == ["template", "indented", "compact"]  # the fenced duplicate is dropped


def test_history_prefers_the_format_written_under_the_same_system_message(tok):
    from pipeline.runtime.drafters import context_of

    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    fenced = "```json\n" + json.dumps(call, indent=2) + "\n```"
    bare = json.dumps(call)
    app_a = {"messages": [{"role": "system", "content": "You book trips."}, {"role": "user", "content": "x"}]}
    app_b = {"messages": [{"role": "user", "content": "y"}]}
    assert context_of(app_a) == "You book trips." and context_of(app_b) == ""
    hist = History()
    for _ in range(3):  # app B's fenced calls are the most frequent overall
        hist.add([1], tok.encode(fenced, add_special_tokens=False), fenced, context_of(app_b))
    hist.add([1], tok.encode(bare, add_special_tokens=False), bare, context_of(app_a))
    first = {name: hist.formats(call_formats(tok), context_of(req))[0] for name, req in (("a", app_a), ("b", app_b))}
    assert (first["a"].prefix, first["a"].style.indent) == ("", 0)          # what app A's target wrote
    assert (first["b"].prefix, first["b"].style.indent) == ("```json\n", 2)
    unseen = hist.formats(call_formats(tok), "another application")[0]
    assert unseen.prefix == "```json\n"  # an unseen context: the most frequent format anywhere


def test_schema_drafter_proposes_openings_tool_names_keys_and_closings(tok, requests):
    req = requests[1]  # get_weather / book_hotel / calculate; the user asks for a hotel
    sd = SchemaDrafter(req, call_formats(tok), max_cands=12)
    assert list(sd.calls)[0] == "book_hotel"  # ranked by words shared with the user message
    start = _texts(tok, sd.propose(_ctx(tok, "")))
    assert start[0].startswith('<tool_call>\n{"name": "book_hotel", "arguments": {"hotel": "')
    assert any(t.startswith('```json\n{\n  "name": "book_hotel",\n  "arguments": {\n    "hotel": "') for t in start)
    named = _texts(tok, sd.propose(_ctx(tok, '```json\n{\n  "name": "get_')))
    assert named == ['weather",\n  "arguments": {\n    "city": "']
    done = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"'
    after = _texts(tok, sd.propose(_ctx(tok, done)))
    assert after[0].startswith(',\n    "unit": "celsius"') and '\n  }\n}\n```<|im_end|>' in after
    assert sd.propose(_ctx(tok, done + '\n  }\n}\n``')) == [tok.encode("`", add_special_tokens=False) + [tok.eos_token_id]]
    assert sd.propose(_ctx(tok, "The answer is 42")) == []


def test_hint_drafter_uses_only_valid_payloads_for_the_tool_the_target_chose(tok, requests):
    req = requests[0]
    fmts = call_formats(tok)
    good = HintDrafter(req, fmts, Ready({"tool_index": 0, "arguments": {"city": "Paris", "unit": "fahrenheit"}}),
                       time.time())
    texts = _texts(tok, good.propose(_ctx(tok, '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "c')))
    assert texts[0] == 'ity": "Paris",\n    "unit": "fahrenheit"\n  }\n}\n```<|im_end|>'
    assert 0 <= good.ready_s < 5 and good.bytes == len('{"tool_index":0,"arguments":{"city":"Paris","unit":"fahrenheit"}}')
    assert good.propose(_ctx(tok, '```json\n{\n  "name": "calculate"')) == []  # another tool: hint not used
    assert "<tool_call>" in _texts(tok, good.propose(_ctx(tok, "")))[0]
    bad = HintDrafter(req, fmts, Ready({"tool_index": 0, "arguments": {"unit": "kelvin"}}), 0.0)
    assert bad.propose(_ctx(tok, "")) == [] and "schema" in bad.error
    none = HintDrafter(req, fmts, None, 0.0)
    assert none.propose(_ctx(tok, "")) == [] and none.error is None and none.ready_s is None


def test_schema_array_of_enums_is_drafted_without_endless_expansion(tok):
    """An array whose items are an enum has no length in the schema: drafting it once recursed without end."""
    from pipeline.runtime import generate
    from pipeline.runtime.replay import ReplayTarget

    tool = {"type": "function", "function": {"name": "find", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "enum": ["Civil", "Divorce", "Business"]}},
        "fee": {"type": "integer"}}, "required": ["tags", "fee"]}}}
    req = {"id": "arr", "messages": [{"role": "user", "content": "divorce lawyer"}], "tools": [tool]}
    text = '```json\n{\n  "name": "find",\n  "arguments": {\n    "tags": ["Divorce", "Civil"],\n    "fee": 4\n  }\n}\n```'
    target = ReplayTarget(tok, {"arr": text})
    res = generate(target, req, "toolspec", max_new_tokens=200)
    assert target.decode(res.token_ids[:-1]) == text and res.stats.forwards < res.stats.new_tokens


def test_history_is_bounded_and_keeps_the_newest_outputs():
    from pipeline.runtime.drafters import History

    h = History(max_outputs=4)
    for i in range(10):
        h.add([1, 2, 3], [100 + i, 200 + i, 300 + i, 400 + i])
    assert len(h.kept) <= 4
    assert h.index.lookup([109, 209], 2, 1) == [[309, 409]]   # the newest output is drafted
    assert h.index.lookup([100, 200], 2, 1) == []             # the oldest was dropped with its index entries


def test_resync_meets_the_known_string_again_where_the_output_left_it():
    from pipeline.runtime.continuation import resync

    def texts(known, partial):
        return [t for t, _ in resync(json.dumps(known), '"' + partial)]

    assert texts("an expert", "exp") == ['ert"']  # the output left out the article, then copies on
    assert texts("home/user/java/libs", "/usr/local/classes:/hom") == ['e/user/java/libs"']  # the longest recent stretch
    assert texts("projects/app", "/") == ['projects/app"']  # a character of its own before the known text
    assert texts("Dr. Kim", "Dr. Lee") == []  # nothing of the known string recurs: no guess
    assert texts("abc", "xyzab") == []  # fewer than RESYNC_MIN characters in common, too long to be a prefix


def test_realign_drafter_drafts_the_hint_only_where_the_output_left_its_value(tok, requests):
    from pipeline.runtime.drafters import RealignDrafter

    req = requests[0]
    hint = HintDrafter(req, call_formats(tok), Ready({"tool_index": 0, "arguments": {"city": "Paris",
                                                                                     "unit": "fahrenheit"}}), 0.0)
    realign = RealignDrafter(hint)
    head = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "'
    off = _ctx(tok, head + "City of Par")
    assert hint.propose(off) == []  # the aligned hint has nothing once the value left it
    assert _texts(tok, realign.propose(off))[0] == 'is",\n    "unit": "fahrenheit"\n  }\n}\n```<|im_end|>'
    on = _ctx(tok, head + "Pa")
    assert realign.propose(on) == [] and _texts(tok, hint.propose(on))[0].startswith('ris"')
    assert realign.propose(_ctx(tok, head[:-8] + '"ci')) == []  # a key, not a value
    assert realign.propose(_ctx(tok, '```json\n{\n  "name": "get_w')) == []  # the root's name is the schema's
    assert RealignDrafter(HintDrafter(req, call_formats(tok), None, 0.0)).propose(off) == []  # no payload
