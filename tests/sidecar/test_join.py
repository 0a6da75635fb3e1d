"""The join: answers -> payload (function index, schema-checked slots of every tool, compact JSON, byte size)."""

import json
from pathlib import Path

from pipeline.payload import Payload
from pipeline.sidecar.join import answer_from_json, answer_json, join, join_answers, parse_answers
from pipeline.sidecar.rows import UNKNOWN, Unknown, parse_slot_answer, wave_questions

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "requests.jsonl"
REQUESTS = [json.loads(line) for line in FIXTURES.read_text().splitlines() if line.strip()]
HOTEL = REQUESTS[1]  # get_weather(city, unit enum), book_hotel(hotel, nights>=1, guests[str], options{...}), calculate


def test_parse_answers_function_slots_and_unknown():
    _, keys = wave_questions(HOTEL)
    texts = ["1"] + ["null"] * (len(keys) - 1)
    texts[keys.index(("slot", 1, "hotel"))] = '"Grand Hotel"'
    texts[keys.index(("slot", 1, "nights"))] = "3 nights"  # not JSON
    answers = parse_answers(keys, texts, n_tools=3)
    assert answers[0] == {"kind": "function", "tool": None, "param": None, "text": "1", "value": 1}
    by_key = {(a["tool"], a["param"]): a["value"] for a in answers[1:]}
    assert by_key[(1, "hotel")] == "Grand Hotel"
    assert isinstance(by_key[(1, "nights")], Unknown)
    assert by_key[(0, "city")] is None
    assert parse_answers([("function",)], ["3"], n_tools=3)[0]["value"] is None  # out of range
    assert parse_answers([("function",)], ["true"], n_tools=3)[0]["value"] is None  # bool is not an index


def test_a_bare_word_is_read_as_the_string_it_spells_and_the_schema_still_decides():
    assert parse_slot_answer("snapshotRequest") == "snapshotRequest"
    assert parse_slot_answer(" System.out\n") == "System.out" and parse_slot_answer("$el") == "$el"
    assert parse_slot_answer('"quoted"') == "quoted" and parse_slot_answer("12") == 12  # JSON first
    assert parse_slot_answer("null") is None and parse_slot_answer("[1]") == [1]
    for text in ("3 nights", "1abc", "foo,bar", 'f("x")', "it's", "{a", "[b", "", "   ", "nul", "tr", "None", "False"):
        assert isinstance(parse_slot_answer(text), Unknown), text
    assert parse_answers([("function",)], ["one"], n_tools=3)[0]["value"] is None  # a function answer is an index
    _, keys = wave_questions(HOTEL)
    texts = ["1"] + ["null"] * (len(keys) - 1)
    texts[keys.index(("slot", 1, "hotel"))] = "Grand_Hotel"  # a string parameter: kept
    texts[keys.index(("slot", 1, "nights"))] = "three"  # an integer parameter: the join drops the word
    joined = join_answers(HOTEL["tools"], parse_answers(keys, texts, n_tools=3))
    assert joined.payload.arguments == {"hotel": "Grand_Hotel"}
    assert [(d["param"], d["value"]) for d in joined.dropped] == [("nights", "three")]


def test_join_keeps_the_chosen_tool_on_top_and_the_others_non_null_valid_slots():
    slots = {(0, "city"): "Paris", (0, "unit"): None, (1, "hotel"): "Grand Hotel", (1, "nights"): 3,
             (1, "guests"): ["Ann", "Bob"], (1, "options"): {"breakfast": True, "view": "sea"},
             (2, "expression"): UNKNOWN, (2, "precision"): None}
    j = join(HOTEL["tools"], 1, slots)
    assert j.payload == Payload(1, {"hotel": "Grand Hotel", "nights": 3, "guests": ["Ann", "Bob"],
                                    "options": {"breakfast": True, "view": "sea"}}, {0: {"city": "Paris"}})
    assert j.dropped == [] and j.missing_required == [] and j.call_errors == []
    # schema order of the tool, not the order of the answers
    assert list(j.payload.arguments) == ["hotel", "nights", "guests", "options"]
    # tool 2 answered nothing usable: no entry; the runtime can draft tools 1 and 0
    assert [c["name"] for c in j.payload.calls(HOTEL["tools"])] == ["book_hotel", "get_weather"]


def test_join_drops_schema_invalid_null_and_unknown_slots():
    slots = {(1, "hotel"): "Grand Hotel", (1, "nights"): 0,  # minimum 1
             (1, "guests"): "Ann",  # not an array
             (1, "options"): {"view": "mountain"},  # enum
             (0, "unit"): "kelvin"}
    j = join(HOTEL["tools"], 1, slots)
    assert j.payload == Payload(1, {"hotel": "Grand Hotel"})  # the other tool's only slot is invalid: no entry
    assert [(d["tool"], d["param"]) for d in j.dropped] == [(1, "nights"), (1, "guests"), (1, "options"), (0, "unit")]
    assert "minimum" in j.dropped[0]["reason"] or "less than" in j.dropped[0]["reason"]
    assert j.missing_required == ["nights"]  # a draft may leave required parameters to the target

    j = join(HOTEL["tools"], 1, {(1, "hotel"): None, (1, "nights"): UNKNOWN})
    assert j.payload == Payload(1, {}) and j.dropped == []
    assert j.missing_required == ["hotel", "nights"]


def test_join_without_a_valid_function_answer_has_no_payload():
    for index in (None, -1, 3):
        j = join(HOTEL["tools"], index, {(1, "hotel"): "Grand Hotel"})
        assert j.payload is None


def test_whole_call_check_resolves_refs_and_reports_root_errors():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": {"unit": {"enum": ["c", "f"]}},
        "properties": {"u": {"$ref": "#/$defs/unit"}, "a": {"type": "integer"}, "b": {"type": "integer"}},
        "dependentRequired": {"a": ["b"]}, "minProperties": 2, "required": ["u"]}}}
    j = join([tool], 0, {(0, "u"): "x", (0, "a"): 1})
    assert j.payload == Payload(0, {"a": 1})
    assert j.dropped[0]["param"] == "u" and j.dropped[0]["reason"].startswith("call:")
    assert j.missing_required == ["u", "b"]  # required, and b because a is present (dependentRequired)
    assert len(j.call_errors) == 1 and "enough properties" in j.call_errors[0]
    assert join([tool], 0, {(0, "u"): "c", (0, "a"): 1, (0, "b"): 2}).payload.arguments == {"u": "c", "a": 1, "b": 2}
    # the same root error in another tool's draft leaves that tool out (others are always schema-valid)
    other = {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {}}}}
    j = join([other, tool], 0, {(1, "u"): "c"})
    assert j.payload == Payload(0, {}) and j.dropped[-1]["tool"] == 1 and "enough properties" in j.dropped[-1]["reason"]
    assert join([other, tool], 0, {(1, "u"): "c", (1, "a"): 1}).payload.others == {1: {"u": "c", "a": 1}}


def test_join_answers_end_to_end_and_json_round_trip():
    _, keys = wave_questions(REQUESTS[0])
    texts = {("function",): "0", ("slot", 0, "city"): '"Paris"', ("slot", 0, "unit"): '"fahrenheit"',
             ("slot", 1, "expression"): '"2+2"', ("slot", 1, "precision"): "nul"}
    answers = parse_answers(keys, [texts[k] for k in keys], 2)
    j = join_answers(REQUESTS[0]["tools"], answers)
    assert j.payload == Payload(0, {"city": "Paris", "unit": "fahrenheit"}, {1: {"expression": "2+2"}})
    assert j.payload.encode() == ('{"tool_index":0,"arguments":{"city":"Paris","unit":"fahrenheit"},'
                                  '"others":{"1":{"expression":"2+2"}}}')
    plain = [answer_json(a) for a in answers]
    json.dumps(plain)  # serializable
    assert plain[-1]["unknown"] is True and plain[-1]["value"] is None
    back = [answer_from_json(a) for a in plain]
    assert isinstance(back[-1]["value"], Unknown) and back[1]["value"] == "Paris"
