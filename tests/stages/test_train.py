"""The train stage on the tiny recipe: a loadable adapter and its files, no rerun when done, resume after an
interruption, and clear errors for bad recipe keys."""

from pathlib import Path

import pytest
import torch

from pipeline.io import InputError, read_json, read_jsonl, write_json, write_jsonl
from pipeline.sidecar.rows import build_rows, label_from_call
from pipeline.sidecar.trainer import PackedSFTTrainer
from pipeline.stages import train
from pipeline.testing import make_tiny_model_dir, resolve_sidecar_recipe

ROOT = Path(__file__).parents[2]
RECIPE = str(ROOT / "recipes/sidecar/tiny.yaml")
FIXTURES = ROOT / "tests/fixtures/requests.jsonl"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2")



def run_stage(argv: list[str]):
    """What `train.main(argv)` runs, raising its InputError (the command line prints it and exits with 2)."""
    assert argv[0] == "--recipe"
    return train.run(train.resolve(argv[1], argv[2:]))

def overrides(model_dir, out, *extra):
    return [f"train.model={model_dir}", f"sft.output_dir={out}", f"train.requests=[{FIXTURES}]", *extra]


def test_trains_on_label_rows_and_saves_a_loadable_adapter(model_dir, tmp_path, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [row for r in read_jsonl(FIXTURES) for row in build_rows(r, label_from_call(r, r["gold"][0]))]
    write_jsonl(tmp_path / "rows.jsonl", rows)  # the labels stage's format
    out = tmp_path / "out"
    args = overrides(model_dir, out, f"train.rows=[{tmp_path / 'rows.jsonl'}]",
                     "sft.max_steps=2")
    assert train.main(["--recipe", RECIPE, *args]).is_dir()

    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json", "recipe.yaml",
                 "metrics.json", "loss.png", "manifest.json"):
        assert (out / name).is_file(), name
    metrics = read_json(out / "metrics.json")
    assert metrics["global_step"] == 2 and metrics["pack"]["rows_kept"] == len(rows)
    assert metrics["pack"]["tokens"] < metrics["pack"]["unpacked_tokens"]
    assert [h["step"] for h in metrics["log_history"] if "loss" in h] == [1, 2]
    assert read_json(out / "manifest.json")["config"]["sft"]["max_steps"] == 2

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(base, out)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().max() > 0 for p in lora_b)  # B starts at zero: the adapter was trained
    tok = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        assert model(**tok("hello", return_tensors="pt")).logits.isfinite().all()

    # done means done: the same recipe again does not train
    monkeypatch.setattr(train, "fit", lambda *a: pytest.fail("retrained a finished output"))
    assert train.main(["--recipe", RECIPE, *args]).is_dir()
    with pytest.raises(InputError, match="different recipe"):
        run_stage(["--recipe", RECIPE, *args, "sft.learning_rate=0.1"])


def test_resumes_from_the_last_checkpoint_after_an_interruption(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    args = ["--recipe", RECIPE, *overrides(model_dir, out, "sft.max_steps=4", "sft.save_steps=2")]
    real_step = PackedSFTTrainer.training_step
    calls = []

    def interrupted(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real_step(self, *a, **k)

    monkeypatch.setattr(PackedSFTTrainer, "training_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.main(args)
    assert (out / "checkpoint-2" / "trainer_state.json").is_file() and not (out / "manifest.json").exists()

    monkeypatch.setattr(PackedSFTTrainer, "training_step", real_step)
    assert train.main(args).is_dir()
    metrics = read_json(out / "metrics.json")
    assert metrics["resumed_from"] == "checkpoint-2" and metrics["global_step"] == 4
    assert [h["step"] for h in metrics["log_history"] if "loss" in h] == [1, 2, 3, 4]


def test_row_sources_first_wins_per_request_and_inputs_decide_a_rerun(model_dir, tmp_path, monkeypatch):
    """`train.rows: [<target labels>, gold]`: a request the first source covers takes none of gold's rows; a finished
    adapter is retrained only when its recipe or an input file changed (and then only with train.overwrite)."""
    reqs = read_jsonl(FIXTURES)
    # the "target" labelled request 0 with another argument than gold's
    label = label_from_call(reqs[0], reqs[0]["gold"][0])
    label["arguments"] = {**label["arguments"], "city": "Lyon"}
    label["slots"] = [{**s, "value": "Lyon"} if s["param"] == "city" else s for s in label["slots"]]
    target_rows = build_rows(reqs[0], label)
    write_jsonl(tmp_path / "target.jsonl", target_rows)
    cfg = train.from_recipe(train.load_recipe(RECIPE, overrides(model_dir, tmp_path / "out",
                                                            f"train.rows=[{tmp_path / 'target.jsonl'},gold]")), "t")
    _, rows, inputs, _, sources = train.load_rows(cfg["train"])
    by_request = {}
    for loc, row in rows:
        by_request.setdefault(row["request_id"], set()).add(loc.split(":")[0])
    assert by_request[reqs[0]["id"]] == {str(tmp_path / "target.jsonl")}
    assert all(src == {"gold"} for rid, src in by_request.items() if rid != reqs[0]["id"])
    assert sources[str(tmp_path / "target.jsonl")] == {"requests": 1, "rows": len(target_rows)}
    assert sources["gold"]["requests"] == len(by_request) - 1
    assert any("Lyon" in row["completion"][0]["content"] for _, row in rows)
    assert Path(tmp_path / "target.jsonl") in inputs

    with pytest.raises(InputError, match=r"train.rows is required"):
        train.from_recipe(train.load_recipe(RECIPE, overrides(model_dir, tmp_path / "out", "train.rows=[]")), "t")

    out = tmp_path / "out"
    args = ["--recipe", RECIPE, *overrides(model_dir, out, f"train.rows=[{tmp_path / 'target.jsonl'},gold]",
                                           "sft.max_steps=1")]
    assert train.main(args).is_dir()
    assert read_json(out / "metrics.json")["row_sources"] == sources
    monkeypatch.setattr(train, "fit", lambda *a: pytest.fail("retrained a finished output"))
    assert train.main(args).is_dir()                       # same recipe, same inputs: nothing to do
    manifest = read_json(out / "manifest.json")         # trained before a knob existed: its manifest lacks the key,
    del manifest["config"]["train"]["slice"]            # and the knob at its default changes nothing
    write_json(out / "manifest.json", manifest)
    assert train.main(args).is_dir()
    write_jsonl(tmp_path / "target.jsonl", target_rows[:1])  # the target labels changed
    with pytest.raises(InputError, match=r"other inputs \(.*target.jsonl changed\)"):
        run_stage(args)


def test_slices_split_the_requests_into_disjoint_parts(model_dir, tmp_path):
    """`train.slice: [k, n]`: the k-th of n disjoint parts of the requests (label rows and gold alike), together all of
    them, the same part on every run; a bad slice is a clear error."""
    reqs = read_jsonl(FIXTURES)
    write_jsonl(tmp_path / "target.jsonl", build_rows(reqs[0], label_from_call(reqs[0], reqs[0]["gold"][0])))
    rows_of = {}
    for k in (0, 1, 2):
        cfg = train.from_recipe(train.load_recipe(RECIPE, overrides(model_dir, tmp_path / "out", f"train.slice=[{k},3]",
                                                                f"train.rows=[{tmp_path / 'target.jsonl'},gold]")), "t")
        _, rows, _, _, _ = train.load_rows(cfg["train"])
        rows_of[k] = {row["request_id"] for _, row in rows}
        assert rows_of[k] == {r["id"] for r in reqs if train.slice_of(r["id"], 3) == k} - {
            r["id"] for r in reqs if not r.get("gold")}
    assert not (rows_of[0] & rows_of[1]) and not (rows_of[1] & rows_of[2]) and not (rows_of[0] & rows_of[2])
    whole = train.from_recipe(train.load_recipe(RECIPE, overrides(model_dir, tmp_path / "out")), "t")
    assert rows_of[0] | rows_of[1] | rows_of[2] == {row["request_id"] for _, row in train.load_rows(whole["train"])[1]}
    assert all(rows_of[k] for k in rows_of)  # the fixture's requests fall in every part
    for bad in ("[3,3]", "[1]", "[-1,2]", "'0/3'"):
        with pytest.raises(InputError, match=r"train.slice=.*expected \[k, n\]"):
            train.from_recipe(train.load_recipe(RECIPE, overrides(model_dir, tmp_path / "out", f"train.slice={bad}")), "t")


def test_continues_from_a_finished_adapter(model_dir, tmp_path, monkeypatch):
    """`train.init_adapter`: the run starts from the adapter's weights (at learning rate 0 it ends on them; a fresh
    adapter's B matrices are zero), the manifest records the adapter as an input (a changed one retrains), a finished
    adapter is kept once the one it continued has left the tree, and an adapter of another shape or question style is
    a clear error."""
    from safetensors.torch import load_file

    first = tmp_path / "first"
    assert train.main(["--recipe", RECIPE, *overrides(model_dir, first)]).is_dir()
    before = load_file(first / "adapter_model.safetensors")
    assert any(v.abs().max() > 0 for k, v in before.items() if "lora_B" in k)

    def cont(out, *extra):
        return ["--recipe", RECIPE, *overrides(model_dir, out, f"train.init_adapter={first}",
                                               "sft.learning_rate=0.0", "sft.max_steps=2", *extra)]

    second = tmp_path / "second"
    assert train.main(cont(second)).is_dir()
    after = load_file(second / "adapter_model.safetensors")
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    inputs = read_json(second / "manifest.json")["inputs"]
    assert str(first / "adapter_model.safetensors") in inputs
    # the adapter it continued leaves the tree (as v6 did once v7 was committed): the finished one is neither
    # retrained nor refused; a new run cannot start from the missing one
    first.rename(tmp_path / "gone")
    with monkeypatch.context() as m:
        m.setattr(train, "fit", lambda *a: pytest.fail("retrained a finished output"))
        assert train.main(cont(second)).is_dir()
        with pytest.raises(InputError, match="is not a finished adapter"):
            run_stage(cont(tmp_path / "third"))
    (tmp_path / "gone").rename(first)
    fresh = tmp_path / "fresh"  # the control: without init_adapter the same run ends on zero B matrices
    assert train.main(["--recipe", RECIPE, *overrides(model_dir, fresh, "sft.learning_rate=0.0",
                                                      "sft.max_steps=2")]).is_dir()
    assert all(v.abs().max() == 0 for k, v in load_file(fresh / "adapter_model.safetensors").items()
               if "lora_B" in k)

    with pytest.raises(InputError, match=r"lora.r=8 but train.init_adapter .* has r=4"):
        run_stage(cont(tmp_path / "bad", "lora.r=8"))
    with pytest.raises(InputError, match=r"questions='short' but train.init_adapter .* trained with questions='long'"):
        run_stage(cont(tmp_path / "bad", "train.questions=short"))
    with pytest.raises(InputError, match="is not a finished adapter"):
        run_stage(cont(tmp_path / "bad", f"train.init_adapter={tmp_path / 'none'}"))
    assert not (tmp_path / "bad").exists()


def test_grows_an_adapter_into_a_larger_lora_with_the_same_products(model_dir, tmp_path):
    """`train.init_grow`: a rank-4 adapter on two modules of layer 0 grows into rank 8 on every module and layer: at
    learning rate 0 each of its products scale*B@A is unchanged (new alpha/r, so B is rescaled), the new modules and
    ranks start silent (B = 0), the saved weights are bfloat16 with `train.save_dtype`, and a recipe whose shape
    cannot hold the adapter is a clear error."""
    from safetensors.torch import load_file

    first = tmp_path / "first"
    assert train.main(["--recipe", RECIPE, *overrides(model_dir, first, "lora.target_modules=[q_proj,v_proj]",
                                                      "lora.layers_to_transform=[0]", "sft.max_steps=2",
                                                      "sft.learning_rate=1e-2")]).is_dir()
    small = load_file(first / "adapter_model.safetensors")
    assert any(v.abs().max() > 0 for k, v in small.items() if "lora_B" in k)

    def grow(out, *extra):
        return ["--recipe", RECIPE, *overrides(model_dir, out, f"train.init_adapter={first}", "train.init_grow=true",
                                               "lora.r=8", "lora.lora_alpha=8", "sft.learning_rate=0.0",
                                               "sft.max_steps=2", *extra)]

    grown_dir = tmp_path / "grown"
    assert train.main(grow(grown_dir, "train.save_dtype=bfloat16")).is_dir()
    grown = load_file(grown_dir / "adapter_model.safetensors")
    assert {v.dtype for v in grown.values()} == {torch.bfloat16}
    assert set(small) < set(grown)                      # every module of every layer now
    assert read_json(grown_dir / "adapter_config.json")["r"] == 8
    for key in (k for k in small if ".lora_A." in k):
        b_key = key.replace(".lora_A.", ".lora_B.")
        before = (8 / 4) * small[b_key].float() @ small[key].float()
        after = (8 / 8) * grown[b_key].float() @ grown[key].float()
        assert torch.allclose(after, before, rtol=2e-2, atol=1e-4), key   # bf16 rounding only
        assert grown[b_key][:, 4:].abs().max() == 0                        # the new ranks start silent
    assert all(v.abs().max() == 0 for k, v in grown.items() if "lora_B" in k and k not in small)

    with pytest.raises(InputError, match=r"cannot hold .*lora.r=2 < the adapter's r=4"):
        run_stage(grow(tmp_path / "bad", "lora.r=2"))
    with pytest.raises(InputError, match=r"cannot hold .*does not hold the adapter's \[0\]"):
        run_stage(grow(tmp_path / "bad", "lora.layers_to_transform=[1]"))
    with pytest.raises(InputError, match=r"init_grow=true needs train.init_adapter"):
        run_stage(["--recipe", RECIPE, *overrides(model_dir, tmp_path / "bad", "train.init_grow=true")])
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("key,match", [
    ("sft.learning_rat=1e-4", r"unknown key\(s\) \['learning_rat'\] in section 'sft'; expected one of .*'learning_rate'"),
    ("lora.rank=8", r"unknown key\(s\) \['rank'\] in section 'lora'; expected one of .*'lora_alpha'"),
    ("train.modle=x", r"unknown key\(s\) \['modle'\] in section 'train'; expected one of .*'model'"),
    ("trainer.x=1", r"unknown top-level key\(s\) \['trainer'\]"),
    ("sft.packing=true", r"sft.packing=True conflicts with prefix-shared packing"),
    ("train.null_keep=2", r"null_keep=2; expected a fraction"),
    ("train.function_repeat=0", r"function_repeat=0; expected an integer >= 1"),
    ("train.questions=terse", r"questions='terse'; expected one of long, short"),
])
def test_bad_recipe_keys_are_clear_errors(model_dir, tmp_path, key, match):
    with pytest.raises(InputError, match=match):
        run_stage(["--recipe", RECIPE, *overrides(model_dir, tmp_path / "out"), key])
    assert not (tmp_path / "out").exists()


def test_every_sidecar_recipe_resolves():
    for path in sorted((ROOT / "recipes/sidecar").glob("*.yaml")):
        resolved = resolve_sidecar_recipe(path)
        assert resolved["sft"]["output_dir"] == f"checkpoints/sidecar/{path.stem}"


def test_the_global_batch_is_the_same_on_1_2_or_8_processes():
    """The recipe's global batch is split into per-device batch x accumulation x processes exactly."""
    for processes in (1, 2, 4, 8):
        per_device, accumulation = train.split_global_batch(32, processes, 4)
        assert per_device * accumulation * processes == 32 and per_device <= 4
    assert train.split_global_batch(32, 1, 4) == (4, 8) and train.split_global_batch(32, 8, 4) == (4, 1)
    assert train.split_global_batch(8, 8, 4) == (1, 1)          # the micro-batch shrinks to the per-process share
    assert train.split_global_batch(24, 2, 5) == (4, 3)         # the largest divisor of the share below the micro
    with pytest.raises(ValueError, match="not a multiple of 3 processes"):
        train.split_global_batch(32, 3, 4)
    # no train.global_batch: the recipe's per-device batch x accumulation is the global batch (one process)
    plan = train.batch_plan({"global_batch": None}, {"per_device_train_batch_size": 4,
                                                     "gradient_accumulation_steps": 8}, 8)
    assert plan == {"global": 32, "processes": 8, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1}
    with pytest.raises(InputError, match="r.yaml: train.global_batch: global batch 6 is not a multiple of 4"):
        train.batch_plan({"global_batch": 6}, {"per_device_train_batch_size": 2}, 4, "r.yaml")


def test_global_batch_sets_the_accumulation_of_a_run(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    out = tmp_path / "gb"
    train.run(train.resolve(RECIPE, overrides(model_dir, out, "train.global_batch=4", "sft.max_steps=1")))
    batch = read_json(out / "metrics.json")["batch"]
    assert batch == {"global": 4, "processes": 1, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    with pytest.raises(InputError, match=r"train.global_batch=0; expected an integer >= 1"):
        train.run(train.resolve(RECIPE, overrides(model_dir, tmp_path / "bad", "train.global_batch=0")))


@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_zero2_runs_two_processes_on_cpu(model_dir, tmp_path):
    """`make train-deepspeed-check`: accelerate + DeepSpeed ZeRO-2, 2 CPU processes (gloo), the tiny recipe."""
    import os
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    out = tmp_path / "out"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ROOT / "build/torch_extensions"), "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
           str(ROOT / "recipes/deepspeed/accelerate-zero2.yaml"), "--num_processes", "2", "--main_process_port", "29533",
           "-m", "pipeline.stages.train", "--recipe", RECIPE, *overrides(model_dir, out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_json(out / "metrics.json")
    assert metrics["world_size"] == 2 and metrics["global_step"] == 4
    # the tiny recipe's 2 x 1 on one process is its global batch: 2 processes x 1 x 1
    assert metrics["batch"] == {"global": 2, "processes": 2, "per_device_train_batch_size": 1,
                                "gradient_accumulation_steps": 1}
    assert list((out / "checkpoint-4").glob("global_step4"))  # a DeepSpeed engine checkpoint, not a plain one
    assert (out / "adapter_model.safetensors").is_file()


# --- train.mode: target (a target taught to write tool calls) ------------------------------------------------------

def test_target_sequences_are_the_prompt_then_the_gold_calls_as_the_template_writes_them(model_dir):
    from transformers import AutoTokenizer

    from pipeline.requests import render_prompt
    from pipeline.sidecar.packing import IGNORE, PackedCollator, pack_targets

    tok = AutoTokenizer.from_pretrained(model_dir)
    requests = {r["id"]: r for r in read_jsonl(FIXTURES)}
    seqs, stats = pack_targets(tok, requests)
    assert stats["sequences"] == len(requests) == len(seqs)
    for s in seqs:
        request = requests[s["request_id"]]
        n = s["segment_ids"].count(0)
        assert tok.decode(s["input_ids"][:n]) == render_prompt(tok, request, {})  # the prompt, no loss on it
        assert set(s["labels"][:n]) == {IGNORE} and s["labels"][n:] == s["input_ids"][n:]
        answer = tok.decode(s["input_ids"][n:])
        assert answer.endswith("<|im_end|>") and answer.count("<tool_call>") == len(request["gold"])
        assert f'"name": "{request["gold"][0]["name"]}"' in answer
    batch = PackedCollator(tok.pad_token_id)(seqs[:2])
    assert batch["attention_mask"].dim() == 2  # one row per sequence: plain causal attention, padding masked
    assert batch["attention_mask"].sum() == sum(len(s["input_ids"]) for s in seqs[:2])
    assert pack_targets(tok, requests, max_length=8)[1]["rows_dropped_too_long"] == len(requests)


def test_target_mode_trains_on_gold_calls_only_and_saves_no_tokenizer(model_dir, tmp_path):
    out = tmp_path / "target"
    args = overrides(model_dir, out, "train.mode=target", "train.rows=[gold]", "sft.max_steps=2")
    assert run_stage(["--recipe", RECIPE, *args]) == out
    assert (out / "adapter_model.safetensors").is_file() and (out / "manifest.json").is_file()
    assert not (out / "tokenizer.json").exists()  # the base model folder has it (Gemma's is 33 MB)
    metrics = read_json(out / "metrics.json")
    assert metrics["global_step"] == 2 and metrics["pack"]["sequences"] == len(read_jsonl(FIXTURES))
    assert metrics["row_sources"] == {"gold": {"requests": len(read_jsonl(FIXTURES)),
                                               "rows": len(read_jsonl(FIXTURES))}}
    with pytest.raises(InputError, match=r"train.mode=target trains on the requests' gold calls only"):
        run_stage(["--recipe", RECIPE, *overrides(model_dir, tmp_path / "x", "train.mode=target",
                                                  f"train.rows=[{tmp_path / 'rows.jsonl'}, gold]")])
    with pytest.raises(InputError, match="train.mode='teacher'; expected one of sidecar, target"):
        run_stage(["--recipe", RECIPE, *overrides(model_dir, tmp_path / "y", "train.mode=teacher")])
    assert train.resolve(str(ROOT / "recipes/target/gemma3-270m-tools.yaml")).sft["output_dir"] == \
        "checkpoints/target/gemma3-270m-tools"
