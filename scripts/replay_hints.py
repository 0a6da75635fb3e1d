"""Where a sidecar's hint wins and where it loses, replayed offline on a target's recorded outputs.

Run as: python scripts/replay_hints.py --rows eval/results/cpu/rows.jsonl --target qwen2.5-coder-1.5b-instruct
            --tokenizer checkpoints/base/qwen2.5-coder-1.5b-instruct --curve <cost-curve JSON>
            --sidecar-model checkpoints/base/smollm2-135m-instruct --adapter checkpoints/sidecar/<recipe>
            [--slot-tools 2] [--hints hints.json] [--out replay.json] [--draft-s 0.008]

The `ar` rows of one target in an eval run are its greedy outputs; a `ReplayTarget` (pipeline/runtime/replay.py)
verifies drafts against them as the real model would, so `toolspec`, `ooo` with the sidecar's payloads and
`ooo-oracle` (the target's own call as the hint) give the forwards the eval would count, in milliseconds. With the
target's measured cost curve (`~/.cache/ooo-spec/cost/<digest>.json`, written by `Target.calibrate()`), the tree
budget chooses tree sizes as on that machine and the simulated decode seconds add up what each verified forward
costs there, with a fixed drafting time per round (`--draft-s`: the budget's choices then do not depend on how busy
the machine is, so two replays compare exactly). Requests are replayed in the rows' order, one target per method, so drafting statistics and
histories carry over as in the eval. Each request is put in one category by comparing the hint with the target's
call: exact, the right tool with other values, another tool, no hint, or no call (a text answer). The sidecar's
payloads are computed once (SlotWave, merged adapter, `--threads`) and kept in `--hints` for reruns.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from pipeline.io import atomic_open, iter_jsonl  # noqa: E402
from pipeline.runtime.budget import CostCurve, TreeBudget  # noqa: E402

METHODS = ("toolspec", "ooo", "ooo-oracle")


def ar_rows(path: Path, target: str) -> list[dict]:
    """The `ar` rows of `target` in an eval run's rows.jsonl, in file order (one per request)."""
    rows, seen = [], set()
    for _, r in iter_jsonl(path):  # a malformed line: InputError naming the file and line
        if r.get("method") == "ar" and r.get("target") == target and r["request_id"] not in seen:
            seen.add(r["request_id"])
            rows.append(r)
    if not rows:
        raise SystemExit(f"{path}: no ar rows of target {target!r}")
    return rows


def category(hint: dict | None, own: dict | None) -> str:
    """How the hint compares with the target's own call (both payloads: tool_index, arguments)."""
    if own is None:
        return "no call"
    if hint is None:
        return "no hint"
    if hint.get("tool_index") != own.get("tool_index"):
        return "another tool"
    return "exact" if hint.get("arguments") == own.get("arguments") else "right tool, other values"


def sidecar_hints(requests: dict[str, dict], args) -> dict[str, dict | None]:
    import torch

    from pipeline.sidecar.wave import SlotWave

    torch.set_num_threads(args.threads)
    wave = SlotWave(args.sidecar_model, args.adapter, dtype=args.dtype, merge_adapter=True,
                    slot_tools=args.slot_tools)
    return {rid: wave.predict(req).payload for rid, req in tqdm(requests.items(), desc="waves", unit="req")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=Path, required=True, help="an eval run's rows.jsonl (its ar rows are replayed)")
    ap.add_argument("--target", required=True, help="the target's name in the rows")
    ap.add_argument("--tokenizer", required=True, help="the target's model folder (its tokenizer)")
    ap.add_argument("--curve", required=True, help="a cost-curve JSON (CostCurve.as_dict), or 'flat'")
    ap.add_argument("--sidecar-model", default="checkpoints/base/smollm2-135m-instruct")
    ap.add_argument("--adapter", default=None, help="the sidecar's adapter (not needed with an existing --hints)")
    ap.add_argument("--slot-tools", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hints", type=Path, default=None, help="payloads by request id: read if it exists, else written")
    ap.add_argument("--requests-root", type=Path, default=Path("data/requests"))
    ap.add_argument("--out", type=Path, default=None, help="per-request results as JSON")
    ap.add_argument("--draft-s", type=float, default=0.008,
                    help="drafting seconds charged per drafted round (fixed, so two replays compare exactly; "
                         "'-1' = the measured drafting time, which varies with the machine's load)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from pipeline.parsers import parse_calls
    from pipeline.payload import payload_from_call
    from pipeline.requests import load_requests
    from pipeline.runtime import Ready, generate
    from pipeline.runtime.replay import ReplayTarget

    rows = ar_rows(args.rows, args.target)
    wanted = {r["request_id"] for r in rows}
    requests = {r["id"]: r for path in sorted(args.requests_root.glob("*/*.jsonl")) if path.name != "rejected.jsonl"
                for r in load_requests(path) if r["id"] in wanted}
    missing = wanted - set(requests)
    if missing:
        raise SystemExit(f"{args.requests_root}: {len(missing)} replayed requests not found, e.g. {sorted(missing)[0]}")
    curve = CostCurve.flat() if args.curve == "flat" else CostCurve.from_dict(json.loads(Path(args.curve).read_text()))
    if args.hints is not None and args.hints.is_file():
        hints = json.loads(args.hints.read_text())
    else:
        if args.adapter is None:
            raise SystemExit("--adapter is required to compute the hints (or pass an existing --hints file)")
        hints = sidecar_hints({r["request_id"]: requests[r["request_id"]] for r in rows}, args)
        if args.hints is not None:
            with atomic_open(args.hints) as f:
                json.dump(hints, f)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    outputs = {r["request_id"]: r["text"] for r in rows}
    per: dict[str, dict] = {}
    for r in rows:
        rid, req = r["request_id"], requests[r["request_id"]]
        calls = parse_calls(r["text"], lenient=True).calls
        own = payload_from_call(calls[0], req.get("tools") or []) if calls else None
        per[rid] = {"category": category(hints.get(rid), own)}
    for method in METHODS:
        target = ReplayTarget(tok, outputs, curve=curve)
        target.budgets[method] = TreeBudget(curve, draft_s=None if args.draft_s < 0 else args.draft_s)
        for r in tqdm(rows, desc=method, unit="req"):
            rid, before = r["request_id"], target.simulated_s
            hint = Ready(hints.get(rid)) if method == "ooo" else None
            res = generate(target, requests[rid], method, sidecar=hint, oracle=outputs[rid] if method == "ooo-oracle"
                           else None, max_new_tokens=512)
            if res.text != outputs[rid]:
                raise SystemExit(f"{rid}: {method} replayed {res.text!r}, recorded {outputs[rid]!r}")
            per[rid][method] = {"forwards": res.stats.forwards, "seconds": round(target.simulated_s - before, 4),
                                "hint_tokens": res.stats.hint_tokens}
    cats = sorted({p["category"] for p in per.values()}, key=lambda c: -sum(p["category"] == c for p in per.values()))
    print(f"{len(rows)} recorded {args.target} outputs of {args.rows}, curve {args.curve}; forwards (simulated decode s)")
    print("| hint vs the target's call | requests | " + " | ".join(METHODS) + " | ooo's share of oracle's gain |")
    print("|---|---|" + "---|" * len(METHODS) + "---|")
    for c in cats + ["all"]:
        sel = [p for p in per.values() if c in ("all", p["category"])]
        f = {m: sum(p[m]["forwards"] for p in sel) for m in METHODS}
        s = {m: sum(p[m]["seconds"] for p in sel) for m in METHODS}
        gain = s["toolspec"] - s["ooo-oracle"]
        share = f"{(s['toolspec'] - s['ooo']) / gain:.0%}" if gain > 0.05 * s["toolspec"] else "-"
        print(f"| {c} | {len(sel)} | " + " | ".join(f"{f[m]} ({s[m]:.1f})" for m in METHODS) + f" | {share} |")
    if args.out is not None:
        with atomic_open(args.out) as f:
            json.dump({"rows": str(args.rows), "target": args.target, "curve": args.curve, "adapter": args.adapter,
                       "requests": per}, f, indent=1)


if __name__ == "__main__":
    main()
