"""scripts/slot_tools_coverage.py: the policies, the table they give from the function row's probabilities, and a run
on a tiny sidecar model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import slot_tools_coverage as cov  # noqa: E402

from pipeline.io import InputError, read_jsonl  # noqa: E402


def test_a_policy_is_n_tools_or_n_tools_up_to_a_probability():
    assert cov.parse_policy("2") == (2, None) and cov.parse_policy("3@0.9") == (3, 0.9)
    for bad in ("0", "two", "2@0", "2@1.5", "2@x"):
        with pytest.raises(InputError, match="--policies"):
            cov.parse_policy(bad)


def test_the_table_counts_the_called_tool_among_those_asked():
    called = {"a": {"benchmark": "b1", "tool": 0}, "b": {"benchmark": "b1", "tool": 2},
              "c": {"benchmark": "b2", "tool": 1}}
    probs = {"a": [0.97, 0.02, 0.01],   # sure and right: one tool under a mass policy
             "b": [0.6, 0.1, 0.3],      # hesitates, the called tool second
             "c": [0.5, 0.2, 0.3]}      # the called tool third
    table = cov.judge(probs, called, [(1, None), (2, None), (3, 0.9)])
    assert table["all"]["1"] == {"requests": 3, "called_asked": pytest.approx(100 / 3), "tools_asked": 1.0}
    assert table["all"]["2"]["called_asked"] == pytest.approx(200 / 3) and table["all"]["2"]["tools_asked"] == 2.0
    # 3@0.9: a -> [0] (0.97), b -> [0, 2] (0.9), c -> [0, 2, 1] (1.0)
    assert table["all"]["3@0.9"] == {"requests": 3, "called_asked": 100.0, "tools_asked": pytest.approx(2.0)}
    assert table["b1"]["3@0.9"]["tools_asked"] == 1.5 and table["b2"]["1"]["called_asked"] == 0.0


def test_a_run_on_a_tiny_sidecar_reads_each_requests_function_row(tmp_path):
    from pipeline.testing import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "model")
    reqs = [r for r in read_jsonl(ROOT / "tests/fixtures/requests.jsonl") if len(r["tools"]) > 1][:3]
    assert len(reqs) >= 2
    (tmp_path / "requests/fixture").mkdir(parents=True)
    (tmp_path / "requests/fixture/test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(json.dumps({"id": r["id"], "tool_index": i % 2, "benchmark": "fixture",
                                          "split": "test"}) + "\n" for i, r in enumerate(reqs)))
    out = tmp_path / "coverage.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/slot_tools_coverage.py"), "--model", str(model),
                          "--labels", str(labels), "--requests-root", str(tmp_path / "requests"), "--dtype", "float32",
                          "--policies", "1", "2", "2@0.5", "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    assert sorted(got["probs"]) == sorted(r["id"] for r in reqs)
    for r in reqs:
        probs = got["probs"][r["id"]]
        assert len(probs) == len(r["tools"]) and sum(probs) == pytest.approx(1.0, abs=1e-5)
    first = [max(range(len(p)), key=p.__getitem__) for p in (got["probs"][r["id"]] for r in reqs)]
    hits = sum(f == i % 2 for i, f in enumerate(first))
    assert got["table"]["all"]["1"]["called_asked"] == pytest.approx(100 * hits / len(reqs))
    assert got["table"]["all"]["2"]["tools_asked"] == 2.0 and 1.0 <= got["table"]["all"]["2@0.5"]["tools_asked"] <= 2.0
    assert f"{len(reqs)} requests with two tools or more" in run.stdout and "\nall " in run.stdout


def test_labels_without_a_tool_index_are_refused_by_file_and_line(tmp_path):
    bad = tmp_path / "labels.jsonl"
    bad.write_text(json.dumps({"id": "x/1", "tool_index": 0}) + "\n" + json.dumps({"id": "x/2"}) + "\n")
    with pytest.raises(InputError, match=r"labels.jsonl.*2"):
        cov.called_tools([str(bad)])


def test_an_eval_runs_ar_rows_name_the_called_tool(tmp_path):
    reqs = {r["id"]: r for r in read_jsonl(ROOT / "tests/fixtures/requests.jsonl")}
    rows = tmp_path / "rows.jsonl"
    texts = [("fixture/0", "t", "ar", '{"name": "calculate", "arguments": {"expression": "1+1"}}'),
             ("fixture/0", "t", "toolspec", '{"name": "get_weather", "arguments": {"city": "Paris"}}'),
             ("fixture/3", "t", "ar", "It is sunny."),  # no call: left out
             ("fixture/1", "other", "ar", '{"name": "get_weather", "arguments": {"city": "Paris"}}')]
    rows.write_text("".join(json.dumps({"request_id": i, "target": t, "method": m, "benchmark": "fixture",
                                        "text": x}) + "\n" for i, t, m, x in texts))
    assert cov.called_in_rows(str(rows), "t", reqs) == {"fixture/0": {"benchmark": "fixture", "tool": 1}}
    with pytest.raises(InputError, match="no ar row of target 'nobody'"):
        cov.called_in_rows(str(rows), "nobody", reqs)
    with pytest.raises(InputError, match=r"rows.jsonl.*fixture/0.*not found"):
        cov.called_in_rows(str(rows), "t", {})
