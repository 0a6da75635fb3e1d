"""Profile one sidecar training step under each knob: rows packed or one by one, loss head, precision, padding,
activation checkpointing, LoRA on every layer or the upper ones. Prints a table of step times and rows/s.

Run as: .venv/bin/python scripts/profile_train.py [--model checkpoints/base/smollm2-135m-instruct]
        [--requests 'data/requests/bfcl/train.jsonl'] [--n-requests 8] [--steps 0] [--threads 2] [--only A,D]

Each variant trains (forward + backward, LoRA r=16 on q,k,v,o,gate,up,down unless it says otherwise) on the rows
of the same requests (first gold call -> rows.build_rows), times one pass over them after one warm-up batch, and
reports rows/s (wall clock) and rows per CPU-second (process time of all its threads: less sensitive to other
processes sharing the cores). The optimizer step is left out (LoRA parameters only: negligible). `trl` head = SFTTrainer's own
compute_loss (fused LM head over every position on CPU, plus full-vocabulary entropy and top-1 for its logs);
`answer` head = PackedSFTTrainer (LM head only where the next token is an answer token).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import torch

sys.path.insert(0, ".")
from pipeline.io import read_jsonl  # noqa: E402
from pipeline.sidecar.packing import PackedCollator, pack_rows, unpacked_rows  # noqa: E402
from pipeline.sidecar.rows import build_rows, label_from_call  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Variant:
    key: str
    note: str
    packed: bool = True
    head: str = "answer"        # answer | trl
    weights: str = "float32"    # float32 | bfloat16
    autocast: bool = True       # bf16 autocast (SFTConfig bf16=true)
    ckpt: bool = False          # activation checkpointing (trl's default is on)
    batch: int = 4              # packed requests (or rows, when not packed) per step
    sort: bool = False          # batch requests of similar length together (less padding)
    upper: float = 1.0          # fraction of layers (from the top) that get LoRA


BASE = Variant("D", "packed, answer head, bf16 autocast, batch 1", batch=1)
VARIANTS = [
    Variant("A", "trl default: rows one by one, trl head, autocast, act. ckpt, batch 8", packed=False, head="trl",
            ckpt=True, batch=8),
    Variant("B", "rows one by one, answer head, batch 8", packed=False, batch=8),
    replace(BASE, key="C", note="packed, trl head (all positions + entropy/top-1)", head="trl"),
    BASE,
    replace(BASE, key="E", note="D + activation checkpointing", ckpt=True),
    replace(BASE, key="F", note="D in fp32 (no autocast)", autocast=False),
    replace(BASE, key="G", note="D with bf16 weights (no autocast)", weights="bfloat16", autocast=False),
    replace(BASE, key="H", note="D, batch 2 in random order (padding)", batch=2),
    replace(BASE, key="I", note="D, batch 2 sorted by length", batch=2, sort=True),
    replace(BASE, key="J", note="D, LoRA on the upper half of the layers", upper=0.5),
    replace(BASE, key="K", note="D, LoRA on the upper third", upper=1 / 3),
    replace(BASE, key="L", note="bf16 weights + LoRA on the upper third", weights="bfloat16", autocast=False,
            upper=1 / 3),
]


def sample_rows(paths: list[str], n: int, seed: int) -> tuple[dict, list[tuple[str, dict]]]:
    requests = [r for p in paths for r in read_jsonl(p) if r.get("gold") and not r.get("gold_errors")]
    random.Random(seed).shuffle(requests)
    chosen = requests[:n]
    rows = [(r["id"], row) for r in chosen for row in build_rows(r, label_from_call(r, r["gold"][0]))]
    return {r["id"]: r for r in chosen}, rows


def make_trainer(v: Variant, model_path: str, tokenizer, features: list[dict], collator):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from pipeline.sidecar.trainer import PackedSFTTrainer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, v.weights),
                                                 attn_implementation="sdpa")
    n_layers = model.config.num_hidden_layers
    first = n_layers - max(1, round(n_layers * v.upper))
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM",
                      layers_to_transform=list(range(first, n_layers)) if first else None)
    skip = collator is not None
    args = SFTConfig(output_dir=tempfile.mkdtemp(prefix="profile-"), use_cpu=True, bf16=v.autocast,
                     activation_checkpointing=v.ckpt, report_to="none", max_length=2048,
                     per_device_train_batch_size=v.batch, remove_unused_columns=not skip,
                     dataset_kwargs={"skip_prepare_dataset": True} if skip else None)
    cls = PackedSFTTrainer if v.head == "answer" else SFTTrainer
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_list(features), processing_class=tokenizer,
                  peft_config=lora, data_collator=collator)
    if v.ckpt:
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return trainer, n_layers - first


def batches_for(v: Variant, sequences: list[dict], rows, tokenizer, trainer_features=None):
    """(features per batch, rows per batch) for the variant's layout."""
    if v.packed:
        items = [(s, s["n_rows"]) for s in sequences]
    elif v.head == "trl":
        items = [(f, 1) for f in trainer_features]
    else:
        items = [(r, 1) for s in sequences for r in unpacked_rows(s)]
    if v.sort:
        items.sort(key=lambda x: len(x[0]["input_ids"]))
    return [items[i:i + v.batch] for i in range(0, len(items), v.batch)]


def profile(v: Variant, a, tokenizer, requests, rows, sequences) -> dict:
    from trl import SFTTrainer  # noqa: F401  (import cost outside the timing)

    if v.head == "trl" and not v.packed:
        features = [{"prompt": r["prompt"], "completion": r["completion"]} for _, r in rows]
        trainer, n_lora = make_trainer(v, a.model, tokenizer, features, None)
        prepared = list(trainer.train_dataset)
        collate = trainer.data_collator
    else:
        trainer, n_lora = make_trainer(v, a.model, tokenizer, sequences, PackedCollator(tokenizer.pad_token_id))
        prepared = None
        collate = PackedCollator(tokenizer.pad_token_id)
    groups = batches_for(v, sequences, rows, tokenizer, prepared)
    model = trainer.model
    model.train()

    def step(group):
        batch = collate([f for f, _ in group])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=v.autocast):
            loss = trainer.compute_loss(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
        tokens = batch["input_ids"].numel()
        real = sum(len(f["input_ids"]) for f, _ in group)
        return sum(n for _, n in group), tokens, real

    step(groups[0])  # warm-up
    timed = groups[1:a.steps + 1] if a.steps else groups  # default: one pass over every batch (same rows for all)
    n_rows = n_tok = n_real = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for group in timed:
        r, t, real = step(group)
        n_rows, n_tok, n_real = n_rows + r, n_tok + t, n_real + real
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = len(timed)
    return {"key": v.key, "note": v.note, "lora_layers": n_lora, "step_s": dt / n, "cpu_s": cpu / n,
            "rows_per_step": n_rows / n, "tokens_per_step": n_tok / n,
            "pad_pct": 100 * (1 - n_real / n_tok), "rows_per_s": n_rows / dt, "rows_per_cpu_s": n_rows / cpu}


def row_text(r: dict) -> str:
    if "error" in r:
        return f"{r['key']:2} {r['note']:<70} {r['error']}"
    return (f"{r['key']:2} {r['note']:<70} {r['lora_layers']:>4} {r['step_s']:>7.2f} {r['cpu_s']:>7.2f} "
            f"{r['rows_per_step']:>5.1f} {r['tokens_per_step']:>6.0f} {r['pad_pct']:>5.1f} {r['peak_gb']:>5.1f} "
            f"{r['rows_per_s']:>7.2f} {r['rows_per_cpu_s']:>10.3f}  (load {r['load']:.1f})")


def child(a, key: str) -> None:
    """Measure one variant in this (fresh) process and print its result as one JSON line."""
    import resource

    limit = int(a.max_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # fail this variant, not the other processes on the box
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    requests, rows = sample_rows(a.requests, a.n_requests, a.seed)
    sequences, _ = pack_rows(tokenizer, requests, rows, max_length=2048)
    v = next(v for v in VARIANTS if v.key == key)
    r = profile(v, a, tokenizer, requests, rows, sequences)
    r["peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    r["load"] = os.getloadavg()[0]
    print("RESULT " + json.dumps(r), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/base/smollm2-135m-instruct")
    ap.add_argument("--requests", nargs="+", default=["data/requests/bfcl/train.jsonl"])
    ap.add_argument("--n-requests", type=int, default=8)
    ap.add_argument("--steps", type=int, default=0, help="timed batches per variant (0: all of them, one pass)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated variant keys, e.g. A,D,L")
    ap.add_argument("--epoch-rows", type=int, default=0, help="print the epoch time this many rows would take")
    ap.add_argument("--max-gb", type=float, default=8.0, help="address-space cap per variant (its own process)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a, a.child)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(a.model)
    requests, rows = sample_rows(a.requests, a.n_requests, a.seed)
    _, stats = pack_rows(tokenizer, requests, rows, max_length=2048)
    print(f"{len(requests)} requests, {stats['rows_kept']} rows: {stats['tokens']} tokens packed, "
          f"{stats['unpacked_tokens']} one by one; {a.threads} threads, {a.steps or 'all'} timed batches per variant, "
          f"each variant in its own process", flush=True)
    only = set(a.only.split(",")) if a.only else None
    print(f"{'':2} {'variant':<70} {'LoRA':>4} {'step s':>7} {'cpu s':>7} {'rows':>5} {'tokens':>6} {'pad%':>5} "
          f"{'GB':>5} {'rows/s':>7} {'rows/cpu-s':>10}", flush=True)
    results = []
    for v in VARIANTS:
        if only and v.key not in only:
            continue
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", v.key], capture_output=True,
                              text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if lines:
            r = json.loads(lines[-1][7:])
            results.append(r)
        else:
            oom = "MemoryError" in proc.stderr or "DefaultCPUAllocator" in proc.stderr
            why = f"out of memory (> {a.max_gb:g} GB)" if oom else proc.stderr.strip().splitlines()[-1:]
            r = {"key": v.key, "note": v.note, "error": f"failed (rc {proc.returncode}): {why}"}
        print(row_text(r), flush=True)
    if a.epoch_rows and results:
        best = max(results, key=lambda r: r["rows_per_cpu_s"])
        ideal = best["rows_per_cpu_s"] * a.threads  # rows/s with the threads' cores to itself
        print(f"fastest: {best['key']} at {best['rows_per_s']:.2f} rows/s here ({best['rows_per_cpu_s']:.3f} rows per "
              f"CPU-second, {ideal:.2f} rows/s on {a.threads} free cores) -> {a.epoch_rows} rows in "
              f"{a.epoch_rows / best['rows_per_s'] / 60:.1f} min here, {a.epoch_rows / ideal / 60:.1f} min on free cores")


if __name__ == "__main__":
    main()
