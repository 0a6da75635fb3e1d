"""The `data` stage: raw benchmarks -> canonical requests, split, contamination-filtered, with a stats report.

Run as: python -m pipeline.stages.data [--recipe recipes/data/default.yaml] [data.key=value ...] [--force]

Each source converter (pipeline/sources/) turns its dialect into JSON Schema and parses gold calls; this stage
checks every tool schema against the 2020-12 meta-schema, validates every gold call against its tool (failures are
counted by reason and marked on the request as `gold_errors`, never fixed or dropped), assigns splits (evaluation
subsets -> `test`, everything else -> `train`/`dev` by a hash of the id), removes contaminated train/dev requests
(CONTAMINATION_RULES; the paper's rule by default: the gold call names a tool that an evaluation set offers), and
writes `data/requests/<benchmark>/<split>.jsonl` + `stats.json` + manifest. When `raw_root` is missing, the raw
files are downloaded from their pinned public sources into `raw_cache` and checked by sha256 (pipeline/sources/fetch.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ..io import InputError, read_json, sha256_file, write_json, write_jsonl, write_manifest
from ..recipes import load_recipe, section
from ..schema import find_tool, schema_errors, tool_name, tool_params, validation_errors
from ..sources import SOURCE_MODULES, fetch, load_source, raw_data_root
from . import Flag, StageConfig
from . import main as stage_main

EVAL_SUBSETS = {"api_bank": ["level-1", "level-2"], "toolalpaca": ["eval_simulated", "eval_real"],
                "bfcl": ["simple_java", "simple_javascript"], "seal_tools": ["test_out_domain"]}


@dataclass
class Config(StageConfig):
    """The `data:` section (recipes/data/default.yaml says what each key does)."""

    raw_root: str = field(default_factory=lambda: str(raw_data_root()))  # $OOO_RAW_DATA, else ../shared/data
    out: str = "data/requests"
    sources: list[str] = field(default_factory=lambda: list(SOURCE_MODULES))
    eval_subsets: dict = field(default_factory=lambda: copy.deepcopy(EVAL_SUBSETS))
    dev_fraction: float = 0.1
    contamination_filter: bool = True
    contamination_rules: list[str] = field(default_factory=lambda: ["gold_names_eval_tool"])
    limit_per_subset: int | None = None
    raw_cache: str = "data/raw-cache"
    fetch: bool = True
    fetch_base_url: str | None = None
    fetch_retries: int = 3
    force: bool = False  # rebuild even if the output is up to date (not a setting of the output: not fingerprinted)

    def fingerprinted(self) -> dict:
        """The settings the output depends on (all but `force`), as the manifest records them."""
        return {k: v for k, v in self.settings().items() if k != "force"}


FLAGS = (Flag("--force", "data.force", "rebuild even if the output is up to date", switch=True),)
SPLITS = ("train", "dev", "test")


def hash_split(request_id: str, dev_fraction: float) -> str:
    """Deterministic train/dev assignment from the request id (stable across machines and runs)."""
    bucket = int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "dev" if bucket < dev_fraction else "train"


def gold_error_reasons(request: dict) -> list[str]:
    """Why each gold call of a request fails its tool's schema, as short reason keys (empty list = all valid)."""
    reasons = []
    for call in request.get("gold", []):
        idx = find_tool(request["tools"], call.get("name", ""))
        if idx is None:
            reasons.append("unknown_tool")
            continue
        args = call.get("arguments")
        if not isinstance(args, dict):
            reasons.append("arguments_not_object")
            continue
        schema = tool_params(request["tools"][idx])
        errors = validation_errors(args, schema)
        if errors:
            reasons.append(_reason_key(args, schema))
    return reasons


def _reason_key(args: dict, schema: dict) -> str:
    from jsonschema import Draft202012Validator

    err = min(Draft202012Validator(schema).iter_errors(args), key=lambda e: (len(e.path), str(e.validator)))
    return f"schema_{err.validator}"


def check_request(req: dict, source: str) -> None:
    """Structural checks of a converted request; a failure is a converter bug, reported with the record id."""
    for key in ("id", "benchmark", "messages", "tools", "gold"):
        if key not in req:
            raise InputError(f"source {source} (record {req.get('id', '?')}): missing field {key!r}")
    for tool in req["tools"]:
        if tool.get("type") != "function" or "name" not in tool.get("function", {}):
            raise InputError(f"source {source} (record {req['id']}): tool is not {{'type': 'function', 'function': "
                             f"{{'name', ...}}}}: {json.dumps(tool)[:200]}")
        params = tool_params(tool)
        errs = schema_errors(params)
        if errs or params.get("type") != "object":
            raise InputError(f"source {source} (record {req['id']}): parameters of tool {tool_name(tool)!r} are not "
                             f"a valid JSON Schema object: {errs[:3] or params.get('type')}")


def contamination_names(requests: list[dict]) -> set[str]:
    """Lower-cased names of every tool the given (evaluation) requests offer."""
    return {tool_name(t).lower() for r in requests for t in r["tools"]}


# rule -> the names in a train/dev request that make it contaminated, given the evaluation tool names (lower case)
CONTAMINATION_RULES = {
    # the paper's rule: a gold call names a tool that an evaluation set offers (drops API-Bank's ToolSearcher calls)
    "gold_names_eval_tool": lambda r, names: sorted({c.get("name", "") for c in r["gold"]
                                                     if c.get("name", "").lower() in names}),
    # stricter: the request merely offers such a tool (removes every API-Bank training request: all offer ToolSearcher)
    "offers_eval_tool": lambda r, names: sorted({tool_name(t) for t in r["tools"] if tool_name(t).lower() in names}),
}


def contamination_filter(reqs: list[dict], rules: list[str], names: set[str],
                         examples: list[str]) -> tuple[list[dict], dict[str, int]]:
    """(kept requests, {rule: removed}); a request counts under the first rule that removes it."""
    keep, removed = [], {rule: 0 for rule in rules}
    for r in reqs:
        for rule in rules:
            hit = CONTAMINATION_RULES[rule](r, names)
            if hit:
                removed[rule] += 1
                if len(examples) < 5:
                    examples.append(f"{r['id']} ({rule}): {', '.join(hit)}")
                break
        else:
            keep.append(r)
    return keep, removed


def _mean(xs: list[float]) -> float:
    return round(statistics.fmean(xs), 2) if xs else 0.0


def split_stats(reqs: list[dict]) -> dict:
    tools = [len(r["tools"]) for r in reqs]
    params = [len(tool_params(t).get("properties", {})) for r in reqs for t in r["tools"]]
    golds = [len(r["gold"]) for r in reqs]
    invalid = Counter(reason for r in reqs for reason in r.get("gold_errors", []))
    return {"requests": len(reqs), "tools_per_request": _mean(tools),
            "tools_range": [min(tools), max(tools)] if tools else [0, 0],
            "params_per_tool": _mean(params), "gold_calls_per_request": _mean(golds),
            "no_gold": sum(1 for g in golds if g == 0),
            "requests_with_invalid_gold": sum(1 for r in reqs if r.get("gold_errors")),
            "invalid_gold_by_reason": dict(sorted(invalid.items())),
            "subsets": dict(sorted(Counter(r.get("subset", "") for r in reqs).items()))}


def format_table(stats: dict) -> str:
    rules = stats.get("contamination_rules", [])
    head = ["benchmark", "split", "requests", "tools/req", "params/tool", "gold/req", "invalid gold (by reason)"]
    head += [f"removed: {rule}" for rule in rules]
    rows = []
    for bench, per_split in stats["benchmarks"].items():
        for split, s in per_split.items():
            reasons = ", ".join(f"{k} {v}" for k, v in s["invalid_gold_by_reason"].items()) or "-"
            rows.append([bench, split, str(s["requests"]), f"{s['tools_per_request']:.2f}",
                         f"{s['params_per_tool']:.2f}", f"{s['gold_calls_per_request']:.2f}",
                         f"{s['requests_with_invalid_gold']} ({reasons})"]
                        + [str(s.get("removed_by_rule", {}).get(rule, 0)) for rule in rules])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows]
    return "\n".join(out)


def input_files(raw_root: Path, sources: list[str]) -> list[Path]:
    files = []
    for s in sources:
        folder = raw_root / s
        if folder.is_dir():
            files += sorted(p for p in folder.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
    return files


def resolve_raw_root(cfg: Config) -> Path:
    """`raw_root` when it is a folder (a local copy wins); else the pinned files, downloaded into `raw_cache`."""
    raw_root = Path(cfg.raw_root)
    if raw_root.is_dir():
        return raw_root
    if not cfg.fetch:
        raise InputError(f"{raw_root}: raw benchmark folder not found (set data.raw_root=PATH, or data.fetch=true "
                         f"to download the pinned sources into {cfg.raw_cache})")
    print(f"{raw_root}: no local raw folder; using the pinned public sources (cache {cfg.raw_cache})")
    return fetch.fetch(cfg.raw_cache, cfg.sources, base_url=cfg.fetch_base_url, retries=cfg.fetch_retries)


def resolve(recipe_path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The `data:` section of the recipe (none: the defaults, = recipes/data/default.yaml) with overrides."""
    recipe = load_recipe(recipe_path, overrides)
    return Config(**section(recipe, "data", known=Config.keys(), where=str(recipe_path or "recipe")), recipe=recipe)


def run(cfg: Config) -> dict:
    """Build the requests (unless up to date), print the stats table; returns the stats (also in stats.json)."""
    stats = build(cfg)
    print_summary(stats, cfg.out)
    return stats


def build(cfg: Config) -> dict:
    unknown = [rule for rule in cfg.contamination_rules if rule not in CONTAMINATION_RULES]
    if unknown:
        raise InputError(f"data.contamination_rules: unknown rule(s) {unknown}; expected some of "
                         f"{list(CONTAMINATION_RULES)}")
    raw_root, out = resolve_raw_root(cfg), Path(cfg.out)
    inputs = input_files(raw_root, cfg.sources)
    settings = cfg.fingerprinted()
    fingerprint = hashlib.sha256(json.dumps([settings, [sha256_file(p) for p in inputs]], sort_keys=True,
                                            default=str).encode()).hexdigest()
    manifest = out / "manifest.json"
    if (not cfg.force and (out / "stats.json").exists() and manifest.exists()
            and read_json(manifest).get("fingerprint") == fingerprint):
        print(f"{out}: up to date (same recipe and inputs; --force to rebuild)")
        return read_json(out / "stats.json")

    # Load and check every source
    by_bench: dict[str, list[dict]] = {}
    rejects, notes, why_no_training = {}, {}, {}
    for name in tqdm(cfg.sources, desc="sources", unit="source"):
        mod = load_source(name)
        res = mod.load(raw_root / name)
        reqs = res.requests
        if cfg.limit_per_subset:
            seen: Counter = Counter()
            kept = []
            for r in reqs:
                seen[r.get("subset", "")] += 1
                if seen[r.get("subset", "")] <= cfg.limit_per_subset:
                    kept.append(r)
            reqs = kept
        ids = Counter(r["id"] for r in reqs)
        dup = [i for i, n in ids.items() if n > 1]
        if dup:
            raise InputError(f"source {name}: duplicate request ids {dup[:5]}")
        for r in reqs:
            check_request(r, name)
            errs = gold_error_reasons(r)
            if errs:
                r["gold_errors"] = errs
            else:
                r.pop("gold_errors", None)
        by_bench[mod.BENCHMARK] = reqs
        rejects[mod.BENCHMARK] = dict(Counter(x["reason"] for x in res.rejects))
        notes[mod.BENCHMARK] = dict(res.notes)
        why_no_training[mod.BENCHMARK] = getattr(mod, "NO_TRAINING_DATA", None)
        if res.rejects:
            write_jsonl(out / mod.BENCHMARK / "rejected.jsonl", res.rejects)

    # Assign splits
    split_of: dict[str, dict[str, list[dict]]] = {b: {s: [] for s in SPLITS} for b in by_bench}
    for bench, reqs in by_bench.items():
        eval_subsets = set(cfg.eval_subsets.get(bench, []))
        for r in reqs:
            r["split"] = "test" if r.get("subset") in eval_subsets else hash_split(r["id"], cfg.dev_fraction)
            split_of[bench][r["split"]].append(r)

    # Benchmarks without training data say so (and why, where the source module knows)
    no_training = {bench: why_no_training.get(bench) or "the source yields no train/dev requests"
                   for bench, splits in split_of.items() if not splits["train"] and not splits["dev"]}

    # Contamination filter: train/dev requests that touch a tool offered by an evaluation set (CONTAMINATION_RULES)
    eval_names = contamination_names([r for b in split_of.values() for r in b["test"]])
    rules = cfg.contamination_rules if cfg.contamination_filter else []
    removed: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
    removed_examples: dict[str, list[str]] = defaultdict(list)
    for bench, splits in split_of.items():
        for split in ("train", "dev"):
            splits[split], removed[bench][split] = contamination_filter(splits[split], rules, eval_names,
                                                                        removed_examples[bench])

    # Write
    stats = {"benchmarks": {}, "rejects": rejects, "notes": notes, "no_training_data": no_training,
             "eval_tool_names": len(eval_names), "contamination_rules": rules,
             "removed_by_contamination": {b: dict(per) for b, per in removed.items()},
             "contamination_examples": {b: ex for b, ex in removed_examples.items() if ex}}
    for bench, splits in split_of.items():
        stats["benchmarks"][bench] = {}
        for split in SPLITS:
            reqs = splits[split]
            path = out / bench / f"{split}.jsonl"
            if not reqs:
                if path.exists():
                    path.unlink()
                continue
            write_jsonl(path, reqs)
            s = split_stats(reqs)
            by_rule = removed.get(bench, {}).get(split, {})
            s["removed_by_contamination"] = sum(by_rule.values())
            s["removed_by_rule"] = by_rule
            stats["benchmarks"][bench][split] = s
    stats["table"] = format_table(stats)
    write_json(out / "stats.json", stats)
    write_manifest(out, "data", settings, inputs, extra={"fingerprint": fingerprint, "bfcl_eval": _bfcl_version()})
    return stats


def _bfcl_version() -> str | None:
    import importlib.metadata as md

    try:
        return md.version("bfcl-eval")
    except md.PackageNotFoundError:
        return None


def print_summary(stats: dict, out: str) -> None:
    print(stats["table"])
    for bench, rej in stats["rejects"].items():
        if rej:
            print(f"{bench}: rejected records by reason: {rej}")
    for bench, n in stats["notes"].items():
        if n:
            print(f"{bench}: notes: {n}")
    for bench, per_split in stats["removed_by_contamination"].items():
        if any(n for by_rule in per_split.values() for n in by_rule.values()):
            print(f"{bench}: removed by contamination rule: {per_split}")
    for bench, why in stats["no_training_data"].items():
        print(f"{bench}: no training data: {why}")
    print(f"wrote {out}/<benchmark>/<split>.jsonl and {out}/stats.json")


def main(argv: list[str] | None = None) -> dict:
    """The command line (the stage contract: pipeline/stages/__init__.py)."""
    return stage_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
