"""scripts/bench_wave.py on a tiny model: the two weight formats the recipes offer (`wave-int8`, `wave-prepacked`)
side by side, each answering every row, with the agreement of their answers counted."""

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "requests.jsonl"


def test_bench_wave_compares_int8_with_prepacked(load_script, tmp_path, capsys):
    import torch

    from pipeline.testing import make_tiny_model_dir

    if not set(torch.backends.quantized.supported_engines) - {"none"}:
        import pytest

        pytest.skip("this torch has no quantized CPU engine")
    make_tiny_model_dir(tmp_path / "tiny", "llama")
    report = load_script("bench_wave").main(["--model", str(tmp_path / "tiny"), "--requests", str(FIXTURES),
                                             "--per-file", "2", "--threads", "1", "--max-value-tokens", "4",
                                             "--methods", "wave-int8", "wave-prepacked"])
    assert len(report["results"]) == 2 and report["rows"] == sum(r["prompts"] for r in report["results"])
    for r in report["results"]:
        assert r["wave-int8"] > 0 and r["wave-prepacked"] > 0 and r["wave-int8_cpu_s"] > 0
        assert r["generated"]["wave-int8"] > 0 and r["generated"]["wave-prepacked"] > 0
    assert report["agree"]["wave-prepacked"] == report["rows"]  # the reference agrees with itself
    assert 0 <= report["agree"]["wave-int8"] <= report["rows"]
    out = capsys.readouterr().out
    assert "| wave-int8 |" in out and "| wave-prepacked |" in out and "equal to wave-prepacked's" in out
