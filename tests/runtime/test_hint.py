"""Payloads -> calls, the target's call formats, text renderings, re-tokenization seams, and call parsing."""

import json

from pipeline.runtime.hint import BARE_COMPACT, FENCED, call_formats, openings, payload_call, render, seam_tokens, \
    suffix_for, template_format
from pipeline.runtime.parse import gold_payload, parse_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"]}}},
         {"type": "function", "function": {"name": "calculate", "parameters": {
             "type": "object", "properties": {"expression": {"type": "string"}}}}}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "f"}}


def test_payload_call_accepts_valid_payloads_and_explains_the_rest():
    assert payload_call({"tool_index": 0, "arguments": {"city": "Paris"}}, TOOLS) == (
        {"name": "get_weather", "arguments": {"city": "Paris"}}, "")
    assert payload_call({"tool_index": 0, "name": "calculate", "arguments": {}}, TOOLS)[0]["name"] == "calculate"
    for bad, why in [("garbage", "expected an object"), ({"tool_index": 2, "arguments": {}}, "not an index"),
                     ({"tool_index": True, "arguments": {}}, "not an index"),
                     ({"tool_index": 0, "arguments": "city=Paris"}, "expected an object"),
                     ({"tool_index": 0, "arguments": {"unit": "kelvin"}}, "do not fit the schema"),
                     ({"name": "nope", "arguments": {}}, "unknown tool")]:
        call, msg = payload_call(bad, TOOLS)
        assert call is None and why in msg, (bad, msg)
    assert payload_call({"tool_index": 0, "arguments": {"unit": "kelvin"}}, TOOLS, validate=False)[0] is not None


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


def test_parse_calls_finds_fenced_tagged_and_bare_calls():
    fenced = "Sure:\n```json\n" + json.dumps(CALL, indent=2) + "\n```"
    tagged = "<tool_call>\n" + json.dumps({"name": "calculate", "arguments": json.dumps({"expression": "1+1"})}) + \
        "\n</tool_call>"
    bare = json.dumps([{"function": {"name": "calculate", "parameters": {}}}])
    assert parse_calls(fenced) == [CALL]
    assert parse_calls(tagged) == [{"name": "calculate", "arguments": {"expression": "1+1"}}]
    assert parse_calls(bare) == [{"name": "calculate", "arguments": {}}]
    assert parse_calls("no call {here}") == [] and parse_calls('{"name": "x", "arguments": "not json"}') == []
    assert gold_payload({"tools": TOOLS, "gold": [{"name": "calculate", "arguments": {"expression": "2"}}]}) == {
        "tool_index": 1, "arguments": {"expression": "2"}}
    assert gold_payload({"tools": TOOLS, "gold": []}) is None


def test_lenient_parse_repairs_bare_words_and_cut_off_calls():
    from pipeline.runtime.parse import parse_lenient

    bare = '```json\n{\n  "name": "f",\n  "arguments": {\n    "session": jdbcSession,\n    "ok": true\n  }\n}\n```'
    assert parse_calls(bare) == [] and parse_lenient(bare) == [
        {"name": "f", "arguments": {"session": "jdbcSession", "ok": True}}]
    cut = '```json\n{\n  "name": "f",\n  "arguments": {\n    "a": [1, 2],\n    "b": "long val'
    assert parse_lenient(cut) == [{"name": "f", "arguments": {"a": [1, 2]}}]  # the last complete member, closed
    assert parse_lenient("no call here") == []
