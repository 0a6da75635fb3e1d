"""The eval report: per-request rows -> summary table (md/csv/json) and plots, always recomputed from the rows.

Run as: python -m pipeline.report eval/results/<run>      (`make report RUN=<run>`)

A row is one (target, benchmark, request, method) decode written by the `eval` stage. Nothing in a row's
summary is trusted: speedups are ratios of summed wall times against the same target's `ar` rows on the same
requests (with a bootstrap interval over requests), "identical to ar" compares token-id digests, and the target's
tool-call accuracy is re-parsed from the `ar` text against the request's gold.
"""

from __future__ import annotations

import argparse
import csv
import io
import random
import statistics
from collections import defaultdict
from pathlib import Path

from .io import atomic_open, read_jsonl, write_json

METHOD_ORDER = ["ar", "pld", "toolspec", "ooo", "ooo-oracle", "hf-pld", "hf-assisted"]


def _sorted_methods(methods) -> list[str]:
    return sorted(methods, key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), m))


def bootstrap_ratio(num: list[float], den: list[float], n: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% interval of sum(num)/sum(den) resampling paired requests."""
    if len(num) < 2:
        r = sum(num) / sum(den) if sum(den) else float("nan")
        return r, r
    rng = random.Random(seed)
    k = len(num)
    ratios = []
    for _ in range(n):
        idx = [rng.randrange(k) for _ in range(k)]
        d = sum(den[i] for i in idx)
        ratios.append(sum(num[i] for i in idx) / d if d else float("nan"))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def call_correct(text: str, request_gold: list[dict], gold_accept: list[dict] | None) -> bool | None:
    """Is the first call in `text` right (BFCL acceptable values where given)? None when there is no gold."""
    from .parsers import parse_calls
    from .scoring import call_accepted

    if not request_gold:
        return None
    calls = parse_calls(text).calls
    if not calls:
        return False
    return call_accepted(calls[0], request_gold, gold_accept)


def summarize(rows: list[dict], n_boot: int = 1000) -> dict:
    cells: dict[tuple, dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        cells[(r["target"], r["benchmark"])][r["method"]][r["request_id"]] = r
    out = {"cells": [], "mean_over_cells": {}}
    per_method_speedups: dict[str, list[float]] = defaultdict(list)
    for (target, bench), by_method in sorted(cells.items()):
        ar = by_method.get("ar", {})
        cell = {"target": target, "benchmark": bench, "placement": None, "methods": {}}
        if ar:
            judged = [call_correct(r["text"], r.get("gold", []), r.get("gold_accept")) for r in ar.values()]
            judged = [j for j in judged if j is not None]
            cell["call_accuracy"] = round(sum(judged) / len(judged), 4) if judged else None
            cell["call_accuracy_n"] = len(judged)
        for method in _sorted_methods(by_method):
            mrows = by_method[method]
            common = sorted(set(mrows) & set(ar))
            m = {"requests": len(mrows)}
            placements = {r.get("placement") for r in mrows.values()}
            m["placement"] = ",".join(sorted(p for p in placements if p))
            new = sum(r["new_tokens"] for r in mrows.values())
            fwd = sum(r["forwards"] for r in mrows.values())
            m["mean_accepted"] = round(new / fwd, 3) if fwd else None
            if common:
                ar_wall = [ar[i]["wall_s"] for i in common]
                me_wall = [mrows[i]["wall_s"] for i in common]
                m["speedup"] = round(sum(ar_wall) / sum(me_wall), 3)
                lo, hi = bootstrap_ratio(ar_wall, me_wall, n_boot)
                m["speedup_ci"] = [round(lo, 3), round(hi, 3)]
                ar_dec = [ar[i]["decode_s"] for i in common]
                me_dec = [mrows[i]["decode_s"] for i in common]
                m["decode_speedup"] = round(sum(ar_dec) / sum(me_dec), 3) if sum(me_dec) else None
                same = [mrows[i]["token_digest"] == ar[i]["token_digest"] for i in common]
                m["identical_to_ar"] = round(sum(same) / len(same), 4)
                m["differs_from_ar"] = [i for i, s in zip(common, same) if not s]
                per_method_speedups[method].append(m["speedup"])
            if any(r.get("hint_ready_s") is not None for r in mrows.values()) or method.startswith("ooo"):
                ready = [r["hint_ready_s"] for r in mrows.values() if r.get("hint_ready_s") is not None]
                m["hint_ready_s_median"] = round(statistics.median(ready), 3) if ready else None
                m["hint_ready_share"] = round(len(ready) / len(mrows), 4)
                m["hint_accepted_share"] = round(sum(r.get("hint_tokens_accepted", 0) for r in mrows.values())
                                                 / new, 4) if new else None
                pb = [r["payload_bytes"] for r in mrows.values() if r.get("payload_bytes")]
                m["payload_bytes_mean"] = round(statistics.fmean(pb), 1) if pb else None
                # the target's own time to its first argument value (from its ar decode): a hint that is ready
                # later than this can only help with the values that come after
                first = [r["first_value_s"] for r in ar.values() if r.get("first_value_s") is not None]
                m["first_value_s_median"] = round(statistics.median(first), 3) if first else None
            cell["methods"][method] = m
        out["cells"].append(cell)
    out["mean_over_cells"] = {m: round(statistics.fmean(v), 3) for m, v in per_method_speedups.items()}
    return out


def to_markdown(summary: dict, title: str = "") -> str:
    lines = [f"# {title}" if title else "# Eval summary", ""]
    lines.append("| target | benchmark | method | n | speedup vs ar (95% CI) | decode speedup | accepted/forward "
                 "| identical to ar | hint ready (median s) | first value (median s) | hint tokens accepted "
                 "| payload bytes |")
    lines.append("|" + "---|" * 12)
    for cell in summary["cells"]:
        for method, m in cell["methods"].items():
            ci = m.get("speedup_ci")
            sp = f"{m['speedup']:.2f}x ({ci[0]:.2f}-{ci[1]:.2f})" if m.get("speedup") is not None else "-"
            fmt = lambda v, f="{:.2f}": f.format(v) if v is not None else "-"
            lines.append(f"| {cell['target']} | {cell['benchmark']} | {method} | {m['requests']} | {sp} | "
                         f"{fmt(m.get('decode_speedup'), '{:.2f}x')} | {fmt(m.get('mean_accepted'))} | "
                         f"{fmt(m.get('identical_to_ar'), '{:.0%}')} | {fmt(m.get('hint_ready_s_median'))} | "
                         f"{fmt(m.get('first_value_s_median'))} | {fmt(m.get('hint_accepted_share'), '{:.0%}')} | "
                         f"{fmt(m.get('payload_bytes_mean'), '{:.0f}')} |")
    lines += ["", "## Target tool-call accuracy (ar output vs gold)", "", "| target | benchmark | accuracy | n |",
              "|---|---|---|---|"]
    for cell in summary["cells"]:
        acc = cell.get("call_accuracy")
        lines.append(f"| {cell['target']} | {cell['benchmark']} | {'-' if acc is None else f'{acc:.0%}'} | "
                     f"{cell.get('call_accuracy_n', 0)} |")
    lines += ["", "## Mean speedup over cells (unweighted, as the paper reports)", "", "| method | mean speedup |",
              "|---|---|"]
    for method in _sorted_methods(summary["mean_over_cells"]):
        lines.append(f"| {method} | {summary['mean_over_cells'][method]:.2f}x |")
    flagged = [(c["target"], c["benchmark"], meth, m["differs_from_ar"]) for c in summary["cells"]
               for meth, m in c["methods"].items() if m.get("differs_from_ar")]
    if flagged:
        lines += ["", "## Outputs that differ from ar (flagged)", ""]
        for target, bench, meth, ids in flagged:
            lines.append(f"- {target} / {bench} / {meth}: {len(ids)} request(s): {', '.join(ids[:10])}")
    return "\n".join(lines) + "\n"


def to_csv(summary: dict) -> str:
    buf = io.StringIO()
    fields = ["target", "benchmark", "method", "requests", "speedup", "speedup_ci_low", "speedup_ci_high",
              "decode_speedup", "mean_accepted", "identical_to_ar", "hint_ready_s_median", "first_value_s_median",
              "hint_accepted_share", "payload_bytes_mean", "call_accuracy", "placement"]
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    for cell in summary["cells"]:
        for method, m in cell["methods"].items():
            ci = m.get("speedup_ci") or [None, None]
            w.writerow({"target": cell["target"], "benchmark": cell["benchmark"], "method": method,
                        "requests": m["requests"], "speedup": m.get("speedup"), "speedup_ci_low": ci[0],
                        "speedup_ci_high": ci[1], "decode_speedup": m.get("decode_speedup"),
                        "mean_accepted": m.get("mean_accepted"), "identical_to_ar": m.get("identical_to_ar"),
                        "hint_ready_s_median": m.get("hint_ready_s_median"),
                        "first_value_s_median": m.get("first_value_s_median"),
                        "hint_accepted_share": m.get("hint_accepted_share"),
                        "payload_bytes_mean": m.get("payload_bytes_mean"),
                        "call_accuracy": cell.get("call_accuracy"), "placement": m.get("placement")})
    return buf.getvalue()


def plot(summary: dict, rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    cells = summary["cells"]
    methods = _sorted_methods({m for c in cells for m in c["methods"] if m != "ar"})
    if cells and methods:
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cells)), 4))
        width = 0.8 / len(methods)
        for j, meth in enumerate(methods):
            ys = [c["methods"].get(meth, {}).get("speedup") or 0 for c in cells]
            ax.bar([i + j * width for i in range(len(cells))], ys, width, label=meth)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))])
        ax.set_xticklabels([f"{c['target']}\n{c['benchmark']}" for c in cells], fontsize=8)
        ax.set_ylabel("speedup over ar (wall time)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / "speedup.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    acc = defaultdict(list)
    for r in rows:
        acc[r["method"]].extend(r.get("accepted_lengths") or [])
    if acc:
        fig, ax = plt.subplots(figsize=(7, 4))
        top = max(max(v) for v in acc.values() if v) if any(acc.values()) else 1
        for meth in _sorted_methods(acc):
            if acc[meth]:
                ax.hist(acc[meth], bins=range(1, top + 2), histtype="step", density=True, label=meth)
        ax.set_xlabel("tokens accepted per target forward")
        ax.set_ylabel("share of forwards")
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / "accepted_length.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def render(run_dir: str | Path, n_boot: int = 1000) -> dict:
    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "rows.jsonl")
    summary = summarize(rows, n_boot)
    write_json(run_dir / "summary.json", summary)
    with atomic_open(run_dir / "summary.md") as f:
        f.write(to_markdown(summary, title=f"Eval {run_dir.name}"))
    with atomic_open(run_dir / "summary.csv") as f:
        f.write(to_csv(summary))
    plot(summary, rows, run_dir)
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.report", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--bootstrap", type=int, default=1000)
    args = ap.parse_args(argv)
    render(args.run_dir, args.bootstrap)
    print((Path(args.run_dir) / "summary.md").read_text())


if __name__ == "__main__":
    main()
