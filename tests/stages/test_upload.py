"""The upload stage up to the HTTP boundary: token first, adapter checks, the model card, the file list, dry run, and
the create_repo / upload_folder calls (HfApi methods replaced; no network)."""

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest

from pipeline.io import InputError, read_json, write_json
from pipeline.stages import upload as up


@pytest.fixture(scope="module")
def saved_adapter(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    from pipeline.testing import make_tiny_model

    model, tok = make_tiny_model("qwen2")
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"]))
    out = tmp_path_factory.mktemp("adapter")
    lora.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def adapter(tmp_path, saved_adapter):
    """An adapter folder as `make train` leaves it, plus what must stay local."""
    out = tmp_path / "checkpoints" / "sidecar" / "tiny"
    shutil.copytree(saved_adapter, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "org/base-model"
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    (out / "recipe.yaml").write_text("recipe_name: tiny\ntrain:\n  compact: true\n"
                                     "  requests: [data/requests/*/train.jsonl]\nlora:\n  r: 4\n")
    (out / "metrics.json").write_text(json.dumps({
        "train": {"train_loss": 1.0, "train_runtime": 600.0}, "global_step": 12,
        "pack": {"rows_kept": 40, "sequences": 9},
        "row_sources": {"data/labels/t/rows/train.jsonl": {"requests": 3, "rows": 12}, "gold": {"requests": 5, "rows": 20}}}))
    (out / "manifest.json").write_text("{}")
    summary = {"bfcl/test": {"requests": 10, "function_accuracy": 0.9, "slot_exact": 0.7, "null_precision": 0.8,
                             "null_recall": 0.6, "whole_call": 0.5, "payload_rate": 1.0, "mean_payload_bytes": 85.0,
                             "mean_latency_s": 1.1, "mean_prompts": 8.0}}
    summary["all"] = summary["bfcl/test"]
    (out / "accuracy.json").write_text(json.dumps({"summary": summary, "reference": "gold"}))
    (out / "accuracy.predictions.jsonl").write_text("{}\n")
    (out / "checkpoint-10").mkdir()
    (out / "checkpoint-10" / "optimizer.pt").write_bytes(b"x")
    (out / "training_args.bin").write_bytes(b"x")
    (out / ".lock").write_text("")
    return out


@pytest.fixture
def hub(monkeypatch):
    """Record HfApi calls instead of making them; a token is available unless a test removes it."""
    calls = []

    def create_repo(self, repo_id, **kw):
        calls.append(("create_repo", repo_id, kw, self.token))
        return f"https://hub.example/{repo_id}"

    def upload_folder(self, **kw):
        calls.append(("upload_folder", kw["repo_id"], kw, self.token))
        return type("CommitInfo", (), {"commit_url": "https://hub.example/commit/abc"})()

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(up, "get_token", lambda: "hf_test_token")
    return calls


def test_missing_token_is_an_error_before_anything_else(tmp_path, hub, monkeypatch, capsys):
    monkeypatch.setattr(up, "get_token", lambda: None)
    missing = tmp_path / "does-not-exist"
    with pytest.raises(up.MissingToken, match="HF_TOKEN"):
        up.upload(missing, "user/name")  # the token is checked before the (missing) adapter
    with pytest.raises(SystemExit) as e:
        up.main(["--adapter", str(missing), "--repo", "user/name"])
    assert e.value.code == 2 and "no Hugging Face token" in capsys.readouterr().err
    assert hub == [] and not missing.exists()


def test_token_comes_from_hf_token(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert up.require_token() == "hf_from_env"
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no cached login there
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    with pytest.raises(up.MissingToken):
        up.require_token()


def test_adapter_errors_name_the_path(tmp_path, hub):
    with pytest.raises(InputError, match="nowhere: adapter folder not found"):
        up.upload(tmp_path / "nowhere", "user/name")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"empty/adapter_config.json: missing"):
        up.upload(tmp_path / "empty", "user/name")
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    with pytest.raises(InputError, match="no adapter weights"):
        up.upload(tmp_path / "empty", "user/name", dry_run=True)
    with pytest.raises(InputError, match="expected a Hub repo id"):
        up.upload(tmp_path / "empty", "not a repo")
    assert hub == []


def test_dry_run_writes_the_card_and_lists_files_without_token_or_network(adapter, hub, monkeypatch, capsys):
    monkeypatch.setattr(up, "get_token", lambda: None)
    record = up.upload(adapter, "user/ooo-sidecar", dry_run=True)
    assert hub == []
    files = record["files"]
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json", "tokenizer.json",
            "recipe.yaml", "metrics.json", "accuracy.json", "README.md", "manifest.json"} <= set(files)
    assert not [f for f in files if f.startswith("checkpoint-") or f.endswith((".pt", ".bin", ".predictions.jsonl"))
                or f.startswith((".", "upload/"))]
    out = capsys.readouterr().out
    assert "would upload" in out and "adapter_model.safetensors" in out
    card = (adapter / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft") and "base_model: org/base-model" in card
    for text in ("BFCL", "Seal-Tools", "API-Bank", "ToolAlpaca", "Apache-2.0", "non-commercial", "LoRA r=4",
                 "q_proj, v_proj", "recipe_name: tiny", "| bfcl/test | 10 | 90.0 | 70.0 |",
                 "PeftModel.from_pretrained", "--enable-lora --lora-modules sidecar=user/ooo-sidecar",
                 "Training inputs: `data/requests/*/train.jsonl`", "| `data/labels/t/rows/train.jsonl` | 3 | 12 |",
                 "| `gold` | 5 | 20 |", "Trained 12 optimizer steps in 10 min, final train loss 1.000"):
        assert text in card, text
    manifest = json.loads((adapter / "upload" / "manifest.json").read_text())
    assert manifest["dry_run"] is True and manifest["files"] == files


def test_upload_creates_the_repo_and_uploads_the_same_files(adapter, hub):
    record = up.upload(adapter, "user/ooo-sidecar", private=True)
    (name, repo, kw, token), (name2, repo2, kw2, token2) = hub
    assert (name, repo, name2, repo2) == ("create_repo", "user/ooo-sidecar", "upload_folder", "user/ooo-sidecar")
    assert kw == {"private": True, "exist_ok": True} and token == token2 == "hf_test_token"
    assert kw2["folder_path"] == str(adapter) and kw2["ignore_patterns"] == up.IGNORE_PATTERNS
    assert record["commit_url"] == "https://hub.example/commit/abc"
    # the listing shown to the user is what upload_folder's own filter keeps
    from huggingface_hub.utils import filter_repo_objects

    every = [p.relative_to(adapter).as_posix() for p in adapter.rglob("*") if p.is_file()]
    assert record["files"] == sorted(filter_repo_objects(every, ignore_patterns=kw2["ignore_patterns"]))


def test_an_adapter_without_its_tokenizer_uploads_its_local_bases(adapter, hub, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (adapter / f).rename(base / f)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "nowhere")
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=r"tokenizer_config.json: missing, and the base model .*nowhere"):
        up.upload(adapter, "user/x", dry_run=True)
    cfg["base_model_name_or_path"] = str(base)
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    staged = {}
    real = huggingface_hub.HfApi.upload_folder

    def upload_folder(self, **kw):  # what the staging folder holds while it is uploaded
        staged.update({p.relative_to(kw["folder_path"]).as_posix(): p.read_bytes()
                       for p in Path(kw["folder_path"]).rglob("*") if p.is_file()})
        return real(self, **kw)

    huggingface_hub.HfApi.upload_folder = upload_folder
    try:
        record = up.upload(adapter, "user/x")
    finally:
        huggingface_hub.HfApi.upload_folder = real
    assert {"tokenizer.json", "tokenizer_config.json", "adapter_model.safetensors"} <= set(record["files"])
    assert staged["tokenizer.json"] == (base / "tokenizer.json").read_bytes() and set(staged) == set(record["files"])
    assert hub[-1][2]["folder_path"] != str(adapter)  # a staging folder
    assert not (adapter / "tokenizer.json").exists()


def test_card_without_recipe_or_accuracy_and_with_a_local_base(adapter, hub):
    (adapter / "recipe.yaml").unlink()
    (adapter / "accuracy.json").unlink()
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(adapter)  # a local folder is not a hub id
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    up.upload(adapter, "user/x", dry_run=True)
    card = (adapter / "README.md").read_text()
    assert "base_model:" not in card.split("---")[1]
    assert "recipe was not found" in card and "Not measured yet" in card
    up.upload(adapter, "user/x", dry_run=True, base_model="Org/Base-1")
    assert "base_model: Org/Base-1" in (adapter / "README.md").read_text()


def test_main_takes_the_adapter_from_a_recipe(adapter, hub, tmp_path, monkeypatch):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(f"sft:\n  output_dir: {adapter}\n")
    record = up.main(["--recipe", str(recipe), "--repo", "user/ooo-sidecar", "--dry-run"])
    assert "adapter_model.safetensors" in record["files"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plain.yaml").write_text("train: {}\n")
    assert up.resolve("plain.yaml", ["upload.repo=u/n"]).adapter == "checkpoints/sidecar/plain"
    with pytest.raises(up.InputError, match="--repo user/name is required"):
        up.resolve("plain.yaml")
    with pytest.raises(up.InputError, match="pass --adapter DIR or --recipe PATH"):
        up.resolve(None, ["upload.repo=u/n"])


def test_card_reads_the_accuracy_that_make_sidecar_eval_writes(adapter, hub):
    (adapter / "sidecar_eval").mkdir()
    accuracy = read_json(adapter / "accuracy.json")
    (adapter / "accuracy.json").unlink()
    gold = {g: dict(m, requests=9) for g, m in accuracy["summary"].items()}  # judged by labels, and by gold alone
    write_json(adapter / "sidecar_eval" / "accuracy.json", dict(accuracy, reference="labels", summary_gold=gold))
    up.upload(adapter, "user/x", dry_run=True)
    card = (adapter / "README.md").read_text()
    assert "| bfcl/test | 10 |" in card and "Not measured yet" not in card
    assert card.index("Against labels calls") < card.index("gold calls only") < card.index("| bfcl/test | 9 |")
