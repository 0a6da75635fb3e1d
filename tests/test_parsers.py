"""Tool-call parsers and schema-directed normalisation: every format, broken outputs, and real teacher outputs."""

import json
from pathlib import Path

import pytest

from pipeline.io import read_jsonl
from pipeline.parsers import close_truncated, normalise_arguments, normalise_value, parse_calls, parse_python_calls

FIXTURES = Path(__file__).parent / "fixtures" / "traces"


def test_qwen_hermes_tags_one_per_call():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1+1"}}\n</tool_call>')
    p = parse_calls(text)
    assert p.format == "tool_call_tag"
    assert p.calls == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                       {"name": "calculate", "arguments": {"expression": "1+1"}}]


def test_tag_with_string_arguments_and_unterminated_last_tag():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call><tool_call>\n{"name": "g", "arguments": {}}'
    p = parse_calls(text)
    assert p.calls == [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]


def test_broken_tag_is_reported_not_parsed():
    p = parse_calls('<tool_call>\n{"name": "f", "arguments": {"a": 1\n</tool_call>')
    assert p.calls == [] and p.format is None
    assert p.problems and "tool_call tag" in p.problems[0]


def test_llama3_json_with_parameters_and_python_tag():
    p = parse_calls('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}')
    assert p.format == "llama_json"
    assert p.calls == [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]


def test_fenced_json_two_space_indent_as_qwen_coder_writes_it():
    call = {"name": "book_hotel", "arguments": {"hotel": "Grand Hotel", "nights": 3, "guests": ["Ann", "Bob"]}}
    text = "```json\n" + json.dumps(call, indent=2) + "\n```"
    p = parse_calls(text)
    assert p.format == "fenced_json" and p.calls == [call]


def test_fenced_list_and_prose_around_it():
    calls = [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]
    text = "Sure, here you go:\n```json\n" + json.dumps(calls, indent=2) + "\n```\nLet me know if you need more."
    assert parse_calls(text).calls == calls


def test_unterminated_fence_still_parses_a_complete_object():
    p = parse_calls('```json\n{\n  "name": "f",\n  "arguments": {"q": "x"}\n}')
    assert p.calls == [{"name": "f", "arguments": {"q": "x"}}]


def test_bare_json_object_list_and_openai_function_wrapper():
    assert parse_calls('{"name": "f", "arguments": {"a": true}}').calls == [{"name": "f", "arguments": {"a": True}}]
    assert parse_calls('[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": null}}]').calls == [
        {"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": None}}]
    wrapped = '{"type": "function", "function": {"name": "f", "arguments": "{\\"a\\": 2}"}}'
    assert parse_calls(wrapped).calls == [{"name": "f", "arguments": {"a": 2}}]


def test_bare_json_that_is_not_a_call_is_not_parsed():
    p = parse_calls('The answer is {"temperature": 21} degrees.')
    assert p.calls == [] and p.format is None


def test_api_bank_request():
    p = parse_calls("API-Request: [ToolSearcher(keywords='healthcare provider appointment')]")
    assert p.format == "api_request"
    assert p.calls == [{"name": "ToolSearcher", "arguments": {"keywords": "healthcare provider appointment"}}]
    p = parse_calls("Okay. API-Request: [AddAlarm(token='a9s8d7', time=\"2023-03-20 07:00:00\")]\nDone")
    assert p.calls == [{"name": "AddAlarm", "arguments": {"token": "a9s8d7", "time": "2023-03-20 07:00:00"}}]


def test_api_bank_request_with_code_inside_is_rejected():
    p = parse_calls("API-Request: [Run(cmd=__import__('os').system('x'))]")
    assert p.calls == [] and p.problems


def test_python_call_list_bfcl_style():
    assert parse_python_calls("[math.hypot(x=4, y=5), f(a=[1, 2], b={'k': True})]") == [
        {"name": "math.hypot", "arguments": {"x": 4, "y": 5}}, {"name": "f", "arguments": {"a": [1, 2], "b": {"k": True}}}]
    assert parse_python_calls("f(1, 2)") is None  # positional arguments have no parameter names
    assert parse_calls("[get_weather(city='Paris')]").format == "python_call"


def test_plain_prose_parses_to_nothing():
    p = parse_calls("I'm sorry, I cannot help with that.")
    assert p.calls == [] and p.format is None


SCHEMA = {"type": "object", "required": ["n"], "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "flag": {"type": "boolean"}, "s": {"type": "string"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "tags": {"type": "array", "items": {"type": "integer"}},
    "opts": {"type": "object", "properties": {"k": {"type": "integer"}}},
    "maybe": {"type": ["integer", "null"]}}}


def test_normalise_only_where_the_schema_says():
    args, notes = normalise_arguments({"n": "5", "x": "2.5", "flag": "True", "s": 7, "unit": "Celsius",
                                       "tags": ["1", 2], "opts": {"k": "3"}, "maybe": None}, SCHEMA)
    assert args == {"n": 5, "x": 2.5, "flag": True, "s": "7", "unit": "celsius", "tags": [1, 2], "opts": {"k": 3},
                    "maybe": None}
    assert len(notes) == 7 and any(n.startswith("n: \"5\" -> 5") for n in notes)


def test_normalise_leaves_valid_and_unconvertible_values_alone():
    args, notes = normalise_arguments({"n": 5, "x": 3, "s": "5", "flag": "yes", "unit": "kelvin"}, SCHEMA)
    assert args == {"n": 5, "x": 3, "s": "5", "flag": "yes", "unit": "kelvin"} and notes == []
    assert normalise_value("5.5", {"type": "integer"}) == ("5.5", [])
    assert normalise_value(5.0, {"type": "integer"}) == (5, ["<root>: 5.0 -> 5 (integer)"])


def test_boolean_written_for_a_string_enum_of_its_spelling():
    schema = {"type": "string", "enum": ["True", "False", "dontcare"]}  # BFCL's smoking_allowed
    assert normalise_value(False, schema) == ("False", ["<root>: false -> \"False\" (enum)"])
    assert normalise_value(True, {"type": "string"}) == (True, [])     # no enum: nothing says how to spell it


def test_null_for_optional_non_nullable_parameter_is_dropped_but_required_null_kept():
    args, notes = normalise_arguments({"n": None, "s": None}, SCHEMA)
    assert args == {"n": None} and notes == ["s: null -> omitted (optional, not nullable)"]


# --- real teacher outputs (captured from runs of the traces stage; see tests/fixtures/traces/README.md) ----------

def _real_cases():
    if not FIXTURES.is_dir():
        return []
    return [(f.name, case) for f in sorted(FIXTURES.glob("*.jsonl")) for case in read_jsonl(f)]


@pytest.mark.parametrize("source,case", _real_cases(), ids=lambda v: v if isinstance(v, str) else v["trace"]["id"])
def test_real_teacher_outputs(source, case):
    p = parse_calls(case["trace"]["text"])
    expect = case["expect"]
    assert p.format == expect["format"], source
    assert len(p.calls) == expect["n_calls"]
    if expect.get("first_call") is not None:
        assert p.calls[0] == expect["first_call"]


# --- what the runtime's oracle and the server read with the same parser (from the runtime's former parser) ---------

def test_openai_spellings_fenced_tagged_and_listed():
    call = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "f"}}
    fenced = "Sure:\n```json\n" + json.dumps(call, indent=2) + "\n```"
    tagged = "<tool_call>\n" + json.dumps({"name": "calculate", "arguments": json.dumps({"expression": "1+1"})}) + \
        "\n</tool_call>"
    listed = json.dumps([{"function": {"name": "calculate", "parameters": {}}}])
    assert parse_calls(fenced).calls == [call]
    assert parse_calls(tagged).calls == [{"name": "calculate", "arguments": {"expression": "1+1"}}]
    assert parse_calls(listed).calls == [{"name": "calculate", "arguments": {}}]
    assert parse_calls("no call {here}").calls == [] and parse_calls('{"name": "x", "arguments": "not json"}').calls == []
    assert parse_calls('{"name": "", "arguments": {}}').calls == []  # a call has a name


def test_lenient_parse_repairs_bare_words_and_cut_off_calls():
    bare = '```json\n{\n  "name": "f",\n  "arguments": {\n    "session": jdbcSession,\n    "ok": true\n  }\n}\n```'
    assert parse_calls(bare).calls == []
    fixed = parse_calls(bare, lenient=True)
    assert fixed.calls == [{"name": "f", "arguments": {"session": "jdbcSession", "ok": True}}]
    assert fixed.repair == "bare_words" and fixed.format == "fenced_json"
    cut = '```json\n{\n  "name": "f",\n  "arguments": {\n    "a": [1, 2],\n    "b": "long val'
    closed = parse_calls(cut, lenient=True)
    assert closed.calls == [{"name": "f", "arguments": {"a": [1, 2]}}]  # the last complete member, closed
    assert closed.repair == "truncated"
    assert parse_calls("no call here", lenient=True).calls == []
    whole = '{"name": "f", "arguments": {"a": 1}}'
    assert parse_calls(whole, lenient=True).repair is None  # nothing to repair


def test_close_truncated_closes_the_value_it_was_cut_in():
    assert close_truncated('{"name": "f", "arguments": {"a": 1, "b": "x') == '{"name": "f", "arguments": {"a": 1}}'
    assert close_truncated('{"a": 1}') is None and close_truncated("prose") is None
    # a second value cut off after a complete first one: the second, not a slice of both
    two = '{"name": "f", "arguments": {}} then {"name": "g", "arguments": {"x": [1, 2], "y": tr'
    assert close_truncated(two) == '{"name": "g", "arguments": {"x": [1, 2]}}'
    assert parse_calls(two, lenient=True).calls == [{"name": "f", "arguments": {}}]  # the first is whole: no repair
