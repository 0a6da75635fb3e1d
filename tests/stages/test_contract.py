"""The stage contract (pipeline/stages/__init__.py): every stage module has a `Config` dataclass, `resolve(recipe_path,
overrides)`, `run(cfg)`, and a `main` that is the shared one; flags are shorthands for overrides; no stage imports
the test helpers."""

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest

from pipeline import stages

STAGE_DIR = Path(stages.__file__).parent


def test_every_stage_module_is_listed():
    on_disk = {p.stem for p in STAGE_DIR.glob("*.py") if p.stem != "__init__"}
    assert on_disk == set(stages.STAGES)


@pytest.mark.parametrize("name", stages.STAGES)
def test_stage_keeps_the_contract(name, monkeypatch):
    mod = importlib.import_module(f"pipeline.stages.{name}")
    assert dataclasses.is_dataclass(mod.Config) and issubclass(mod.Config, stages.StageConfig), name
    assert list(inspect.signature(mod.resolve).parameters) == ["recipe_path", "overrides"], name
    assert list(inspect.signature(mod.run).parameters) == ["cfg"], name
    assert (mod.__doc__ or "").strip(), f"{name}: no module docstring"
    calls = []
    monkeypatch.setattr(mod, "stage_main", lambda module, argv: calls.append((module, argv)) or "ran")
    assert mod.main(["--recipe", "x.yaml"]) == "ran" and calls == [(mod, ["--recipe", "x.yaml"])], name
    for flag in getattr(mod, "FLAGS", ()):  # a flag names a setting of the stage's own section
        section, key = flag.key.split(".")
        assert section == name and key in mod.Config.keys(), flag


@pytest.mark.parametrize("name", stages.STAGES)
def test_no_stage_imports_the_test_helpers(name):
    tree = ast.parse((STAGE_DIR / f"{name}.py").read_text())
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert not [m for m in imported if m.split(".")[-1] == "testing"], name


def test_the_shared_main_turns_flags_into_overrides_and_reports_bad_input(tmp_path, monkeypatch, capsys):
    from pipeline.stages import upload

    seen = []
    monkeypatch.setattr(upload, "run", seen.append)
    stages.main(upload, ["--adapter", str(tmp_path / "a b"), "--repo", "user/name", "--dry-run",
                         "--commit-message", "Upload: v2", "upload.private=true"])
    cfg = seen[0]
    assert (cfg.adapter, cfg.repo, cfg.dry_run, cfg.private) == (str(tmp_path / "a b"), "user/name", True, True)
    assert cfg.commit_message == "Upload: v2"  # the flag's value reaches the config as written, not read as YAML
    assert cfg.recipe["upload"]["repo"] == "user/name"  # the loaded recipe travels with the config
    with pytest.raises(SystemExit) as e:
        stages.main(upload, ["--adapter", "a"])
    assert e.value.code == 2 and "error: upload: --repo user/name is required" in capsys.readouterr().err


def test_settings_leave_the_recipe_out():
    from pipeline.stages import data

    cfg = data.Config(out="o", recipe={"data": {"out": "o"}})
    assert "recipe" not in cfg.settings() and cfg.settings()["out"] == "o"
    assert "recipe" not in data.Config.keys() and "force" not in cfg.fingerprinted()
