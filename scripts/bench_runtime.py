"""Benchmark the speculative runtime: every method side by side on one target, over N requests.

Run as: python scripts/bench_runtime.py [--target checkpoints/base/qwen2.5-coder-1.5b-instruct] [--bench bfcl]
        [-n 50] [--hint gold|sidecar|none] [--threads 2] [--out rows.jsonl]

Per method it prints: speedup over `ar` (ratio of total wall time, prefill included), decode-only speedup, mean
accepted tokens per target forward, share of outputs equal to `ar`'s, `ooo`'s mean hint-ready time and accepted
hint tokens, and the loop's own overhead per round (drafting + bookkeeping) relative to an `ar` round.
Hints for `ooo`: `--hint gold` sends each request's gold call through a sidecar process (an upper bound on a
sidecar that is right, labelled as such), `--hint sidecar` builds the wave with `--sidecar-factory` inside the
worker process, `--hint none` makes `ooo` equal `toolspec` plus polling. `ooo-oracle` always uses the call parsed
from the target's own `ar` output, instantly ready.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pipeline.io import ResumableJsonl, read_jsonl
from pipeline.runtime import METHODS, Sidecar, Target, generate
from pipeline.runtime.parse import gold_payload


def gold_wave(request: dict) -> dict | None:
    return gold_payload(request)


def delayed_gold_wave(request: dict) -> dict | None:
    time.sleep(float(request.get("_hint_delay_s", 0.0)))
    return gold_payload(request)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(rows: list[dict], methods: list[str]) -> list[dict]:
    ar = {r["id"]: r for r in rows if r["method"] == "ar"}
    ar_wall = sum(r["wall_s"] for r in ar.values())
    ar_decode = sum(r["decode_s"] for r in ar.values())
    ar_round = ar_decode / max(sum(r["forwards"] for r in ar.values()), 1)
    out = []
    for m in methods:
        rs = [r for r in rows if r["method"] == m]
        if not rs:
            continue
        fwd = sum(r["forwards"] for r in rs)
        ready = [r["hint_ready_s"] for r in rs if r.get("hint_ready_s") is not None]
        out.append({
            "method": m, "n": len(rs),
            "speedup": ar_wall / max(sum(r["wall_s"] for r in rs), 1e-9),
            "decode_speedup": ar_decode / max(sum(r["decode_s"] for r in rs), 1e-9),
            "acc_per_fwd": sum(r["new_tokens"] for r in rs) / max(fwd, 1),
            "same_as_ar": sum(r["same_as_ar"] for r in rs) / len(rs),
            "wall_s": sum(r["wall_s"] for r in rs),
            "tree_per_fwd": sum(r["tree_nodes"] for r in rs) / max(fwd, 1),
            "overhead": (sum(r["overhead_s"] for r in rs) / max(fwd, 1)) / max(ar_round, 1e-9),
            "hint_ready_s": sum(ready) / len(ready) if ready else None,
            "hint_share": (sum(r["hint_tokens"] for r in rs) / max(sum(r["new_tokens"] for r in rs), 1)
                           if m.startswith("ooo") else None),
        })
    return out


def print_table(summary: list[dict], header: str) -> None:
    print(header)
    print(f"| {'method':10} | {'n':>3} | {'speedup':>7} | {'decode x':>8} | {'acc/fwd':>7} | {'== ar':>6} | "
          f"{'nodes/fwd':>9} | {'overhead':>8} | {'hint ready':>10} | {'hint tok':>8} |")
    print("|" + "|".join("-" * w for w in (12, 5, 9, 10, 9, 8, 11, 10, 12, 10)) + "|")
    for s in summary:
        ready = f"{s['hint_ready_s']:.2f} s" if s["hint_ready_s"] is not None else "-"
        share = f"{100 * s['hint_share']:.0f}%" if s["hint_share"] is not None else "-"
        print(f"| {s['method']:10} | {s['n']:>3} | {s['speedup']:6.2f}x | {s['decode_speedup']:7.2f}x | "
              f"{s['acc_per_fwd']:7.2f} | {100 * s['same_as_ar']:5.0f}% | {s['tree_per_fwd']:9.1f} | "
              f"{100 * s['overhead']:7.1f}% | {ready:>10} | {share:>8} |")


def from_eval(run_dir: Path) -> int:
    """The same table from the eval stage's rows (identity to `ar` by token digest), one block per target."""
    rows = read_jsonl(run_dir / "rows.jsonl")
    by_target: dict[str, list[dict]] = {}
    for r in rows:
        if r["method"] in METHODS:
            by_target.setdefault(r["target"], []).append(r)
    for target, rs in by_target.items():
        ar = {r["request_id"]: r["token_digest"] for r in rs if r["method"] == "ar"}
        rs = [r | {"id": r["request_id"], "same_as_ar": r["token_digest"] == ar.get(r["request_id"]),
                   "hint_tokens": r.get("hint_tokens_accepted") or 0, "tree_nodes": r.get("tree_nodes", 0),
                   "overhead_s": r.get("overhead_s") or 0.0} for r in rs if r["request_id"] in ar]
        methods = [m for m in METHODS if any(r["method"] == m for r in rs)]
        benches = sorted({r["benchmark"] for r in rs})
        print_table(summarize(rs, methods), f"\n{target}: {len(ar)} requests of {', '.join(benches)} from "
                                            f"{run_dir / 'rows.jsonl'} (placement {rs[0].get('placement')})")
    return 0


def replay(args) -> int:
    """Acceptance of every method on recorded `ar` outputs, with the target's tokenizer and no model."""
    from transformers import AutoTokenizer

    from pipeline.runtime import Ready
    from pipeline.runtime.replay import ReplayTarget

    recorded = {r["id"]: r for r in read_jsonl(args.replay) if r["method"] == "ar"}
    paths = args.requests or [f"data/requests/{args.bench}/test.jsonl"]
    requests = [r for p in paths for r in read_jsonl(p) if r["id"] in recorded]
    tok = AutoTokenizer.from_pretrained(args.target)
    target = ReplayTarget(tok, {i: r["token_ids"] for i, r in recorded.items()})
    opts = dict(max_new_tokens=args.max_new_tokens, max_nodes=args.max_nodes, max_depth=args.max_depth)
    totals: dict[str, list[int]] = {}
    for req in requests:
        for method in [m for m in args.methods.split(",") if m]:
            hint = Ready(gold_payload(req)) if method == "ooo" and args.hint == "gold" else None
            res = generate(target, req, method, sidecar=hint, **opts)
            assert res.token_ids == target.outputs[req["id"]][:len(res.token_ids)], (req["id"], method)
            t = totals.setdefault(method, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + res.stats.new_tokens, t[1] + res.stats.forwards, t[2] + res.stats.tree_nodes
    print(f"replay of {len(requests)} recorded ar outputs ({args.replay}), tree {args.max_nodes}/{args.max_depth}")
    for m, (new, fwd, nodes) in totals.items():
        print(f"  {m:10} accepted/forward {new / fwd:6.2f}   nodes/forward {nodes / fwd:5.1f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="checkpoints/base/qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--bench", default="bfcl", help="reads data/requests/<bench>/test.jsonl (unless --requests)")
    ap.add_argument("--requests", nargs="+", help="canonical requests JSONL file(s)")
    ap.add_argument("-n", type=int, default=5, help="number of requests per file (the first n)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--hint", choices=["gold", "sidecar", "none"], default="gold")
    ap.add_argument("--hint-delay", type=float, default=0.0, help="seconds a gold hint waits before answering")
    ap.add_argument("--sidecar-factory", default="pipeline.sidecar.factory:make_wave",
                    help="'module:function' returning the wave callable (--hint sidecar)")
    ap.add_argument("--sidecar-kwargs", default="{}", help="JSON keyword arguments for the factory")
    ap.add_argument("--sidecar-timeout", type=float, default=60.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--max-nodes", type=int, default=32)
    ap.add_argument("--max-depth", type=int, default=24)
    ap.add_argument("--out", help="write one row per (request, method) here")
    ap.add_argument("--replay", help="rows of an earlier run (--out): replay its ar outputs through every method's "
                                     "drafters without the model (acceptance only, in seconds)")
    ap.add_argument("--from-eval", metavar="RUN_DIR", help="print this table from an eval run's rows.jsonl (the "
                                                           "runtime's methods, per target) instead of decoding")
    args = ap.parse_args(argv)
    if args.from_eval:
        return from_eval(Path(args.from_eval))
    if args.replay:
        return replay(args)

    import torch

    torch.set_num_threads(args.threads)
    paths = [Path(p) for p in (args.requests or [f"data/requests/{args.bench}/test.jsonl"])]
    for path in paths:
        if not path.exists():
            print(f"no requests at {path}: run `make data` or pass --requests", file=sys.stderr)
            return 2
    requests = [req for path in paths for req in read_jsonl(path)[: args.n]]
    path = ", ".join(str(p) for p in paths)
    methods = [m for m in args.methods.split(",") if m]
    if "ar" not in methods:
        methods.insert(0, "ar")
    target = Target.load(args.target, dtype=args.dtype)
    generate(target, requests[0], "ar", max_new_tokens=4)  # warm-up: first-call costs are not the method's
    target.histories.clear()

    if args.hint == "sidecar":
        sidecar = Sidecar(factory=args.sidecar_factory, factory_kwargs=json.loads(args.sidecar_kwargs),
                          start_method="spawn", timeout_s=args.sidecar_timeout)
    elif args.hint == "gold":
        sidecar = Sidecar(delayed_gold_wave if args.hint_delay else gold_wave, timeout_s=args.sidecar_timeout)
    else:
        sidecar = None
    opts = dict(max_new_tokens=args.max_new_tokens, max_nodes=args.max_nodes, max_depth=args.max_depth)
    writer = ResumableJsonl(args.out, key="key") if args.out else None  # a rerun skips finished rows
    done = {r["key"]: r for r in read_jsonl(writer.partial)} if writer else {}
    rows, diffs = [], []
    t0 = time.perf_counter()
    try:
        for i, req in enumerate(requests):
            if args.hint_delay:
                req = dict(req, _hint_delay_s=args.hint_delay)
            ar = done.get(f"{req['id']}|ar")
            if ar is None:
                res = generate(target, req, "ar", **opts)
                ar = {"key": f"{req['id']}|ar", "id": req["id"], "method": "ar", "same_as_ar": True, "text": res.text,
                      "token_ids": res.token_ids} | res.stats.as_dict()
            for method in methods:
                row = ar if method == "ar" else done.get(f"{req['id']}|{method}")
                if row is None:
                    res = generate(target, req, method, sidecar=sidecar, oracle=ar["text"], **opts)
                    row = {"key": f"{req['id']}|{method}", "id": req["id"], "method": method,
                           "same_as_ar": res.token_ids == ar["token_ids"], "text": res.text,
                           "token_ids": res.token_ids} | res.stats.as_dict()
                if not row["same_as_ar"]:
                    at = first_difference(row["token_ids"], ar["token_ids"])
                    diffs.append(f"{req['id']} {method}: differs from ar at token {at}: "
                                 f"{target.decode(row['token_ids'][at:at + 4])!r} vs "
                                 f"{target.decode(ar['token_ids'][at:at + 4])!r}")
                rows.append(row)
                if writer:
                    writer.write(row)
            print(f"[{i + 1}/{len(requests)}] {req['id']}: ar {ar['new_tokens']} tokens in {ar['wall_s']:.1f} s; "
                  + ", ".join(f"{r['method']} {r['mean_accepted']:.1f}/fwd" for r in rows[-len(methods):]), flush=True)
    finally:
        if sidecar is not None:
            sidecar.close()
        if writer:
            writer.finish()
    hint = {"gold": "gold call via a sidecar process (not a trained sidecar)", "none": "no hint",
            "sidecar": f"sidecar {args.sidecar_factory}"}[args.hint]
    print_table(summarize(rows, methods),
                f"\n{Path(args.target).name} ({args.dtype}, {args.threads} threads), {len(requests)} requests from "
                f"{path}, ooo hint: {hint}, tree {args.max_nodes} nodes / depth {args.max_depth}, "
                f"{time.perf_counter() - t0:.0f} s")
    for d in diffs:
        print("  " + d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
