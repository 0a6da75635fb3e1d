"""Sidecar accuracy: matching rules (strict JSON, BFCL acceptable values), per-request scores and aggregates on fixed
predictions, and the command line (outputs, resume, stale predictions) with a scripted wave and with a tiny model."""

import json
from pathlib import Path

import pytest

from pipeline.io import InputError
from pipeline.sidecar import accuracy
from pipeline.sidecar.accuracy import (accept_match, aggregate, markdown_table, reference_call, score_request,
                                       slot_match, summarize, values_equal)
from pipeline.sidecar.join import payload_bytes
from pipeline.sidecar.rows import UNKNOWN, wave_questions
from pipeline.sidecar.wave import finish_prediction

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "requests.jsonl"
REQUESTS = [json.loads(line) for line in FIXTURES.read_text().splitlines() if line.strip()]


def test_values_equal_is_strict_json():
    assert values_equal(1, 1.0) and values_equal({"a": [1, {"b": None}]}, {"a": [1.0, {"b": None}]})
    assert not values_equal(True, 1) and not values_equal(0, False) and not values_equal("1", 1)
    assert not values_equal("Paris", "paris") and not values_equal([1, 2], [2, 1])
    assert not values_equal({"a": 1}, {"a": 1, "b": 2}) and not values_equal(None, "")


def test_accept_match_follows_bfcl_acceptable_values():
    assert accept_match("12 * 7 + 3", ["12*7+3", "12 * 7 + 3"])
    assert accept_match(None, [0.01, ""]) and accept_match(0.01, [0.01, ""]) and not accept_match(0.1, [0.01, ""])
    assert not accept_match(None, ["celsius"])  # omission only where "" is listed
    assert not accept_match(UNKNOWN, ["", None])
    nested = [{"city": ["Paris", "paris"], "unit": ["c", ""]}]  # a dict of lists: matched key by key
    assert accept_match({"city": "paris"}, nested) and accept_match({"city": "Paris", "unit": "c"}, nested)
    assert not accept_match({"city": "Paris", "unit": "k"}, nested)
    assert not accept_match({"unit": "c"}, nested)  # city may not be omitted
    assert not accept_match({"city": "Paris", "extra": 1}, nested)
    assert accept_match([{"x": 2}, 3], [[{"x": [1, 2]}, 3]])  # dicts inside lists, same rule
    assert not accept_match([{"x": 4}, 3], [[{"x": [1, 2]}, 3]])
    assert accept_match([1, 2], [[1, 2]]) and not accept_match([1, 2], [[2, 1]])


def test_slot_match_and_reference_call():
    assert slot_match(None, None) and not slot_match(UNKNOWN, None) and slot_match(3.0, 3)
    ref = reference_call(REQUESTS[2])
    assert ref["tool_index"] == 0 and ref["accept"]["precision"] == [0.01, ""]
    assert reference_call({**REQUESTS[0], "gold": []}) is None
    assert reference_call({**REQUESTS[0], "gold": [{"name": "not_offered", "arguments": {}}]}) is None
    label = {"id": "fixture/0", "tool_index": 1, "name": "calculate", "arguments": {"expression": "1"}}
    assert reference_call(REQUESTS[0], label) == {"tool_index": 1, "arguments": {"expression": "1"}, "accept": None}


def _pred(function, slots, payload):
    return {"function": function, "slots": slots, "payload": payload, "payload_bytes": payload_bytes(payload)}


# Fixed predictions for the four fixture requests (file order); expected counts worked out by hand in the comments.
PA = {"tool_index": 0, "arguments": {"city": "Paris", "unit": "celsius"}}
PB = {"tool_index": 0, "arguments": {"expression": "12 * 7 + 3"}}
PC = {"tool_index": 2, "arguments": {}}
PD = {"tool_index": 1, "arguments": {"city": "Tokyo"}}
PREDICTIONS = [
    # gold get_weather(Paris, fahrenheit): function right, city right, unit wrong; other tool all null
    _pred(0, {(0, "city"): "Paris", (0, "unit"): "celsius", (1, "expression"): None, (1, "precision"): None}, PA),
    # gold book_hotel: function wrong; 3 of 4 slots right (3.0 == 3, dict order free), guests unknown
    _pred(2, {(0, "city"): "x", (0, "unit"): None, (1, "hotel"): "Grand Hotel", (1, "nights"): 3.0,
              (1, "guests"): UNKNOWN, (1, "options"): {"view": "sea", "breakfast": True},
              (2, "expression"): None, (2, "precision"): None}, PC),
    # gold calculate("12*7+3", 0.01) with accept lists: both slots match ("" lets precision be omitted), call EM
    _pred(0, {(0, "expression"): "12 * 7 + 3", (0, "precision"): None}, PB),
    # gold get_weather(Tokyo), unit absent: all right, a true null; call EM
    _pred(1, {(0, "hotel"): None, (0, "nights"): None, (0, "guests"): None, (0, "options"): None,
              (1, "city"): "Tokyo", (1, "unit"): None}, PD),
]


def test_score_request_on_fixed_predictions():
    scores = [score_request(r, p, reference_call(r)) for r, p in zip(REQUESTS, PREDICTIONS)]
    assert [s["function_correct"] for s in scores] == [True, False, True, True]
    assert [(s["slots"], s["slots_correct"]) for s in scores] == [(2, 1), (4, 3), (2, 2), (2, 2)]
    assert [(s["null_tp"], s["null_fp"], s["null_fn"]) for s in scores] == [(0, 0, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)]
    assert [(s["other_slots"], s["other_null"]) for s in scores] == [(2, 2), (4, 3), (0, 0), (4, 4)]
    assert [s["whole_call"] for s in scores] == [False, False, True, True]
    assert [s["unknown"] for s in scores] == [0, 1, 0, 0]


def test_aggregate_and_table():
    scores = [score_request(r, p, reference_call(r)) for r, p in zip(REQUESTS, PREDICTIONS)]
    for s, lat in zip(scores, (1.0, 2.0, 3.0, 4.0)):
        s.update(group="fixture/test", latency_s=lat, n_prompts=5)
    m = aggregate(scores)
    assert m["requests"] == 4 and m["function_accuracy"] == 0.75 and m["slot_exact"] == 0.8
    assert m["null_precision"] == 0.5 and m["null_recall"] == 1.0 and m["whole_call"] == 0.5
    assert m["other_tool_null_rate"] == 0.9 and m["unknown_rate"] == 1 / 20 and m["payload_rate"] == 1.0
    assert m["mean_payload_bytes"] == sum(payload_bytes(p) for p in (PA, PC, PB, PD)) / 4
    assert m["mean_latency_s"] == 2.5 and m["mean_prompts"] == 5
    scores[0]["group"] = "other/dev"
    summary = summarize(scores)
    assert list(summary) == ["fixture/test", "other/dev", "all"] and summary["other/dev"]["requests"] == 1
    table = markdown_table(summary)
    assert table.splitlines()[0].startswith("| benchmark | requests | function acc | slot EM")
    assert "| all | 4 | 75.0 | 80.0 | 50.0 | 100.0 | 50.0 | 100.0 |" in table
    empty = aggregate([])
    assert empty["function_accuracy"] is None and "–" in markdown_table({"all": empty})


class ScriptedWave:
    """Answers every request's wave with its gold call (a perfect sidecar), through the real parse + join."""

    def __init__(self):
        self.calls = 0

    def predict(self, request):
        self.calls += 1
        _, keys = wave_questions(request)
        gold = request["gold"][0]
        index = [t["function"]["name"] for t in request["tools"]].index(gold["name"])
        texts = [str(index) if k[0] == "function" else
                 json.dumps(gold["arguments"].get(k[2]) if k[1] == index else None) for k in keys]
        return finish_prediction(request, keys, texts, {"prefill": 0.0, "decode": 0.0}, 0.0)


def test_cli_writes_summary_table_predictions_and_resumes(tmp_path, monkeypatch):
    wave = ScriptedWave()
    monkeypatch.setattr(accuracy, "make_wave", lambda args: wave)
    out = tmp_path / "acc.json"
    argv = ["--model", "m", "--requests", str(FIXTURES), "--out", str(out)]
    result = accuracy.main(argv)
    all_ = result["summary"]["all"]
    assert wave.calls == 4 and all_["requests"] == 4
    assert all_["function_accuracy"] == 1.0 and all_["slot_exact"] == 1.0 and all_["whole_call"] == 1.0
    assert json.loads(out.read_text())["summary"]["fixture/test"]["requests"] == 4
    assert out.with_suffix(".md").read_text().startswith("| benchmark |")
    rows = [json.loads(line) for line in (tmp_path / "acc.predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in REQUESTS] and rows[0]["payload"]["tool_index"] == 0

    accuracy.main(argv)  # same settings: everything is resumed, nothing recomputed
    assert wave.calls == 4
    accuracy.main(argv + ["--max-value-tokens", "7"])  # other settings: stale predictions are redone
    assert wave.calls == 8
    result = accuracy.main(argv + ["--max-value-tokens", "7", "--limit", "2"])
    assert wave.calls == 8 and result["summary"]["all"]["requests"] == 2


def test_cli_with_labels_and_bad_input(tmp_path, monkeypatch):
    monkeypatch.setattr(accuracy, "make_wave", lambda args: ScriptedWave())
    labels = tmp_path / "labels.jsonl"
    labels.write_text(json.dumps({"id": "fixture/0", "tool_index": 1, "name": "calculate", "arguments": {}}) + "\n")
    result = accuracy.main(["--model", "m", "--requests", str(FIXTURES), "--labels", str(labels),
                            "--out", str(tmp_path / "a.json")])
    assert result["reference"] == "labels" and result["skipped_without_reference"] == 3
    assert result["summary"]["all"]["function_accuracy"] == 0.0  # the wave answers gold (0), the label says 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "messages": []}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:1 \(record x\): request without 'tools'"):
        accuracy.main(["--model", "m", "--requests", str(bad), "--out", str(tmp_path / "b.json")])
    with pytest.raises(InputError, match="adapter_config.json"):
        accuracy.main(["--adapter", str(tmp_path), "--requests", str(FIXTURES)])


def test_cli_runs_a_real_tiny_model(tmp_path):
    from pipeline.testing import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "tiny", "qwen2")
    out = tmp_path / "eval" / "accuracy.json"
    result = accuracy.main(["--model", str(model_dir), "--requests", str(FIXTURES), "--limit", "1",
                            "--max-value-tokens", "2", "--threads", "1", "--out", str(out)])
    m = result["summary"]["all"]
    assert m["requests"] == 1 and m["mean_prompts"] == 5 and m["mean_latency_s"] > 0
    row = json.loads((tmp_path / "eval" / "accuracy.predictions.jsonl").read_text())
    assert len(row["answers"]) == 5 and row["timings"]["prefill"] > 0
