"""What one target forward of k tree tokens costs on this machine, and the tree sizes the budget then chooses.

Run as: python scripts/cost_curve.py --model checkpoints/base/qwen2.5-coder-1.5b-instruct [--dtype auto float32 bfloat16]
            [--backend transformers llamacpp] [--gguf FILE] [--threads 2] [--past 512]
            [--replay eval/results/cpu/rows.jsonl | data/traces/<teacher>/dev.jsonl]

`--backend llamacpp` measures the llama.cpp target on the GGUF the model folder was converted from (`--gguf` for
another one); each backend's curve is a row, so both backends on the same CPU sit side by side. Prints the measured
curve per backend and dtype beside the AVX2-only AMD EPYC curves measured elsewhere (docs/architecture.md,
"Tree budget"), and for each curve the tree size the budget (pipeline/runtime/budget.py) chooses for a typical
candidate tree at several
acceptance rates. With --replay, the recorded `ar` outputs of an eval run are replayed through `toolspec` with each
curve (ReplayTarget): chosen tree sizes, accepted tokens per forward and simulated decode seconds vs `ar`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.hardware import machine, resolve_dtype  # noqa: E402
from pipeline.runtime.budget import Acceptance, CostCurve, TreeBudget  # noqa: E402
from pipeline.runtime.verify import build_tree  # noqa: E402

# One forward of Qwen2.5-Coder-1.5B, 2 threads, ~400-token cache, AMD EPYC with AVX2 only (no AVX-512).
AVX2_CURVES = {
    "epyc-avx2 bfloat16": CostCurve((1, 8, 32), (0.26, 1.30, 5.08), {"source": "measured on an AVX2-only AMD EPYC"}),
    "epyc-avx2 float32": CostCurve((1, 8, 32), (0.42, 1.29, 1.84), {"source": "measured on an AVX2-only AMD EPYC"}),
}


def typical_tree():
    """A round of `toolspec`/`ooo`: a 16-token hint chain, a 10-token schema chain sharing 3, two lookups."""
    cands = [(list(range(100, 116)), 1), (list(range(100, 103)) + list(range(200, 207)), 2),
             (list(range(300, 310)), 8), (list(range(400, 406)), 4)]
    return build_tree(0, cands, 32, 24)


def chosen(curve: CostCurve, rate: float) -> int:
    acc = Acceptance({b: rate for b in (1, 2, 4, 8, 16)}, weight=1e6)
    return len(TreeBudget(curve, acceptance=acc).choose(typical_tree())[0])


def recorded_outputs(path: Path) -> dict[str, str]:
    """request id -> the target's own text, from eval rows (method ar) or traces rows (id, text)."""
    out = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("method") == "ar" and r.get("text") is not None:
            out[r["request_id"]] = r["text"]
        elif "method" not in r and r.get("text") and not r.get("error"):
            out[r["id"]] = r["text"]
    return out


def replay(rows_path: Path, curves: dict[str, CostCurve], tokenizer_path: str, limit: int | None = None) -> None:
    """Recorded outputs through toolspec and ooo (gold hint) on a ReplayTarget per cost curve: the tree sizes the
    budget chooses there and the decode time it would take, against ar's (one token per forward)."""
    from transformers import AutoTokenizer

    from pipeline.requests import load_requests
    from pipeline.runtime import Ready, generate
    from pipeline.payload import gold_payload
    from pipeline.runtime.replay import ReplayTarget

    outputs = recorded_outputs(rows_path)
    reqs = {r["id"]: r for path in sorted(Path("data/requests").glob("*/*.jsonl")) if path.name != "rejected.jsonl"
            for r in load_requests(path) if r["id"] in outputs}
    ids = sorted(reqs)[:limit] if limit else sorted(reqs)
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    print(f"\nreplay of {len(ids)} recorded outputs from {rows_path} (simulated decode time per curve):")
    print("| curve | method | mean tree size | share of 1-node rounds | tokens/forward | simulated decode s "
          "| ar decode s | decode ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for name, curve in curves.items():
        for method in ("toolspec", "ooo"):
            target = ReplayTarget(tok, {i: outputs[i] for i in ids}, curve=curve)
            sizes, new, fwd = [], 0, 0
            for rid in ids:
                hint = Ready(gold_payload(reqs[rid])) if method == "ooo" else None
                res = generate(target, reqs[rid], method, sidecar=hint, validate_hint=False, max_new_tokens=512)
                sizes += res.stats.tree_sizes
                new, fwd = new + res.stats.new_tokens, fwd + res.stats.forwards
            ar_s = new * curve.cost(1)
            label = "ooo (gold hint)" if method == "ooo" else method
            print(f"| {name} | {label} | {sum(sizes) / len(sizes):.1f} | {sizes.count(1) / len(sizes):.0%} | "
                  f"{new / fwd:.2f} | {target.simulated_s:.1f} | {ar_s:.1f} | {ar_s / target.simulated_s:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", nargs="+", default=["auto"], help="transformers dtypes (llama.cpp: the GGUF's own)")
    ap.add_argument("--backend", nargs="+", default=["transformers"], choices=["transformers", "llamacpp"])
    ap.add_argument("--gguf", default=None, help="llamacpp: the GGUF (default: the model folder's source GGUF)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--past", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replay", type=Path, default=None,
                    help="recorded target outputs: an eval run's rows.jsonl (ar rows) or a traces file")
    ap.add_argument("--replay-limit", type=int, default=None)
    ap.add_argument("--curve-only", action="store_true", help="use the cached curve of this machine if there is one")
    args = ap.parse_args()
    import torch

    from pipeline.runtime.backend import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(machine(threads=torch.get_num_threads())))
    curves = {}
    for backend in args.backend:
        kinds = args.dtype if backend == "transformers" else ["gguf"]
        for dtype in kinds:
            kw = {"dtype": dtype} if backend == "transformers" else {"gguf": args.gguf, "threads": args.threads}
            target = load_target(backend, args.model, **kw)
            curve = target.calibrate(past=args.past, reps=args.reps, cache=args.curve_only)
            curves[f"here {backend} {resolve_dtype(dtype) if backend == 'transformers' else target.gguf.name}"] = curve
            del target
    curves.update(AVX2_CURVES)
    print(f"\none forward of k tree tokens after a {args.past}-token cache, seconds:")
    ks = (1, 2, 4, 8, 16, 32)
    print("| curve | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---|" + "---|" * len(ks))
    for name, c in curves.items():
        print(f"| {name} | " + " | ".join(f"{c.cost(k):.3f}" for k in ks) + " |")
    rates = (0.3, 0.5, 0.7, 0.9)
    print("\ntree size the budget chooses for a typical 32-node candidate tree, by acceptance rate:")
    print("| curve | " + " | ".join(f"rate {r}" for r in rates) + " |")
    print("|---|" + "---|" * len(rates))
    for name, c in curves.items():
        print(f"| {name} | " + " | ".join(str(chosen(c, r)) for r in rates) + " |")
    if args.replay:
        replay(args.replay, curves, args.model, args.replay_limit)


if __name__ == "__main__":
    main()
