"""Benchmark the speculative runtime: every method side by side on one target, over N requests, through the runner.

Run as: python scripts/bench_runtime.py [--target checkpoints/base/qwen2.5-coder-1.5b-instruct] [--bench bfcl]
        [-n 5] [--hint gold|sidecar|none] [--schedules adaptive split] [--out rows.jsonl]
        python scripts/bench_runtime.py --from-eval eval/results/cpu        (the table from an eval run's rows)
        python scripts/bench_runtime.py --replay rows.jsonl                 (acceptance on recorded outputs, no model)

The same runner and report as `make eval` (pipeline/eval/runner.py, pipeline/eval/report.py): every variant warmed up,
shuffled per request, timed from arrival, baselines on every core, `ooo` under each schedule, ratios end to end and
for the decode phase with 95% intervals. Hints for `ooo`: `--hint gold` sends each request's gold call through a
sidecar process (an upper bound on a sidecar that is right, labelled as such), `--hint sidecar` builds the wave with
`--sidecar-factory` inside the worker process, `--hint none` drops `ooo`. `ooo-oracle` always uses the call parsed
from the target's own `ar` output, instantly ready (an upper bound). The machine (CPU model and flags, dtype,
threads) is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.hardware import machine  # noqa: E402
from pipeline.io import ResumableJsonl, read_jsonl  # noqa: E402
from pipeline.eval.report import summarize, to_markdown  # noqa: E402
from pipeline.requests import load_requests  # noqa: E402
from pipeline.runtime import METHODS, generate  # noqa: E402
from pipeline.payload import gold_payload  # noqa: E402


def gold_wave(request: dict) -> dict | None:
    return gold_payload(request)


def delayed_gold_wave(request: dict) -> dict | None:
    time.sleep(float(request.get("_hint_delay_s", 0.0)))
    return gold_payload(request)


def from_eval(run_dir: Path) -> int:
    rows = read_jsonl(run_dir / "rows.jsonl")
    print(to_markdown(summarize(rows), title=f"{run_dir} (from its rows)"))
    return 0


def replay(args) -> int:
    """Acceptance of every method on recorded `ar` outputs, with the target's tokenizer and no model."""
    from transformers import AutoTokenizer

    from pipeline.runtime import Ready
    from pipeline.runtime.replay import ReplayTarget

    recorded = {r["request_id"]: r for r in read_jsonl(args.replay) if r["method"] == "ar" and r.get("token_ids")}
    paths = args.requests or [f"data/requests/{args.bench}/test.jsonl"]
    requests = [r for r in load_requests(paths) if r["id"] in recorded]
    tok = AutoTokenizer.from_pretrained(args.target)
    target = ReplayTarget(tok, {i: r["token_ids"] for i, r in recorded.items()})
    totals: dict[str, list[int]] = {}
    for req in requests:
        for method in [m for m in args.methods.split(",") if m]:
            hint = Ready(gold_payload(req)) if method == "ooo" and args.hint == "gold" else None
            res = generate(target, req, method, sidecar=hint, max_new_tokens=args.max_new_tokens)
            assert res.token_ids == target.outputs[req["id"]][:len(res.token_ids)], (req["id"], method)
            t = totals.setdefault(method, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + res.stats.new_tokens, t[1] + res.stats.forwards, t[2] + res.stats.tree_nodes
    print(f"replay of {len(requests)} recorded ar outputs ({args.replay})")
    for m, (new, fwd, nodes) in totals.items():
        print(f"  {m:10} accepted/forward {new / fwd:6.2f}   nodes/forward {nodes / fwd:5.1f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="checkpoints/base/qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--bench", default="bfcl", help="reads data/requests/<bench>/test.jsonl (unless --requests)")
    ap.add_argument("--requests", nargs="+", help="canonical requests JSONL file(s)")
    ap.add_argument("-n", type=int, default=5, help="requests per file (evenly spaced)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--schedules", nargs="+", default=["adaptive"], help="schedules for ooo (runtime/schedule.py)")
    ap.add_argument("--hint", choices=["gold", "sidecar", "none"], default="gold")
    ap.add_argument("--hint-delay", type=float, default=0.0, help="seconds a gold hint waits before answering")
    ap.add_argument("--sidecar-factory", default="pipeline.sidecar.factory:make_wave",
                    help="'module:function' returning the wave callable (--hint sidecar)")
    ap.add_argument("--sidecar-kwargs", default="{}", help="JSON keyword arguments for the factory")
    ap.add_argument("--sidecar-timeout", type=float, default=60.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="cores to use (default: every core)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--tree-budget", choices=["auto", "fixed"], default="auto")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the rows here (a rerun skips finished rows)")
    ap.add_argument("--replay", help="rows of an earlier run (--out): replay its ar outputs through every method's "
                                     "drafters without the model (acceptance only, in seconds)")
    ap.add_argument("--from-eval", metavar="RUN_DIR", help="print the table from an eval run's rows.jsonl")
    args = ap.parse_args(argv)
    if args.from_eval:
        return from_eval(Path(args.from_eval))
    if args.replay:
        return replay(args)

    import torch

    from pipeline.hardware import available_cores
    from pipeline.eval.runner import Runner
    from pipeline.runtime import Target

    paths = [Path(p) for p in (args.requests or [f"data/requests/{args.bench}/test.jsonl"])]
    requests = load_requests(paths, args.n, how="even")
    methods = [m for m in args.methods.split(",") if m]
    if args.hint == "none":
        methods = [m for m in methods if m != "ooo"]
    torch.set_num_threads(args.threads or len(available_cores()))
    target = Target.load(args.target, dtype=args.dtype, prefix_cache=not args.no_prefix_cache)
    if args.tree_budget == "auto":
        target.calibrate()
    sidecar = None
    if args.hint == "sidecar":
        sidecar = {"factory": args.sidecar_factory, "kwargs": json.loads(args.sidecar_kwargs)}
    elif args.hint == "gold":
        sidecar = {"wave": delayed_gold_wave if args.hint_delay else gold_wave}
    runner = Runner(target, methods, run="bench", schedules=args.schedules, sidecar=sidecar,
                    max_new_tokens=args.max_new_tokens, seed=args.seed, threads=args.threads,
                    sidecar_timeout_s=args.sidecar_timeout, tree_budget=args.tree_budget)
    writer = ResumableJsonl(args.out, key="key") if args.out else None
    done = writer.done_ids() if writer else set()
    rows = [r for r in read_jsonl(writer.partial)] if writer and writer.partial.exists() else []
    t0 = time.perf_counter()
    try:
        runner.warmup(requests[0])
        for i, req in enumerate(requests):
            if args.hint_delay:
                req = dict(req, _hint_delay_s=args.hint_delay)
            new = runner.run(args.bench, req, done)
            for row in new:
                rows.append(row)
                if writer:
                    writer.write(row)
            print(f"[{i + 1}/{len(requests)}] {req['id']}: " + ", ".join(
                f"{r['variant']} {r['new_tokens'] / max(r['forwards'], 1):.1f}/fwd {r['wall_s']:.1f}s" for r in new),
                flush=True)
    finally:
        runner.close()
        if writer:
            writer.close()
            writer.finish()
    hint = {"gold": "gold call via a sidecar process (an upper bound on a right sidecar)", "none": "no hint",
            "sidecar": f"sidecar {args.sidecar_factory}"}[args.hint]
    print(json.dumps(machine(args.dtype, torch.get_num_threads())))
    print(to_markdown(summarize(rows), title=f"{Path(args.target).name}, {len(requests)} requests from "
                      f"{', '.join(map(str, paths))}, ooo hint: {hint}, {time.perf_counter() - t0:.0f} s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
