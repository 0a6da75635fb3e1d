"""Structural alignment on text: the JSON position tracker, the style it learns, and continuations from any
point of a call, including after a divergence and under a schema (nested objects, enums, arrays)."""

import json

import pytest

from pipeline.runtime.continuation import Arr, Choice, Obj, Open, continue_at
from pipeline.runtime.drafters import skeleton
from pipeline.jsonscan import Style, read_value, scan

CALL = {"name": "book_hotel", "arguments": {"hotel": "Grand \"Ritz\" Zürich", "nights": 3, "guests": ["Ann", "Bob"],
                                            "options": {"breakfast": True, "view": "sea", "extra": None},
                                            "price": -12.5e3}}
RENDERINGS = {
    "fenced": "```json\n" + json.dumps(CALL, indent=2, ensure_ascii=False) + "\n```",
    "tag": "<tool_call>\n" + json.dumps(CALL, ensure_ascii=False) + "\n</tool_call>",
    "indent4": json.dumps(CALL, indent=4, ensure_ascii=False),
    "tight": json.dumps(CALL, separators=(",", ":"), ensure_ascii=False),
}


def _continuations(text, value):
    pos = scan(text)
    return list(dict.fromkeys(t for style in pos.style.variants() for t, _ in continue_at(pos, value, style)))


def test_scanner_tracks_keys_values_and_partial_tokens():
    text = RENDERINGS["fenced"]
    pos = scan(text[:text.index("Grand") + 3])
    assert (pos.state, pos.path(), pos.partial, pos.prefix) == ("in_value", ["arguments", "hotel"], '"Gra', "```json\n")
    pos = scan(text[:text.index('"nights"') + 3])
    assert (pos.state, pos.partial, pos.stack[-1].keys) == ("in_key", '"ni', ["hotel"])
    pos = scan(text[:text.index('"Bob"')])
    assert (pos.state, pos.path(), pos.ws) == ("value", ["arguments", "guests", 0], "\n      ")
    assert pos.stack[-1].count == 1 and pos.stack[-1].values == {0: "Ann"}
    pos = scan(text)
    assert (pos.state, pos.calls, pos.suffix) == ("done", 1, "\n```")
    assert scan("Sure, here it is: get_weather(city=1)").state == "start"
    assert scan('{"a": ]').state == "invalid"
    pos = scan('{"session": jdbcSession, "n": 2')  # a bare word some targets write: the structure goes on
    assert (pos.state, pos.stack[0].values) == ("in_value", {"session": "jdbcSession"})


@pytest.mark.parametrize("name,style", [("fenced", Style(2, " ", None, False)), ("tag", Style(0, " ", " ", True)),
                                        ("indent4", Style(4, " ", None, False)), ("tight", Style(0, "", "", True))])
def test_style_is_learned_from_the_output(name, style):
    assert scan(RENDERINGS[name]).style == style


@pytest.mark.parametrize("name", sorted(RENDERINGS))
def test_known_call_continues_exactly_from_every_point(name):
    """From any character of the output inside the JSON, one candidate completes it exactly (for unusual styles,
    once the output has shown its style: the default guesses are 2-space indented and one-line with spaces)."""
    text = RENDERINGS[name]
    start, end = text.index("{"), text.rindex("}") + 1
    if name in ("indent4", "tight"):
        start = text.index(",") + 1
    for cut in range(start + 1, end):
        conts = _continuations(text[:cut], CALL)
        assert text[cut:end] in conts, (name, text[:cut][-30:], conts[:3])


def test_alignment_rejoins_after_a_divergent_value_and_a_different_key_order():
    hint = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "fahrenheit", "days": 2}}
    out = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Ly'
    assert _continuations(out, hint) == []  # inside a value the hint does not know: nothing to propose
    out += 'on, France"'
    assert _continuations(out, hint)[0] == ',\n    "unit": "fahrenheit",\n    "days": 2\n  }\n}'
    out += ',\n    "days": 5'  # the target writes the keys in another order, and another value
    assert _continuations(out, hint)[0] == ',\n    "unit": "fahrenheit"\n  }\n}'
    tag = '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"'  # an alias of "arguments"
    assert _continuations(tag, hint)[0] == ', "unit": "fahrenheit", "days": 2}}'


def test_whitespace_already_written_is_not_proposed_again():
    out = '{\n  "name": "f",\n  '
    assert _continuations(out, {"name": "f", "arguments": {}}) == ['"arguments": {}\n}']
    assert _continuations(out + '"arg', {"name": "f", "arguments": {}}) == ['uments": {}\n}']


TOOL = {"type": "object", "required": ["hotel"], "properties": {
    "hotel": {"type": "string"}, "nights": {"type": "integer"},
    "options": {"type": "object", "properties": {"breakfast": {"type": "boolean"},
                                                 "view": {"type": "string", "enum": ["sea", "city"]}}},
    "guests": {"type": "array", "items": {"type": "string"}}}}


def test_schema_skeleton_for_nested_enum_array_parameters():
    sk = skeleton(TOOL)
    assert isinstance(sk, Obj) and sk.required == {"hotel"} and list(sk.members) == ["hotel", "nights", "options",
                                                                                       "guests"]
    assert sk.members["hotel"] == Open('"') and sk.members["nights"] == Open("")
    assert sk.members["options"].members == {"breakfast": Choice([True, False]), "view": Choice(["sea", "city"])}
    assert sk.members["guests"] == Arr(Open('"'))
    assert skeleton({"enum": ["only"]}) == "only" and skeleton({"type": ["null", "boolean"]}) == Choice([True, False])


def test_schema_machine_proposes_scaffolding_and_never_values():
    call = {"name": "book_hotel", "arguments": skeleton(TOOL)}
    out = '```json\n{\n  "name": "book_hotel",\n  "arguments": {\n    "'
    conts = _continuations(out, call)
    assert conts[0] == 'hotel": "'  # the required key, then the value's opening quote only
    assert conts[1] == 'nights": '
    assert all(c.startswith(('hotel": "', 'nights": ', 'options": {')) for c in conts)  # up to 3 keys, schema order
    assert 'options": {\n      "breakfast": false,\n      "view": "city"\n    },\n    "hotel": "' in conts
    out += 'hotel": "Ritz"'
    conts = _continuations(out, call)
    assert conts[0] == ',\n    "nights": '  # next key in schema order; the number is unknown
    assert '\n  }\n}' in conts  # all required keys are there: closing is a candidate too
    out += ',\n    "nights": 3'
    conts = _continuations(out, call)
    opts = ',\n    "options": {\n      "breakfast": true,\n      "view": "sea"\n    },\n    "guests": ['
    assert conts[0] == opts + '"'  # enum and boolean members one branch each; arrays on one line first,
    assert opts + '\n      "' in conts  # then broken like objects (the output has not shown an array yet)
    out += ',\n    "options": {\n      "breakfast": false,\n      "view": "c'
    conts = _continuations(out, call)
    assert conts[0].startswith('ity"\n    }') and not any(c.startswith("ea") for c in conts)  # enum completion
    out += 'ity"\n    },\n    "guests": ["Ann", '
    assert _continuations(out, call)[0] == '"'  # an array item of strings opens with a quote


# --- read_value: one value from a given opener, with spans (the server's streaming call view reads with it) --------

def test_read_value_records_spans_of_every_member():
    text = 'x {"name": "f", "arguments": {"a": [1, "two"], "b": null}} tail'
    root, stop = read_value(text, 2)
    assert stop is None and (root.start, root.end) == (2, text.index(" tail"))
    (k1, name), (k2, args) = root.members
    assert (k1, name.kind, text[name.start:name.end]) == ("name", '"', '"f"')
    assert (k2, args.kind, text[args.start:args.end]) == ("arguments", "{", '{"a": [1, "two"], "b": null}')
    (ka, arr), (kb, nul) = args.members
    assert ka == "a" and [text[n.start:n.end] for _, n in arr.members] == ["1", '"two"'] and [k for k, _ in arr.members] == [None, None]
    assert (kb, nul.kind, text[nul.start:nul.end]) == ("b", "s", "null")


def test_read_value_stops_where_the_text_stops_being_json():
    text = '{"a": 1, "b": bare, "c": 2}'
    root, stop = read_value(text, 0)
    assert stop == text.index("bare") and root.end is None  # strict: a bare word is not JSON
    root, stop = read_value(text, 0, strict=False)
    assert stop is None and root.end == len(text)  # tolerant (what the drafters' scan does): the structure goes on
    for bad, at in [('{"a" 1}', 5), ('{"a": 1,}', 8), ('[1,]', 3), ('{"a": }', 6), ('{"a": "x\\q"}', 6)]:
        assert read_value(bad, 0)[1] == at, bad


def test_read_value_leaves_unfinished_values_open():
    for text in ['{"name": "f", "arguments": {"q": "Par', '{"n": 12', '[tr', '{"a": [1, {"b"']:
        root, stop = read_value(text, 0)
        assert stop is None and root.end is None, text
    root, _ = read_value('{"n": 12', 0)
    assert root.members[0][1].end is None  # a number at the end of the text may still grow
    with pytest.raises(ValueError, match="not"):
        read_value("abc", 0)


def test_read_value_reads_one_value_and_scan_finds_the_same_structure():
    text = '{"a": {"b": [1, 2]}} {"c": 3}'
    root, stop = read_value(text, 0)
    assert stop is None and root.end == text.index("} {") + 1 and len(root.members) == 1
    pos = scan(text)  # scan goes on to the last value and keeps its spans too
    assert pos.state == "done" and pos.root.start == text.rindex("{") and pos.root.end == len(text)
