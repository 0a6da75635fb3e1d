"""Smoke check of the runtime: tiny targets of every family, every method, outputs identical to `ar`.

Run as: .venv/bin/python scripts/smoke_runtime.py [--requests tests/fixtures/requests.jsonl] [--max-new-tokens 32]

Each tiny target is a random 2-layer model in float64 whose weights are drawn with a large scale, so that its
greedy text varies with the context (`pipeline.testing.tiny_target`); `ooo` gets the request's gold call from a
sidecar process. Every method runs through the eval's runner (pipeline/eval/runner.py). A replay target (the gold call
written as a fenced JSON block) then shows the drafters' acceptance on a realistic output. Exits 1 when any output
differs from `ar`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.io import read_jsonl  # noqa: E402
from pipeline.eval.runner import Runner  # noqa: E402
from pipeline.runtime import Ready, generate  # noqa: E402
from pipeline.runtime.loop import METHODS  # noqa: E402
from pipeline.payload import gold_payload  # noqa: E402
from pipeline.runtime.replay import ReplayTarget  # noqa: E402
from pipeline.testing import FAMILIES, make_tokenizer, tiny_target  # noqa: E402


def run(requests: list[dict], max_new_tokens: int) -> int:
    """Every method through the runner (the same one `make eval` uses) on tiny targets; then the replay target."""
    import torch

    torch.set_num_threads(1)
    tok = make_tokenizer()
    failures = 0
    variants = None
    for family in FAMILIES:
        target = tiny_target(family, tok)
        runner = Runner(target, list(METHODS), run="smoke", schedules=["adaptive", "split"],
                        sidecar={"wave": gold_payload}, max_new_tokens=max_new_tokens, threads=1)
        try:
            runner.warmup(requests[0], max_new_tokens=4)
            for req in requests:
                rows = {r["variant"]: r for r in runner.run("fixture", req)}
                if variants is None:
                    variants = sorted(rows, key=lambda v: (v != "ar", v))
                    print(f"{'target':12} {'request':12} " + " ".join(f"{v:>14}" for v in variants))
                cells = []
                for v in variants:
                    same = rows[v]["token_digest"] == rows["ar"]["token_digest"]
                    failures += not same
                    cells.append(f"{'ok' if same else 'DIFF'} {rows[v]['new_tokens'] / rows[v]['forwards']:5.2f}/fwd")
                print(f"{target.name:12} {req['id']:12} " + " ".join(f"{c:>14}" for c in cells))
        finally:
            runner.close()
    outputs = {r["id"]: "```json\n" + json.dumps(r["gold"][0], indent=2) + "\n```" for r in requests if r.get("gold")}
    replay = ReplayTarget(tok, outputs)
    for req in requests:
        if req["id"] not in outputs:
            continue
        cells = []
        for method in METHODS:
            hint = Ready(gold_payload(req)) if method == "ooo" else None
            res = generate(replay, req, method, sidecar=hint, max_new_tokens=4 * max_new_tokens)
            same = res.token_ids == replay.outputs[req["id"]][:len(res.token_ids)]
            failures += not same
            cells.append(f"{'ok' if same else 'DIFF'} {res.stats.mean_accepted:5.2f}/fwd")
        print(f"{'replay':12} {req['id']:12} " + " ".join(f"{c:>14}" for c in cells))
    print("smoke: all outputs identical to ar" if not failures else f"smoke: {failures} outputs differ from ar")
    return 1 if failures else 0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="tests/fixtures/requests.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    sys.exit(run(read_jsonl(args.requests), args.max_new_tokens))


if __name__ == "__main__":
    main()
