"""Sidecar accuracy metrics on fixed predictions: reference calls (labels over gold), value EM apart from null P/R
under one set of rules (BFCL options included), multi-tool function accuracy, skipped requests, the table.
The stage that runs the wave is tested in tests/stages/test_sidecar_eval.py; the rules in tests/test_scoring.py."""

import json
from pathlib import Path

import pytest

from pipeline.io import InputError
from pipeline.payload import payload_bytes
from pipeline.sidecar.accuracy import (aggregate, in_conversation, load_labels, markdown_table, miss_kind, misses_table,
                                      reference_call, reparse_row, request_misses, score_request, summarize)
from pipeline.sidecar.rows import UNKNOWN, wave_questions

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "requests.jsonl"
REQUESTS = [json.loads(line) for line in FIXTURES.read_text().splitlines() if line.strip()]


def test_reference_call_prefers_the_label_and_skips_what_cannot_be_judged():
    ref = reference_call(REQUESTS[2])
    assert ref["tool_index"] == 0 and ref["accept"]["precision"] == [0.01, ""] and ref["source"] == "gold"
    assert reference_call({**REQUESTS[0], "gold": []}) is None
    assert reference_call({**REQUESTS[0], "gold": [{"name": "not_offered", "arguments": {}}]}) is None
    label = {"id": "fixture/0", "tool_index": 1, "name": "calculate", "arguments": {"expression": "1"}}
    assert reference_call(REQUESTS[0], label) == {"tool_index": 1, "arguments": {"expression": "1"}, "accept": None,
                                                  "source": "labels"}


def _pred(function, slots, payload):
    return {"function": function, "slots": slots, "payload": payload, "payload_bytes": payload_bytes(payload)}


# Fixed predictions for the four fixture requests (file order); expected counts worked out by hand in the comments.
PA = {"tool_index": 0, "arguments": {"city": "Paris", "unit": "celsius"}, "others": {"1": {"expression": "2"}}}
PB = {"tool_index": 0, "arguments": {"expression": "12 * 7 + 3"}}
PC = {"tool_index": 2, "arguments": {}}
PD = {"tool_index": 1, "arguments": {"city": "Tokyo"}}
PREDICTIONS = [
    # gold get_weather(Paris, fahrenheit), 2 tools: function right, city right, unit wrong
    _pred(0, {(0, "city"): "Paris", (0, "unit"): "celsius", (1, "expression"): "2", (1, "precision"): None}, PA),
    # gold book_hotel, 3 tools: function wrong; 3 of 4 values right (3.0 == 3, dict order free), guests unknown
    _pred(2, {(0, "city"): "x", (0, "unit"): None, (1, "hotel"): "Grand Hotel", (1, "nights"): 3.0,
              (1, "guests"): UNKNOWN, (1, "options"): {"view": "sea", "breakfast": True},
              (2, "expression"): None, (2, "precision"): None}, PC),
    # gold calculate("12*7+3", 0.01) with options, 1 tool: both values match ("" lets precision be omitted, so its
    # null is a right null too), call EM
    _pred(0, {(0, "expression"): "12 * 7 + 3", (0, "precision"): None}, PB),
    # gold get_weather(Tokyo), unit absent, 2 tools: all right, a true null; call EM
    _pred(1, {(0, "hotel"): "Ritz", (0, "nights"): None, (0, "guests"): None, (0, "options"): None,
              (1, "city"): "Tokyo", (1, "unit"): None}, PD),
]


def test_score_request_on_fixed_predictions():
    scores = [score_request(r, p, reference_call(r)) for r, p in zip(REQUESTS, PREDICTIONS)]
    assert [s["function_correct"] for s in scores] == [True, False, True, True]
    assert [s["multi_tool"] for s in scores] == [True, True, False, True]
    assert [(s["value_slots"], s["value_correct"]) for s in scores] == [(2, 1), (4, 3), (2, 2), (1, 1)]
    assert [(s["null_tp"], s["null_fp"], s["null_fn"]) for s in scores] == [(0, 0, 0), (0, 0, 0), (1, 0, 0), (1, 0, 0)]
    assert [s["whole_call"] for s in scores] == [False, False, True, True]
    assert [s["unknown"] for s in scores] == [0, 1, 0, 0] and [s["others"] for s in scores] == [1, 0, 0, 0]
    # a missed null (the reference omits unit) and a null where a value was due
    missed = score_request(REQUESTS[3], _pred(1, {(1, "city"): None, (1, "unit"): "celsius"}, None),
                           reference_call(REQUESTS[3]))
    assert (missed["null_tp"], missed["null_fp"], missed["null_fn"]) == (0, 1, 1)
    assert (missed["value_slots"], missed["value_correct"], missed["has_payload"]) == (1, 0, False)


def test_a_stored_row_is_judged_as_todays_parse_and_join_read_its_texts():
    hotel = REQUESTS[1]  # book_hotel(hotel: string, nights: integer >= 1, ...) is tool 1
    _, keys = wave_questions(hotel)
    texts = ["1"] + ["null"] * (len(keys) - 1)
    texts[keys.index(("slot", 1, "hotel"))] = "Grand_Hotel"  # a bare word: unknown to the parse that stored the row
    old = {"id": hotel["id"], "function": 1, "payload": {"tool_index": 1, "arguments": {}}, "payload_bytes": 35,
           "slots": [[k[1], k[2], None, k == ("slot", 1, "hotel")] for k in keys[1:]], "answers": texts,
           "timings": {"total": 1.0}, "n_prompts": len(keys)}
    new = reparse_row(hotel, old)
    assert new["payload"] == {"tool_index": 1, "arguments": {"hotel": "Grand_Hotel"}}
    assert new["payload_bytes"] == payload_bytes(new["payload"]) and new["timings"] == old["timings"]
    assert [1, "hotel", "Grand_Hotel", False] in new["slots"] and not any(s[3] for s in new["slots"])
    assert reparse_row(hotel, new) == new  # already today's reading
    assert reparse_row(hotel, {**old, "answers": texts[:-1]}) == {**old, "answers": texts[:-1]}  # texts do not fit


def test_aggregate_and_table():
    scores = [score_request(r, p, reference_call(r)) for r, p in zip(REQUESTS, PREDICTIONS)]
    for s, lat in zip(scores, (1.0, 2.0, 3.0, 4.0)):
        s.update(group="fixture/test", latency_s=lat, n_prompts=5, cpu_s=lat / 2 if lat < 4 else None)
    m = aggregate(scores, skipped=2)
    assert m["requests"] == 4 and m["function_accuracy"] == 0.75
    assert m["requests_multi"] == 3 and m["function_accuracy_multi"] == pytest.approx(2 / 3)
    assert m["slot_exact"] == pytest.approx(7 / 9) and m["value_slots"] == 9
    assert m["null_precision"] == 1.0 and m["null_recall"] == 1.0 and m["whole_call"] == 0.5
    assert m["payload_rate"] == 1.0 and m["mean_others"] == 0.25 and m["unknown"] == 1
    assert m["mean_payload_bytes"] == sum(payload_bytes(p) for p in (PA, PC, PB, PD)) / 4
    assert m["mean_latency_s"] == 2.5 and m["mean_prompts"] == 5 and m["skipped"] == 2 and m["reference"] == "gold"
    assert m["p50_latency_s"] == 2.0 and m["p95_latency_s"] == 4.0  # nearest rank
    assert m["mean_cpu_s"] == 1.0  # over the waves that recorded it
    scores[0].update(group="other/dev", source="labels")
    summary = summarize(scores, {"fixture/test": 1, "empty/test": 3})
    assert list(summary) == ["empty/test", "fixture/test", "other/dev", "all"]
    assert summary["other/dev"]["requests"] == 1 and summary["other/dev"]["reference"] == "labels"
    assert summary["all"]["reference"] == "labels 1 + gold 3" and summary["all"]["skipped"] == 4
    assert summary["empty/test"]["requests"] == 0 and summary["empty/test"]["function_accuracy"] is None
    table = markdown_table(summary)
    assert table.splitlines()[0].startswith("| benchmark | requests | function acc | value EM | multi fn acc | multi")
    assert "| fixture/test | 3 | 66.7 | 85.7 | 50.0 | 2 | 100.0 | 100.0 | 66.7 | 100.0 |" in table
    assert table.rstrip().endswith("| 4 | labels 1 + gold 3 |")
    assert "–" in markdown_table({"all": aggregate([])})


def test_load_labels_names_file_and_record(tmp_path):
    good = tmp_path / "dev.jsonl"
    good.write_text(json.dumps({"id": "a", "tool_index": 0, "arguments": {}}) + "\n")
    assert load_labels([good])["a"]["tool_index"] == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "b", "tool_index": "0"}) + "\n")
    with pytest.raises(InputError, match=r"bad.jsonl:1 \(record b\): expected a label"):
        load_labels([bad])


def test_miss_kinds_name_what_went_wrong():
    assert miss_kind(None, "Paris") == "null" and miss_kind(UNKNOWN, "Paris") == "unparsed"
    assert miss_kind("celsius", None) == "extra" and miss_kind("5", 5) == "type" and miss_kind(True, 1) == "type"
    assert miss_kind("new york", "New-York") == "case/space" and miss_kind("Grand", "Grand Hotel") == "partial"
    assert miss_kind("Grand Hotel Paris", "Grand Hotel") == "partial" and miss_kind("Rome", "Paris") == "string"
    assert miss_kind(3, 4.5) == "number" and miss_kind(["Ann"], ["Ann", "Bob"]) == "list/object"
    assert miss_kind({"a": 1}, {"a": 2}) == "list/object" and miss_kind(True, False) == "other"


def test_in_conversation_finds_values_written_out():
    text = "book the grand hotel for 3 nights, 2.50 eur"
    assert in_conversation("Grand Hotel", text) and in_conversation(3, text) and in_conversation(3.0, text)
    assert not in_conversation(2.5, text) and not in_conversation(5, text)
    assert not in_conversation("Ritz", text) and not in_conversation(" ", text) and not in_conversation(["3"], text)
    assert not in_conversation(30, "for 3 nights") and not in_conversation(3, "for 30 nights")


def test_request_misses_and_their_table():
    misses = []
    for r, p in zip(REQUESTS, PREDICTIONS):
        misses += [{"group": "fixture/test", **m} for m in request_misses(r, p, reference_call(r))]
    # request 0: unit celsius for fahrenheit (written out in the question); request 1: calculate for book_hotel
    assert [(m["param"], m["kind"], m["value"], m["reference"], m["in_conversation"]) for m in misses] == [
        ("unit", "string", "celsius", "fahrenheit", True), (None, "function", "calculate", "book_hotel", None)]
    # a right function with a null for a value, an unparsed answer and a value the reference omits
    wrong = {(1, "hotel"): None, (1, "nights"): 3, (1, "guests"): UNKNOWN, (1, "options"): {"view": "sea"}}
    label = {"tool_index": 1, "arguments": {"nights": 3, "guests": ["Ann", "Bob"]}}
    got = request_misses(REQUESTS[1], {"function": 1, "slots": wrong}, reference_call(REQUESTS[1], label))
    assert [(m["param"], m["kind"], m["in_conversation"]) for m in got] == [("guests", "unparsed", False),
                                                                            ("options", "extra", None)]
    table = misses_table(misses + [{"group": "other/dev", **m} for m in got])
    assert "| miss | fixture/test | other/dev | all |" in table
    assert "| function | 1 | 0 | 1 |" in table and "| string | 1 | 0 | 1 |" in table and "| extra | 0 | 1 | 1 |" in table
    assert "| copyable | 1/1 | 0/1 | 1/2 |" in table
