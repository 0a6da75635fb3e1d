"""Every variant of a run against llama.cpp's `ar` (issue #44): the fastest plain decoder a CPU user has.

The runner stamps each row with its target's backend (`backend`: transformers or llamacpp). For every benchmark,
each (target, variant) is compared with the `ar` rows of the run's llama.cpp target on the same requests (the same
prompt ids: both backends tokenize with the model folder's tokenizer): end-to-end and decode-phase ratios (llama.cpp
`ar` seconds / the variant's seconds; above 1 = faster than llama.cpp `ar`), with a bootstrap 95% interval over
requests, and the share of rows whose tokens equal llama.cpp `ar`'s. Runs without a llama.cpp target get no table.
"""

from __future__ import annotations

from collections import defaultdict


def versus_llamacpp_ar(rows: list[dict], n_boot: int = 1000) -> list[dict]:
    """One entry per (benchmark, target, variant) with llama.cpp `ar` rows on the same requests."""
    from .report import _ratio

    base: dict[tuple[str, str], dict] = {}
    for r in rows:
        if r.get("backend") == "llamacpp" and r.get("variant", r["method"]) == "ar":
            base[(r["benchmark"], r["request_id"])] = r
    if not base:
        return []
    groups: dict[tuple[str, str, str], list[tuple[dict, dict]]] = defaultdict(list)
    for r in rows:
        ar = base.get((r["benchmark"], r["request_id"]))
        if ar is not None and r is not ar:
            groups[(r["benchmark"], r["target"], r.get("variant") or r["method"])].append((ar, r))
    out = []
    for (bench, target, variant), pairs in sorted(groups.items()):
        wall = _ratio([a["wall_s"] for a, _ in pairs], [r["wall_s"] for _, r in pairs], n_boot)
        dec = _ratio([a["decode_s"] for a, _ in pairs], [r["decode_s"] for _, r in pairs], n_boot)
        same = sum(a.get("token_digest") == r.get("token_digest") for a, r in pairs)
        out.append({"benchmark": bench, "target": target, "backend": pairs[0][1].get("backend", "transformers"),
                    "variant": variant, "end_to_end": wall, "decode": dec, "identical": round(same / len(pairs), 3),
                    "n": len(pairs), "prefix_cache": all(r.get("prefix_cache", True) for _, r in pairs)})
    return out


def markdown(entries: list[dict]) -> list[str]:
    """The table's lines (none without entries)."""
    if not entries:
        return []

    def fmt(d: dict | None) -> str:
        return "-" if d is None else f"{d['ratio']:.2f}x [{d['ci'][0]:.2f}, {d['ci'][1]:.2f}]"

    lines = ["", "## Against llama.cpp's ar (same requests; > 1 = faster)", "",
             "| benchmark | target | backend | variant | end to end | decode | identical to llama.cpp ar | n |",
             "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        mark = " (no prefix cache)" if not e["prefix_cache"] else ""
        lines.append(f"| {e['benchmark']} | {e['target']} | {e['backend']} | {e['variant']} | "
                     f"{fmt(e['end_to_end'])}{mark} | {fmt(e['decode'])} | {e['identical']:.0%} | {e['n']} |")
    return lines


__all__ = ["versus_llamacpp_ar", "markdown"]
