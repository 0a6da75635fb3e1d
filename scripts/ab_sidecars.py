"""Sidecars side by side in real time: `ooo` with each sidecar on the same requests, runs interleaved, one table.

Run as: .venv/bin/python scripts/ab_sidecars.py --name ab16t-s17 \
            --sidecar v9=checkpoints/sidecar/smollm2-135m-cpu-v9 \
            --sidecar q05=checkpoints/sidecar/qwen2.5-coder-0.5b-cpu [--rounds 2] \
            [--sidecar v9st1=checkpoints/sidecar/smollm2-135m-cpu-v9,eval.sidecar.slot_tools=1] \
            [--recipe recipes/eval/sidecar-ab.yaml] [--copy-from eval/results/<run>] [eval.key=value ...]
        .venv/bin/python scripts/ab_sidecars.py --table eval/results/<run> eval/results/<run> ...   (print only)

Every round runs each sidecar once as its own eval run, `eval/results/sidecar-<name>-<label>` (`-r2`, `-r3` ... for
later rounds), in the order A B, then B A in the next round, so a drift of the machine over the window falls on both.
The first run measures every method of the recipe (`ar`, `toolspec`, ...); every later run starts from a copy of its
rows without a sidecar, so only `ooo` is measured again (`--copy-from` names an earlier run to take them from instead,
measured on this machine: its rows are then not measured in this window, and the output says so). A sidecar's base model
is its adapter's `base_model_name_or_path`; overrides after its folder (`,eval.key=value`) apply to its runs only, so
one adapter can run under two settings. A run that already has rows resumes (the eval skips finished rows).

Prints, per run and variant: requests, wall / prefill / decode seconds summed over the requests, target forwards, the
waves' CPU seconds, the exclusive hint share of the drafted tokens (`hint_tokens_accepted / draft_tokens`, the
report's figure), outputs identical to `ar`, and busy rows (`pipeline.eval.report.busy`); the variants without a sidecar
once, from the first run (the later runs hold copies); then each run's `ooo` wall time over the first run's, and each
method without a sidecar over each run's `ooo` (its speedup). Only requests that every run finished are counted.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.io import InputError, atomic_open, dumps, read_json, read_jsonl  # noqa: E402
from pipeline.eval.report import busy, machine_line  # noqa: E402
from pipeline.sidecar.accuracy import base_model_of  # noqa: E402

RESULTS = Path("eval/results")


def load_rows(run_dir: Path) -> list[dict]:
    """A run's rows: rows.jsonl, or rows.jsonl.partial while (or after) its eval was interrupted."""
    for name in ("rows.jsonl", "rows.jsonl.partial"):
        if (run_dir / name).is_file():
            return read_jsonl(run_dir / name)
    return []


def run_table(runs: dict[str, list[dict]]) -> tuple[list[dict], int]:
    """One line per (run, variant) over the requests every run finished with every variant it has; and their count."""
    done = [{r["request_id"] for r in rows if r["variant"].startswith("ooo")} for rows in runs.values()]
    common = set.intersection(*done) if done else set()
    lines = []
    for n, (run, rows) in enumerate(runs.items()):
        ar = {r["request_id"]: r["token_digest"] for r in rows if r["variant"] == "ar"}
        by_variant = defaultdict(list)
        for r in rows:
            if r["request_id"] in common:
                by_variant[r["variant"]].append(r)
        for variant in sorted(by_variant):
            if n and not variant.startswith("ooo"):
                continue  # the later runs' rows without a sidecar are the first run's, copied
            vrows = by_variant[variant]
            drafted = sum(r.get("draft_tokens") or 0 for r in vrows)
            hint = sum(r.get("hint_tokens_accepted") or 0 for r in vrows)
            lines.append({
                "run": run, "variant": variant, "requests": len(vrows),
                "wall_s": sum(r["wall_s"] for r in vrows), "prefill_s": sum(r["prefill_s"] for r in vrows),
                "decode_s": sum(r["decode_s"] for r in vrows), "forwards": sum(r["forwards"] for r in vrows),
                "wave_cpu_s": sum(r.get("sidecar_cpu_s") or 0.0 for r in vrows) if variant.startswith("ooo") else None,
                "hint_share": hint / drafted if variant.startswith("ooo") and drafted else None,
                "same_as_ar": sum(ar.get(r["request_id"]) == r["token_digest"] for r in vrows),
                "busy": sum(busy(r) is not None for r in vrows)})
    return lines, len(common)


def markdown(lines: list[dict], n_common: int) -> str:
    out = [f"{n_common} requests finished in every run; seconds summed over them.", "",
           "| run | variant | requests | wall s | prefill s | decode s | forwards | wave CPU-s | exclusive hint share "
           "| same as ar | busy |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in lines:
        wave = "-" if x["wave_cpu_s"] is None else f"{x['wave_cpu_s']:.1f}"
        share = "-" if x["hint_share"] is None else f"{100 * x['hint_share']:.1f}%"
        out.append(f"| {x['run']} | {x['variant']} | {x['requests']} | {x['wall_s']:.1f} | {x['prefill_s']:.1f} | "
                   f"{x['decode_s']:.1f} | {x['forwards']} | {wave} | {share} | {x['same_as_ar']}/{x['requests']} | "
                   f"{x['busy']} |")
    ooo = [x for x in lines if x["variant"].startswith("ooo")]
    peers = [x for x in lines if not x["variant"].startswith("ooo") and x["variant"] != "ar"]
    out.append("")
    for variant in sorted({x["variant"] for x in ooo}):  # each ooo variant across the runs
        same = [x for x in ooo if x["variant"] == variant]
        if len(same) > 1:
            out.append(f"`{variant}` wall time over {same[0]['run']}'s: "
                       + ", ".join(f"{x['run']} {x['wall_s'] / same[0]['wall_s']:.3f}" for x in same[1:]))
        for peer in peers:  # a method without a sidecar over each run's ooo, end to end
            out.append(f"`{peer['variant']}` wall time over `{variant}`'s: "
                       + ", ".join(f"{x['run']} {peer['wall_s'] / x['wall_s']:.3f}x" for x in same))
    return "\n".join(out)


def print_table(run_dirs: list[Path]) -> str:
    runs = {d.name: load_rows(d) for d in run_dirs}
    empty = [name for name, rows in runs.items() if not rows]
    if empty:
        raise InputError(f"no rows in {', '.join(empty)} (expected eval/results/<run>/rows.jsonl)")
    manifest = run_dirs[0] / "manifest.json"
    text = (machine_line(read_json(manifest).get("machine") if manifest.is_file() else None) + "\n\n"
            + markdown(*run_table(runs)))
    print(text)
    return text


def schedule(labels: list[str], rounds: int) -> list[tuple[str, int]]:
    """(label, round) in run order: A B, then B A, then A B ..."""
    order = []
    for k in range(1, rounds + 1):
        order += [(label, k) for label in (labels if k % 2 else labels[::-1])]
    return order


def seed_rows(source: Path, run_dir: Path) -> int:
    """Copy `source`'s rows without a sidecar (`ar`, `toolspec`, ...) into a run that has no rows yet."""
    if load_rows(run_dir):
        return 0
    rows = [r for r in load_rows(source) if not r["variant"].startswith("ooo")]
    with atomic_open(run_dir / "rows.jsonl") as f:
        f.writelines(dumps(r) + "\n" for r in rows)
    return len(rows)


def parse_sidecars(specs: list[str]) -> dict[str, tuple[Path, list[str]]]:
    """{label: (adapter folder, its own eval.key=value overrides)} of `LABEL=ADAPTER[,eval.key=value ...]` specs."""
    sidecars = {}
    for spec in specs:
        label, sep, rest = spec.partition("=")
        adapter, *own = rest.split(",")
        if not sep or not label or not adapter:
            raise InputError(f"--sidecar {spec!r}: expected LABEL=ADAPTER_FOLDER[,eval.key=value ...]")
        bad = [o for o in own if not o.startswith("eval.") or "=" not in o]
        if bad:
            raise InputError(f"--sidecar {spec!r}: {bad[0]!r} is not an eval.key=value override")
        if label in sidecars:
            raise InputError(f"--sidecar {spec!r}: the label {label!r} is given twice")
        base_model_of(adapter)  # the adapter folder must name its base model
        sidecars[label] = (Path(adapter), own)
    if len(sidecars) < 2:
        raise InputError("give at least two --sidecar LABEL=ADAPTER_FOLDER to compare")
    return sidecars


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", nargs="+", type=Path, help="print the table of these run folders and stop")
    ap.add_argument("--name", help="runs are eval/results/sidecar-<name>-<label>[-r<k>]")
    ap.add_argument("--sidecar", action="append", default=[],
                    help="LABEL=ADAPTER_FOLDER[,eval.key=value ...] (two or more; its overrides apply to its runs)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--recipe", default="recipes/eval/sidecar-ab.yaml")
    ap.add_argument("--copy-from", type=Path, help="take the rows without a sidecar from this earlier run")
    ap.add_argument("overrides", nargs="*", help="eval.key=value, passed to every run")
    args = ap.parse_args(argv)
    try:
        if args.table:
            print_table(args.table)
            return 0
        if not args.name:
            raise InputError("--name is required to run (or --table to print runs)")
        sidecars = parse_sidecars(args.sidecar)
        runs = []
        for label, k in schedule(list(sidecars), max(1, args.rounds)):
            run = f"sidecar-{args.name}-{label}" + (f"-r{k}" if k > 1 else "")
            source = args.copy_from or (RESULTS / runs[0] if runs else None)
            if source is not None:
                seeded = seed_rows(source, RESULTS / run)
                print(f"== {run}: {seeded} rows without a sidecar copied from {source}" if seeded else f"== {run}")
            else:
                print(f"== {run}: measures every method")
            adapter, own = sidecars[label]
            cmd = [sys.executable, "-m", "pipeline.stages.eval", "--recipe", args.recipe, f"eval.run={run}",
                   *args.overrides, f"eval.sidecar.model={base_model_of(adapter)}", f"eval.sidecar.adapter={adapter}",
                   *own]
            subprocess.run(cmd, check=True)
            runs.append(run)
        print_table([RESULTS / r for r in runs])
        if args.copy_from:
            made = args.copy_from / "manifest.json"
            when = read_json(made).get("created", "?") if made.is_file() else "?"
            print(f"The rows without a sidecar were measured by {args.copy_from} (created {when}), not in this window.")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
