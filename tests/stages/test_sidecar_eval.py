"""The sidecar_eval stage: recipe section, outputs + manifest, resume and stale predictions, labels over gold,
evenly spaced samples, skipped requests, errors; with a scripted wave and once with a tiny real model."""

import json
from pathlib import Path

import pytest

from pipeline.io import InputError
from pipeline.sidecar.rows import wave_questions
from pipeline.sidecar.wave import finish_prediction
from pipeline.stages import sidecar_eval

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "requests.jsonl"
REQUESTS = [json.loads(line) for line in FIXTURES.read_text().splitlines() if line.strip()]
ROOT = Path(__file__).resolve().parents[2]


class ScriptedWave:
    """Answers every request's wave with its gold call (a perfect sidecar), through the real parse + join."""

    def __init__(self):
        self.calls = 0

    def predict(self, request):
        self.calls += 1
        _, keys = wave_questions(request)
        gold = (request["gold"] or [{"name": request["tools"][0]["function"]["name"], "arguments": {}}])[0]
        index = [t["function"]["name"] for t in request["tools"]].index(gold["name"])
        texts = [str(index) if k[0] == "function" else
                 json.dumps(gold["arguments"].get(k[2]) if k[1] == index else None) for k in keys]
        return finish_prediction(request, keys, texts, {"prefill": 0.0, "decode": 0.0}, 0.0)


def write_recipe(tmp_path, requests=(str(FIXTURES),), **section):
    recipe = tmp_path / "side.yaml"
    body = {"requests": list(requests), "model": "m", "out": str(tmp_path / "out"), **section}
    recipe.write_text("sidecar_eval:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in body.items()))
    return str(recipe)


def test_writes_summary_table_predictions_manifest_and_resumes(tmp_path, monkeypatch):
    wave = ScriptedWave()
    monkeypatch.setattr(sidecar_eval, "make_wave", lambda cfg: wave)
    recipe = write_recipe(tmp_path)
    result = sidecar_eval.main(["--recipe", recipe])
    all_ = result["summary"]["all"]
    assert wave.calls == 4 and all_["requests"] == 4 and result["reference"] == "gold"
    assert all_["function_accuracy"] == 1.0 and all_["slot_exact"] == 1.0 and all_["whole_call"] == 1.0
    assert all_["null_precision"] == 1.0 and all_["function_accuracy_multi"] == 1.0 and all_["requests_multi"] == 3
    out = tmp_path / "out"
    assert json.loads((out / "accuracy.json").read_text())["summary"]["fixture/test"]["requests"] == 4
    assert (out / "accuracy.md").read_text().split("\n\n")[1].startswith("| benchmark |")  # after the machine line
    assert "| miss |" in (out / "accuracy.md").read_text() and (out / "misses.jsonl").read_text() == ""  # all right
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "sidecar_eval" and str(FIXTURES) in manifest["inputs"]
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [r["id"] for r in REQUESTS] and rows[0]["payload"]["tool_index"] == 0

    sidecar_eval.main(["--recipe", recipe])  # same settings: everything is resumed, nothing recomputed
    assert wave.calls == 4
    # a row stored by an older parse (its slots unknown, no payload) is judged again from its texts, not re-run
    stale = [{**r, "payload": None, "payload_bytes": 0, "slots": [[t, p, None, True] for t, p, *_ in r["slots"]]}
             for r in rows]
    (out / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stale))
    result = sidecar_eval.main(["--recipe", recipe])
    assert wave.calls == 4 and result["summary"]["all"]["slot_exact"] == 1.0
    assert [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()] == rows
    sidecar_eval.main(["--recipe", recipe, "sidecar_eval.max_value_tokens=7"])  # other settings: redone
    assert wave.calls == 8
    result = sidecar_eval.main(["--recipe", recipe, "sidecar_eval.max_value_tokens=7", "sidecar_eval.limit=2"])
    assert wave.calls == 8 and result["summary"]["all"]["requests"] == 2
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 4  # still every request's prediction
    sidecar_eval.main(["--recipe", recipe, "sidecar_eval.max_value_tokens=7", "sidecar_eval.fresh=true"])
    assert wave.calls == 12


def test_limit_takes_evenly_spaced_requests_and_skipped_ones_are_counted(tmp_path, monkeypatch):
    seen = []
    wave = ScriptedWave()
    monkeypatch.setattr(sidecar_eval, "make_wave", lambda cfg: wave)
    monkeypatch.setattr(wave, "predict", lambda r, f=wave.predict: seen.append(r["id"]) or f(r))
    reqs = tmp_path / "reqs.jsonl"
    extra = [{**REQUESTS[0], "id": f"x/{i}", "gold": [] if i % 2 else REQUESTS[0]["gold"]} for i in range(6)]
    reqs.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS + extra))
    result = sidecar_eval.main(["--recipe", write_recipe(tmp_path, [str(reqs)], limit=5)])
    assert seen == ["fixture/0", "fixture/2", "x/0", "x/2", "x/4"]  # every other request of 10
    assert result["summary"]["all"]["requests"] == 5 and result["summary"]["all"]["skipped"] == 0
    result = sidecar_eval.main(["--recipe", write_recipe(tmp_path, [str(reqs)])])
    assert result["summary"]["all"]["requests"] == 7 and result["summary"]["all"]["skipped"] == 3
    assert "| 3 | gold |" in (tmp_path / "out" / "accuracy.md").read_text()


def test_labels_of_the_teacher_win_over_gold(tmp_path, monkeypatch):
    monkeypatch.setattr(sidecar_eval, "make_wave", lambda cfg: ScriptedWave())
    folder = tmp_path / "data" / "labels" / "t"
    folder.mkdir(parents=True)
    (folder / "dev.jsonl").write_text(json.dumps({"id": "fixture/0", "tool_index": 1, "arguments": {}}) + "\n")
    (folder / "rejected.jsonl").write_text(json.dumps({"id": "fixture/1", "reason": "unparsed"}) + "\n")
    result = sidecar_eval.main(["--recipe", write_recipe(tmp_path, teacher="t", data_dir=str(tmp_path / "data"))])
    all_ = result["summary"]["all"]
    assert all_["reference"] == "labels 1 + gold 3" and all_["function_accuracy"] == 0.75  # the label says tool 1
    assert str(folder / "dev.jsonl") in result["inputs"]
    gold = result["summary_gold"]["all"]  # the same predictions judged by gold alone, beside
    assert gold["reference"] == "gold" and gold["function_accuracy"] == 1.0
    assert "judged against gold only" in (tmp_path / "out" / "accuracy.md").read_text()
    result = sidecar_eval.main(["--recipe", write_recipe(tmp_path, teacher="nobody", data_dir=str(tmp_path / "data"),
                                                         out=str(tmp_path / "gold-only"))])
    assert result["summary"]["all"]["reference"] == "gold"  # no labels yet: gold everywhere, and it says so
    assert result["summary_gold"] is None and "gold only" not in (tmp_path / "gold-only" / "accuracy.md").read_text()


def test_requests_the_target_answered_with_text_are_also_judged_without(tmp_path, monkeypatch):
    """A request whose target trace is a text answer has no label: gold judges it in the main table, and a third
    table leaves it out (no call there for a hint to draft); other rejections stay in."""
    from pipeline.stages.labels import NO_CALL

    wave = ScriptedWave()
    monkeypatch.setattr(wave, "predict", lambda r, f=wave.predict: f({**r, "gold": []}) if r["id"] == "fixture/1"
                        else f(r))  # a wrong function answer where the target answered text
    monkeypatch.setattr(sidecar_eval, "make_wave", lambda cfg: wave)
    folder = tmp_path / "data" / "labels" / "t"
    folder.mkdir(parents=True)
    (folder / "test.jsonl").write_text(json.dumps({"id": "fixture/0", "tool_index": 0, "arguments": {}}) + "\n")
    (folder / "rejected.jsonl").write_text(
        json.dumps({"id": "fixture/1", "reason": "unparsed", "detail": NO_CALL}) + "\n"
        + json.dumps({"id": "fixture/3", "reason": "schema_invalid", "detail": "call 0 get_weather: unit"}) + "\n")
    result = sidecar_eval.main(["--recipe", write_recipe(tmp_path, teacher="t", data_dir=str(tmp_path / "data"))])
    assert result["summary"]["all"]["requests"] == 4 and result["summary"]["all"]["function_accuracy"] == 0.75
    calls = result["summary_calls"]["all"]
    assert result["text_answers"] == ["fixture/1"] and calls["requests"] == 3 and calls["function_accuracy"] == 1.0
    assert calls["reference"] == "labels 1 + gold 2" and str(folder / "rejected.jsonl") in result["inputs"]
    md = (tmp_path / "out" / "accuracy.md").read_text()
    assert "without the 1 requests whose target trace answers with text" in md and "fixture/1" in md
    (folder / "rejected.jsonl").write_text(json.dumps({"id": "fixture/3", "reason": "unparsed", "detail": "x"}) + "\n")
    result = sidecar_eval.main(["--recipe", write_recipe(tmp_path, teacher="t", data_dir=str(tmp_path / "data"))])
    assert result["summary_calls"] is None and result["text_answers"] == []


def test_bad_recipes_and_requests_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(sidecar_eval, "make_wave", lambda cfg: ScriptedWave())
    with pytest.raises(InputError, match=r"unknown key.*limt"):
        sidecar_eval.run(sidecar_eval.resolve(write_recipe(tmp_path, limt=3)))
    with pytest.raises(InputError, match="backend='tgi'"):
        sidecar_eval.run(sidecar_eval.resolve(write_recipe(tmp_path, backend="tgi")))
    with pytest.raises(InputError, match="matches no file"):
        sidecar_eval.run(sidecar_eval.resolve(write_recipe(tmp_path, [str(tmp_path / "none-*.jsonl")])))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "messages": []}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:1 \(record x\): expected `tools`"):
        sidecar_eval.run(sidecar_eval.resolve(write_recipe(tmp_path, [str(bad)])))
    with pytest.raises(InputError, match="adapter_config.json"):
        sidecar_eval.run(sidecar_eval.resolve(write_recipe(tmp_path, model=None, adapter=str(tmp_path))))
    with pytest.raises(InputError, match="set sidecar_eval.model, sidecar_eval.adapter"):
        sidecar_eval.run(sidecar_eval.resolve(write_recipe(tmp_path, model=None)))


def test_every_sidecar_recipe_has_a_sidecar_eval_section():
    for path in sorted((ROOT / "recipes/sidecar").glob("*.yaml")):
        recipe = sidecar_eval.load_recipe(path)
        recipe["sidecar_eval"]["model"] = "m"  # the adapter's base model is read from the trained adapter
        cfg = sidecar_eval.from_recipe(recipe, str(path))
        assert cfg.requests and cfg.adapter == f"checkpoints/sidecar/{path.stem}", path
        assert sidecar_eval.out_dir(cfg) == Path(f"checkpoints/sidecar/{path.stem}/sidecar_eval")


def test_runs_a_real_tiny_model(tmp_path):
    from pipeline.testing import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "tiny", "qwen2")
    result = sidecar_eval.main(["--recipe", write_recipe(tmp_path, model=str(model_dir), limit=1, max_value_tokens=2,
                                                         threads=1)])
    m = result["summary"]["all"]
    assert m["requests"] == 1 and m["mean_prompts"] == 5 and m["mean_latency_s"] > 0
    row = json.loads((tmp_path / "out" / "predictions.jsonl").read_text())
    assert len(row["answers"]) == 5 and row["timings"]["prefill"] > 0
    assert 0 < row["timings"]["cpu_s"] and row["timings"]["others_cpu_s"] >= 0 and m["mean_cpu_s"] > 0
    table = (tmp_path / "out" / "accuracy.md").read_text()
    assert table.startswith("Machine: ") and "Busy waves: " in table and "| wave p95 |" in table


def test_the_adapter_is_merged_as_in_the_runtime_unless_told_otherwise(monkeypatch):
    import pipeline.sidecar.wave as wave_mod

    made = []
    monkeypatch.setattr(wave_mod, "SlotWave", lambda model, adapter, **kw: made.append((adapter, kw)))
    recipe = {"sidecar_eval": {"requests": ["r.jsonl"], "model": "m", "adapter": "a"}}
    sidecar_eval.make_wave(sidecar_eval.from_recipe(recipe))
    sidecar_eval.make_wave(sidecar_eval.from_recipe({"sidecar_eval": {**recipe["sidecar_eval"], "merge_adapter": False}}))
    sidecar_eval.make_wave(sidecar_eval.from_recipe({"sidecar_eval": {"requests": ["r.jsonl"], "model": "m"}}))
    assert [kw["config"].merge_adapter for _, kw in made] == [True, False, False]  # nothing to merge without an adapter
    merged, unmerged = (sidecar_eval.Config(requests=[], model="m", merge_adapter=m) for m in (True, False))
    assert sidecar_eval.fingerprint(merged) != sidecar_eval.fingerprint(unmerged)  # predictions are redone


def test_an_int8_wave_is_judged_as_the_runtime_runs_it(monkeypatch):
    """`sidecar_eval.quantize: int8` builds the wave with the same `SidecarConfig` a recipe's `sidecar.quantize` gives
    the worker (SlotWave loads it in float32: tests/sidecar/test_wave.py); its predictions get their own fingerprint,
    while those made before the key existed keep theirs."""
    import pipeline.sidecar.wave as wave_mod

    made = []
    monkeypatch.setattr(wave_mod, "SlotWave", lambda model, adapter, **kw: made.append(kw))
    recipe = {"sidecar_eval": {"requests": ["r.jsonl"], "model": "m", "adapter": "a", "dtype": "auto"}}
    sidecar_eval.make_wave(sidecar_eval.from_recipe({"sidecar_eval": {**recipe["sidecar_eval"], "quantize": "int8"}}))
    sidecar_eval.make_wave(sidecar_eval.from_recipe(recipe))
    assert [(kw["config"].quantize, kw["config"].dtype) for kw in made] == [("int8", "auto"), (None, "auto")]
    plain = sidecar_eval.Config(requests=[], model="m")
    int8 = sidecar_eval.Config(requests=[], model="m", quantize="int8")
    assert sidecar_eval.fingerprint(plain) != sidecar_eval.fingerprint(int8)
    assert '"quantize"' not in sidecar_eval.fingerprint(plain)  # the committed predictions are still reused
    for extra, match in (({"quantize": "int4"}, "sidecar_eval.quantize='int4'"),
                         ({"quantize": "int8", "backend": "vllm"}, "transformers backend only")):
        with pytest.raises(InputError, match=match):
            sidecar_eval.from_recipe({"sidecar_eval": {**recipe["sidecar_eval"], **extra}}, "r.yaml")
