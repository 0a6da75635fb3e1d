"""Which tools a staged wave should ask: how often the tool the target called is among those asked, per policy.

Run as: .venv/bin/python scripts/slot_tools_coverage.py --adapter checkpoints/sidecar/smollm2-135m-cpu-v9 \
            --labels data/labels/qwen2.5-coder-1.5b/test.jsonl data/labels/qwen2.5-coder-1.5b/dev.jsonl \
            [--policies 1 2 3 2@0.9 3@0.9 ...] [--out eval/sidecar/slot-tools-coverage.json]
        .venv/bin/python scripts/slot_tools_coverage.py --adapter <it> \
            --rows eval/results/cpu/rows.jsonl --target qwen2.5-coder-1.5b-instruct     (a table's own requests)

A staged wave (`sidecar.slot_tools`) runs the function row first and decodes the slots of the
tools its first token ranks highest. Where the target then calls a tool whose slots were not asked, the hint has no
values for that call. For every labelled request with two tools or more, this runs the function row's first step once
(`SlotWave._first_logits`, the wave's own prompt and weights), takes the probability of each tool (`wave.tool_probs`)
and judges each policy by `wave.top_tools`: `N` asks the top N tools (the wave's `slot_tools: N`), `N@p` the fewest
of the top N whose probability reaches p. It prints, per benchmark and policy: requests, the share whose called tool
(the labels stage's call, or the first call of the target's `ar` output in an eval run's rows) is asked, and the
tools asked per request. Every tool asked costs the wave decode rows and a
tool not asked costs the hint its values, so the policy to take covers the called tool with the fewest tools asked;
the A/B in real time (`scripts/ab_sidecars.py`) decides.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.io import InputError, iter_jsonl, where, write_json  # noqa: E402


def parse_policy(text: str) -> tuple[int, float | None]:
    """`N` -> (N, None); `N@p` -> (N, p)."""
    n, _, p = text.partition("@")
    try:
        out = (int(n), float(p) if p else None)
    except ValueError:
        raise InputError(f"--policies: {text!r}: expected N or N@p (e.g. 2 or 3@0.9)") from None
    if out[0] < 1 or (out[1] is not None and not 0 < out[1] <= 1):
        raise InputError(f"--policies: {text!r}: N >= 1 and 0 < p <= 1")
    return out


def called_tools(label_paths: list[str]) -> dict[str, dict]:
    """{request id: {"benchmark", "tool": the tool index of the target's call}} from the labels stage's files (one
    label per request: the call it labelled, `call_index`, the first where the output has several)."""
    out: dict[str, dict] = {}
    for path in label_paths:
        for line, lab in iter_jsonl(path):
            if not isinstance(lab.get("id"), str) or not isinstance(lab.get("tool_index"), int):
                raise InputError(f"{where(path, line, lab.get('id'))}: expected a labels stage row (id, tool_index)")
            out[lab["id"]] = {"benchmark": lab.get("benchmark") or lab["id"].split("/")[0], "tool": lab["tool_index"]}
    return out


def called_in_rows(rows_path: str, target: str, requests: dict[str, dict]) -> dict[str, dict]:
    """{request id: {"benchmark", "tool"}}: the tool of the first call in `target`'s `ar` output of each request in
    an eval run's rows (requests answered with text, or with a tool the request lacks, are left out)."""
    from pipeline.parsers import parse_calls
    from pipeline.payload import payload_from_call

    out: dict[str, dict] = {}
    for line, r in iter_jsonl(rows_path):
        if r.get("method") != "ar" or r.get("target") != target or r.get("request_id") in out:
            continue
        if r.get("request_id") not in requests:
            raise InputError(f"{where(rows_path, line, r.get('request_id'))}: request not found under --requests-root")
        calls = parse_calls(r.get("text") or "", lenient=True).calls
        own = payload_from_call(calls[0], requests[r["request_id"]].get("tools") or []) if calls else None
        if own is not None:
            out[r["request_id"]] = {"benchmark": r.get("benchmark") or r["request_id"].split("/")[0],
                                    "tool": own["tool_index"]}
    if not out:
        raise InputError(f"{rows_path}: no ar row of target {target!r} with a tool call")
    return out


def judge(probs_by_id: dict[str, list[float]], called: dict[str, dict],
          policies: list[tuple[int, float | None]]) -> dict[str, dict[str, dict]]:
    """{benchmark (and "all"): {policy: {requests, called_asked (%), tools_asked (mean)}}}."""
    import torch

    from pipeline.sidecar.wave import top_tools

    acc: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for rid, probs in probs_by_id.items():
        p = torch.tensor(probs)
        for n, mass in policies:
            asked = top_tools(p, n, mass)
            for group in (called[rid]["benchmark"], "all"):
                acc[group][policy_name(n, mass)].append((called[rid]["tool"] in asked, len(asked)))
    return {g: {name: {"requests": len(v), "called_asked": 100 * sum(a for a, _ in v) / len(v),
                       "tools_asked": sum(k for _, k in v) / len(v)} for name, v in by.items()}
            for g, by in acc.items()}


def policy_name(n: int, mass: float | None) -> str:
    return f"{n}" if mass is None else f"{n}@{mass:g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapter", help="sidecar adapter folder (checkpoints/sidecar/<recipe>/); none: the base model")
    ap.add_argument("--model", help="base model folder (default: the adapter's base_model_name_or_path)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--labels", nargs="+", help="the labels stage's <split>.jsonl files")
    src.add_argument("--rows", help="an eval run's rows.jsonl: the target's `ar` outputs name the called tool")
    ap.add_argument("--target", help="with --rows: the target whose `ar` rows to read")
    ap.add_argument("--requests-root", default="data/requests")
    ap.add_argument("--policies", nargs="+", default=["1", "2", "3", "2@0.8", "2@0.9", "2@0.95", "3@0.9", "3@0.95"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", help="write the table as JSON here too")
    args = ap.parse_args(argv)
    try:
        import torch
        from tqdm import tqdm

        from pipeline.hardware import resolve_dtype
        from pipeline.requests import load_requests
        from pipeline.sidecar.accuracy import base_model_of
        from pipeline.sidecar.wave import SlotWave, tool_probs, wave_inputs

        if not (args.adapter or args.model):
            raise InputError("--adapter or --model: which sidecar's function row to read")
        if args.rows and not args.target:
            raise InputError("--rows needs --target (the target whose ar rows name the called tool)")
        policies = [parse_policy(p) for p in args.policies]
        every = {r["id"]: r for path in sorted(Path(args.requests_root).glob("*/*.jsonl"))
                 if path.name != "rejected.jsonl" for r in load_requests(path)}
        called = called_tools(args.labels) if args.labels else called_in_rows(args.rows, args.target, every)
        requests = [every[i] for i in called if i in every and len(every[i].get("tools") or []) > 1]
        if not requests:
            raise InputError(f"no request with two tools or more among the {len(called)} whose called tool is known "
                             f"(requests under {args.requests_root})")
        wave = SlotWave(args.model or base_model_of(args.adapter), args.adapter, dtype=resolve_dtype(args.dtype),
                        merge_adapter=True)
        probs_by_id = {}
        with torch.inference_mode():
            for req in tqdm(requests, desc="function rows", unit="req"):
                prefix, suffixes, _ = wave_inputs(wave.tokenizer, req, wave.compact, wave.chat_template_kwargs,
                                                  wave.questions)
                ids = wave._tool_ids(len(req["tools"]))
                if ids is None:
                    continue
                logits = wave._first_logits(wave._prefix_cache(prefix, req["id"]), len(prefix), suffixes[0])
                probs_by_id[req["id"]] = tool_probs(logits, ids).tolist()
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = judge(probs_by_id, called, policies)
    print(f"{len(probs_by_id)} requests with two tools or more; sidecar {args.adapter or args.model}; called tools from "
          f"{args.rows or ', '.join(args.labels)}")
    print(f"{'benchmark':<12} {'policy':<8} {'requests':>8} {'called tool asked %':>20} {'tools asked':>11}")
    for group in sorted(table, key=lambda g: (g == "all", g)):
        for name, row in table[group].items():
            print(f"{group:<12} {name:<8} {row['requests']:>8} {row['called_asked']:>20.1f} {row['tools_asked']:>11.2f}")
    if args.out:
        write_json(args.out, {"adapter": args.adapter, "model": args.model, "labels": args.labels, "rows": args.rows,
                              "target": args.target, "table": table, "probs": probs_by_id})
    return 0


if __name__ == "__main__":
    sys.exit(main())
