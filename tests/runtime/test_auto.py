"""`backend: auto` (pipeline/runtime/auto.py): the choice from measured curves, tested with fake ones, and where the
choice is recorded (the server's /health, the eval's rows and manifest) with the real loaders on a tiny model."""

import json

import pytest

from pipeline.runtime.auto import WORKLOAD, choose, predict
from pipeline.runtime.budget import SIZES, CostCurve


def curve(step_s: float, slope: float, prefill_s: float) -> CostCurve:
    """A fake curve: one forward of k tokens costs step_s + slope * (k - 1); the 512-token prefill prefill_s."""
    return CostCurve(SIZES, tuple(step_s + slope * (k - 1) for k in SIZES), {"past": 512, "prefill_s": prefill_s})


# The issue's own figures (2-core Intel Xeon with AMX): transformers bf16 on AMX is flat, llama.cpp's Q4_K_M steep
AMX = {"transformers": curve(0.229, 0.0018, 2.0), "llamacpp": curve(0.077, 0.0115, 4.9)}
# AVX2-only: torch float32 pays per token, llama.cpp's quantized step is several times cheaper
AVX2 = {"transformers": curve(0.60, 0.02, 11.6), "llamacpp": curve(0.09, 0.012, 5.0)}


class FakeTarget:
    def __init__(self, backend, c):
        self.backend, self._curve, self.closed, self.curve = backend, c, False, None

    def calibrate(self):
        self.curve = self._curve
        return self._curve

    def close(self):
        self.closed = True


def loader(curves, fail=()):
    made = {}

    def load(backend):
        if backend in fail:
            raise OSError(f"{backend} segfault avoided")
        made[backend] = FakeTarget(backend, curves[backend])
        return made[backend]
    return load, made


BOTH = [("transformers", None), ("llamacpp", None)]


def test_predict_is_prefill_plus_forwards_times_their_cost():
    c = curve(0.1, 0.01, 1.024)
    prefill, decode = predict(c, "ooo", "transformers")
    per_forward, tree = WORKLOAD["methods"]["transformers"]["ooo"]
    assert prefill == pytest.approx(1.024 / 512 * WORKLOAD["prompt_tokens"])
    assert decode == pytest.approx(WORKLOAD["new_tokens"] / per_forward * c.cost(round(tree)))
    assert predict(c, "ar", "llamacpp")[1] == pytest.approx(WORKLOAD["new_tokens"] * 0.1)
    assert predict(c, "ooo@deferred", "llamacpp") == predict(c, "ooo", "llamacpp")  # a schedule is the method


@pytest.mark.parametrize("machine,method,expected", [
    (AMX, "ooo", "transformers"),    # flat verify: big trees are nearly free
    (AMX, "ar", "llamacpp"),         # one token a step: llama.cpp's cheaper step wins
    (AVX2, "ooo", "llamacpp"),
    (AVX2, "ar", "llamacpp"),
])
def test_the_faster_backend_for_the_method_serves_and_the_other_is_closed(machine, method, expected):
    load, made = loader(machine)
    target, choice = choose("model", method, load, only=BOTH)
    assert choice.backend == expected and target is made[expected] and not target.closed
    other = made["llamacpp" if expected == "transformers" else "transformers"]
    assert other.closed
    rec = target.backend_choice
    assert rec["choice"] == expected and rec["method"] == method and set(rec["cpu"]) == {"model", "flags"}
    times = {e["backend"]: e["predicted_s"] for e in rec["estimates"]}
    assert times[expected] < times[other.backend]
    assert rec["why"].startswith(f"{method} predicted {times[expected]:.2f} s per request on {expected} vs ")
    assert choice.summary() == {"choice": expected, "predicted_s": times}
    json.dumps(rec)  # what /health and the manifest write


def test_a_backend_that_cannot_run_is_recorded_and_the_others_compete():
    load, made = loader(AVX2, fail={"llamacpp"})
    target, choice = choose("model", "ooo", load, only=BOTH)
    assert choice.backend == "transformers"
    bad = next(e for e in target.backend_choice["estimates"] if e["backend"] == "llamacpp")
    assert bad == {"backend": "llamacpp", "error": "OSError: llamacpp segfault avoided"}
    assert target.backend_choice["why"].endswith("(the only backend that could run here)")
    load, _ = loader(AVX2)
    target, choice = choose("model", "ooo", load, only=[("transformers", None), ("llamacpp", "not installed")])
    assert choice.backend == "transformers" and choice.estimates[1].error == "not installed"
    load, _ = loader(AVX2, fail={"transformers", "llamacpp"})
    with pytest.raises(RuntimeError, match="no backend can run model: transformers: OSError"):
        choose("model", "ooo", load, only=BOTH)


def test_a_folder_without_a_gguf_leaves_llamacpp_out(tmp_path):
    from pipeline.runtime.auto import candidates

    got = dict(candidates(str(tmp_path)))
    assert got["transformers"] is None and got["llamacpp"]  # not installed, or no GGUF: either way a reason
    assert dict(candidates(str(tmp_path), gguf=str(tmp_path / "x.gguf")))["llamacpp"]


def test_serve_with_backend_auto_names_its_choice_in_health(tmp_path, monkeypatch):
    import torch

    from pipeline.recipes import load_recipe
    from pipeline.serve.cli import ServeConfig, build_engine
    from pipeline.testing import make_tiny_model_dir

    monkeypatch.setenv("OOO_COST_DIR", str(tmp_path / "cost"))
    threads = torch.get_num_threads()
    model = make_tiny_model_dir(tmp_path / "tiny")
    engine = build_engine(ServeConfig.from_recipe(load_recipe("recipes/serve/tiny.yaml", [
        f"serve.target={model}", "serve.warmup=false", "serve.backend=auto", "serve.method=toolspec"])))
    try:
        body, status = engine.health()
        choice = body["backend_choice"]
        assert status == 200 and body["backend"] == choice["choice"] == "transformers"
        assert choice["method"] == "toolspec" and "predicted" in choice["why"]
        llama = next(e for e in choice["estimates"] if e["backend"] == "llamacpp")
        assert "error" in llama  # a tiny folder has no GGUF (or llama-cpp-python is not installed)
        assert engine.target.curve is not None and "prefill_s" in engine.target.curve.meta
    finally:
        engine.close()
        torch.set_num_threads(threads)


def test_eval_rows_and_manifest_record_the_auto_choice(tmp_path, monkeypatch):
    import shutil
    from pathlib import Path

    from pipeline.io import read_json, read_jsonl
    from pipeline.stages import eval as eval_stage
    from pipeline.testing import make_tiny_model_dir

    monkeypatch.setenv("OOO_COST_DIR", str(tmp_path / "cost"))
    make_tiny_model_dir(tmp_path / "tiny", "qwen2")
    (tmp_path / "requests" / "fixture").mkdir(parents=True)
    shutil.copy(Path(__file__).parents[1] / "fixtures" / "requests.jsonl",
                tmp_path / "requests" / "fixture" / "test.jsonl")
    recipe = {"eval": {"run": "auto", "out": str(tmp_path / "results"), "requests_root": str(tmp_path / "requests"),
                       "benchmarks": {"fixture": 1}, "methods": ["ar", "pld"], "max_new_tokens": 6,
                       "targets": [{"name": "tiny", "path": str(tmp_path / "tiny"), "dtype": "float64",
                                    "backend": "auto"}], "drop_busy_rows": False}}
    (tmp_path / "auto.yaml").write_text(json.dumps(recipe))
    eval_stage.main(["--recipe", str(tmp_path / "auto.yaml")])
    run = tmp_path / "results" / "auto"
    rows = read_jsonl(run / "rows.jsonl")
    assert len(rows) == 2 and all(r["backend"] == "transformers" for r in rows)
    assert all(r["backend_choice"]["choice"] == "transformers" for r in rows)
    made = read_json(run / "manifest.json")["backend_choices"]["tiny"]
    assert made["choice"] == "transformers" and made["method"] == "ar"
