"""Wave latency benchmark: the shared-prefix slot wave vs one prompt at a time vs an unshared padded batch.

Run as: .venv/bin/python scripts/bench_wave.py --model checkpoints/base/smollm2-135m-instruct \
            --requests data/requests/bfcl/test.jsonl data/requests/seal_tools/test.jsonl ... [--per-file 5] \
            [--threads 1] [--dtype bfloat16] [--max-value-tokens 32] [--out eval/bench/wave.json]

For each request the methods get the same token ids (`wave.wave_inputs`: shared prefix + one suffix per
question) and decode greedily up to --max-value-tokens, stopping at <|im_end|>/eos:
  wave     SlotWave.run as the sidecar runs it: prefix forward once, written once into a preallocated batch cache,
           parallel greedy decode in place; a row leaves the batch at its stop token or as soon as its answer is a
           whole JSON value (early stop);
  wave-merged  the wave with the LoRA adapter folded into the base weights (`merge_adapter`: one plain model, as
           the runtime's sidecar worker loads it), same prefix sharing and early stop (needs --adapter);
  wave-int8  the wave in int8 (`quantize="int8"`: loaded and merged in float32, every linear but down_proj in int8,
           as a recipe's `sidecar.quantize: int8` runs it), whatever --dtype says;
  wave-prepacked  wave-merged with its linears prepacked for oneDNN (`prepack=True`, as the recipes run the wave);
           `--methods wave-int8 wave-prepacked --dtype bfloat16` compares the two weight formats the recipes offer;
  wave-prefix  wave-merged (wave without --adapter) with a prefix cache of --prefix-cache tokens: each wave starts
           from the longest prefix an earlier request of the run shared with it (the system prompt and tools; never
           its own), as a server's sidecar sees requests one after the other (use --pick first for a file's order);
  wave-head  wave-merged (wave without --adapter) with the output layer run on the prefix's last position, as the
           prefix forward did before `fill_cache` (wave revision 3);
  wave-before  the wave before those two changes: the prefix KV repeated per row in a DynamicCache (each step
           copies the whole cache), rows leave only at their stop token;
  naive    one `model.generate` per prompt (prefix + suffix), one after the other;
  batched  one `model.generate` over all prompts, each its full prefix + suffix, left-padded (no sharing).
The answers compared are the decoded texts' JSON values (early stop ends a row where its value is whole).
Latency (wall) and CPU seconds (this process, every thread) are token ids in -> answer tokens out (tokenizing and the join are the same for all three and take
milliseconds). It checks that the methods give the same answers and prints p50 / p90 / mean per method, by prompts per
wave (requests with 10+ slots apart: the target there is wave >= 3x faster than naive). Not a test: it measures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from pipeline.hardware import machine
from pipeline.io import iter_jsonl, write_json
from pipeline.sidecar.rows import answer_complete, parse_answer, slot_keys
from pipeline.runtime.target import output_layer_prefill
from pipeline.sidecar.wave import SlotWave, answer_texts, wave_inputs

METHODS = ("wave", "wave-merged", "wave-int8", "wave-prepacked", "wave-prefix", "wave-head", "wave-before", "naive",
           "batched")
FORMATS = {"wave-int8": {"dtype": "float32", "quantize": "int8"}, "wave-prepacked": {"prepack": True}}


def pick(path: str, n: int, how: str) -> list[dict]:
    """n requests of a file: the first n, or (spread) n at evenly spaced quantiles of the slot count."""
    reqs = [r for _, r in iter_jsonl(path)]
    if how == "first" or len(reqs) <= n:
        return reqs[:n]
    by_size = sorted(reqs, key=lambda r: (len(slot_keys(r["tools"])), r["id"]))
    return [by_size[round(i * (len(by_size) - 1) / max(1, n - 1))] for i in range(n)]


def cut(tokens: list[int], stop: set[int]) -> list[int]:
    """Tokens up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i + 1]
    return tokens


def run_naive(model, prefix, suffixes, cap, stop_ids, pad_id):
    rows = []
    for s in suffixes:
        ids = torch.tensor([prefix + s])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cap, do_sample=False,
                             eos_token_id=stop_ids, pad_token_id=pad_id)
        rows.append(cut(out[0, ids.shape[1]:].tolist(), set(stop_ids)))
    return rows


def run_batched(model, prefix, suffixes, cap, stop_ids, pad_id):
    seqs = [prefix + s for s in suffixes]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, seq in enumerate(seqs):
        ids[b, width - len(seq):] = torch.tensor(seq)
        mask[b, width - len(seq):] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=cap, do_sample=False, eos_token_id=stop_ids,
                         pad_token_id=pad_id)
    return [cut(row.tolist(), set(stop_ids)) for row in out[:, width:]]


def percentiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = lambda p: xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]  # noqa: E731  nearest-rank on few points
    return {"p50": statistics.median(xs), "p95": q(0.95), "mean": statistics.fmean(xs), "n": len(xs)}


def table(results: list[dict], methods: list[str]) -> str:
    groups = {"all": results, "<10 slots": [r for r in results if r["slots"] < 10],
              "10+ slots": [r for r in results if r["slots"] >= 10]}
    ref = "naive" if "naive" in methods else methods[-1]
    lines = ["| requests | n | prompts/wave (mean) | method | p50 s | p95 s | mean s | CPU-s/request | "
             f"{ref} / method (mean) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, rs in groups.items():
        if not rs:
            continue
        prompts = statistics.fmean(r["prompts"] for r in rs)
        ref_mean = statistics.fmean(r[ref] for r in rs)
        for m in methods:
            p = percentiles([r[m] for r in rs])
            lines.append(f"| {name} | {len(rs)} | {prompts:.1f} | {m} | {p['p50']:.2f} | {p['p95']:.2f} | "
                         f"{p['mean']:.2f} | {statistics.fmean(r[m + '_cpu_s'] for r in rs):.2f} | "
                         f"{ref_mean / p['mean']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter")
    ap.add_argument("--requests", nargs="+", required=True)
    ap.add_argument("--per-file", type=int, default=5)
    ap.add_argument("--pick", choices=("spread", "first"), default="spread")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32",
                    help="bfloat16 is faster, but its rounding differs between batch shapes (answers may differ)")
    ap.add_argument("--max-value-tokens", type=int, default=32)
    ap.add_argument("--methods", nargs="+", choices=METHODS,
                    help="default: all (wave-merged only with --adapter)")
    ap.add_argument("--prefix-cache", type=int, default=8192, help="wave-prefix: tokens the prefix cache holds")
    ap.add_argument("--out", help="JSON with per-request timings and the summary")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.methods and "wave-merged" in args.methods and not args.adapter:
        ap.error("--methods wave-merged needs --adapter (a base model has nothing to merge)")
    methods = [m for m in METHODS if m in args.methods] if args.methods else \
        [m for m in METHODS if m != "wave-merged" or args.adapter]
    wave = SlotWave(args.model, args.adapter, dtype=args.dtype, max_value_tokens=args.max_value_tokens,
                     merge_adapter=False)
    merged = SlotWave(args.model, args.adapter, dtype=args.dtype, max_value_tokens=args.max_value_tokens,
                      merge_adapter=True) if "wave-merged" in methods else None
    formats = {m: SlotWave(args.model, args.adapter, **{"dtype": args.dtype, **kw},
                           max_value_tokens=args.max_value_tokens, merge_adapter=bool(args.adapter))
               for m, kw in FORMATS.items() if m in methods}
    cached = SlotWave((merged or wave).model, tokenizer=wave.tokenizer, max_value_tokens=args.max_value_tokens,
                      compact=wave.compact, chat_template_kwargs=wave.chat_template_kwargs, questions=wave.questions,
                      prefix_cache=args.prefix_cache) if "wave-prefix" in methods else None
    before = SlotWave(wave.model, tokenizer=wave.tokenizer, max_value_tokens=args.max_value_tokens,
                      compact=wave.compact, chat_template_kwargs=wave.chat_template_kwargs, early_stop=False,
                      prealloc=False)
    model, tok, cap, stop_ids, pad = wave.model, wave.tokenizer, wave.max_value_tokens, wave.stop_ids, wave.pad_id
    requests = [r for path in args.requests for r in pick(path, args.per_file, args.pick)]
    results = []
    with torch.inference_mode():
        # first calls pay one-time set-up (kernels, allocator), which belongs to no method's latency
        run_naive(model, [1, 2, 3], [[4]], 2, stop_ids, pad)
        run_batched(model, [1, 2, 3], [[4], [5, 6]], 2, stop_ids, pad)
        wave.run([1, 2, 3], [[4], [5, 6]])
        if merged is not None:
            merged.run([1, 2, 3], [[4], [5, 6]])
        for w in formats.values():
            w.run([1, 2, 3], [[4], [5, 6]])
        before.run([1, 2, 3], [[4], [5, 6]])
        for k, req in enumerate(requests):
            prefix, suffixes, keys = wave_inputs(tok, req, wave.compact, wave.chat_template_kwargs, wave.questions)
            n_tools = len(req["tools"])
            timed, cpu, outputs = {}, {}, {}
            for m in methods:
                t0, c0 = time.perf_counter(), time.process_time()
                if m in ("wave", "wave-merged", "wave-head", *FORMATS):
                    done = lambda r, text, keys=keys, n=n_tools: answer_complete(text, keys[r][0], n)  # noqa: E731
                    runner = formats.get(m) or (wave if m == "wave" or merged is None else merged)
                    with output_layer_prefill() if m == "wave-head" else nullcontext():
                        outputs[m] = runner.run(prefix, suffixes, done)[0]
                elif m == "wave-prefix":
                    done = lambda r, text, keys=keys, n=n_tools: answer_complete(text, keys[r][0], n)  # noqa: E731
                    outputs[m] = cached.run(prefix, suffixes, done, key=req["id"])[0]
                    cpu["cached_tokens"] = cached.cached_tokens
                elif m == "wave-before":
                    outputs[m] = before.run(prefix, suffixes)[0]
                elif m == "naive":
                    outputs[m] = run_naive(model, prefix, suffixes, cap, stop_ids, pad)
                else:
                    outputs[m] = run_batched(model, prefix, suffixes, cap, stop_ids, pad)
                timed[m], cpu[f"{m}_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
            ref = methods[-1] if "naive" not in methods else "naive"
            values = {m: [parse_answer(t) for t in answer_texts(tok, outputs[m], stop_ids)] for m in methods}
            same = {m: sum(a == b for a, b in zip(values[m], values[ref])) for m in methods}
            results.append({"id": req["id"], "slots": len(suffixes) - 1, "prompts": len(suffixes),
                            "prefix_tokens": len(prefix), "suffix_tokens": sum(map(len, suffixes)),
                            "generated": {m: sum(map(len, outputs[m])) for m in methods}, **timed, **cpu,
                            **{f"{m}_same_as_ref": same[m] for m in methods}})
            r = results[-1]
            print(f"[{k + 1}/{len(requests)}] {req['id']}: {r['prompts']} prompts, prefix {r['prefix_tokens']} tok, "
                  + ", ".join(f"{m} {r[m]:.2f}s ({r[m + '_cpu_s']:.2f} CPU-s, {same[m]}/{r['prompts']} same)"
                              for m in methods), flush=True)
    n_rows = sum(r["prompts"] for r in results)
    agree = {m: sum(r[f"{m}_same_as_ref"] for r in results) for m in methods}
    text = table(results, methods)
    print(f"\n{args.model} ({args.dtype}, {args.threads} thread(s), cap {cap} tokens), {len(results)} requests\n")
    print(text)
    print(f"\nanswers (JSON values) equal to {methods[-1] if 'naive' not in methods else 'naive'}'s: "
          + ", ".join(f"{m} {agree[m]}/{n_rows} rows" for m in methods))
    print(f"machine: {machine(args.dtype, args.threads)}")
    report = {"config": vars(args), "results": results, "table": text, "agree": agree, "rows": n_rows}
    if args.out:
        write_json(Path(args.out), report)
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
