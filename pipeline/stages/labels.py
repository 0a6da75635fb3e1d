"""Labels: parse teacher traces into sidecar labels (function index + every slot) and SFT rows, reject the rest.

Run as: python -m pipeline.stages.labels --recipe recipes/teacher/qwen2.5-coder-1.5b-cpu.yaml [labels.force=true]

Reads `<data_dir>/traces/<teacher>/<split>.jsonl` and the requests they answer; writes into `<data_dir>/labels/<teacher>/`:
    <split>.jsonl        one label per accepted trace (pipeline.sidecar.rows.label_from_call + provenance fields)
    rows/<split>.jsonl   SFT rows (pipeline.sidecar.rows.build_rows: trl prompt-completion + kind/tool/param metadata)
    rejected.jsonl       every trace not labelled, with `reason` and `detail`
    stats.json           the report printed at the end; manifest.json
Per trace: parse every call in the text (pipeline.parsers), keep the first call that names an offered tool and whose
arguments satisfy its schema after schema-directed normalisation (the paper keeps the first valid call; how many traces
had more than one call is counted), then compare with gold: exactly and with BFCL's acceptable values
(`pipeline.scoring`, the rules sidecar accuracy and the eval report use too).
`labels.require_gold_agreement` drops calls that disagree with an existing gold call. Outputs are written atomically;
a rerun with the same inputs and recipe does nothing (`labels.force=true` redoes it).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..io import InputError, iter_jsonl, read_json, sha256_file, where, write_json, write_jsonl, write_manifest
from ..parsers import normalise_arguments, parse_calls
from ..recipes import load_recipe, section
from ..scoring import call_accepted, call_equal
from ..schema import find_tool, tool_params, validation_errors
from ..sidecar.rows import build_rows, label_from_call
from ..requests import load_requests
from . import StageConfig
from . import main as stage_main
from .traces import TOP_KEYS, request_files


@dataclass
class Config(StageConfig):
    teacher: str
    data_dir: str = "data"
    benchmarks: list[str] | str = "all"
    splits: list[str] = field(default_factory=lambda: ["train", "dev"])
    require_gold_agreement: bool = False  # drop calls that disagree with gold (BFCL-acceptable); fewer, cleaner rows
    compact: bool = True                  # compact one-line-per-parameter tool block (shorter prefix) vs full JSON
    force: bool = False                   # redo even when inputs and recipe are unchanged
    allow_partial: bool = False           # label a traces run still in progress (<split>.jsonl.partial)


LABEL_KEYS = {"require_gold_agreement", "compact", "force", "allow_partial"}
NO_CALL = "no tool call found"  # the `detail` of a rejected trace that answers with text (reason "unparsed")


def resolve(recipe_path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """The teacher recipe's top-level keys and `labels:` section, with overrides, checked."""
    if recipe_path is None:
        raise InputError("labels: --recipe is required (a recipes/teacher/*.yaml file)")
    config, where_ = load_recipe(recipe_path, overrides), str(recipe_path)
    bad = sorted(set(config) - TOP_KEYS)
    if bad:
        raise InputError(f"{where_}: unknown top-level key(s) {bad}; expected one of {sorted(TOP_KEYS)}")
    teacher = config.get("teacher") or config.get("recipe_name")
    if not teacher:
        raise InputError(f"{where_}: `teacher` (output folder name) is required")
    top = {k: config[k] for k in ("data_dir", "benchmarks", "splits") if k in config}
    cfg = Config(teacher=teacher, **top, **section(config, "labels", LABEL_KEYS, where_), recipe=config)
    if isinstance(cfg.splits, str):
        cfg.splits = [cfg.splits]
    return cfg


# --- agreement with gold (pure) -----------------------------------------------------------------------------------

def normalised_gold(tools: list[dict], call: dict) -> dict:
    """A gold call under the same schema-directed normalisation as the teacher's (Seal-Tools gold writes "85" for an
    integer; the data stage reports such gold as `gold_errors`), so agreement compares like with like."""
    idx = find_tool(tools, call["name"])
    if idx is None:
        return call
    return {"name": call["name"], "arguments": normalise_arguments(call.get("arguments") or {},
                                                                   tool_params(tools[idx]))[0]}


# --- one trace -> label or rejection (pure) -----------------------------------------------------------------------

def label_trace(request: dict, trace: dict, require_gold_agreement: bool = False) -> tuple[dict | None, dict]:
    """(label or None, facts) for one trace. Facts: parsed, format, n_calls, valid, gold_exact, gold_accept,
    normalised, and for a rejection `reason` + `detail`."""
    facts = {"parsed": False, "format": None, "n_calls": 0, "valid": False, "gold_exact": None, "gold_accept": None,
             "normalised": []}
    if trace.get("error"):
        return None, {**facts, "reason": "trace_error", "detail": trace["error"]}
    parsed = parse_calls(trace.get("text") or "")
    if not parsed.calls:
        reason = "truncated" if trace.get("finish_reason") == "length" else "unparsed"
        return None, {**facts, "reason": reason, "detail": "; ".join(parsed.problems) or NO_CALL}
    facts.update(parsed=True, format=parsed.format, n_calls=len(parsed.calls))
    tools, problems, chosen = request["tools"], [], None
    for k, call in enumerate(parsed.calls):
        idx = find_tool(tools, call["name"])
        if idx is None:
            problems.append(("unknown_tool", f"call {k}: {call['name']!r} is not an offered tool"))
            continue
        args, notes = normalise_arguments(call["arguments"], tool_params(tools[idx]))
        errors = validation_errors(args, tool_params(tools[idx]))
        if errors:
            problems.append(("schema_invalid", f"call {k} {call['name']}: " + "; ".join(errors[:3])))
            continue
        chosen = (k, {"name": call["name"], "arguments": args}, notes, call)
        break
    if chosen is None:
        reason = "schema_invalid" if any(r == "schema_invalid" for r, _ in problems) else "unknown_tool"
        return None, {**facts, "reason": reason, "detail": " | ".join(d for _, d in problems)}
    k, call, notes, raw = chosen
    facts.update(valid=True, normalised=notes, call_index=k)
    if request["gold"]:
        gold = [normalised_gold(tools, g) for g in request["gold"]]
        # BFCL's checker sees the raw call; its acceptable values may keep a type the schema does not allow
        accept = (call_accepted(call, gold, request.get("gold_accept"))
                  or call_accepted(raw, request["gold"], request.get("gold_accept")))
        facts.update(gold_exact=call_equal(call, gold), gold_accept=accept)
        if require_gold_agreement and not facts["gold_accept"]:
            return None, {**facts, "reason": "gold_disagreement",
                          "detail": f"teacher {call} vs gold {request['gold'][0]}"}
    label = label_from_call(request, call)
    label.update({"benchmark": request.get("benchmark"), "format": parsed.format, "n_calls": len(parsed.calls),
                  "call_index": k, "normalised": notes, "gold_exact": facts["gold_exact"],
                  "gold_accept": facts["gold_accept"]})
    return label, facts


# --- the stage ----------------------------------------------------------------------------------------------------

def _paths(cfg: Config) -> tuple[Path, Path]:
    return Path(cfg.data_dir) / "traces" / cfg.teacher, Path(cfg.data_dir) / "labels" / cfg.teacher


def label_split(cfg: Config, split: str) -> tuple[list[dict], list[dict], list[dict], dict, list[Path]]:
    traces_dir, _ = _paths(cfg)
    trace_file = traces_dir / f"{split}.jsonl"
    partial = trace_file.with_name(trace_file.name + ".partial")
    if not trace_file.is_file() and cfg.allow_partial and partial.is_file():
        trace_file = partial
    if not trace_file.is_file():
        hint = " (a run in progress: labels.allow_partial=true)" if partial.is_file() else ""
        raise InputError(f"{trace_file}: traces not found{hint}; run `python -m pipeline.stages.traces` with this recipe")
    files = request_files(cfg.data_dir, cfg.benchmarks, split)
    requests = {r["id"]: r for r in load_requests(files)}
    labels, rejected, rows = [], [], []
    st = Counter()
    by_bench: dict[str, Counter] = {}
    reasons, formats = Counter(), Counter()
    for lineno, trace in iter_jsonl(trace_file, torn_tail_ok=trace_file.suffix == ".partial"):
        request = requests.get(trace.get("id"))
        if request is None:
            raise InputError(f"{where(trace_file, lineno, trace.get('id'))}: no such request in {[str(f) for f in files]}")
        label, facts = label_trace(request, trace, cfg.require_gold_agreement)
        st["traces"] += 1
        st["trace_errors"] += facts.get("reason") == "trace_error"
        st["parsed"] += facts["parsed"]
        st["multi_call"] += facts["n_calls"] > 1
        st["schema_valid"] += facts["valid"]
        st["with_gold"] += facts["valid"] and facts["gold_exact"] is not None
        st["gold_exact"] += bool(facts["gold_exact"])
        st["gold_accept"] += bool(facts["gold_accept"])
        st["normalised"] += bool(facts["normalised"])
        b = by_bench.setdefault(request.get("benchmark") or trace["id"].split("/")[0], Counter())
        b["traces"] += 1
        b["no_call"] += not facts["parsed"] and facts.get("reason") != "trace_error"
        b["trace_errors"] += facts.get("reason") == "trace_error"
        for k in ("parsed", "valid"):
            b[k] += bool(facts[k])
        b["with_gold"] += facts["valid"] and facts["gold_exact"] is not None
        b["gold_exact"] += bool(facts["gold_exact"])
        b["gold_accept"] += bool(facts["gold_accept"])
        if facts["format"]:
            formats[facts["format"]] += 1
        if label is None:
            reasons[facts["reason"]] += 1
            rejected.append({"id": trace["id"], "split": split, "teacher": cfg.teacher, "reason": facts["reason"],
                             "detail": facts["detail"], "finish_reason": trace.get("finish_reason"),
                             "text": trace.get("text")})
            continue
        label["split"] = split
        labels.append(label)
        rows += build_rows(request, label, cfg.compact)
    st["labels"] = len(labels)
    stats = {**{k: st[k] for k in ("traces", "trace_errors", "parsed", "schema_valid", "multi_call", "with_gold",
                                   "gold_exact", "gold_accept", "normalised", "labels")},
             "rejected": dict(sorted(reasons.items())), "formats": dict(sorted(formats.items())),
             "rows": dict(sorted(Counter(r["kind"] for r in rows).items())),
             "slot_rows_null": sum(r["kind"] == "slot" and r["null"] for r in rows),
             "by_benchmark": {k: dict(v) for k, v in sorted(by_bench.items())}}
    return labels, rejected, rows, stats, [trace_file, *files]


def _pct(n: int, d: int) -> str:
    return f"{n}/{d} ({100 * n / d:.1f}%)" if d else f"{n}/0"


def report_text(teacher: str, stats: dict) -> str:
    lines = [f"labels for teacher {teacher}"]
    for split, s in stats.items():
        t = s["traces"]
        lines += [f"[{split}] traces {t} (errors {s['trace_errors']})",
                  f"  parsed        {_pct(s['parsed'], t)}   formats {s['formats']}",
                  f"  schema-valid  {_pct(s['schema_valid'], t)}   normalised {s['normalised']}",
                  f"  >1 call       {s['multi_call']} (first valid call kept)",
                  f"  gold exact    {_pct(s['gold_exact'], s['with_gold'])}   "
                  f"gold acceptable {_pct(s['gold_accept'], s['with_gold'])}  (of valid calls with gold)",
                  f"  labels        {s['labels']}   rejected {s['rejected']}",
                  f"  rows          {s['rows']}   (null slot rows {s['slot_rows_null']})"]
        if s.get("by_benchmark"):
            lines += ["", f"| {split} | traces | no call | parsed | schema-valid | gold exact | gold acceptable |",
                      "|---|---|---|---|---|---|---|"]
            for bench, b in s["by_benchmark"].items():
                t = b.get("traces", 0)
                lines.append(f"| {bench} | {t} | {_pct(b.get('no_call', 0), t)} | {_pct(b.get('parsed', 0), t)} | "
                             f"{_pct(b.get('valid', 0), t)} | {_pct(b.get('gold_exact', 0), b.get('with_gold', 0))} | "
                             f"{_pct(b.get('gold_accept', 0), b.get('with_gold', 0))} |")
            lines.append("")
    return "\n".join(lines)


def code_checksums() -> dict:
    """The rules that make labels: a change in any of them makes a rerun redo the work."""
    from .. import parsers, scoring
    from ..sidecar import rows as rows_module

    return {Path(m.__file__).name: sha256_file(m.__file__)
            for m in (parsers, scoring, rows_module, sys.modules[__name__])}


def run(cfg: Config) -> dict:
    """Label every split and print the report; returns the stats (also in stats.json)."""
    stats = label(cfg)
    print(report_text(cfg.teacher, stats))
    return stats


def label(cfg: Config) -> dict:
    """The stats of every split's labels, made unless inputs, recipe and code are unchanged."""
    traces_dir, out_dir = _paths(cfg)
    config = {"recipe": cfg.recipe, "resolved": {k: v for k, v in cfg.settings().items() if k != "force"},
              "code": code_checksums()}
    manifest = out_dir / "manifest.json"
    if not cfg.force and manifest.is_file() and (out_dir / "stats.json").is_file():
        old = read_json(manifest)
        inputs = [traces_dir / f"{s}.jsonl" for s in cfg.splits]
        inputs += [f for s in cfg.splits for f in request_files(cfg.data_dir, cfg.benchmarks, s)]
        same_inputs = all(p.is_file() and old.get("inputs", {}).get(str(p)) == sha256_file(p) for p in inputs)
        if same_inputs and all(old.get("config", {}).get(k) == config[k] for k in ("resolved", "code")):
            stats = read_json(out_dir / "stats.json")
            print(f"labels {cfg.teacher}: up to date (inputs, recipe and code unchanged; labels.force=true to redo)")
            return stats
    stats, rejected_all, inputs = {}, [], []
    results = {}
    for split in cfg.splits:
        labels, rejected, rows, stats[split], used = label_split(cfg, split)
        results[split] = (labels, rows)
        rejected_all += rejected
        inputs += used
    for split, (labels, rows) in results.items():
        write_jsonl(out_dir / f"{split}.jsonl", labels)
        write_jsonl(out_dir / "rows" / f"{split}.jsonl", rows)
    # the splits another recipe labelled into this folder (e.g. the test requests `make sidecar-eval` judges) stay
    before = read_json(out_dir / "stats.json") if (out_dir / "stats.json").is_file() else {}
    others = [s for s in before if s not in cfg.splits and (out_dir / f"{s}.jsonl").is_file()]
    if others:
        stats = {**{s: before[s] for s in others}, **stats}
        if (out_dir / "rejected.jsonl").is_file():
            rejected_all = [r for _, r in iter_jsonl(out_dir / "rejected.jsonl") if r.get("split") in others] + rejected_all
    write_jsonl(out_dir / "rejected.jsonl", rejected_all)
    write_json(out_dir / "stats.json", stats)
    trace_manifest = traces_dir / "manifest.json"
    gold = read_json(trace_manifest).get("gold") if trace_manifest.is_file() else None
    write_manifest(out_dir, "labels", config, inputs, extra={"gold_traces": gold, "stats": stats})
    return stats


def main(argv: list[str] | None = None) -> dict:
    """The command line (the stage contract: pipeline/stages/__init__.py)."""
    return stage_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
