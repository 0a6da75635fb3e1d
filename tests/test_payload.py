"""The payload contract: wire form round trips, bytes, calls per tool, errors that say what is wrong."""

import json

import pytest

from pipeline.payload import Payload, PayloadError, payload_bytes

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"]}}},
         {"type": "function", "function": {"name": "calculate", "parameters": {
             "type": "object", "properties": {"expression": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


def test_round_trips_through_the_wire_form():
    p = Payload(1, {"expression": "2+2"}, {0: {"city": "Zürich"}})
    assert p.encode() == '{"tool_index":1,"arguments":{"expression":"2+2"},"others":{"0":{"city":"Zürich"}}}'
    assert p.bytes == len(p.encode()) + 1  # ü is two bytes in UTF-8
    assert Payload.parse(json.loads(p.encode())) == p and Payload.parse(p) is p
    assert Payload.parse(p.to_json()).to_json() == p.to_json()
    top_only = Payload(0, {"city": "Paris"})
    assert top_only.encode() == '{"tool_index":0,"arguments":{"city":"Paris"}}'  # the paper's payload, no "others"
    assert payload_bytes(top_only.to_json()) == top_only.bytes and payload_bytes(None) == 0
    assert payload_bytes({"garbage": 1}) == len('{"garbage":1}')


def test_calls_top_first_then_every_other_tool_with_arguments():
    p = Payload(1, {}, {0: {"city": "Paris"}, 2: {}})
    assert p.call(TOOLS) == {"name": "calculate", "arguments": {}}
    assert p.calls(TOOLS) == [{"name": "calculate", "arguments": {}},
                              {"name": "get_weather", "arguments": {"city": "Paris"}}]  # partial: required lifted
    named = Payload.parse({"name": "get_weather", "arguments": {"unit": "c"}})
    assert named.call(TOOLS) == {"name": "get_weather", "arguments": {"unit": "c"}}


def test_from_call_and_errors():
    call = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "f"}}
    assert Payload.from_call(call, TOOLS) == Payload(0, call["arguments"])
    assert Payload.from_call(call, TOOLS).call(TOOLS) == call
    with pytest.raises(PayloadError, match="not one of the offered tools"):
        Payload.from_call({"name": "nope", "arguments": {}}, TOOLS)
    with pytest.raises(PayloadError, match="do not fit the schema of get_weather"):
        Payload(1, {}, {0: {"unit": "kelvin"}}).calls(TOOLS)
    assert Payload(0, {"unit": "kelvin"}).call(TOOLS, validate=False)["arguments"] == {"unit": "kelvin"}
    with pytest.raises(PayloadError, match="tool_index 3 is not an index into 3 tools"):
        Payload(3, {}).call(TOOLS)
    for bad, why in [([], "expected an object"), ({"tool_index": "x", "arguments": {}}, "not an index"),
                     ({"tool_index": 0, "arguments": {}, "others": []}, "others is list"),
                     ({"tool_index": 0, "arguments": {}, "others": {"a": {}}}, "others key 'a'"),
                     ({"tool_index": 0, "arguments": {}, "others": {"1": "x"}}, "others['1'] is str")]:
        with pytest.raises(PayloadError, match=why.replace("[", r"\[").replace("]", r"\]")):
            Payload.parse(bad)
