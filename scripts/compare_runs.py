"""Two eval runs of the same requests side by side: CPU time per request and whether every output is unchanged.

Run as: .venv/bin/python scripts/compare_runs.py eval/results/prefill-ab-before eval/results/prefill-ab-after

For each run: the eval's CPU seconds per request (the target process's CPU time over every variant's row, plus its
sidecar worker's, as `measured` records them around each row) and its wall seconds per request; then the ratio, and
how many (target, benchmark, request, variant) rows have the same token digest in both runs (the outputs must not
change when only the measuring protocol does).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.io import read_jsonl  # noqa: E402


def per_request(rows: list[dict]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"cpu_s": 0.0, "wall_s": 0.0})
    for r in rows:
        m = r.get("measured") or {}
        key = f"{r['target']}|{r['benchmark']}|{r['request_id']}"
        out[key]["cpu_s"] += (m.get("cpu_s") or 0.0) + (m.get("sidecar_cpu_s") or 0.0)
        out[key]["wall_s"] += m.get("wall_s") or 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    args = ap.parse_args(argv)
    runs = {name: read_jsonl(Path(path) / "rows.jsonl") for name, path in (("before", args.before),
                                                                              ("after", args.after))}
    reqs = {name: per_request(rows) for name, rows in runs.items()}
    common = sorted(set(reqs["before"]) & set(reqs["after"]))
    if not common:
        sys.exit("compare_runs: the runs share no request")
    figures = {}
    for name in runs:
        cpu = sum(reqs[name][k]["cpu_s"] for k in common) / len(common)
        wall = sum(reqs[name][k]["wall_s"] for k in common) / len(common)
        figures[name] = (cpu, wall)
        print(f"{name:6}: {cpu:8.1f} CPU-s / request, {wall:8.1f} wall-s / request ({args.before if name == 'before' else args.after})")
    b, a = figures["before"], figures["after"]
    print(f"after / before: CPU {a[0] / b[0]:.3f} ({1 - a[0] / b[0]:+.1%} saved), wall {a[1] / b[1]:.3f}, "
          f"over {len(common)} requests")
    digest = {name: {r["key"]: r["token_digest"] for r in rows} for name, rows in runs.items()}
    keys = sorted(set(digest["before"]) & set(digest["after"]))
    same = sum(digest["before"][k] == digest["after"][k] for k in keys)
    print(f"outputs unchanged: {same}/{len(keys)} rows")
    for k in keys:
        if digest["before"][k] != digest["after"][k]:
            print(f"  differs: {k}")
    return 0 if same == len(keys) else 1


if __name__ == "__main__":
    sys.exit(main())
