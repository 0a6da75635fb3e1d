"""One prepared check of the GPU path, for a lent GPU machine (one H100, no network) or, in CPU mode, for CI.

Run as: python scripts/gpu_check.py [--device cuda] [--rows eval/results/cpu/rows.jsonl]      (`make gpu-check`)
        python scripts/gpu_check.py --device cpu --quick                                   (CI: tiny shapes only)

On tiny random models built on the spot (the project's tiny tokenizer, no downloads) and a random-weight model of
Qwen2.5-7B's shape, it checks, in order:
1. lossless: every runtime method's tokens equal `ar`'s on the device, in float32 and in bf16 (counts per dtype;
   bf16 trees may round differently from a chain, the count says how often);
2. the sidecar wave (`SlotWave` through the sidecar factory) answering on the device;
3. 20 LoRA training steps in bf16 (peft + a plain torch loop: no trl on this path) with a falling loss;
4. the cost curve of the 7B-shaped target: one forward of 1/8/32/64 tree tokens after a 1,024-token cache, timed with
   the device-aware clock (pipeline/runtime/clock.py: synchronized);
5. a PROJECTION, not a measurement: the committed table's recorded forwards (each runtime row's `tree_sizes`: the
   tree verified in each round, on the CPU) re-costed on that curve, giving each method's projected decode speedup
   over `ar` on this device (the tree sizes the CPU budget chose: a GPU's flatter curve would choose larger trees);
6. vLLM's engine with this project's proposer (pipeline/vllm_spec): greedy output equal to the engine without it and
   its drafts accepted (tests/vllm_spec/test_engine.py, run by vLLM's own environment, `.venv-vllm`, where
   `make vllm-setup` built it; skipped with the reason where it did not, and in --quick mode: CI runs it in
   `make test-vllm`).
It prints one table. What it imports: torch, transformers, peft, accelerate and this repository; never trl or vllm.
The device machine has a transformers older than the project's pin: carry the wheels `pip download --no-deps
transformers==<pin> tokenizers safetensors huggingface-hub` gives (~15 MiB in all) and install them with `--no-deps
--target` beside the repository (see README "Running on GPUs"); `--quick` shrinks every model for CI (~1 min on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.io import iter_jsonl, read_jsonl  # noqa: E402
from pipeline.runtime.budget import CostCurve  # noqa: E402
from pipeline.runtime.clock import Clock  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "requests.jsonl"
# Qwen2.5-7B's shape (its config.json); the vocabulary is the tiny tokenizer's padded to the real size
QWEN25_7B = {"hidden": 3584, "layers": 28, "heads": 28, "kv_heads": 4, "intermediate_size": 18944,
             "vocab_size": 152064}
QUICK_SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate_size": 128, "vocab_size": 600}
SIZES = (1, 8, 32, 64)


def tiny_on(device: str, dtype: torch.dtype, tok):
    """The tests' context-sensitive tiny Qwen2 target (pipeline.testing.tiny_target), moved to `device` in `dtype`."""
    from pipeline.runtime.target import Target
    from pipeline.testing import tiny_target

    t = tiny_target("qwen2", tok)
    return Target(t.model.to(device=device, dtype=dtype), tok, name=f"tiny-{dtype}".replace("torch.", ""))


def lossless(device: str, tok, requests: list[dict], new_tokens: int) -> list[tuple[str, str, str]]:
    """Rows: per dtype, how many (request, method) decodes equal `ar`'s tokens."""
    from pipeline.payload import gold_payload
    from pipeline.runtime import METHODS, Ready, generate

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        target = tiny_on(device, dtype, tok)
        same = total = 0
        worst = []
        for req in requests:
            ar = generate(target, req, "ar", max_new_tokens=new_tokens)
            for method in METHODS[1:]:
                res = generate(target, req, method, sidecar=Ready(gold_payload(req)), oracle=ar,
                               max_new_tokens=new_tokens, tree_budget="fixed")
                total += 1
                same += res.token_ids == ar.token_ids
                if res.token_ids != ar.token_ids:
                    worst.append(method)
        name = str(dtype).replace("torch.", "")
        out.append(("lossless " + name, f"{len(METHODS) - 1} methods x {len(requests)} requests",
                    f"{same}/{total} equal ar" + (f" (differ: {sorted(set(worst))})" if worst else "")))
    return out


def wave_check(device: str, tok, requests: list[dict], tmp: Path) -> tuple[str, str, str]:
    from pipeline.sidecar.factory import make_wave
    from pipeline.testing import make_tiny_model_dir

    folder = make_tiny_model_dir(tmp / "tiny-sidecar", "qwen2")
    predict = make_wave(model=str(folder), dtype="float32", device=device, max_value_tokens=4)
    clock = Clock(device)
    t0 = clock.now()
    answers = [predict(r) for r in requests]
    seconds = clock.now() - t0
    return ("sidecar wave", f"SlotWave on {device}, {len(requests)} requests",
            f"{sum(a is not None for a in answers)} payloads, {seconds / len(requests) * 1000:.0f} ms per wave")


def lora_steps(device: str, tok, steps: int = 20) -> tuple[str, str, str]:
    """`steps` LoRA steps in bf16 on the tiny model (random token sequences; the loss must fall)."""
    from peft import LoraConfig, get_peft_model

    from pipeline.testing import make_tiny_model

    model, _ = make_tiny_model("qwen2", tokenizer=tok, dtype=torch.bfloat16)
    model = get_peft_model(model.to(device), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                        task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, len(tok), (4, 64), generator=g).to(device)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    ok = losses[-1] < losses[0]
    return ("LoRA bf16", f"{steps} steps, batch 4 x 64", f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
            + ("" if ok else " (DID NOT FALL)"))


def shaped_target(device: str, tok, shape: dict):
    """A random-weight Qwen2 of `shape` on `device` in bf16 (float32 on a CPU), weights drawn on the device."""
    from transformers import AutoModelForCausalLM

    from pipeline.runtime.target import Target
    from pipeline.testing import make_config

    cfg = make_config("qwen2", shape["vocab_size"], hidden=shape["hidden"], layers=shape["layers"],
                      heads=shape["heads"], kv_heads=shape["kv_heads"], intermediate=shape["intermediate_size"])
    cfg.tie_word_embeddings = False  # Qwen2.5-7B has its own output layer
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return Target(model, tok, name=f"random-qwen2-{shape['hidden']}x{shape['layers']}")


def projection(rows_path: Path, curve: CostCurve) -> tuple[list[tuple[str, str, str]], dict]:
    """Each runtime method's decode time re-costed on `curve`: the sum of cost(tree size) over its recorded rounds;
    per benchmark the ratio of `ar`'s sum to the method's, then the mean over benchmarks (as the report does)."""
    per: dict[tuple[str, str], dict[str, float]] = {}
    for _, r in iter_jsonl(rows_path):
        sizes = r.get("tree_sizes")
        if not sizes:  # the transformers peers record no rounds: not projected
            continue
        cell = per.setdefault((r["target"], r["benchmark"]), {})
        cell[r["variant"]] = cell.get(r["variant"], 0.0) + sum(curve.cost(k) for k in sizes)
    ratios: dict[str, list[float]] = {}
    for cell in per.values():
        for variant, secs in cell.items():
            if "ar" in cell and variant != "ar" and secs > 0:
                ratios.setdefault(variant, []).append(cell["ar"] / secs)
    means = {v: statistics.fmean(x) for v, x in sorted(ratios.items())}
    rows = [(f"PROJECTION {v}", f"{len(ratios[v])} (target, benchmark) cells of {rows_path.name}",
             f"{m:.2f}x ar decode (projected, not measured)") for v, m in means.items()]
    return rows, means


def vllm_check(python: Path, timeout_s: float = 900) -> tuple[str, str, str]:
    """The proposer inside vLLM's engine on this machine's device (its engine test, in vLLM's environment)."""
    import subprocess

    what = "vLLM engine + OooProposer: output = plain engine's, drafts accepted"
    if not python.is_file():
        return ("vllm proposer", what, f"skipped: {python} not found (make vllm-setup)")
    t0 = time.perf_counter()
    try:
        done = subprocess.run([str(python), "-m", "pytest", "-q", "-m", "vllm", "tests/vllm_spec/test_engine.py"],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return ("vllm proposer", what, f"FAILED: no result in {timeout_s:.0f} s")
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    verdict = "ok" if done.returncode == 0 else "FAILED"
    return ("vllm proposer", what, f"{verdict}: {last} ({time.perf_counter() - t0:.0f} s)")


def table(rows: list[tuple[str, str, str]]) -> str:
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    line = lambda r: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"  # noqa: E731
    return "\n".join([line(rows[0]), "|" + "|".join("-" * (x + 2) for x in w) + "|", *map(line, rows[1:])])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default=str(ROOT / "eval/results/cpu/rows.jsonl"), help="the committed table's rows")
    ap.add_argument("--quick", action="store_true", help="tiny shapes everywhere (CI on a CPU)")
    ap.add_argument("--requests", type=int, default=4, help="fixture requests for the lossless check")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                    help="vLLM's environment, for the proposer's engine check")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("gpu-check: --device cuda but torch sees no CUDA device (run --device cpu --quick for CI)")
    import tempfile

    from pipeline.hardware import gpu_line, machine
    from pipeline.testing import make_tokenizer

    started = time.perf_counter()
    torch.manual_seed(0)
    tok = make_tokenizer()
    requests = read_jsonl(FIXTURES)[:args.requests]
    rows = [("check", "what", "result")]
    rows += lossless(args.device, tok, requests, args.new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(wave_check(args.device, tok, requests, Path(tmp)))
    rows.append(lora_steps(args.device, tok))
    shape = QUICK_SHAPE if args.quick else QWEN25_7B
    target = shaped_target(args.device, tok, shape)
    curve = CostCurve.measure(target, past=1024 if not args.quick else 64, reps=3, sizes=SIZES)
    del target
    rows.append(("cost curve", f"{shape['hidden']}x{shape['layers']} random, past {curve.meta['past']}, synchronized",
                 ", ".join(f"k={k} {s * 1000:.1f} ms" for k, s in zip(curve.sizes, curve.seconds))))
    means = {}
    if Path(args.rows).is_file():
        proj, means = projection(Path(args.rows), curve)
        rows += proj
    else:
        rows.append(("PROJECTION", args.rows, "not found: no projection"))
    if not args.quick:
        rows.append(vllm_check(Path(args.vllm_python)))
    mach = machine()
    print(f"gpu-check on {args.device}: {gpu_line(mach.get('gpu')) or mach['cpu']['model']}, torch {torch.__version__}"
          f", {time.perf_counter() - started:.0f} s")
    print(table(rows))
    out = {"device": args.device, "machine": mach, "rows": rows[1:], "curve": curve.as_dict(), "projection": means,
           "seconds": round(time.perf_counter() - started, 1)}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
