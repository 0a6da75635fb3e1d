"""Every recipe under recipes/ loads and resolves with the stage that reads it (a typo in a key is an error here,
not hours into a run); a file no test knows how to check fails, so a new recipe folder gets a checker."""

import json
from pathlib import Path

import pytest

from pipeline.recipes import load_recipe, section

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.relative_to(ROOT) for p in (ROOT / "recipes").rglob("*") if p.suffix in (".yaml", ".json"))


def check_teacher(path, recipe):
    from pipeline.stages import labels, traces

    traces.resolve(path)
    labels.resolve(path)


def check_sidecar(path, recipe):
    from pipeline.stages import sidecar_eval
    from pipeline.testing import resolve_sidecar_recipe

    resolve_sidecar_recipe(path, recipe)  # a continuation of an adapter only git history keeps: the error, the rest
    section(recipe, "sidecar_eval", sidecar_eval.KEYS, str(path))  # resolve() also wants the trained adapter


def check_target(path, recipe):
    from pipeline.stages import train

    cfg = train.resolve(path)
    assert cfg.train["mode"] == "target" and cfg.train["rows"] == ["gold"]
    assert cfg.sft["output_dir"] == f"checkpoints/target/{path.stem}"
    from pipeline.stages.models import load_registry  # make models merges this adapter into a registry model
    assert any(s.adapter == cfg.sft["output_dir"] for s in load_registry().values()), f"{path}: no models.yaml entry"


def check_eval(path, recipe):
    from pipeline.stages import eval as eval_stage

    if "vllm_bench" in recipe:  # scripts/bench_vllm.py's recipe: the same requests on vLLM's engine
        import importlib.util

        spec = importlib.util.spec_from_file_location("bench_vllm", ROOT / "scripts" / "bench_vllm.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        assert bench.load_config(str(path), [])["engines"]
        return
    cfg = eval_stage.resolve(path)
    assert cfg.methods and cfg.targets


def check_serve(path, recipe):
    from pipeline.serve.cli import ServeConfig

    ServeConfig.from_recipe(recipe, str(path))


def check_data(path, recipe):
    from pipeline.stages import data

    data.resolve(path)


def check_models(path, recipe):
    from pipeline.stages.models import load_registry

    assert load_registry(ROOT / path)


CHECKERS = {"teacher": check_teacher, "sidecar": check_sidecar, "target": check_target, "eval": check_eval,
            "serve": check_serve, "data": check_data}


@pytest.mark.parametrize("path", RECIPES, ids=str)
def test_every_recipe_resolves(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    if path.name == "models.yaml":
        return check_models(path, None)
    if path.parent.name == "deepspeed":
        if path.suffix == ".json":
            assert json.loads((ROOT / path).read_text())["zero_optimization"]["stage"] == 2
        else:
            import yaml

            assert yaml.safe_load((ROOT / path).read_text())["distributed_type"] == "DEEPSPEED"
        return
    assert path.parent.name in CHECKERS, f"{path}: no checker for recipes/{path.parent.name}/ in tests/test_recipes.py"
    CHECKERS[path.parent.name](path, load_recipe(ROOT / path))
