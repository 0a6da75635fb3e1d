"""Release artifacts (pipeline/artifacts.py): every tracked one is sealed in a manifest with its sha256, all of them
fit the size budget, and the committed CPU adapter loads with peft and answers a wave on a real request."""

from pathlib import Path

import pytest

from pipeline import artifacts
from pipeline.io import read_json

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "checkpoints/sidecar/smollm2-135m-cpu-v9"
BASE = ROOT / "checkpoints/base/smollm2-135m-instruct"


def test_tracked_artifacts_are_sealed_and_within_budget():
    files = artifacts.tracked(ROOT)
    if files is None:
        pytest.skip("not a git checkout: nothing is tracked")
    assert artifacts.problems(ROOT, files) == []


def test_seal_and_check_catch_a_changed_an_unlisted_and_an_oversized_file(tmp_path):
    run = tmp_path / "eval/results/cpu"
    (run / "sub").mkdir(parents=True)
    (run / "rows.jsonl").write_text('{"key": 1}\n')
    (run / "sub" / "manifest.json").write_text("{}")
    (run / "sub" / "table.md").write_text("| a |\n")
    (run / "rows.jsonl.partial").write_text("in flight")
    artifacts.seal(run / "sub")
    artifacts.seal(run)
    files = read_json(run / "manifest.json")["files"]
    assert set(files) == {"rows.jsonl"} and files["rows.jsonl"]["bytes"] == 11  # sub/ has its own manifest
    rel = [p.relative_to(tmp_path) for p in (run / "rows.jsonl", run / "sub" / "table.md", run / "manifest.json")]
    assert artifacts.problems(tmp_path, rel) == []
    (run / "rows.jsonl").write_text('{"key": 2}\n')
    (run / "late.png").write_bytes(b"x" * 2000)
    bad = artifacts.problems(tmp_path, rel + [Path("eval/results/cpu/late.png")], budget_mb=0.001)
    assert any("rows.jsonl: sha256 differs" in b for b in bad)
    assert any("late.png: not listed" in b for b in bad)
    assert any("over the 0 MB budget" in b for b in bad)
    loose = tmp_path / "data/traces/t"
    loose.mkdir(parents=True)
    (loose / "dev.jsonl").write_text("{}\n")
    assert any("no manifest.json" in b for b in artifacts.problems(tmp_path, [Path("data/traces/t/dev.jsonl")]))


@pytest.mark.skipif(not (ADAPTER / "adapter_config.json").is_file(), reason="no committed adapter in this checkout")
def test_committed_adapter_is_complete():
    for name in ("adapter_model.safetensors", "adapter_config.json", "recipe.yaml",
                 "metrics.json", "loss.png", "manifest.json"):
        assert (ADAPTER / name).is_file(), name
    tracked = [str(f) for f in artifacts.tracked(ROOT) or []]  # checkpoint-*/ may exist locally: never committed
    assert not [f for f in tracked if "/checkpoint-" in f or f.endswith(("optimizer.pt", "training_args.bin"))]
    metrics = read_json(ADAPTER / "metrics.json")
    assert metrics["row_sources"] and metrics["global_step"] > 0


@pytest.mark.skipif(not (ADAPTER / "adapter_config.json").is_file(), reason="no committed adapter in this checkout")
@pytest.mark.skipif(not (BASE / "config.json").is_file(),
                    reason=f"{BASE.relative_to(ROOT)} missing: `make models` builds it (not part of `make test`)")
def test_committed_adapter_loads_with_peft_and_answers_a_wave():
    from peft import PeftModel

    from pipeline.io import read_jsonl
    from pipeline.payload import Payload
    from pipeline.sidecar.wave import SlotWave

    wave = SlotWave(str(BASE), str(ADAPTER), dtype="float32", merge_adapter=False)
    assert isinstance(wave.model, PeftModel)
    request = read_jsonl(ROOT / "tests/fixtures/requests.jsonl")[0]  # get_weather(city="Paris", unit="fahrenheit")
    payload = wave.predict(request).payload
    assert payload is not None  # a valid function answer
    call = Payload.parse(payload).call(request["tools"], validate=False)
    assert call["name"] in {t["function"]["name"] for t in request["tools"]} and isinstance(call["arguments"], dict)
