"""The `train` stage: LoRA SFT of the sidecar on prefix-shared packed rows (trl SFTTrainer + peft LoraConfig).

Run as: python -m pipeline.stages.train [--recipe recipes/sidecar/smollm2-135m-cpu-v9.yaml] [section.key=value ...]
Several GPUs: accelerate launch --config_file recipes/deepspeed/accelerate-zero2.yaml -m pipeline.stages.train
              --recipe recipes/sidecar/qwen3-0.6b.yaml sft.deepspeed=recipes/deepspeed/zero2.json
The optimizer step's batch is the recipe's global batch on any number of processes (`train.global_batch`, default
the recipe's per-device batch x accumulation): each process's batch and accumulation are derived (`batch_plan`).

A recipe has three sections: `train:` (this stage's own keys, `DEFAULTS` below), `sft:` (trl `SFTConfig` fields,
verbatim) and `lora:` (peft `LoraConfig` fields, verbatim); an unknown key is an error that lists the valid ones.
Rows come from `train.rows`, sources in order of precedence (the labels stage's SFT row files, or `gold`: rows built
from the requests' gold calls); the first source with rows for a request wins it. They are regrouped per request and packed prefix-once with `pipeline.sidecar.packing`; `sft.max_length` caps a packed
sequence (a request whose rows do not fit is split into several sequences, each with its prefix).

Writes checkpoints/sidecar/<recipe>/ (or `sft.output_dir`): the adapter (PeftModel.from_pretrained-loadable), the
tokenizer, recipe.yaml (resolved), metrics.json, loss.png, manifest.json (written last: its presence means done).
An interrupted run resumes from its last complete checkpoint-*; a finished one is not rerun unless the recipe
changed and `train.overwrite=true`.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..artifacts import seal
from ..io import InputError, iter_jsonl, read_json, write_json, write_manifest
from ..recipes import load_recipe, section
from . import StageConfig
from . import main as stage_main

STAGE = "train"
DEFAULT_RECIPE = "recipes/sidecar/smollm2-135m-cpu-v9.yaml"  # the default sidecar, as `make train` names it
DEFAULTS = {
    "mode": "sidecar",            # sidecar: the wave's rows (function and slot questions) | target: teach the model
                                  # itself to write tool calls (the request's prompt in its chat template, its gold
                                  # calls as that template writes them; `rows: [gold]` only; output under
                                  # checkpoints/target/)
    "model": None,                # base model: a local folder or a hub id
    "requests": [],               # request JSONL files (globs allowed) the rows were built from
    "rows": [],                   # row sources in order of precedence: SFT row files of the labels stage (globs
                                  # allowed) or `gold` (rows from each request's first gold call); per request, the
                                  # first source with rows wins
    "max_requests": None,         # keep only the first N requests (smoke runs, profiling)
    "slice": None,                # [k, n]: only the requests whose id hashes to k mod n (k < n), a disjoint k-th of
                                  # n: an epoch trained in n session-sized runs, each continuing the last
                                  # (`init_adapter`); null: every request
    "compact": True,              # compact tool block in the prefix (one line per tool/param); false: full JSON
    "questions": "long",          # how a row asks its question (pipeline.sidecar.rows.QUESTION_STYLES): long | short;
                                  # the wave asks as the adapter was trained (its recipe.yaml)
    "chat_template_kwargs": {},   # e.g. {enable_thinking: false} for Qwen3
    "function_repeat": 1,         # pack a multi-tool request's function row this many times (= its loss weight)
    "null_keep": 1.0,             # fraction of null slot rows of NOT-chosen tools kept (deterministic hash)
    "dtype": "float32",           # weights dtype: float32 (use sft.bf16 for autocast), bfloat16, float16, auto (bf16
                                  # where native, else float32)
    "attn_implementation": "sdpa",  # sdpa or eager (both take the packed 4-D mask; flash-attention does not)
    "threads": None,              # torch CPU threads (null: torch's default)
    "init_adapter": None,         # a finished adapter folder to continue from (its weights, rank, layers and
                                  # modules; fresh optimizer and schedule): another epoch with a new recipe
    "init_grow": False,           # with init_adapter: the recipe's `lora:` may be larger (rank >=, modules and layers
                                  # a superset, bias equal); the adapter's product B*A is copied into it unchanged
                                  # (A's first rows, B's first columns rescaled by the alpha/r ratio), the new parts
                                  # start as a fresh LoRA (B = 0): more capacity, the same function at step 0
    "save_dtype": None,           # cast the saved adapter weights (e.g. bfloat16: half the bytes of float32)
    "overwrite": False,           # retrain a finished output whose recipe changed
    "global_batch": None,         # packed sequences per optimizer step over all processes; each process's batch and
                                  # accumulation are derived from it (`split_global_batch`), so 1 or 8 GPUs take the
                                  # same steps; null: sft.per_device_train_batch_size x gradient_accumulation_steps
                                  # (what the recipe trains in one process)
}
SECTIONS = ("train", "sft", "lora")
GOLD = "gold"  # a `train.rows` source: rows built from each request's first gold call
MODES = ("sidecar", "target")
FORCED_SFT = {"remove_unused_columns": False, "dataset_kwargs": {"skip_prepare_dataset": True},
              "packing": False, "padding_free": False}


def split_global_batch(global_batch: int, processes: int, micro: int) -> tuple[int, int]:
    """(per-device batch, accumulation steps) whose product times `processes` is exactly `global_batch`: the
    recipe's micro-batch `micro` (what one device holds) or the largest divisor of the per-process share below it.
    An 8-GPU run of a 4 x 8 recipe (global 32) takes 4 x 1 per device, not 4 x 8 x 8 = 256 per step."""
    if global_batch < 1 or processes < 1 or micro < 1:
        raise ValueError(f"global batch {global_batch}, {processes} processes, micro-batch {micro}: all must be >= 1")
    if global_batch % processes:
        raise ValueError(f"global batch {global_batch} is not a multiple of {processes} processes: choose a global "
                         "batch every process count you launch divides (e.g. a multiple of 8)")
    share = global_batch // processes
    per_device = min(micro, share)
    while share % per_device:
        per_device -= 1
    return per_device, share // per_device


def world_size() -> int:
    """Processes of this training run (accelerate / torchrun / deepspeed set WORLD_SIZE; 1 when run plainly)."""
    return int(os.environ.get("WORLD_SIZE") or 1)


def batch_plan(train: dict, sft: dict, processes: int, where: str = "recipe") -> dict:
    """The global batch (`train.global_batch`, else the recipe's per-device batch x accumulation) split over
    `processes`: {global, processes, per_device_train_batch_size, gradient_accumulation_steps}."""
    micro = int(sft.get("per_device_train_batch_size", 8))  # SFTConfig's own default
    global_batch = train.get("global_batch") or micro * int(sft.get("gradient_accumulation_steps", 1))
    try:
        per_device, accumulation = split_global_batch(int(global_batch), processes, micro)
    except ValueError as e:
        raise InputError(f"{where}: train.global_batch: {e}") from None
    return {"global": int(global_batch), "processes": processes, "per_device_train_batch_size": per_device,
            "gradient_accumulation_steps": accumulation}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


@dataclass
class Config(StageConfig):
    """A resolved sidecar recipe: this stage's keys (`train:`, DEFAULTS filled in) and trl's `sft:` and peft's
    `lora:` fields verbatim."""

    recipe_name: str
    train: dict
    sft: dict
    lora: dict
    recipe_path: str | None = None

    def resolved(self) -> dict:
        """The resolved recipe as recipe.yaml and the manifest record it (a rerun compares it)."""
        return {"recipe_name": self.recipe_name, "train": self.train, "sft": self.sft, "lora": self.lora}


def resolve(recipe_path: str | Path | None = DEFAULT_RECIPE, overrides: Sequence[str] = ()) -> Config:
    """The sidecar recipe with overrides, checked (`from_recipe`; `train.init_adapter` is checked by `run`, only
    when it is about to train)."""
    recipe = load_recipe(recipe_path, overrides)
    resolved = from_recipe(recipe, str(recipe_path or "recipe"), check_init=False)
    return Config(**resolved, recipe_path=None if recipe_path is None else str(recipe_path), recipe=recipe)


def from_recipe(config: dict, where: str, check_init: bool = True) -> dict:
    """Check every key against its dataclass and fill the stage defaults; returns the resolved recipe.
    `check_init` false leaves `train.init_adapter` unchecked (`run` checks it only when it is about to train: a
    finished adapter is kept though the one it continued has left the tree)."""
    from peft import LoraConfig
    from trl import SFTConfig

    bad = sorted(set(config) - set(SECTIONS) - {"recipe_name", "sidecar_eval", "upload"})  # their own stages
    if bad:
        raise InputError(f"{where}: unknown top-level key(s) {bad}; expected sections {list(SECTIONS)}")
    train = {**DEFAULTS, **section(config, "train", set(DEFAULTS), where)}
    sft = dict(section(config, "sft", _fields(SFTConfig), where))
    lora = dict(section(config, "lora", _fields(LoraConfig), where))
    for key, value in FORCED_SFT.items():
        if key in sft and sft[key] != value:
            raise InputError(f"{where}: sft.{key}={sft[key]!r} conflicts with prefix-shared packing, which needs "
                             f"{value!r}; remove the key")
    if not train["model"]:
        raise InputError(f"{where}: train.model is required (a local model folder or a hub id)")
    if isinstance(train["rows"], str):
        train["rows"] = [train["rows"]]
    if train["mode"] not in MODES:
        raise InputError(f"{where}: train.mode={train['mode']!r}; expected one of {', '.join(MODES)}")
    if train["mode"] == "target" and train["rows"] != [GOLD]:
        raise InputError(f"{where}: train.mode=target trains on the requests' gold calls only (rows: [{GOLD}]), got "
                         f"rows={train['rows']!r}: a target taught another target's calls would agree with a "
                         "sidecar distilled from them by construction")
    if not train["rows"]:
        raise InputError(f"{where}: train.rows is required: row files of the labels stage and/or `{GOLD}`, in order "
                         "of precedence (e.g. [data/labels/<teacher>/rows/train.jsonl, gold])")
    if not train["requests"]:
        raise InputError(f"{where}: train.requests is required (the request files the rows were built from)")
    if not 0.0 <= float(train["null_keep"]) <= 1.0:
        raise InputError(f"{where}: train.null_keep={train['null_keep']!r}; expected a fraction in [0, 1]")
    if not isinstance(train["function_repeat"], int) or train["function_repeat"] < 1:
        raise InputError(f"{where}: train.function_repeat={train['function_repeat']!r}; expected an integer >= 1")
    from ..sidecar.rows import QUESTION_STYLES
    if train["questions"] not in QUESTION_STYLES:
        raise InputError(f"{where}: train.questions={train['questions']!r}; expected one of {', '.join(QUESTION_STYLES)}")
    if train["slice"] is not None:
        sl = train["slice"]
        ints = isinstance(sl, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in sl)
        if not (ints and len(sl) == 2 and 0 <= sl[0] < sl[1]):
            raise InputError(f"{where}: train.slice={sl!r}; expected [k, n] with integers 0 <= k < n (the k-th of n "
                             "disjoint parts of the requests)")
    gb = train["global_batch"]
    if gb is not None and (not isinstance(gb, int) or isinstance(gb, bool) or gb < 1):
        raise InputError(f"{where}: train.global_batch={gb!r}; expected an integer >= 1 (sequences per optimizer "
                         "step over all processes) or null")
    if train["init_grow"] and not train["init_adapter"]:
        raise InputError(f"{where}: train.init_grow=true needs train.init_adapter (the adapter to grow)")
    if train["save_dtype"] not in (None, "float32", "bfloat16", "float16"):
        raise InputError(f"{where}: train.save_dtype={train['save_dtype']!r}; expected float32, bfloat16 or float16")
    if train["init_adapter"] and check_init:
        check_init_adapter(train, lora, where)
    name = config.get("recipe_name", "default")
    sft.setdefault("output_dir", f"checkpoints/{train['mode']}/{name}")
    return {"recipe_name": name, "train": train, "sft": sft, "lora": lora}


INIT_LORA_KEYS = ("r", "lora_alpha", "target_modules", "layers_to_transform", "bias")


def check_init_adapter(train: dict, lora: dict, where: str) -> None:
    """`train.init_adapter` is a finished adapter of the same base model, asked its questions in the same style; the
    recipe's `lora:` section, where it sets the adapter's shape (rank, alpha, modules, layers, bias), must agree with
    the adapter's own config (the adapter keeps its shape; a disagreement would be silently ignored)."""
    folder = Path(train["init_adapter"])
    cfg_path = folder / "adapter_config.json"
    if not cfg_path.is_file() or not (folder / "adapter_model.safetensors").is_file():
        raise InputError(f"{where}: train.init_adapter={str(folder)!r} is not a finished adapter (no "
                         "adapter_config.json / adapter_model.safetensors); train it first (make train RECIPE=...)")
    cfg = read_json(cfg_path)
    base = cfg.get("base_model_name_or_path")
    if base and Path(base).resolve() != Path(train["model"]).resolve() and base != train["model"]:
        raise InputError(f"{cfg_path}: adapter of base model {base!r}, but train.model is {train['model']!r}")
    if train["init_grow"]:
        check_growth(lora, cfg, folder, where)
    for key in INIT_LORA_KEYS if not train["init_grow"] else ():
        if key in lora and key in cfg:
            mine, theirs = lora[key], cfg[key]
            if isinstance(mine, (list, tuple, set)) and isinstance(theirs, (list, tuple, set)):
                mine, theirs = sorted(mine), sorted(theirs)
            if mine != theirs:
                raise InputError(f"{where}: lora.{key}={lora[key]!r} but train.init_adapter {str(folder)!r} has "
                                 f"{key}={cfg[key]!r}; set it as the adapter has it (or remove it)")
    done = folder / "recipe.yaml"
    if done.is_file():
        made = (yaml.safe_load(done.read_text(encoding="utf-8")) or {}).get("train") or {}
        for key in ("compact", "questions"):
            if key in made and made[key] != train[key]:
                raise InputError(f"{where}: train.{key}={train[key]!r} but train.init_adapter {str(folder)!r} was "
                                 f"trained with {key}={made[key]!r} ({done})")


def check_growth(lora: dict, cfg: dict, folder: Path, where: str) -> None:
    """`train.init_grow`: the recipe's LoRA shape holds the adapter's (rank >=, modules and layers supersets, the
    same bias, neither DoRA nor rsLoRA), so its weights fit inside the new ones."""
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in lora:
            raise InputError(f"{where}: train.init_grow needs lora.{key} (the grown adapter's shape)")
    mods = lora["target_modules"]
    mods = {mods} if isinstance(mods, str) else set(mods)
    old_layers = cfg.get("layers_to_transform")
    new_layers = lora.get("layers_to_transform")
    if isinstance(old_layers, int):
        old_layers = [old_layers]
    if isinstance(new_layers, int):
        new_layers = [new_layers]
    problems = []
    if int(lora["r"]) < int(cfg["r"]):
        problems.append(f"lora.r={lora['r']} < the adapter's r={cfg['r']}")
    if not set(cfg["target_modules"]) <= mods:
        problems.append(f"lora.target_modules lacks {sorted(set(cfg['target_modules']) - mods)}")
    if new_layers is not None and (old_layers is None or not set(old_layers) <= set(new_layers)):
        problems.append(f"lora.layers_to_transform={new_layers} does not hold the adapter's {old_layers}")
    if lora.get("bias", "none") != cfg.get("bias", "none"):
        problems.append(f"lora.bias={lora.get('bias', 'none')!r} but the adapter has {cfg.get('bias')!r}")
    for flag in ("use_dora", "use_rslora"):
        if lora.get(flag) or cfg.get(flag):
            problems.append(f"{flag} (a grown adapter keeps the plain alpha/r scale)")
    if problems:
        raise InputError(f"{where}: train.init_grow: the recipe's lora shape cannot hold train.init_adapter "
                         f"{str(folder)!r}: {'; '.join(problems)}")


def grow_into(model, folder: str | Path) -> dict:
    """Copy a finished adapter into the (larger) fresh LoRA of `model` so that every product scale*B*A is the
    adapter's: A's first r_old rows, B's first r_old columns times scale_old/scale_new; the rest keep their fresh
    init (B = 0, so the new capacity starts silent). Returns counts for the log."""
    import torch
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = read_json(folder / "adapter_config.json")
    old_scale = cfg["lora_alpha"] / cfg["r"]
    weights = load_file(folder / "adapter_model.safetensors")
    params = dict(model.named_parameters())
    copied, grown = 0, set()
    with torch.no_grad():
        for key, old in weights.items():
            if not key.endswith((".lora_A.weight", ".lora_B.weight")):
                raise InputError(f"{folder / 'adapter_model.safetensors'}: tensor {key!r} is not a LoRA A/B matrix; "
                                 "train.init_grow copies plain LoRA adapters only")
            name = key[:-len(".weight")] + ".default.weight"
            if name not in params:
                raise InputError(f"{folder / 'adapter_model.safetensors'}: tensor {key!r} has no place in the grown "
                                 f"adapter (looked for {name!r})")
            new = params[name]
            r_old = old.shape[0] if ".lora_A." in key else old.shape[1]
            module = model.get_submodule(key[:-len(".lora_A.weight")])
            new_scale = module.scaling["default"]
            if ".lora_A." in key:
                new[:r_old, :].copy_(old.to(new.dtype))
            else:
                new[:, :r_old].copy_((old.float() * (old_scale / new_scale)).to(new.dtype))
                new[:, r_old:].zero_()
            copied += 1
            grown.add(key.rsplit(".lora_", 1)[0])
    fresh = {n.rsplit(".lora_", 1)[0] for n in params if ".lora_A." in n} - grown
    return {"copied_tensors": copied, "grown_modules": len(grown), "fresh_modules": len(fresh)}


def expand(patterns, key: str) -> list[Path]:
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    paths = []
    for pat in patterns:
        found = sorted(glob.glob(pat))
        if not found:
            raise InputError(f"train.{key}: {pat!r} matches no file")
        paths += [Path(p) for p in found]
    return paths


def load_requests(train: dict) -> tuple[dict, list[Path]]:
    """The requests of `train.requests` by id (only `train.slice`'s part of them), and the files read."""
    req_files = expand(train["requests"], "requests")
    requests: dict[str, dict] = {}
    for path in req_files:
        for line, req in iter_jsonl(path):
            if req.get("id") in requests:
                raise InputError(f"{path}:{line} (record {req.get('id')}): duplicate request id")
            requests[req.get("id")] = req
    if train.get("slice") is not None:
        k, n = train["slice"]
        requests = {rid: req for rid, req in requests.items() if slice_of(rid, n) == k}
    return requests, req_files


def gold_skip(request: dict) -> str | None:
    """Why a request's gold calls cannot be trained on (a key of the stage's skip counts), or None."""
    if not request.get("gold"):
        return "no_gold"
    return "gold_errors" if request.get("gold_errors") else None


def load_target_requests(train: dict) -> tuple[dict, list[Path], dict]:
    """`train.mode: target`: the requests whose gold calls can be taught (every call names an offered tool), the
    first `max_requests` of them; the files read and counts of what was skipped."""
    requests, files = load_requests(train)
    skipped = {"no_gold": 0, "gold_errors": 0, "gold_not_offered": 0}
    keep = {}
    for rid, req in requests.items():
        offered = {(t.get("function") or t).get("name") for t in req.get("tools") or []}
        why = gold_skip(req) or ("gold_not_offered" if any(c.get("name") not in offered for c in req["gold"]) else None)
        if why:
            skipped[why] += 1
        else:
            keep[rid] = req
    if train["max_requests"]:
        keep = dict(list(keep.items())[: int(train["max_requests"])])
    return keep, files, skipped


def load_rows(train: dict) -> tuple[dict, list[tuple[str, dict]], list[Path], dict, dict]:
    """Requests by id, (location, row) pairs, the input files, counts of what was skipped, and rows per source.

    `train.rows` is an ordered list of sources (row files, globs allowed, or `gold`); the first source that has rows
    for a request wins it, so `[<target labels>, gold]` trains on the target's own call wherever the target was
    traced and on the gold call elsewhere."""
    from ..sidecar.rows import build_rows, label_from_call

    requests, req_files = load_requests(train)
    skipped = {"no_gold": 0, "gold_errors": 0, "gold_not_offered": 0}
    rows: list[tuple[str, dict]] = []
    row_files: list[Path] = []
    sources: dict[str, dict] = {}
    won: set = set()  # request ids an earlier source already gave rows for
    for source in train["rows"]:
        found: list[tuple[str, dict]] = []
        if source == GOLD:
            for rid, req in requests.items():
                if rid in won:
                    continue
                if why := gold_skip(req):
                    skipped[why] += 1
                else:
                    try:
                        label = label_from_call(req, req["gold"][0])
                    except ValueError:
                        skipped["gold_not_offered"] += 1
                        continue
                    found += [(f"gold:{rid}", row) for row in build_rows(req, label, train["compact"],
                                                                                   train["questions"])]
        else:
            for path in expand([source], "rows"):
                row_files.append(path)
                found += [(f"{path}:{line}", row) for line, row in iter_jsonl(path)
                          if row.get("request_id") not in won
                          and (train.get("slice") is None or row.get("request_id") in requests)]
        got = {row.get("request_id") for _, row in found}
        sources[str(source)] = {"requests": len(got), "rows": len(found)}
        won |= got
        rows += found
    if train["max_requests"]:
        keep = list(dict.fromkeys(row.get("request_id") for _, row in rows))[: int(train["max_requests"])]
        keep = set(keep)
        rows = [(loc, row) for loc, row in rows if row.get("request_id") in keep]
    return requests, rows, req_files + row_files, skipped, sources


def slice_of(request_id: str, n: int) -> int:
    """Which of `n` disjoint parts a request belongs to (`train.slice`): a stable hash of its id, the same on every
    machine and run."""
    return int(hashlib.sha256(str(request_id).encode()).hexdigest()[:8], 16) % n


def last_checkpoint(out: Path) -> Path | None:
    """The newest checkpoint-N that was written completely (trainer_state.json is saved last)."""
    done = [p for p in out.glob("checkpoint-*") if (p / "trainer_state.json").is_file() and p.name[11:].isdigit()]
    return max(done, key=lambda p: int(p.name[11:]), default=None)


def plot_loss(log_history: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(h["step"], h["loss"]) for h in log_history if "loss" in h]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if points:
        ax.plot(*zip(*points), marker=".")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("answer-token loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def fit(resolved: dict, recipe_path: str | None) -> Path:
    """Train the adapter of a resolved recipe (resuming from its last checkpoint) and save it; returns its folder."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig

    from ..sidecar.packing import PackedCollator, pack_rows, pack_targets
    from ..sidecar.trainer import PackedSFTTrainer

    train, sft_kw, lora_kw = resolved["train"], resolved["sft"], resolved["lora"]
    out = Path(sft_kw["output_dir"])
    if train["threads"]:
        torch.set_num_threads(int(train["threads"]))

    # Load data
    target = train["mode"] == "target"
    if target:
        requests, inputs, skipped = load_target_requests(train)
        rows, sources = [], {GOLD: {"requests": len(requests), "rows": len(requests)}}
    else:
        requests, rows, inputs, skipped, sources = load_rows(train)
    inputs = inputs + init_weights(train)  # the manifest records the weights continued from (a changed one retrains)
    if not (requests if target else rows):
        raise InputError(f"train: no rows to train on (skipped requests: {skipped})")
    tokenizer = AutoTokenizer.from_pretrained(train["model"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    plan = batch_plan(train, sft_kw, world_size(), recipe_path or "recipe")
    print(f"batch: {plan['global']} sequences per optimizer step = {plan['processes']} process(es) x "
          f"{plan['per_device_train_batch_size']} x {plan['gradient_accumulation_steps']} accumulation",
          file=sys.stderr)
    args = SFTConfig(**{"report_to": "none", **sft_kw, **FORCED_SFT,
                        **{k: plan[k] for k in ("per_device_train_batch_size", "gradient_accumulation_steps")}})
    if target:
        sequences, stats = pack_targets(tokenizer, requests, train["chat_template_kwargs"], args.max_length,
                                        progress=True)
    else:
        sequences, stats = pack_rows(tokenizer, requests, rows, train["compact"], train["chat_template_kwargs"],
                                     args.max_length, float(train["null_keep"]), args.seed, progress=True,
                                     questions=train["questions"], function_repeat=train["function_repeat"])
    if not sequences:
        raise InputError(f"train: every row was dropped ({stats}); raise sft.max_length")
    for s in sequences:
        s["length"] = len(s["input_ids"])
    dataset = Dataset.from_list(sequences)
    print(f"packed {stats['rows_kept']} rows of {stats['requests']} requests into {stats['sequences']} sequences: "
          f"{stats['tokens']} tokens instead of {stats['unpacked_tokens']} one by one", file=sys.stderr)

    # Load model
    from ..hardware import torch_dtype

    dtype = torch_dtype(train["dtype"])  # auto: bf16 where native (GPU, AVX-512 BF16 / AMX), else float32
    model = AutoModelForCausalLM.from_pretrained(train["model"], dtype=dtype,
                                                 attn_implementation=train["attn_implementation"])
    lora = LoraConfig(**{"task_type": "CAUSAL_LM", **lora_kw})
    if train["init_adapter"] and train["init_grow"]:  # a larger LoRA holding the finished adapter's products
        from peft import get_peft_model

        model = get_peft_model(model, lora)
        counts = grow_into(model, train["init_adapter"])
        lora = None
        print(f"grew the adapter {train['init_adapter']} into the recipe's LoRA: {counts}", file=sys.stderr)
    elif train["init_adapter"]:  # continue a finished adapter: its weights and shape, a fresh optimizer and schedule
        from peft import PeftModel

        model, lora = PeftModel.from_pretrained(model, train["init_adapter"], is_trainable=True), None
        print(f"continuing from the adapter {train['init_adapter']}", file=sys.stderr)

    # Train
    trainer = PackedSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                               peft_config=lora, data_collator=PackedCollator(tokenizer.pad_token_id))
    ckpt = last_checkpoint(out)
    if ckpt is not None:
        print(f"resuming from {ckpt}", file=sys.stderr)
    result = trainer.train(resume_from_checkpoint=str(ckpt) if ckpt else None)

    # Save: adapter + tokenizer into a temporary folder, then moved into place; manifest last
    final_tmp = out / ".final.partial"
    if target:  # a target's adapter goes onto its base, which has the tokenizer (Gemma's: 33 MB)
        trainer.processing_class = None
    trainer.save_model(str(final_tmp))
    if trainer.is_world_process_zero():
        if train["save_dtype"]:
            cast_weights(final_tmp / "adapter_model.safetensors", train["save_dtype"])
        if not target:
            tokenizer.save_pretrained(str(final_tmp))
        for f in final_tmp.iterdir():
            os.replace(f, out / f.name)
        shutil.rmtree(final_tmp, ignore_errors=True)
        with open(out / "recipe.yaml", "w", encoding="utf-8") as f:
            f.write(f"# resolved from {recipe_path}\n" + yaml.safe_dump(resolved, sort_keys=False))
        runtime = result.metrics.get("train_runtime") or 0.0
        seq_per_s = result.metrics.get("train_samples_per_second") or 0.0
        rows_per_seq = stats["rows_kept"] / max(stats["sequences"], 1)
        metrics = {"train": result.metrics, "pack": stats, "skipped_requests": skipped, "row_sources": sources,
                   "rows_per_second": seq_per_s * rows_per_seq,
                   "epoch_rows": stats["rows_kept"], "global_step": trainer.state.global_step,
                   "resumed_from": ckpt.name if ckpt else None, "runtime_s_this_run": runtime,
                   "world_size": trainer.accelerator.num_processes, "batch": plan,
                   "log_history": trainer.state.log_history}
        write_json(out / "metrics.json", metrics)
        plot_loss(trainer.state.log_history, out / "loss.png", f"{train['mode']} {resolved['recipe_name']}")
        write_manifest(out, STAGE, resolved, inputs, extra={"recipe": recipe_path,
                                                           "metrics": {k: v for k, v in metrics.items()
                                                                       if k != "log_history"}})
        seal(out)  # a release artifact: the manifest lists its files' sha256 (pipeline/artifacts.py)
    return out


def cast_weights(path: Path, dtype: str) -> None:
    """Rewrite a safetensors file with its floating tensors in `dtype` (train.save_dtype)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    target = getattr(torch, dtype)
    cast = {k: (v.to(target) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    tmp = path.with_name(path.name + ".partial")
    save_file(cast, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def _same_recipe(a: dict, b: dict) -> bool:
    """The same resolved recipe, `overwrite` aside; a `train:` key at its default counts as absent, so a knob added
    since an adapter was trained (its manifest lacks it) does not make the adapter's recipe another one."""
    def norm(c):
        c = json.loads(json.dumps(c))
        c.get("train", {}).pop("overwrite", None)
        for key, default in DEFAULTS.items():
            if key in c.get("train", {}) and c["train"][key] == default:
                del c["train"][key]
        return c
    return norm(a) == norm(b)


def input_files(train: dict) -> list[Path]:
    """The files a recipe reads (requests, then row files), as the manifest records them."""
    return expand(train["requests"], "requests") + [p for src in train["rows"] if src != GOLD
                                                    for p in expand([src], "rows")] + init_weights(train)


def init_weights(train: dict) -> list[Path]:
    """The weights file of `train.init_adapter` (an input of the run), or nothing."""
    return [Path(train["init_adapter"]) / "adapter_model.safetensors"] if train.get("init_adapter") else []


def changed_inputs(manifest: dict, train: dict) -> list[str]:
    """Input files whose sha256 differs from the finished adapter's manifest (or that were added or removed). The
    weights of `train.init_adapter` are not compared once that folder is gone (a committed adapter whose predecessor
    left the tree: its manifest keeps the sha256 it started from)."""
    from ..io import sha256_file

    before = manifest.get("inputs") or {}
    files = input_files(train)
    gone = {str(p) for p in init_weights(train) if not p.is_file()}
    now = {str(p): sha256_file(p) for p in files if str(p) not in gone}
    return sorted(k for k in set(before) | set(now) if k not in gone and before.get(k) != now.get(k))


def run(cfg: Config) -> Path:
    """Train unless the output folder holds an adapter of this recipe and these inputs; returns the folder."""
    resolved, where = cfg.resolved(), cfg.recipe_path or "recipe"
    out = Path(cfg.sft["output_dir"])
    manifest = out / "manifest.json"
    if manifest.is_file():
        done = read_json(manifest)
        same = _same_recipe(done.get("config") or {}, resolved)
        changed = changed_inputs(done, cfg.train) if same else []
        if same and not changed:
            print(f"{out}: already trained with this recipe and these inputs (delete {manifest} to retrain)")
            return out
        if not cfg.train["overwrite"]:
            why = "a different recipe" if not same else f"other inputs ({', '.join(changed[:3])} changed)"
            raise InputError(f"{out}: holds an adapter trained with {why}; pass train.overwrite=true "
                             "to retrain it, or choose another sft.output_dir")
    if cfg.train["init_adapter"]:
        check_init_adapter(cfg.train, cfg.lora, where)
    if manifest.is_file():
        shutil.rmtree(out, ignore_errors=True)
    print(fit(resolved, cfg.recipe_path))
    return out


def main(argv: list[str] | None = None) -> Path:
    """The command line (the stage contract: pipeline/stages/__init__.py)."""
    return stage_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
