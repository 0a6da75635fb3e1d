"""scripts/bench_prefill.py on a tiny float64 model: the timing table, and `--greedy` finds no output that a chunked
prefill changes (exact arithmetic), while `first_difference` locates one where there is."""

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "requests.jsonl"


def test_bench_prefill_greedy_outputs_on_a_tiny_float64_model(load_script, tmp_path, capsys):
    from pipeline.io import read_json
    from pipeline.testing import make_tiny_model_dir

    make_tiny_model_dir(tmp_path / "tiny", "qwen2")
    script = load_script("bench_prefill")
    report = script.main(["--model", str(tmp_path / "tiny"), "--requests", str(FIXTURES), "--per-file", "2",
                          "--chunks", "3", "8", "--reps", "1", "--threads", "1", "--dtype", "float64",
                          "--greedy", "6", "--output-layer", "--out", str(tmp_path / "r.json")])
    assert [(d["id"], d["chunk"]) for d in report["greedy"]][:2] == [(report["greedy"][0]["id"], 3),
                                                                      (report["greedy"][0]["id"], 8)]
    assert len(report["greedy"]) == 4 and all(d["tokens"] > 0 for d in report["greedy"])
    assert all(d["first_diff"] is None for d in report["greedy"])  # float64: chunks change no output
    out = capsys.readouterr().out
    assert "chunks of 3 vs whole: 0 of 2 outputs differ" in out and "| chunks of 8 |" in out
    assert "| whole, with the output layer |" in out and {r["chunk"] for r in report["rows"]} == {None, 3, 8, "head"}
    assert read_json(tmp_path / "r.json")["greedy"] == report["greedy"]

    one = script.main(["--model", str(tmp_path / "tiny"), "--requests", str(FIXTURES), "--ids",
                       report["greedy"][2]["id"], "--chunks", "4", "--reps", "1", "--dtype", "float64"])
    assert {r["id"] for r in one["rows"]} == {report["greedy"][2]["id"]} and "greedy" not in one

    first = script.first_difference
    assert first([1, 2, 3], [1, 2, 3]) is None
    assert first([1, 2, 3], [1, 5, 3]) == 1
    assert first([1, 2], [1, 2, 3]) == 2
