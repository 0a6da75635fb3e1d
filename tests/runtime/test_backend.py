"""The backend table (pipeline/runtime/backend.py) and how eval recipes name a backend; no llama.cpp needed."""

import json

import pytest

from pipeline.io import InputError
from pipeline.runtime.backend import BACKENDS, TargetBackend, gguf_of, load_target
from pipeline.stages.eval import resolve, target_methods


def test_both_targets_implement_the_protocol(targets):
    from pipeline.runtime.llamacpp import LlamaCppTarget

    assert isinstance(targets["qwen2"], TargetBackend)
    missing = [m for m in ("prompt_ids", "prefill", "verify", "keep", "drop", "set_threads", "calibrate", "make_memo")
               if not callable(getattr(LlamaCppTarget, m, None))]
    assert not missing and set(BACKENDS) == {"transformers", "llamacpp"}


def test_unknown_backend_and_missing_gguf_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown target backend 'onnx'"):
        load_target("onnx", "x")
    with pytest.raises(FileNotFoundError, match="manifest.json: missing"):
        gguf_of(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"source": {"gguf": str(tmp_path / "gone.gguf")},
                                                        "config": {"gguf_file": "m.gguf"}}))
    with pytest.raises(FileNotFoundError, match="make models"):
        gguf_of(tmp_path, downloads=tmp_path / "dl")
    (tmp_path / "dl" / tmp_path.name).mkdir(parents=True)
    (tmp_path / "dl" / tmp_path.name / "m.gguf").write_bytes(b"GGUF")
    assert gguf_of(tmp_path, downloads=tmp_path / "dl") == tmp_path / "dl" / tmp_path.name / "m.gguf"


def test_eval_targets_run_only_their_backends_peers(tmp_path):
    def resolved(recipe: dict):
        path = tmp_path / "eval.yaml"
        path.write_text(json.dumps(recipe))  # JSON is YAML
        return resolve(path)

    recipe = {"eval": {"benchmarks": {"b": 1}, "targets": [{"name": "l", "path": "p", "backend": "llamacpp"}],
                       "methods": ["ar", "toolspec", "hf-pld", "hf-assisted", "llama-pld", "llama-draft"],
                       "assistant": {"path": "small"}}}
    cfg = resolved(recipe)
    assert target_methods(cfg, cfg.targets[0]) == ["ar", "toolspec", "llama-pld", "llama-draft"]
    assert target_methods(cfg, {"name": "t", "path": "p"}) == ["ar", "toolspec", "hf-pld", "hf-assisted"]
    assert target_methods(cfg, {"name": "s", "path": "small", "backend": "llamacpp"}) == ["ar", "toolspec", "llama-pld"]
    for name, size in (("draft", 100), ("tiny", 10), ("big", 1000)):  # a draft model must be smaller than its target
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"w" * size)
    cfg.assistant = {"path": str(tmp_path / "draft")}
    assert target_methods(cfg, {"name": "t", "path": str(tmp_path / "tiny")}) == ["ar", "toolspec", "hf-pld"]
    assert target_methods(cfg, {"name": "t", "path": str(tmp_path / "big")})[-1] == "hf-assisted"
    recipe["eval"]["targets"][0]["backend"] = "onnx"
    with pytest.raises(InputError, match="backend 'onnx'"):
        resolved(recipe)
