"""Chunked vs whole prefill on a real target: what asking the schedule between chunks costs.

Run as: .venv/bin/python scripts/bench_prefill.py [--model checkpoints/base/qwen2.5-coder-1.5b-instruct]
            [--requests data/requests/*/test.jsonl] [--per-file 2 | --ids ID,...] [--chunks 64 128 256] [--reps 2]
            [--threads 2] [--dtype auto] [--greedy N] [--output-layer]

The adaptive schedule can give the target every core back mid-prefill only if the prompt goes through the target in
chunks (`Target.prefill(chunk=...)`); each chunk re-reads the cache written so far, so chunks are not free. For every
request the prompt (minus its last token, as the runtime prefills it) is prefilled whole and in each chunk size, in
an order rotated per request and repetition, with the prefix cache off (every variant computes every token); the
table gives the mean seconds and the ratio to the whole prefill, per chunk size. Not a test: it measures (on a quiet
machine: the figures carry the CPU model and the load).

`--greedy N` then decodes `ar` for N tokens after each prefill (whole and every chunk size, untimed) and lists the
requests whose greedy output differs from the whole prefill's, with the first differing token: in exact arithmetic
chunks change nothing (the float64 tests), in bf16 a near-tie can flip with the forward's shape.

`--output-layer` adds a whole prefill that also runs the output layer for the last position, as every prefill did
before `target.fill_cache` (`output_layer_prefill`): the before/after of dropping it.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.hardware import cpu_sample, cpu_usage, machine  # noqa: E402
from pipeline.io import write_json  # noqa: E402
from pipeline.requests import load_requests  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    import torch

    from pipeline.runtime import Target
    from pipeline.runtime.target import output_layer_prefill

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/base/qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--requests", nargs="+", default=sorted(glob.glob("data/requests/*/test.jsonl")))
    ap.add_argument("--per-file", type=int, default=2)
    ap.add_argument("--ids", help="comma-separated request ids: only these (of --requests, all of each file)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--greedy", type=int, default=0, metavar="N",
                    help="also decode N tokens of ar after each prefill and report outputs that differ from whole")
    ap.add_argument("--output-layer", action="store_true",
                    help="also time the whole prefill with the output layer (before fill_cache)")
    ap.add_argument("--out", help="JSON with every timing")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = Target.load(args.model, dtype=args.dtype, prefix_cache=False)
    if args.ids:
        want = args.ids.split(",")
        found = {r["id"]: r for path in args.requests for r in load_requests(path) if r["id"] in want}
        missing = [i for i in want if i not in found]
        if missing:
            raise SystemExit(f"--ids: {missing} not in {args.requests}")
        requests = [found[i] for i in want]
    else:
        requests = [r for path in args.requests for r in load_requests(path, args.per_file, how="even")]
    variants = [None] + list(args.chunks) + (["head"] if args.output_layer else [])
    target.prefill(target.prompt_ids(requests[0])[:-1][:64])  # first-call set-up belongs to no variant
    times: dict = {v: [] for v in variants}
    rows, before = [], cpu_sample()
    for i, req in enumerate(requests):
        ids = target.prompt_ids(req)[:-1]
        for rep in range(args.reps):
            k = (i + rep) % len(variants)
            for v in variants[k:] + variants[:k]:  # rotated: no variant always runs first
                with output_layer_prefill() if v == "head" else nullcontext():
                    t0 = time.perf_counter()
                    target.prefill(ids, chunk=None if v == "head" else v)
                    times[v].append(time.perf_counter() - t0)
                rows.append({"id": req["id"], "tokens": len(ids), "chunk": v, "s": times[v][-1]})
        print(f"[{i + 1}/{len(requests)}] {req['id']}: {len(ids)} tokens, whole "
              f"{statistics.fmean(times[None][-args.reps:]):.2f}s, "
              + ", ".join(f"{c}: {statistics.fmean(times[c][-args.reps:]):.2f}s" for c in variants[1:]), flush=True)
    usage = cpu_usage(before, cpu_sample())
    whole = statistics.fmean(times[None])
    lines = ["| prefill | mean s | / whole |", "|---|---|---|"]
    for v in variants:
        mean = statistics.fmean(times[v])
        name = {None: "whole", "head": "whole, with the output layer"}.get(v, f"chunks of {v}")
        lines.append(f"| {name} | {mean:.3f} | {mean / whole:.3f} |")
    mach = machine(args.dtype, torch.get_num_threads())
    tokens = statistics.fmean(len(target.prompt_ids(r)) for r in requests)
    print(f"\n{args.model}, {len(requests)} requests (mean {tokens:.0f} prompt tokens), {args.reps} reps each\n")
    print("\n".join(lines))
    print(f"\nmachine: {mach}\nwhile it ran: {usage}")
    report = {"config": vars(args), "machine": mach, "usage": usage, "rows": rows, "table": "\n".join(lines)}
    if args.greedy:
        report["greedy"] = greedy_outputs(target, requests, args.chunks, args.greedy)
        for c in args.chunks:
            diff = [d for d in report["greedy"] if d["chunk"] == c and d["first_diff"] is not None]
            print(f"greedy {args.greedy} tokens, chunks of {c} vs whole: {len(diff)} of {len(requests)} outputs differ"
                  + "".join(f"\n  {d['id']} from token {d['first_diff']}" for d in diff))
    if args.out:
        write_json(Path(args.out), report)
    return report


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one is a prefix); None if equal."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None else (None if len(a) == len(b) else min(len(a), len(b)))


def greedy_outputs(target, requests: list[dict], chunks: list[int], tokens: int) -> list[dict]:
    """Per request and chunk size: where `ar`'s greedy output after a chunked prefill first leaves the whole one's."""
    from pipeline.runtime.loop import generate

    out = []
    for req in requests:
        whole = generate(target, req, "ar", max_new_tokens=tokens).token_ids
        for c in chunks:
            ids = generate(target, req, "ar", max_new_tokens=tokens, prefill_chunk=c).token_ids
            out.append({"id": req["id"], "chunk": c, "tokens": len(ids), "first_diff": first_difference(whole, ids)})
    return out


if __name__ == "__main__":
    main()
