"""The upload stage: publish a sidecar adapter folder to the Hugging Face Hub with a generated model card.

Run as: python -m pipeline.stages.upload --adapter checkpoints/sidecar/<recipe>/ --repo user/name
            [--dry-run] [--private] [--base-model HUB_ID]        (or --recipe recipes/sidecar/<recipe>.yaml)

What goes up (one `upload_folder` commit into a repo made with `create_repo(exist_ok=True)`): the peft adapter, the
tokenizer (the adapter folder's, else its local base model's), the resolved recipe, metrics, the loss curve,
`accuracy.json/.md` when `make sidecar-eval` wrote them, and README.md — the model card generated here (base model, training data and licenses, recipe, accuracy table, usage
with peft and with vLLM `--enable-lora`). Trainer checkpoints, optimizer states, pickles and per-request
predictions stay local (IGNORE_PATTERNS).

Token: HF_TOKEN or the cached `huggingface-cli login` (`huggingface_hub.get_token()`); without one the stage stops
before it reads or writes anything. `--dry-run` needs no token: it writes the card into the adapter folder and lists
the files an upload would send. A record of each run (files, repo, commit) goes to <adapter>/upload/manifest.json.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from contextlib import nullcontext
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from huggingface_hub import HfApi, get_token
from huggingface_hub.utils import filter_repo_objects

from ..artifacts import seal
from ..io import HUB_REPO_ID, InputError, atomic_open, looks_like_hub_id, read_json, write_manifest
from ..recipes import load_recipe, section
from ..sidecar.accuracy import adapter_of, markdown_table
from . import Flag, StageConfig
from . import main as stage_main

IGNORE_PATTERNS = ["checkpoint-*", "checkpoint-*/**", "runs/**", "upload/**", "*.pt", "*.pth", "training_args.bin",
                   "rng_state*", "*.partial", "*.tmp", "*.predictions.jsonl", ".*", "**/.*"]
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
RECIPE_FILES = ("recipe.yaml", "recipe.yml", "resolved_recipe.yaml", "config.yaml", "recipe.json")
# (source, license, note) of the data the sidecar's rows come from; see ../shared/data/<source>/README.md
TRAINING_DATA = [
    ("BFCL v4 (Berkeley Function Calling Leaderboard)", "Apache-2.0", ""),
    ("Seal-Tools", "Apache-2.0", ""),
    ("API-Bank", "Apache-2.0", "api-bank/LICENSE (the repository root is MIT)"),
    ("ToolAlpaca", "Apache-2.0", "GPT-generated; some consider data derived from it non-commercial"),
]


class MissingToken(RuntimeError):
    pass


def require_token() -> str:
    token = get_token()
    if not token:
        raise MissingToken("no Hugging Face token: set HF_TOKEN or run `huggingface-cli login` "
                           "(or use --dry-run to write the card without uploading)")
    return token


def check_adapter(adapter: Path) -> None:
    if not adapter.is_dir():
        raise InputError(f"{adapter}: adapter folder not found "
                         "(expected checkpoints/sidecar/<recipe>/ from `make train`)")
    if not (adapter / "adapter_config.json").is_file():
        raise InputError(f"{adapter / 'adapter_config.json'}: missing; {adapter} is not a peft adapter folder")
    if not any((adapter / w).is_file() for w in ADAPTER_WEIGHTS):
        raise InputError(f"{adapter}: no adapter weights (expected one of {list(ADAPTER_WEIGHTS)})")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


def tokenizer_source(adapter: Path, base: str | None) -> Path:
    """Where the repo's tokenizer comes from: the adapter folder's own, else its local base model's (a committed
    adapter leaves out the copy `make models` builds beside it: SmolLM2's is 3.5 MB of the 40 MB tree)."""
    if (adapter / "tokenizer_config.json").is_file():
        return adapter
    if base and (Path(base) / "tokenizer_config.json").is_file():
        return Path(base)
    raise InputError(f"{adapter / 'tokenizer_config.json'}: missing, and the base model {base!r} is no local folder "
                     "with a tokenizer (build it with `make models`, or save the tokenizer into the adapter folder)")


def find_recipe(adapter: Path) -> tuple[Path | None, dict | None]:
    for name in RECIPE_FILES:
        path = adapter / name
        if path.is_file():
            text = path.read_text()
            try:
                recipe = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
            except (json.JSONDecodeError, yaml.YAMLError) as e:
                raise InputError(f"{path}: unreadable recipe ({e})") from e
            return path, recipe if isinstance(recipe, dict) else None
    return None, None


def upload_files(adapter: Path) -> list[str]:
    """Files (relative, sorted) that `upload_folder` sends with IGNORE_PATTERNS — the same filter it applies."""
    files = [p.relative_to(adapter).as_posix() for p in adapter.rglob("*") if p.is_file()]
    return sorted(filter_repo_objects(files, ignore_patterns=IGNORE_PATTERNS))


def model_card(repo: str, adapter_config: dict, recipe_path: Path | None, recipe: dict | None,
               accuracy: dict | None, base_model: str | None = None, metrics: dict | None = None) -> str:
    """README.md of the Hub repo (pure: everything comes in as arguments)."""
    base = base_model or adapter_config.get("base_model_name_or_path") or "unknown"
    front = {"library_name": "peft", "license": "apache-2.0", "pipeline_tag": "text-generation",
             "tags": ["lora", "peft", "tool-calling", "speculative-decoding", "ooo-spec"]}
    if looks_like_hub_id(base):
        front["base_model"] = base
    rank, alpha = adapter_config.get("r"), adapter_config.get("lora_alpha")
    targets = adapter_config.get("target_modules")
    targets = ", ".join(sorted(targets)) if isinstance(targets, list) else targets
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {repo.split('/')[-1]}", "",
             "An OoO-Spec sidecar: a LoRA adapter that turns a small model into a parallel tool-call slot predictor "
             "(OoO-Spec, arXiv 2608.00814). When a tool-calling request arrives it answers, in one batched wave that "
             "shares the prompt prefix, which tool is called and the JSON value of every parameter of every tool; "
             "the join of those answers, `{\"tool_index\": i, \"arguments\": {...}}`, is a draft that a target model "
             "verifies token by token (greedy output unchanged, only faster).", "",
             "## Base model", "", f"`{base}`" + ("" if looks_like_hub_id(base) else
                                                " (a local path when trained; load the same weights)"), "",
             "## Training data", "",
             "The SFT rows come from the pipeline's data stage over these sources (training splits only; a training "
             "request whose tools occur in an evaluation benchmark is dropped) and the teacher's calls on them. "
             "Which files this adapter saw is in the recipe below.", "",
             "| source | license | note |", "|---|---|---|"]
    lines += [f"| {name} | {lic} | {note} |" for name, lic, note in TRAINING_DATA]
    seen = [f for key in ("requests", "rows") for f in _as_list(((recipe or {}).get("train") or {}).get(key))]
    if seen:
        lines += ["", "Training inputs: " + ", ".join(f"`{f}`" for f in seen) + "."]
    sources = (metrics or {}).get("row_sources")
    if sources:  # which labels it learned from: the first source with rows for a request won it
        lines += ["", "Labels it learned from (row sources in order of precedence; `gold` = the benchmark's own call, "
                      "a row file = a teacher's calls):", "", "| source | requests | rows |", "|---|---|---|"]
        lines += [f"| `{name}` | {s['requests']} | {s['rows']} |" for name, s in sources.items()]
    if metrics and metrics.get("train"):
        t = metrics["train"]
        lines += ["", f"Trained {metrics.get('global_step')} optimizer steps in "
                      f"{(t.get('train_runtime') or 0) / 60:.0f} min, final train loss {t.get('train_loss', float('nan')):.3f} "
                      f"({(metrics.get('pack') or {}).get('rows_kept')} rows packed into "
                      f"{(metrics.get('pack') or {}).get('sequences')} sequences)."]
    lines += ["", "## Recipe", "",
              f"LoRA r={rank}, alpha={alpha}, dropout={adapter_config.get('lora_dropout')}, "
              f"target modules: {targets}."]
    if recipe is not None:
        lines += ["", f"Resolved recipe (`{recipe_path.name}`):", "", "```yaml",
                  yaml.safe_dump(recipe, sort_keys=False).strip(), "```"]
    else:
        lines += ["", "The resolved recipe was not found in the adapter folder."]
    lines += ["", "## Accuracy", ""]
    if accuracy and accuracy.get("summary"):
        lines += [f"Against {accuracy.get('reference', 'gold')} calls; slot EM over the reference tool's parameters "
                  "(BFCL acceptable values where present), null P/R with `null` as the positive class, "
                  "call EM on the joined payload, wave latency on the evaluating machine.", "",
                  markdown_table(accuracy["summary"]).strip()]
        if accuracy.get("summary_gold"):
            lines += ["", "The same predictions against the benchmarks' gold calls only:", "",
                      markdown_table(accuracy["summary_gold"]).strip()]
    else:
        lines += ["Not measured yet (`make sidecar-eval`)."]
    lines += ["", "## Usage", "", "With peft:", "", "```python",
              "from peft import PeftModel",
              "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              f"tokenizer = AutoTokenizer.from_pretrained(\"{repo}\")",
              f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(\"{base}\"), \"{repo}\")",
              "```", "",
              "The one-wave predictor of the OoO-Spec pipeline (prompts, shared-prefix batch, join):", "",
              "```python", "from pipeline.sidecar.wave import SlotWave", "",
              f"wave = SlotWave(\"{base}\", adapter=\"<local copy of {repo}>\")",
              "prediction = wave.predict(request)  # canonical request: messages + tools",
              "prediction.payload  # {\"tool_index\": ..., \"arguments\": {...}}", "```", "",
              "With vLLM (LoRA serving; a wave is one batched completions request and prefix caching shares the "
              "prompt prefix):", "", "```bash",
              f"vllm serve {base} --enable-lora --lora-modules sidecar={repo} --max-lora-rank {max(8, rank or 8)} "
              "--enable-prefix-caching", "```", "",
              "or in process: `pipeline.sidecar.vllm_backend.VllmWave(base, adapter_dir).predict(request)`.", ""]
    return "\n".join(lines)


def upload(adapter: str | Path, repo: str, *, dry_run: bool = False, private: bool = False,
           base_model: str | None = None, commit_message: str = "Upload OoO-Spec sidecar adapter") -> dict:
    """Write the card into `adapter`, then create `repo` and upload the folder (or, dry run, list the files)."""
    token = None if dry_run else require_token()  # before anything else
    if not HUB_REPO_ID.match(repo):
        raise InputError(f"--repo {repo!r}: expected a Hub repo id of the form user/name")
    adapter = Path(adapter)
    check_adapter(adapter)

    # Card
    adapter_config = read_json(adapter / "adapter_config.json")
    recipe_path, recipe = find_recipe(adapter)
    # `make sidecar-eval` writes <adapter>/sidecar_eval/accuracy.json (older adapters: <adapter>/accuracy.json)
    found = [p for p in (adapter / "sidecar_eval" / "accuracy.json", adapter / "accuracy.json") if p.is_file()]
    accuracy = read_json(found[0]) if found else None
    base = base_model or adapter_config.get("base_model_name_or_path")
    if not looks_like_hub_id(base):
        print(f"note: base model {base!r} is not a hub id; pass --base-model to name it in the card's metadata")
    with atomic_open(adapter / "README.md") as f:
        f.write(model_card(repo, adapter_config, recipe_path, recipe, accuracy, base_model,
                           read_json(adapter / "metrics.json") if (adapter / "metrics.json").is_file() else None))
    seal(adapter)  # the card is one of the adapter's files now
    tok_dir = tokenizer_source(adapter, adapter_config.get("base_model_name_or_path"))
    extra = [] if tok_dir == adapter else [f for f in TOKENIZER_FILES if (tok_dir / f).is_file()]
    files = sorted(set(upload_files(adapter)) | set(extra))

    # Upload
    record = {"repo": repo, "private": private, "dry_run": dry_run, "files": files}
    if dry_run:
        print(f"dry run: wrote {adapter / 'README.md'}; would upload {len(files)} files to {repo}:")
        print("\n".join(f"  {f}" for f in files))
    else:
        api = HfApi(token=token)
        repo_url = api.create_repo(repo, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="ooo-upload-") if extra else nullcontext() as staging:
            folder = adapter
            if extra:  # the adapter's files and its base's tokenizer, side by side
                folder = Path(staging)
                for f in upload_files(adapter):
                    (folder / f).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(adapter / f, folder / f)
                for f in extra:
                    shutil.copy2(tok_dir / f, folder / f)
            commit = api.upload_folder(repo_id=repo, folder_path=str(folder), ignore_patterns=IGNORE_PATTERNS,
                                       commit_message=commit_message)
        record.update(repo_url=str(repo_url), commit_url=getattr(commit, "commit_url", None))
        print(f"uploaded {len(files)} files to {repo_url} ({record['commit_url']})")
    config = {"adapter": str(adapter), "repo": repo, "dry_run": dry_run, "private": private, "base_model": base_model}
    write_manifest(adapter / "upload", "upload", config, inputs=[adapter / f for f in files], extra=record)
    return record


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass
class Config(StageConfig):
    """What to publish where: the `upload:` section or, as `make upload` passes them, the flags (FLAGS)."""

    adapter: str | None = None          # default with --recipe: checkpoints/sidecar/<recipe>/ (its sft.output_dir)
    repo: str | None = None             # Hub repo id, user/name (required)
    dry_run: bool = False               # write the card and list the files; upload nothing (no token needed)
    private: bool = False
    base_model: str | None = None       # hub id of the base model for the card (default: the adapter's base)
    commit_message: str = "Upload OoO-Spec sidecar adapter"


FLAGS = (Flag("--adapter", "upload.adapter", "adapter folder, e.g. checkpoints/sidecar/<recipe>/"),
         Flag("--repo", "upload.repo", "Hub repo id, user/name"),
         Flag("--dry-run", "upload.dry_run", "write the card and list the files; upload nothing", switch=True),
         Flag("--private", "upload.private", "create the repo private", switch=True),
         Flag("--base-model", "upload.base_model", "hub id of the base model for the card"),
         Flag("--commit-message", "upload.commit_message", "the Hub commit's message"))
ERRORS = (MissingToken,)


def resolve(recipe_path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The `upload:` settings; `--recipe` names a sidecar recipe whose adapter is uploaded unless --adapter is given."""
    recipe = load_recipe(recipe_path, overrides)
    cfg = Config(**section(recipe, "upload", Config.keys(), str(recipe_path or "recipe")), recipe=recipe)
    if not cfg.adapter:
        if recipe_path is None:
            raise InputError("upload: pass --adapter DIR or --recipe PATH (a sidecar recipe: its adapter)")
        cfg.adapter = str(adapter_of(recipe))
    if not cfg.repo:
        raise InputError("upload: --repo user/name is required (the Hub repo to publish to)")
    return cfg


def run(cfg: Config) -> dict:
    return upload(cfg.adapter, cfg.repo, dry_run=cfg.dry_run, private=cfg.private, base_model=cfg.base_model,
                  commit_message=cfg.commit_message)


def main(argv: list[str] | None = None) -> dict:
    """The command line (the stage contract: pipeline/stages/__init__.py)."""
    return stage_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
