"""Shared helpers: JSONL errors, atomic and resumable writes, recipes, the tiny-model factory."""

import json

import pytest

from pipeline.io import InputError, ResumableJsonl, atomic_open, read_jsonl, write_jsonl
from pipeline.recipes import apply_overrides, load_recipe


def test_read_jsonl_names_file_and_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"id": 1}\n{"id": 2,,}\n')
    with pytest.raises(InputError, match=r"x\.jsonl:2: invalid JSON"):
        read_jsonl(p)
    p.write_text('{"id": 1}\n[1, 2]\n')
    with pytest.raises(InputError, match=r"x\.jsonl:2: expected a JSON object"):
        read_jsonl(p)


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    p = tmp_path / "out.jsonl"
    write_jsonl(p, [{"a": 1}])
    with pytest.raises(RuntimeError), atomic_open(p) as f:
        f.write("partial")
        raise RuntimeError("boom")
    assert read_jsonl(p) == [{"a": 1}]
    assert [x.name for x in tmp_path.iterdir()] == ["out.jsonl"]


def test_resumable_jsonl_survives_torn_line(tmp_path):
    p = tmp_path / "t.jsonl"
    w = ResumableJsonl(p)
    w.write({"id": "a"})
    w.write({"id": "b"})
    w.close()
    with open(w.partial, "a") as f:
        f.write('{"id": "c", "te')  # killed mid-write
    w2 = ResumableJsonl(p)
    assert w2.done_ids() == {"a", "b"}
    w2.write({"id": "b"})  # duplicate ignored
    w2.write({"id": "c"})
    w2.finish()
    assert [r["id"] for r in read_jsonl(p)] == ["a", "b", "c"]


def test_recipe_overrides(tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("train:\n  lr: 1.0e-4\n  epochs: 1\n")
    cfg = load_recipe(r, ["train.lr=2e-4", "train.tags=[a,b]", "eval.limit=5"])
    assert cfg["train"] == {"lr": 2e-4, "epochs": 1, "tags": ["a", "b"]}
    assert cfg["eval"] == {"limit": 5} and cfg["recipe_name"] == "r"
    with pytest.raises(InputError, match="key=value"):
        apply_overrides({}, ["nokey"])
    with pytest.raises(InputError, match="not found"):
        load_recipe(tmp_path / "missing.yaml")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_model_dir_loads_like_a_real_model(tmp_path, family):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.testing import make_tiny_model_dir

    d = make_tiny_model_dir(tmp_path / family, family)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d)
    assert model.config.model_type == family
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "w",
                                               "parameters": {"type": "object", "properties": {}}}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    text = tok.apply_chat_template([{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "", "tool_calls": [call]}],
                                   tools=tools, tokenize=False)
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
           '<|im_end|>' in text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")
    assert tok.decode(ids["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape[-1] == len(tok)
