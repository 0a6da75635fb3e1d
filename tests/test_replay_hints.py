"""scripts/replay_hints.py: categories of a hint against the target's call, and a replay on recorded outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from replay_hints import category  # noqa: E402

from pipeline.io import read_jsonl  # noqa: E402


def test_category_compares_the_hint_with_the_targets_call():
    own = {"tool_index": 0, "arguments": {"city": "Paris"}}
    assert category(dict(own), own) == "exact"
    assert category({"tool_index": 0, "arguments": {"city": "Rome"}}, own) == "right tool, other values"
    assert category({"tool_index": 1, "arguments": {}}, own) == "another tool"
    assert category(None, own) == "no hint"
    assert category(own, None) == "no call"


def test_a_right_hint_saves_forwards_a_wrong_one_does_not(tmp_path):
    """Two recorded calls with free-text values; the right hint replays in fewer forwards than toolspec, the wrong
    one's values in none fewer than toolspec's for its request, and the oracle in the fewest."""
    from pipeline.testing import make_tokenizer

    tok_dir = tmp_path / "tok"
    make_tokenizer().save_pretrained(tok_dir)
    reqs = read_jsonl(ROOT / "tests/fixtures/requests.jsonl")[:2]
    (tmp_path / "requests/fixture").mkdir(parents=True)
    (tmp_path / "requests/fixture/test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    texts = {reqs[0]["id"]: '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "fahrenheit"}}',
             reqs[1]["id"]: '{"name": "get_weather", "arguments": {"city": "Grand Hotel Sea View Town"}}'}
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"method": "ar", "target": "t", "request_id": rid, "text": t}) + "\n"
                            for rid, t in texts.items()))
    hints = tmp_path / "hints.json"
    hints.write_text(json.dumps({reqs[0]["id"]: {"tool_index": 0, "arguments": {"city": "Paris", "unit": "fahrenheit"}},
                                 reqs[1]["id"]: {"tool_index": 0, "arguments": {"city": "Oslo"}}}))
    out = tmp_path / "replay.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/replay_hints.py"), "--rows", str(rows), "--target", "t",
                          "--tokenizer", str(tok_dir), "--curve", "flat", "--hints", str(hints), "--requests-root",
                          str(tmp_path / "requests"), "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    per = json.loads(out.read_text())["requests"]
    right, wrong = per[reqs[0]["id"]], per[reqs[1]["id"]]
    assert right["category"] == "exact" and wrong["category"] == "right tool, other values"
    assert right["ooo"]["forwards"] < right["toolspec"]["forwards"] and right["ooo"]["hint_tokens"] > 0
    assert wrong["ooo-oracle"]["forwards"] < wrong["ooo"]["forwards"]
    assert "| all | 2 |" in run.stdout


def test_rows_without_the_target_are_refused(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"method": "ar", "target": "other", "request_id": "x", "text": "hi"}) + "\n")
    from replay_hints import ar_rows

    with pytest.raises(SystemExit, match="no ar rows of target 't'"):
        ar_rows(rows, "t")
