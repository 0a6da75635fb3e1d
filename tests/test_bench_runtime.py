"""scripts/bench_runtime.py runs the shared runner end to end on a tiny model and prints the report's table."""

import shutil
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "requests.jsonl"


def test_bench_runtime_on_a_tiny_model(load_script, tmp_path, capsys, monkeypatch):
    from pipeline.io import read_jsonl
    from pipeline.testing import make_tiny_model_dir

    monkeypatch.setenv("OOO_COST_DIR", str(tmp_path / "cost"))
    make_tiny_model_dir(tmp_path / "tiny", "qwen2")
    shutil.copy(FIXTURES, tmp_path / "req.jsonl")
    out = tmp_path / "rows.jsonl"
    rc = load_script("bench_runtime").main([
        "--target", str(tmp_path / "tiny"), "--requests", str(tmp_path / "req.jsonl"), "-n", "2",
        "--methods", "ar,toolspec,ooo", "--schedules", "adaptive", "split", "--max-new-tokens", "8",
        "--threads", "1", "--out", str(out)])
    assert rc == 0
    rows = read_jsonl(out)
    assert {r["variant"] for r in rows} == {"ar", "toolspec", "ooo@adaptive", "ooo@split"} and len(rows) == 8
    text = capsys.readouterr().out
    assert "| ooo@split |" in text
    assert '"cpu"' in text and "decode vs ar" in text
    assert list((tmp_path / "cost").glob("*.json")), "the cost curve was measured and cached"
