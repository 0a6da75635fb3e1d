"""The eval report: per-request rows -> summary table (md/csv/json) and plots, always recomputed from the rows.

Run as: python -m pipeline.eval.report eval/results/<run>      (`make report RUN=<run>`)

A row is one (target, benchmark, request, variant) decode written by the runner (pipeline/eval/runner.py); a variant is a
method under a schedule (`ooo@adaptive`; baselines run on every core). Nothing in a row's summary is trusted:
speedups are ratios of summed times against the same target's `ar` rows on the same requests, end to end and for the
decode phase alone, with a bootstrap 95% interval over requests, once over all rows and once over the rows whose
tokens are identical to `ar`'s; "identical to ar" compares token-id digests (and names the first differing token);
upper bounds (`ooo-oracle`) are labelled and kept out of the means; for the hint, the share of rows whose hint was
rejected (with the reasons), late or never ready, the hint's share of accepted draft tokens, tokens drafted for a
tool other than the top one, and the sidecar's CPU seconds per request; the prefix cache's savings per benchmark; the
target's tool-call accuracy is re-parsed from the `ar` text against the request's gold.
"""

from __future__ import annotations

import argparse
import csv
import io
import random
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from ..hardware import gpu_line
from ..io import atomic_open, read_json, read_jsonl, write_json
from ..methods import METHOD_TABLE, PEERS, upper_bound
from ..methods import hint_outcome as outcome_of_hint

METHOD_ORDER = list(METHOD_TABLE) + list(PEERS)
BUSY_FOREIGN_CORES = 0.3  # other processes' CPU over a row, in cores: more means it shared the machine
BUSY_STEAL_CORES = 0.1    # CPU the hypervisor took away, in cores
PREFILL_RULE = ("Prefill: variants that prefill the same prompt on the same threads with no wave beside them (ar, pld, "
                "toolspec, ooo-oracle, and ooo@deferred, whose wave starts after the prefill) share one measured "
                "prefill per request (the KV restored, its seconds charged to each) and read the same prefix cache "
                "(never a request's own prompt); other ooo variants prefill themselves beside (adaptive) or after "
                "(sequential) their wave. The transformers peers (hf-pld, hf-assisted) prefill the whole prompt "
                "themselves without the prefix cache (transformers' candidate generation does not continue from a "
                "prefilled cache), so their end-to-end ratios are marked 'no prefix cache'; compare their decode "
                "ratios. hf-assisted's decode includes its draft model's own prompt pass.")


def busy(row: dict) -> str | None:
    """Why a row's timings cannot be trusted (another job shared the cores, or the hypervisor stole CPU), or None.

    Judged from the row's `measured` readings: the machine's busy CPU seconds minus this process's and its own sidecar
    worker's (measured around the row; else the wave's own CPU seconds), over the row's measured wall time."""
    m = row.get("measured") or {}
    wall = m.get("wall_s") or 0.0
    if not wall or m.get("machine_cpu_s") is None:
        return None
    own = m.get("sidecar_cpu_s") if m.get("sidecar_cpu_s") is not None else row.get("sidecar_cpu_s")
    foreign = (m["machine_cpu_s"] - (m.get("cpu_s") or 0.0) - (own or 0.0)) / wall
    if foreign > BUSY_FOREIGN_CORES:
        return f"other processes used {foreign:.2f} cores"
    if (m.get("steal_s") or 0.0) / wall > BUSY_STEAL_CORES:
        return f"steal {m['steal_s'] / wall:.2f} cores"
    return None


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two outputs differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _sorted_methods(methods) -> list[str]:
    def key(v):
        m = v.split("@")[0]
        return (METHOD_ORDER.index(m) if m in METHOD_ORDER else len(METHOD_ORDER), v)
    return sorted(methods, key=key)


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
    from ..parsers import parse_calls
    from ..scoring import call_accepted

    if not request_gold:
        return None
    calls = parse_calls(text).calls
    if not calls:
        return False
    return call_accepted(calls[0], request_gold, gold_accept)


def _ratio(num: list[float], den: list[float], n_boot: int) -> dict | None:
    if not num or not sum(den):
        return None
    lo, hi = bootstrap_ratio(num, den, n_boot)
    return {"ratio": round(sum(num) / sum(den), 3), "ci": [round(lo, 3), round(hi, 3)], "n": len(num)}


def hint_outcome(row: dict) -> str:
    """A row's hint outcome (`methods.hint_outcome`)."""
    return outcome_of_hint(row.get("hint_error"), row.get("hint_ready_s"), row.get("hint_tokens_accepted"))


def summarize(rows: list[dict], n_boot: int = 1000) -> dict:
    cells: dict[tuple, dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        cells[(r["target"], r["benchmark"])][r.get("variant") or r["method"]][r["request_id"]] = r
    out = {"cells": [], "mean_over_cells": {}, "upper_bounds": {}, "prefix_cache": []}
    per_variant: dict[str, list[float]] = defaultdict(list)
    per_variant_dec: dict[str, list[float]] = defaultdict(list)
    per_bound: dict[str, list[float]] = defaultdict(list)
    for (target, bench), by_variant in sorted(cells.items()):
        ar = by_variant.get("ar", {})
        ts = by_variant.get("toolspec", {})
        assisted = by_variant.get("hf-assisted", {})
        cell = {"target": target, "benchmark": bench, "methods": {}}
        if ar:
            judged = [call_correct(r["text"], r.get("gold", []), r.get("gold_accept")) for r in ar.values()]
            judged = [j for j in judged if j is not None]
            cell["call_accuracy"] = round(sum(judged) / len(judged), 4) if judged else None
            cell["call_accuracy_n"] = len(judged)
            prompt = sum(r.get("prompt_tokens") or 0 for r in ar.values())
            cached = sum(r.get("cached_tokens") or 0 for r in ar.values())
            out["prefix_cache"].append({"target": target, "benchmark": bench, "requests": len(ar),
                                        "prompt_tokens": prompt, "cached_tokens": cached,
                                        "cached_share": round(cached / prompt, 4) if prompt else None,
                                        "ar_prefill_s_mean": round(statistics.fmean(r["prefill_s"] for r in ar.values()), 3)})
        for v in _sorted_methods(by_variant):
            mrows = by_variant[v]
            common = sorted(set(mrows) & set(ar))
            m = {"requests": len(mrows), "schedule": next(iter(mrows.values())).get("schedule", "all-cores"),
                 "upper_bound": upper_bound(v),
                 "no_prefix_cache": any(r.get("prefix_cache") is False for r in mrows.values())}
            new = sum(r["new_tokens"] for r in mrows.values())
            fwd = sum(r["forwards"] for r in mrows.values())
            m["mean_accepted"] = round(new / fwd, 3) if fwd else None
            sizes = [s for r in mrows.values() for s in r.get("tree_sizes") or []]
            m["tree_size_mean"] = round(statistics.fmean(sizes), 2) if sizes else None
            if common:
                same = [mrows[i]["token_digest"] == ar[i]["token_digest"] for i in common]
                ident = [i for i, ok in zip(common, same) if ok]
                m["identical_to_ar"] = round(sum(same) / len(same), 4)
                m["differs_from_ar"] = []
                for i, ok in zip(common, same):
                    if not ok:
                        at = first_difference(mrows[i].get("token_ids") or [], ar[i].get("token_ids") or [])
                        m["differs_from_ar"].append({"request_id": i, "first_token": at})
                for name, ids in (("all", common), ("identical", ident)):
                    m[f"e2e_{name}"] = _ratio([ar[i]["wall_s"] for i in ids], [mrows[i]["wall_s"] for i in ids], n_boot)
                    m[f"decode_{name}"] = _ratio([ar[i]["decode_s"] for i in ids], [mrows[i]["decode_s"] for i in ids],
                                                 n_boot)
                m["speedup"] = (m["e2e_all"] or {}).get("ratio")
                m["decode_speedup"] = (m["decode_all"] or {}).get("ratio")
                if m["upper_bound"]:
                    per_bound[v].append(m["speedup"])
                else:
                    per_variant[v].append(m["speedup"])
                    if m["decode_speedup"] is not None:
                        per_variant_dec[v].append(m["decode_speedup"])
            tcommon = sorted(set(mrows) & set(ts))
            if v.split("@")[0] == "ooo" and tcommon:
                m["vs_toolspec_e2e"] = _ratio([ts[i]["wall_s"] for i in tcommon], [mrows[i]["wall_s"] for i in tcommon],
                                              n_boot)
                m["vs_toolspec_decode"] = _ratio([ts[i]["decode_s"] for i in tcommon],
                                                 [mrows[i]["decode_s"] for i in tcommon], n_boot)
                # upper bound: this decode after toolspec's own prefill, as if the wave cost the target nothing
                m["vs_toolspec_e2e_free_wave"] = _ratio(
                    [ts[i]["wall_s"] for i in tcommon],
                    [ts[i]["wall_s"] - ts[i]["decode_s"] + mrows[i]["decode_s"] for i in tcommon], n_boot)
            acommon = sorted(set(mrows) & set(assisted))
            if v.split("@")[0] == "ooo" and acommon:
                m["vs_hf_assisted_e2e"] = _ratio([assisted[i]["wall_s"] for i in acommon],
                                                 [mrows[i]["wall_s"] for i in acommon], n_boot)
                m["vs_hf_assisted_decode"] = _ratio([assisted[i]["decode_s"] for i in acommon],
                                                    [mrows[i]["decode_s"] for i in acommon], n_boot)
            if v.split("@")[0].startswith("ooo"):
                outcomes = Counter(hint_outcome(r) for r in mrows.values())
                m["hint_outcomes"] = {k: round(c / len(mrows), 4) for k, c in sorted(outcomes.items())}
                reasons = Counter(r["hint_error"][:80] for r in mrows.values() if r.get("hint_error"))
                m["hint_reasons"] = dict(reasons.most_common(5))
                ready = [r["hint_ready_s"] for r in mrows.values() if r.get("hint_ready_s") is not None]
                m["hint_ready_s_median"] = round(statistics.median(ready), 3) if ready else None
                hint = sum(r.get("hint_tokens_accepted", 0) for r in mrows.values())  # only the hint had them
                shared = sum(r.get("hint_shared_tokens", 0) for r in mrows.values())
                drafted = sum(r.get("draft_tokens", 0) for r in mrows.values())
                m["hint_share_of_draft"] = round(hint / drafted, 4) if drafted else None  # exclusive hint tokens
                m["hint_shared_share_of_draft"] = round(shared / drafted, 4) if drafted else None
                m["hint_accepted_share"] = round(hint / new, 4) if new else None
                other = sum(r.get("hint_other_tokens", 0) for r in mrows.values())
                m["hint_other_tool_tokens"] = other
                pb = [r["payload_bytes"] for r in mrows.values() if r.get("payload_bytes")]
                m["payload_bytes_mean"] = round(statistics.fmean(pb), 1) if pb else None
                cpu = [r["sidecar_cpu_s"] for r in mrows.values() if r.get("sidecar_cpu_s") is not None]
                m["sidecar_cpu_s_mean"] = round(statistics.fmean(cpu), 3) if cpu else None
                first = [r["first_value_s"] for r in ar.values() if r.get("first_value_s") is not None]
                m["first_value_s_median"] = round(statistics.median(first), 3) if first else None
                paired = [(r.get("hint_ready_s"), ar[i]["first_value_s"]) for i, r in mrows.items()
                          if i in ar and ar[i].get("first_value_s") is not None]
                m["hint_before_first_value"] = round(sum(ready is not None and ready <= first
                                                         for ready, first in paired) / len(paired), 4) \
                    if paired else None  # the wave answered before `ar` of the same request began its first value
            cell["methods"][v] = m
        out["cells"].append(cell)
    out["mean_over_cells"] = {v: round(statistics.fmean(x), 3) for v, x in per_variant.items()}
    out["mean_decode_over_cells"] = {v: round(statistics.fmean(x), 3) for v, x in per_variant_dec.items()}
    out["cells_per_variant"] = {v: len(x) for v, x in per_variant.items()}
    out["upper_bounds"] = {v: round(statistics.fmean(x), 3) for v, x in per_bound.items()}
    out["targets"] = target_formats(rows)
    out["per_target"] = per_target_means(out["cells"])
    out["claim"] = claim(out["cells"], out["per_target"])
    return out


def verdict(ratio: dict | None) -> str | None:
    """"faster" / "slower" where the ratio's 95% interval lies wholly above / below 1, "level" where it holds 1."""
    if not ratio:
        return None
    lo, hi = ratio["ci"]
    return "faster" if lo > 1 else "slower" if hi < 1 else "level"


def claim(cells: list[dict], per_target: dict) -> dict:
    """The product's claim, judged cell by cell for every `ooo` schedule: faster than `toolspec` end to end, never
    slower than `ar`, the same output. target -> variant -> {"cells": benchmark -> verdicts, "vs_toolspec" /
    "vs_ar": counts of faster / level / slower cells, "slower_than_toolspec" / "slower_than_ar": the cells whose
    interval lies below 1, "mean_vs_toolspec_e2e", "identical_to_ar"}; "best" per target: the variant with the highest
    mean end-to-end ratio against `toolspec` over its benchmarks."""
    out: dict[str, dict] = {}
    for cell in cells:
        for v, m in cell["methods"].items():
            if v.split("@")[0] != "ooo" or "vs_toolspec_e2e" not in m:
                continue
            c = out.setdefault(cell["target"], {}).setdefault(v, {"cells": {}})
            c["cells"][cell["benchmark"]] = {"vs_toolspec_e2e": m["vs_toolspec_e2e"],
                                             "vs_toolspec": verdict(m["vs_toolspec_e2e"]),
                                             "vs_ar_e2e": m.get("e2e_all"), "vs_ar": verdict(m.get("e2e_all")),
                                             "identical_to_ar": m.get("identical_to_ar")}
    for target, by_v in out.items():
        for v, c in by_v.items():
            for peer in ("toolspec", "ar"):
                said = [x[f"vs_{peer}"] for x in c["cells"].values() if x[f"vs_{peer}"]]
                c[f"vs_{peer}"] = {k: said.count(k) for k in ("faster", "level", "slower")}
                c[f"slower_than_{peer}"] = sorted(b for b, x in c["cells"].items() if x[f"vs_{peer}"] == "slower")
            means = per_target.get(target, {}).get(v, {})
            c["mean_vs_toolspec_e2e"] = means.get("vs_toolspec_e2e")
            c["identical_to_ar"] = means.get("identical_to_ar")
        ranked = [v for v in by_v if by_v[v]["mean_vs_toolspec_e2e"] is not None]
        by_v_best = max(ranked, key=lambda v: by_v[v]["mean_vs_toolspec_e2e"]) if ranked else None
        out[target] = {"variants": by_v, "best": by_v_best}
    return out


PER_TARGET_KEYS = {  # per-target mean over benchmarks of these cell figures (a ratio's point value)
    "e2e": "speedup", "decode": "decode_speedup", "vs_toolspec_e2e": "vs_toolspec_e2e",
    "vs_toolspec_decode": "vs_toolspec_decode", "vs_toolspec_e2e_free_wave": "vs_toolspec_e2e_free_wave",
    "hint_share": "hint_share_of_draft",
    "sidecar_cpu_s": "sidecar_cpu_s_mean", "hint_before_first_value": "hint_before_first_value",
    "identical_to_ar": "identical_to_ar"}


def target_formats(rows: list[dict]) -> dict[str, dict]:
    """target -> its family, vocabulary size, call format and how often the hint's first rendering matched the
    token the target wrote first (from the `ar` rows that record them; rows of older runs have none)."""
    out: dict[str, dict] = {}
    for r in rows:
        if r.get("method") != "ar" or "family" not in r:
            continue
        t = out.setdefault(r["target"], {"family": r["family"], "vocab_size": r["vocab_size"],
                                         "call_format": r["call_format"], "matched": 0, "n": 0})
        if r.get("hint_opening_match") is not None:
            t["n"] += 1
            t["matched"] += bool(r["hint_opening_match"])
    return out


def per_target_means(cells: list[dict]) -> dict[str, dict[str, dict]]:
    """target -> variant -> unweighted means over that target's benchmarks (the issue's "mean over benchmarks" on
    one target), with the number of cells each mean covers."""
    acc: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for cell in cells:
        for v, m in cell["methods"].items():
            for name, key in PER_TARGET_KEYS.items():
                x = m.get(key)
                x = x.get("ratio") if isinstance(x, dict) else x
                if x is not None:
                    acc[cell["target"]][v][name].append(x)
    return {t: {v: {**{k: round(statistics.fmean(xs), 3) for k, xs in figs.items()},
                    "cells": max(map(len, figs.values()))} for v, figs in by_v.items()}
            for t, by_v in acc.items()}


def _r(d: dict | None) -> str:
    return "-" if not d else f"{d['ratio']:.2f}x ({d['ci'][0]:.2f}-{d['ci'][1]:.2f})"


def machine_line(machine: dict | None) -> str:
    """The hardware a run measured on, from its manifest (CPU model and flags, torch capability, dtype, threads)."""
    if not machine:
        return "Machine: not recorded (a run from before manifests named it)."
    cpu = machine.get("cpu") or {}
    gpu = f", {gpu_line(machine['gpu'])}" if machine.get("gpu") else ""
    return (f"Machine: {cpu.get('model', '?')}, {cpu.get('cores', '?')} cores, flags "
            f"{' '.join(cpu.get('flags') or []) or 'none of note'}, torch {machine.get('torch', '?')} CPU capability "
            f"{machine.get('torch_cpu_capability', '?')}{gpu}; dtype {machine.get('dtype', '?')}, "
            f"{machine.get('threads', '?')} threads.")


def wave_settings(sc: dict) -> str:
    """The wave's settings a sidecar identity records (`eval.sidecar_identity`), as a clause of the report's sidecar
    line: its code revision, weight format, staged tools and prefix cache; empty where none is recorded."""
    parts = [f"wave revision {sc['wave']}"] if sc.get("wave") is not None else []
    if sc.get("quantize"):
        parts.append(f"{sc['quantize']} linear layers (down_proj kept out)")
    elif sc.get("prepack"):
        parts.append("prepacked weights")
    if sc.get("slot_tools") is not None:
        parts.append(f"slots of the top {sc['slot_tools']} tool{'s' if sc['slot_tools'] != 1 else ''}")
    if sc.get("prefix_cache"):
        parts.append(f"prefix cache of {sc['prefix_cache']} tokens")
    return f"; {', '.join(parts)}" if parts else ""


def to_markdown(summary: dict, title: str = "") -> str:
    fmt = lambda v, f="{:.2f}": f.format(v) if v is not None else "-"  # noqa: E731
    lines = [f"# {title}" if title else "# Eval summary", "", machine_line(summary.get("machine")), ""]
    sc = summary.get("sidecar")
    if sc:
        lines += [f"Sidecar: {sc.get('model')} + adapter {sc.get('adapter') or 'none'} (adapter_model.safetensors "
                  f"sha256 {(sc.get('adapter_sha256') or '-')[:16]}"
                  f"{', merged into the base weights' if sc.get('merged') else ''}){wave_settings(sc)}; git commit "
                  f"{summary.get('git_commit') or '?'}.", ""]
    b = summary.get("busy_rows")
    if b:
        machines = "; ".join(f"{k} ({n} rows)" for k, n in b["machines"].items()) or "not recorded"
        kept = "kept in" if summary.get("busy_rows_kept") else "left out of"
        lines += [f"Rows: {b['rows']}, measured on {machines}. Busy rows: {b['busy']} ({b['rule']}), {kept} "
                  f"every table below" + (f": {', '.join(f'{v} {n}' for v, n in b['per_variant'].items())}"
                                          if b["per_variant"] else "") + ".", ""]
        if summary.get("with_busy_rows"):
            lines += ["Mean end to end over cells with the busy rows kept: " + ", ".join(
                f"{v} {x:.2f}x" for v, x in sorted(summary["with_busy_rows"]["mean_over_cells"].items())) + ".", ""]
    lines += claim_markdown(summary.get("claim") or {})
    lines += [PREFILL_RULE, "",
              "Ratios are summed `ar` wall time / summed method wall time on the same requests (95% bootstrap "
              "interval). Baselines run on every core; `ooo@<schedule>` names the schedule. Upper bounds are marked "
              "*(upper bound)* and kept out of the means.", "",
             "| target | benchmark | variant | n | end to end vs ar | decode vs ar | decode vs ar (identical rows) "
             "| tokens/forward | tree size | identical to ar |",
             "|" + "---|" * 10]
    for cell in summary["cells"]:
        for v, m in cell["methods"].items():
            name = f"{v} *(upper bound)*" if m.get("upper_bound") else \
                f"{v} *(no prefix cache)*" if m.get("no_prefix_cache") else v
            lines.append(f"| {cell['target']} | {cell['benchmark']} | {name} | {m['requests']} | "
                         f"{_r(m.get('e2e_all'))} | {_r(m.get('decode_all'))} | {_r(m.get('decode_identical'))} | "
                         f"{fmt(m.get('mean_accepted'))} | {fmt(m.get('tree_size_mean'), '{:.1f}')} | "
                         f"{fmt(m.get('identical_to_ar'), '{:.0%}')} |")
    lines += ["", "## ooo against toolspec and the hint", "",
              "| target | benchmark | variant | vs toolspec, end to end | vs toolspec, decode | vs toolspec, end to end "
              "if the wave were free *(upper bound)* | vs hf-assisted, end "
              "to end | vs hf-assisted, decode | hint-only share of accepted draft tokens (any hint) "
              "| other-tool hint tokens | hint outcomes | rejection reasons | hint ready (median s) "
              "| first value (median s) | hint ready before the first value | sidecar CPU s/request "
              "| payload bytes |", "|" + "---|" * 17]
    for cell in summary["cells"]:
        for v, m in cell["methods"].items():
            if "hint_outcomes" not in m:
                continue
            outcomes = ", ".join(f"{k} {c:.0%}" for k, c in m["hint_outcomes"].items())
            reasons = "; ".join(f"{k} ({c})" for k, c in m.get("hint_reasons", {}).items()) or "-"
            lines.append(f"| {cell['target']} | {cell['benchmark']} | {v} | {_r(m.get('vs_toolspec_e2e'))} | "
                         f"{_r(m.get('vs_toolspec_decode'))} | {_r(m.get('vs_toolspec_e2e_free_wave'))} | "
                         f"{_r(m.get('vs_hf_assisted_e2e'))} | "
                         f"{_r(m.get('vs_hf_assisted_decode'))} | {fmt(m.get('hint_share_of_draft'), '{:.0%}')} "
                         f"({fmt(m.get('hint_shared_share_of_draft'), '{:.0%}')}) | "
                         f"{m.get('hint_other_tool_tokens', 0)} | {outcomes} | {reasons} | "
                         f"{fmt(m.get('hint_ready_s_median'))} | {fmt(m.get('first_value_s_median'))} | "
                         f"{fmt(m.get('hint_before_first_value'), '{:.0%}')} | {fmt(m.get('sidecar_cpu_s_mean'))} | "
                         f"{fmt(m.get('payload_bytes_mean'), '{:.0f}')} |")
    lines += ["", "## Prefix cache (ar rows)", "", "| target | benchmark | requests | prompt tokens | from the cache "
              "| share | ar prefill mean s |", "|---|---|---|---|---|---|---|"]
    for p in summary.get("prefix_cache", []):
        lines.append(f"| {p['target']} | {p['benchmark']} | {p['requests']} | {p['prompt_tokens']} | "
                     f"{p['cached_tokens']} | {fmt(p['cached_share'], '{:.0%}')} | {p['ar_prefill_s_mean']:.2f} |")
    if summary.get("cost_curves"):
        lines += ["", "## Cost curves (one target forward of k tree tokens, s; the tree budget's input)", "",
                  "| target | " + " | ".join(f"k={k}" for k in next(iter(summary["cost_curves"].values()))["sizes"])
                  + " |", "|---|" + "---|" * len(next(iter(summary["cost_curves"].values()))["sizes"])]
        for t, c in summary["cost_curves"].items():
            lines.append(f"| {t} | " + " | ".join(f"{x:.3f}" for x in c["seconds"]) + " |")
    if summary.get("targets"):
        lines += ["", "## Targets (family, vocabulary, the call format the hint renders first)", "",
                  "| target | family | vocabulary | call format (opening, arguments key) | hint's first token = target's |",
                  "|---|---|---|---|---|"]
        for name, t in summary["targets"].items():
            rate = f"{t['matched']}/{t['n']}" if t["n"] else "-"
            lines.append(f"| {name} | {t['family']} | {t['vocab_size']} | `{t['call_format']}` | {rate} |")
    lines += ["", "## Target tool-call accuracy (ar output vs gold)", "", "| target | benchmark | accuracy | n |",
              "|---|---|---|---|"]
    for cell in summary["cells"]:
        acc = cell.get("call_accuracy")
        lines.append(f"| {cell['target']} | {cell['benchmark']} | {'-' if acc is None else f'{acc:.0%}'} | "
                     f"{cell.get('call_accuracy_n', 0)} |")
    lines += ["", "## Mean over cells (unweighted, as the paper reports)", ""]
    counts = summary.get("cells_per_variant", {})
    if len(set(counts.values())) > 1:
        lines += ["Variants were measured in different numbers of cells (column `cells`): their means are over "
                  "different targets or benchmarks and are not comparable with each other; compare them per target "
                  "(below).", ""]
    lines += ["| variant | cells | mean end to end | mean decode |", "|---|---|---|---|"]
    uncached = {v for c in summary["cells"] for v, m in c["methods"].items() if m.get("no_prefix_cache")}
    for v in _sorted_methods(summary["mean_over_cells"]):
        name = f"{v} *(no prefix cache)*" if v in uncached else v
        lines.append(f"| {name} | {counts.get(v, '-')} | {summary['mean_over_cells'][v]:.2f}x | "
                     f"{fmt(summary.get('mean_decode_over_cells', {}).get(v), '{:.2f}x')} |")
    for v, x in summary.get("upper_bounds", {}).items():
        lines.append(f"| {v} *(upper bound, not a method)* | - | {x:.2f}x | - |")
    if summary.get("per_target"):
        lines += ["", "## Mean over benchmarks, per target", "",
                  "| target | variant | cells | end to end vs ar | decode vs ar | vs toolspec, end to end | "
                  "vs toolspec, decode | vs toolspec, end to end if the wave were free *(upper bound)* | "
                  "exclusive hint share | hint ready before the first value | sidecar CPU s/request | "
                  "identical to ar |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
        for t, by_v in summary["per_target"].items():
            for v in _sorted_methods(by_v):
                f = by_v[v]
                name = f"{v} *(upper bound)*" if upper_bound(v) else f"{v} *(no prefix cache)*" if v in uncached else v
                lines.append(f"| {t} | {name} | {f['cells']} | {fmt(f.get('e2e'), '{:.2f}x')} | "
                             f"{fmt(f.get('decode'), '{:.2f}x')} | {fmt(f.get('vs_toolspec_e2e'), '{:.2f}x')} | "
                             f"{fmt(f.get('vs_toolspec_decode'), '{:.2f}x')} | "
                             f"{fmt(f.get('vs_toolspec_e2e_free_wave'), '{:.2f}x')} | {pct(f.get('hint_share'))} | "
                             f"{pct(f.get('hint_before_first_value'))} | {fmt(f.get('sidecar_cpu_s'))} | "
                             f"{pct(f.get('identical_to_ar'))} |")
    flagged = [(c["target"], c["benchmark"], v, m["differs_from_ar"]) for c in summary["cells"]
               for v, m in c["methods"].items() if m.get("differs_from_ar")]
    if flagged:
        lines += ["", "## Outputs that differ from ar (first differing token)", ""]
        for target, bench, v, diffs in flagged:
            items = ", ".join(f"{d['request_id']} @ {d['first_token']}" for d in diffs[:10])
            lines.append(f"- {target} / {bench} / {v}: {len(diffs)} request(s): {items}")
    return "\n".join(lines) + "\n"


def claim_markdown(judged: dict) -> list[str]:
    """The claim section of the report (`claim`): one line per target and `ooo` schedule."""
    if not judged:
        return []
    fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
    counts = lambda c: f"{c['faster']} / {c['level']} / {c['slower']}"  # noqa: E731
    lines = ["## The claim, cell by cell", "",
             "`ooo` against `toolspec` and `ar` end to end, per benchmark: a cell is *faster* or *slower* only where "
             "its 95% interval lies wholly above or below 1, else *level*. The claim: faster than `toolspec`, "
             "never slower than `ar`, the same output as `ar` (in bf16 up to near-ties between two tokens: the last "
             "section lists the outputs that differ). (best): the schedule with the highest mean against `toolspec`.",
             "",
             "| target | variant | mean vs toolspec, end to end | vs toolspec: faster / level / slower cells | "
             "slower than toolspec | vs ar: faster / level / slower cells | slower than ar | identical to ar |",
             "|" + "---|" * 8]
    for target, t in judged.items():
        for v in _sorted_methods(t["variants"]):
            c = t["variants"][v]
            name = f"**{v}** (best)" if v == t["best"] else v
            lines.append(f"| {target} | {name} | {fmt(c['mean_vs_toolspec_e2e'], '{:.2f}x')} | "
                         f"{counts(c['vs_toolspec'])} | {', '.join(c['slower_than_toolspec']) or 'none'} | "
                         f"{counts(c['vs_ar'])} | {', '.join(c['slower_than_ar']) or 'none'} | "
                         f"{fmt(c['identical_to_ar'], '{:.0%}')} |")
    return lines + [""]


def to_csv(summary: dict) -> str:
    buf = io.StringIO()
    fields = ["target", "benchmark", "variant", "schedule", "upper_bound", "requests", "e2e", "e2e_ci_low",
              "e2e_ci_high", "decode", "decode_ci_low", "decode_ci_high", "decode_identical", "mean_accepted",
              "tree_size_mean", "identical_to_ar", "vs_toolspec_decode", "hint_share_of_draft",
              "hint_other_tool_tokens", "hint_ready_s_median", "hint_before_first_value", "sidecar_cpu_s_mean",
              "payload_bytes_mean", "call_accuracy"]
    w = csv.DictWriter(buf, fieldnames=fields)
    w.writeheader()
    for cell in summary["cells"]:
        for v, m in cell["methods"].items():
            e, d = m.get("e2e_all") or {}, m.get("decode_all") or {}
            w.writerow({"target": cell["target"], "benchmark": cell["benchmark"], "variant": v,
                        "schedule": m.get("schedule"), "upper_bound": m.get("upper_bound"), "requests": m["requests"],
                        "e2e": e.get("ratio"), "e2e_ci_low": (e.get("ci") or [None])[0],
                        "e2e_ci_high": (e.get("ci") or [None, None])[1], "decode": d.get("ratio"),
                        "decode_ci_low": (d.get("ci") or [None])[0], "decode_ci_high": (d.get("ci") or [None, None])[1],
                        "decode_identical": (m.get("decode_identical") or {}).get("ratio"),
                        "mean_accepted": m.get("mean_accepted"), "tree_size_mean": m.get("tree_size_mean"),
                        "identical_to_ar": m.get("identical_to_ar"),
                        "vs_toolspec_decode": (m.get("vs_toolspec_decode") or {}).get("ratio"),
                        "hint_share_of_draft": m.get("hint_share_of_draft"),
                        "hint_other_tool_tokens": m.get("hint_other_tool_tokens"),
                        "hint_ready_s_median": m.get("hint_ready_s_median"),
                        "hint_before_first_value": m.get("hint_before_first_value"),
                        "sidecar_cpu_s_mean": m.get("sidecar_cpu_s_mean"),
                        "payload_bytes_mean": m.get("payload_bytes_mean"), "call_accuracy": cell.get("call_accuracy")})
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
        acc[r.get("variant") or r["method"]].extend(r.get("accepted_lengths") or [])
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


def busy_summary(rows: list[dict]) -> dict:
    """Busy rows per variant, the reasons, and the machines the rows ran on (rows accumulate over sessions)."""
    flagged = [(r, busy(r)) for r in rows]
    per_variant = Counter(r.get("variant") or r["method"] for r, why in flagged if why)
    machines = Counter(" / ".join(str(x) for x in ((r.get("machine") or {}).get("cpu"),
                                                   " ".join((r.get("machine") or {}).get("flags") or []),
                                                   (r.get("machine") or {}).get("dtype"),
                                                   f"torch {(r.get('machine') or {}).get('torch')}",
                                                   gpu_line((r.get("machine") or {}).get("gpu"))) if x != "")
                       for r in rows if r.get("machine"))
    util = defaultdict(list)
    for r in rows:
        m = r.get("measured") or {}
        if m.get("wall_s") and m.get("cpu_s") is not None and r.get("threads"):
            util[r.get("variant") or r["method"]].append(m["cpu_s"] / m["wall_s"] / r["threads"])
    return {"rows": len(rows), "busy": sum(1 for _, why in flagged if why), "per_variant": dict(per_variant),
            "examples": [f"{r['key']}: {why}" for r, why in flagged if why][:10], "machines": dict(machines),
            "utilization": {v: round(statistics.fmean(x), 3) for v, x in util.items()},
            "rule": f"a row is busy when other processes used more than {BUSY_FOREIGN_CORES} cores on average while "
                    f"it ran (/proc/stat busy time minus this process and its own wave) or steal exceeded "
                    f"{BUSY_STEAL_CORES} cores"}


def render(run_dir: str | Path, n_boot: int = 1000, drop_busy: bool = True) -> dict:
    """summary.{json,md,csv} and plots from the rows; the tables leave busy rows out (`with_busy_rows` gives the means
    with them, for comparison) unless `drop_busy` is false."""
    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "rows.jsonl")
    clean = [r for r in rows if not (drop_busy and busy(r))]
    summary = summarize(clean, n_boot)
    summary["busy_rows"] = busy_summary(rows)
    summary["busy_rows_kept"] = not drop_busy
    if len(clean) < len(rows):
        everything = summarize(rows, n_boot)
        summary["with_busy_rows"] = {"mean_over_cells": everything["mean_over_cells"],
                                     "mean_decode_over_cells": everything["mean_decode_over_cells"]}
    manifest = run_dir / "manifest.json"
    if manifest.is_file():  # the eval stage records the machine and each target's cost curve there
        extra = read_json(manifest)
        summary["machine"] = extra.get("machine")
        summary["sidecar"] = extra.get("sidecar")
        summary["git_commit"] = extra.get("git_commit")
        summary["cost_curves"] = {t: {"sizes": c["sizes"], "seconds": c["seconds"]}
                                  for t, c in (extra.get("cost_curves") or {}).items()}
    from . import backends

    summary["vs_llamacpp_ar"] = backends.versus_llamacpp_ar(clean, n_boot)
    write_json(run_dir / "summary.json", summary)
    with atomic_open(run_dir / "summary.md") as f:
        f.write(to_markdown(summary, title=f"Eval {run_dir.name}"))
        f.write("\n".join(backends.markdown(summary["vs_llamacpp_ar"])) + "\n" if summary["vs_llamacpp_ar"] else "")
    with atomic_open(run_dir / "summary.csv") as f:
        f.write(to_csv(summary))
    plot(summary, rows, run_dir)
    if manifest.is_file():
        from ..artifacts import seal

        seal(run_dir)
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.eval.report", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--keep-busy", action="store_true", help="keep rows that shared the machine in the tables")
    args = ap.parse_args(argv)
    render(args.run_dir, args.bootstrap, drop_busy=not args.keep_busy)
    print((Path(args.run_dir) / "summary.md").read_text())


if __name__ == "__main__":
    main()
