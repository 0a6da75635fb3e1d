"""Agent turns: each request re-sent as the next turn of its own conversation, for an eval where decode dominates.

Run as: python scripts/agent_turns.py --rows eval/results/cpu-llamacpp/rows.jsonl \
            --target qwen2.5-coder-1.5b-instruct-llamacpp [--per-benchmark 2] [--out data/requests-turns]
        make eval RECIPE=recipes/eval/cpu-llamacpp-turns.yaml

An agent calls a tool, reads the result and often calls again: the second request carries the first one's prompt and
the target's answer, then a short new user message. For `--per-benchmark` evenly spaced requests of each benchmark
with an `ar` row of `--target` in `--rows`, writes two request files per benchmark under `--out`:
    <benchmark>/test.jsonl         the original requests (turn 1), unchanged
    <benchmark>-turn2/test.jsonl   the same conversations + the target's own `ar` answer as the assistant turn + a short
                                   user message asking for the call again (ids `<id>/turn2`; tools and gold unchanged)
An eval recipe that lists `<benchmark>` before `<benchmark>-turn2` (round-robin order) decodes each turn 1 right before
its turn 2, so turn 2's prefill reads turn 1's prompt from the prefix cache (every method alike) and prefills only the
answer and the new message: what stays is mostly decode. Compare the methods on the `-turn2` benchmarks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.io import InputError, iter_jsonl, write_jsonl, write_manifest  # noqa: E402
from pipeline.requests import load_requests, sample  # noqa: E402

FOLLOW_UP = "The service timed out and returned nothing. Please make the same call again."


def answers(rows_path: Path, target: str) -> dict[str, str]:
    """request id -> the text of `target`'s `ar` row (the answer turn 2 carries)."""
    out = {}
    for lineno, row in iter_jsonl(rows_path):
        if row.get("target") == target and row.get("method") == "ar":
            if not isinstance(row.get("text"), str):
                raise InputError(f"{rows_path}:{lineno}: the ar row of {row.get('request_id')} has no text")
            out[row["request_id"]] = row["text"]
    if not out:
        raise InputError(f"{rows_path}: no ar row of target {target!r} (targets are named by the eval recipe)")
    return out


def second_turn(request: dict, answer: str, follow_up: str = FOLLOW_UP) -> dict:
    """The request's conversation one turn later: its messages, the target's answer, a new user message."""
    messages = request["messages"] + [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
    return {**request, "id": f"{request['id']}/turn2", "messages": messages}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=Path, required=True, help="an eval run's rows.jsonl with ar rows of --target")
    ap.add_argument("--target", required=True, help="the target's name in that run")
    ap.add_argument("--requests-root", type=Path, default=Path("data/requests"))
    ap.add_argument("--split", default="test")
    ap.add_argument("--per-benchmark", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("data/requests-turns"))
    args = ap.parse_args(argv)

    done = answers(args.rows, args.target)
    inputs = [args.rows]
    for bench in sorted(p.name for p in args.requests_root.iterdir() if (p / f"{args.split}.jsonl").is_file()):
        path = args.requests_root / bench / f"{args.split}.jsonl"
        have = [r for r in load_requests(path) if r["id"] in done]
        if not have:
            continue
        inputs.append(path)
        picked = sample(have, args.per_benchmark, "even", 0)
        write_jsonl(args.out / bench / f"{args.split}.jsonl", picked)
        write_jsonl(args.out / f"{bench}-turn2" / f"{args.split}.jsonl",
                    [second_turn(r, done[r["id"]]) for r in picked])
        print(f"{bench}: {len(picked)} requests and their second turns")
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"follow_up": FOLLOW_UP}
    write_manifest(args.out, "agent_turns", config, inputs)


if __name__ == "__main__":
    main()
