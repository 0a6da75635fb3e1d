"""The labels stage: slot labels with nulls, validation + normalisation, rejections, gold agreement, SFT rows,
the gold round trip (gold -> traces -> labels gives back the gold calls), and real teacher traces."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.io import InputError, read_json, read_jsonl
from pipeline.schema import param_names
from pipeline.sidecar.rows import build_rows, slot_keys
from pipeline.stages import labels, traces
from pipeline.testing import make_tokenizer

FIXTURES = Path(__file__).parents[1] / "fixtures"
REQS = {r["id"]: r for r in read_jsonl(FIXTURES / "requests.jsonl")}


def trace(text, rid="fixture/1", finish="stop", error=None):
    return {"id": rid, "teacher": "t", "backend": "test", "text": text, "prompt_tokens": 1, "completion_tokens": 1,
            "finish_reason": finish, "latency_s": 0.0, "error": error}


def fenced(call):
    return "```json\n" + json.dumps(call, indent=2) + "\n```"


def test_slots_cover_the_called_tools_parameters_with_nulls():
    req = REQS["fixture/1"]  # get_weather(city, unit), book_hotel(hotel, nights, guests, options), calculate(...)
    label, facts = labels.label_trace(req, trace(fenced({"name": "book_hotel", "arguments": {"hotel": "Grand Hotel",
                                                                                             "nights": 3}})))
    assert facts["valid"] and label["tool_index"] == 1 and label["format"] == "fenced_json"
    # only the called tool: what a call of another tool would hold is unknown, so those slots are not labelled
    assert [(s["tool"], s["param"]) for s in label["slots"]] == [k for k in slot_keys(req["tools"]) if k[0] == 1]
    values = {(s["tool"], s["param"]): s["value"] for s in label["slots"]}
    assert values[(1, "hotel")] == "Grand Hotel" and values[(1, "nights")] == 3
    assert values[(1, "guests")] is None and values[(1, "options")] is None      # omitted by the call
    rows = build_rows(req, label)
    assert [(r["kind"], r["tool"], r["param"]) for r in rows] == [("function", None, None)] + [
        ("slot", 1, p) for p in ("hotel", "nights", "guests", "options")]
    assert rows[1]["prompt"][-1]["content"].endswith(
        "If tool [1] book_hotel is called, the value of hotel? JSON, or null if such a call would omit it.")
    assert label["gold_exact"] is False and label["gold_accept"] is False          # gold also books guests/options


def test_schema_normalisation_is_applied_and_recorded():
    req = REQS["fixture/1"]
    call = {"name": "book_hotel", "arguments": {"hotel": "Grand Hotel", "nights": "3", "guests": ["Ann", "Bob"],
                                                "options": {"breakfast": "true", "view": "Sea"}}}
    label, facts = labels.label_trace(req, trace(f"<tool_call>\n{json.dumps(call)}\n</tool_call>"))
    assert label["arguments"] == REQS["fixture/1"]["gold"][0]["arguments"]
    assert label["normalised"] == ['nights: "3" -> 3 (integer)', 'options/breakfast: "true" -> true (boolean)',
                                   'options/view: "Sea" -> "sea" (enum)']
    assert label["gold_exact"] is True


def test_gold_is_normalised_the_same_way_before_comparing():
    req = json.loads(json.dumps(REQS["fixture/1"]))
    req["gold"][0]["arguments"]["nights"] = "3"   # schema-invalid gold, as Seal-Tools writes it
    label, facts = labels.label_trace(req, trace(json.dumps(REQS["fixture/1"]["gold"][0])))
    assert label["normalised"] == [] and facts["gold_exact"] is True and facts["gold_accept"] is True


def test_first_valid_call_is_kept_and_multi_calls_counted():
    req = REQS["fixture/0"]
    text = ('<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": 5}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "fahrenheit"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1"}}\n</tool_call>')
    label, facts = labels.label_trace(req, trace(text, "fixture/0"))
    assert facts["n_calls"] == 4 and label["call_index"] == 1 and label["name"] == "get_weather"
    assert label["arguments"] == {"city": "5"}  # 5 -> "5": the schema says string, so call 1 is valid
    assert label["normalised"] == ['city: 5 -> "5" (string)'] and label["gold_exact"] is False


@pytest.mark.parametrize("text,finish,error,reason", [
    ("I cannot help with that.", "stop", None, "unparsed"),
    ('```json\n{\n  "name": "calculate",\n  "arguments": {\n    "expression": "12*', "length", None, "truncated"),
    ('{"name": "get_forecast", "arguments": {}}', "stop", None, "unknown_tool"),
    ('{"name": "calculate", "arguments": {"precision": 0.1}}', "stop", None, "schema_invalid"),
    ('{"name": "calculate", "arguments": {"expression": "1", "precision": "high"}}', "stop", None, "schema_invalid"),
    ("", "error", "RuntimeError: out of memory", "trace_error"),
])
def test_rejections_have_reasons(text, finish, error, reason):
    label, facts = labels.label_trace(REQS["fixture/2"], trace(text, "fixture/2", finish, error))
    assert label is None and facts["reason"] == reason and facts["detail"]


def test_bfcl_acceptable_values_and_gold_filter():
    req = REQS["fixture/2"]  # gold_accept: expression in ["12*7+3", "12 * 7 + 3"], precision in [0.01, ""]
    ok = trace('{"name": "calculate", "arguments": {"expression": "12 * 7 + 3"}}', "fixture/2")
    label, facts = labels.label_trace(req, ok, require_gold_agreement=True)
    assert label is not None and facts["gold_exact"] is False and facts["gold_accept"] is True
    bad = trace('{"name": "calculate", "arguments": {"expression": "12*7", "precision": 0.01}}', "fixture/2")
    assert labels.label_trace(req, bad)[0] is not None
    label, facts = labels.label_trace(req, bad, require_gold_agreement=True)
    assert label is None and facts["reason"] == "gold_disagreement"
    # the rules themselves: tests/test_scoring.py


def write_recipe(tmp_path, **labels_kw):
    path = tmp_path / "teacher.yaml"
    path.write_text(yaml.safe_dump({"teacher": "t", "data_dir": str(tmp_path), "splits": ["train"],
                                    "traces": {"backend": "gold", "model": str(tmp_path / "tok")},
                                    "labels": labels_kw}))
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    make_tokenizer().save_pretrained(out)
    return out


def setup_gold_run(tmp_path, requests, tokenizer_dir):
    shutil.copytree(tokenizer_dir, tmp_path / "tok")
    (tmp_path / "requests" / "fixture").mkdir(parents=True)
    (tmp_path / "requests" / "fixture" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    traces.main(["--recipe", str(write_recipe(tmp_path))])


def test_gold_round_trip_and_stage_outputs(tmp_path, tokenizer_dir, capsys):
    requests = list(REQS.values())
    setup_gold_run(tmp_path, requests, tokenizer_dir)
    stats = labels.main(["--recipe", str(write_recipe(tmp_path))])["train"]
    out = tmp_path / "labels" / "t"
    got = {lab["id"]: lab for lab in read_jsonl(out / "train.jsonl")}
    for req in requests:  # gold -> traces -> labels gives back the gold call
        assert {"name": got[req["id"]]["name"], "arguments": got[req["id"]]["arguments"]} == req["gold"][0]
        assert got[req["id"]]["gold_exact"] and got[req["id"]]["normalised"] == []
    n_slots = sum(len(param_names(t)) for r in requests for t in r["tools"] if t["function"]["name"] == r["gold"][0]["name"])
    assert stats["rows"] == {"function": 4, "slot": n_slots}
    assert stats["traces"] == stats["parsed"] == stats["schema_valid"] == stats["gold_exact"] == 4
    per = stats["by_benchmark"]  # the per-benchmark report: parse, schema-valid, gold agreement, no call
    assert sum(b["traces"] for b in per.values()) == 4 and all(b.get("no_call", 0) == 0 for b in per.values())
    assert "| train | traces | no call | parsed |" in labels.report_text("t", {"train": stats})
    rows = read_jsonl(out / "rows" / "train.jsonl")
    assert len(rows) == 4 + n_slots and rows[0]["prompt"][0]["role"] == "system"
    assert read_jsonl(out / "rejected.jsonl") == []
    assert read_json(out / "stats.json")["train"] == stats
    assert read_json(out / "manifest.json")["gold_traces"] is True
    printed = capsys.readouterr().out
    assert "gold exact    4/4 (100.0%)" in printed
    # unchanged inputs and recipe: nothing to do; a changed recipe redoes it
    labels.main(["--recipe", str(write_recipe(tmp_path))])
    assert "up to date" in capsys.readouterr().out
    labels.main(["--recipe", str(write_recipe(tmp_path, compact=False))])
    assert "up to date" not in capsys.readouterr().out
    with pytest.raises(InputError, match="direct_call"):  # the whole-call row is gone; its key is an error
        labels.run(labels.resolve(str(write_recipe(tmp_path, direct_call=True))))


def test_rejected_file_and_missing_request_error(tmp_path, tokenizer_dir):
    requests = list(REQS.values())
    setup_gold_run(tmp_path, requests, tokenizer_dir)
    trace_file = tmp_path / "traces" / "t" / "train.jsonl"
    rows = read_jsonl(trace_file)
    rows[0]["text"] = "no call here"
    trace_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats = labels.main(["--recipe", str(write_recipe(tmp_path, require_gold_agreement=True))])["train"]
    assert stats["labels"] == 3 and stats["rejected"] == {"unparsed": 1}
    rejected = read_jsonl(tmp_path / "labels" / "t" / "rejected.jsonl")
    assert [(r["id"], r["reason"], r["text"]) for r in rejected] == [(rows[0]["id"], "unparsed", "no call here")]
    with open(trace_file, "a") as f:
        f.write(json.dumps(dict(rows[0], id="elsewhere/1")) + "\n")
    with pytest.raises(InputError, match=r"train.jsonl:5 \(record elsewhere/1\): no such request"):
        labels.run(labels.resolve(str(write_recipe(tmp_path))))


# --- real teacher traces (tests/fixtures/traces/*.jsonl: request + trace + what labels must make of it) ---------

def _real_cases():
    folder = FIXTURES / "traces"
    cases = [case for f in sorted(folder.glob("*.jsonl")) for case in read_jsonl(f)] if folder.is_dir() else []
    return [case for case in cases if "request" in case]  # API-Bank texts have no canonical request


@pytest.mark.parametrize("case", _real_cases(), ids=lambda c: c["trace"]["id"])
def test_real_traces_label_as_expected(case):
    label, facts = labels.label_trace(case["request"], case["trace"])
    expect = case["expect_label"]
    assert facts.get("reason") == expect["reason"]
    if expect["reason"] is None:
        assert facts["gold_exact"] == expect["gold_exact"] and facts["gold_accept"] == expect["gold_accept"]
        called = case["request"]["tools"][label["tool_index"]]
        assert [s["param"] for s in label["slots"]] == list(called["function"]["parameters"]["properties"])


def test_partial_traces_of_a_run_in_progress(tmp_path, tokenizer_dir):
    setup_gold_run(tmp_path, list(REQS.values()), tokenizer_dir)
    done = tmp_path / "traces" / "t" / "train.jsonl"
    partial = done.with_name("train.jsonl.partial")
    partial.write_text(done.read_text() + '{"id": "fixture/9", "te')  # torn last line of a live run
    done.unlink()
    with pytest.raises(InputError, match="run in progress: labels.allow_partial=true"):
        labels.run(labels.resolve(str(write_recipe(tmp_path))))
    stats = labels.main(["--recipe", str(write_recipe(tmp_path, allow_partial=True))])["train"]
    assert stats["traces"] == stats["labels"] == 4


def test_a_second_recipe_adds_the_sidecar_eval_test_requests_beside_train(tmp_path, tokenizer_dir):
    """`traces.pick: even` runs the requests `make sidecar-eval` picks (limit evenly spaced per file); its split lands
    beside the train split in the same folders, whose progress, stats and rejects stay."""
    from pipeline.requests import load_requests

    requests = list(REQS.values())
    setup_gold_run(tmp_path, requests, tokenizer_dir)
    labels.main(["--recipe", str(write_recipe(tmp_path))])
    bad = dict(requests[0], id="fixture/bad", gold=[{"name": "no_such_tool", "arguments": {}}])
    with open(tmp_path / "requests" / "fixture" / "train.jsonl", "a") as f:  # one rejected train trace
        f.write(json.dumps(bad) + "\n")
    traces.main(["--recipe", str(write_recipe(tmp_path))])
    labels.main(["--recipe", str(write_recipe(tmp_path))])
    files = []
    for bench in ("a", "b"):
        path = tmp_path / "requests" / bench / "test.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps(dict(r, id=f"{bench}/{i}")) + "\n"
                                for i, r in enumerate(requests * 3)))
        files.append(path)
    test_recipe = yaml.safe_load(write_recipe(tmp_path).read_text())
    test_recipe.update(splits=["test"], benchmarks=["a", "b"])
    test_recipe["traces"].update(limit=5, pick="even")
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(test_recipe))
    traces.main(["--recipe", str(tmp_path / "test.yaml")])
    stats = labels.main(["--recipe", str(tmp_path / "test.yaml")])

    picked = [r["id"] for r in load_requests(files, 5, "even")]  # sidecar_eval's selection
    assert len(picked) == 10 and picked != [f"a/{i}" for i in range(5)] + [f"b/{i}" for i in range(5)]
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "traces" / "t" / "test.jsonl")) == sorted(picked)
    assert sorted(r["id"] for r in read_jsonl(tmp_path / "labels" / "t" / "test.jsonl")) == sorted(picked)
    manifest = read_json(tmp_path / "traces" / "t" / "manifest.json")
    assert manifest["progress"] == {"train": {"requested": 5, "done": 5}, "test": {"requested": 10, "done": 10}}
    assert [(r["splits"], r["pick"]) for r in manifest["runs"]] == [(["train"], "shuffle")] * 2 + [(["test"], "even")]
    assert str(tmp_path / "requests" / "fixture" / "train.jsonl") in manifest["inputs"]
    assert set(stats) == {"train", "test"} and stats["train"]["labels"] == 4 and stats["test"]["labels"] == 10
    assert [r["id"] for r in read_jsonl(tmp_path / "labels" / "t" / "rejected.jsonl")] == ["fixture/bad"]
    assert len(read_jsonl(tmp_path / "labels" / "t" / "train.jsonl")) == 4
    with pytest.raises(InputError, match="traces.pick='random'; expected one of"):
        traces.run(traces.resolve(str(tmp_path / "test.yaml"), ["traces.pick=random"]))
