"""The `eval` stage: targets x benchmarks x methods through the runtime, beside transformers' own speculation.

Run as: python -m pipeline.stages.eval --recipe recipes/eval/cpu.yaml [eval.key=value ...]     (`make eval`)

For every target, every benchmark's test requests (evenly spaced with an optional limit) are decoded by the runner
(pipeline/runner.py: every variant warmed up, shuffled per request, timed from arrival, baselines on every core,
`ooo` under each of `eval.schedules`); one row per (target, benchmark, request, variant) is appended to
`eval/results/<run>/rows.jsonl` (a rerun skips finished rows), then the report (`pipeline.report`) is rendered from
the rows. Methods: the runtime's table (`pipeline.runtime.loop.METHOD_TABLE`) and two transformers peers in the same
process on the same target: prompt-lookup decoding (`hf-pld`) and assisted generation with a small draft model
(`hf-assisted`; the universal path with `assistant_tokenizer` when the tokenizers differ).
The manifest records the machine (CPU model and flags, torch's CPU capability, dtype, threads) and each target's
measured cost curve, the tree budget's input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from ..hardware import available_cores, machine, resolve_dtype
from ..io import InputError, ResumableJsonl, write_manifest
from ..recipes import load_recipe, section
from ..requests import load_requests
from ..runner import ALL_METHODS, PEERS, HFPeers, Runner, variant, variants
from ..sidecar.factory import FACTORY

KNOWN = {"run", "out", "requests_root", "split", "benchmarks", "targets", "methods", "sidecar", "assistant",
         "schedules", "max_new_tokens", "hf_pld_tokens", "threads", "sidecar_timeout_s", "warmup", "seed",
         "prefix_cache", "tree_budget"}
DEFAULTS = {"out": "eval/results", "requests_root": "data/requests", "split": "test", "schedules": ["adaptive"],
            "max_new_tokens": 256, "hf_pld_tokens": 10, "threads": None, "sidecar_timeout_s": 60.0,
            "methods": list(ALL_METHODS), "sidecar": None, "assistant": None, "warmup": True, "seed": 0,
            "prefix_cache": True, "tree_budget": "auto"}


def round_robin(requests: dict[str, list[dict]]) -> list[tuple[str, dict]]:
    """(benchmark, request) pairs taking one request of each benchmark in turn."""
    from itertools import zip_longest

    rows = zip_longest(*[[(b, r) for r in reqs] for b, reqs in requests.items()])
    return [pair for row in rows for pair in row if pair is not None]


def benchmark_requests(cfg: dict) -> dict[str, list[dict]]:
    """Each benchmark's test requests; a limit takes evenly spaced ones (every subset in proportion)."""
    return {bench: load_requests(Path(cfg["requests_root"]) / bench / f"{cfg['split']}.jsonl", limit, how="even")
            for bench, limit in (cfg["benchmarks"] or {}).items()}


def resolve(recipe: dict, where: str = "recipe") -> dict:
    """The `eval:` section with defaults, checked: known keys, methods, schedules, targets and benchmarks present."""
    from ..runtime.schedule import SCHEDULES

    cfg = {**DEFAULTS, **section(recipe, "eval", known=KNOWN, where=where)}
    cfg.setdefault("run", recipe.get("recipe_name", "run"))
    for k in ("targets", "benchmarks"):
        if not cfg.get(k):
            raise InputError(f"{where}: eval.{k} is required")
    unknown = sorted(set(cfg["methods"]) - set(ALL_METHODS))
    if unknown:
        raise InputError(f"{where}: eval.methods: unknown {unknown}; expected some of {ALL_METHODS}")
    bad = sorted(set(cfg["schedules"]) - set(SCHEDULES))
    if bad:
        raise InputError(f"{where}: eval.schedules: unknown {bad}; expected some of {SCHEDULES}")
    for i, t in enumerate(cfg["targets"]):
        extra = sorted(set(t) - {"name", "path", "dtype", "device", "chat_template_kwargs"})
        if not {"name", "path"} <= set(t) or extra:
            raise InputError(f"{where}: eval.targets[{i}] needs name and path (and may set dtype, device, "
                             f"chat_template_kwargs); got {sorted(t)}")
    if "ooo" in cfg["methods"] and not cfg.get("sidecar"):
        raise InputError(f"{where}: eval.methods has 'ooo' but eval.sidecar is not set (model, adapter)")
    return cfg


def run(cfg: dict, recipe: dict) -> Path:
    from ..runtime import Target

    run_dir = Path(cfg["out"]) / cfg["run"]
    methods = list(cfg["methods"])
    requests = benchmark_requests(cfg)
    sc = cfg.get("sidecar") or None
    writer = ResumableJsonl(run_dir / "rows.jsonl", key="key")
    done = writer.done_ids()
    inputs = [Path(cfg["requests_root"]) / b / f"{cfg['split']}.jsonl" for b in requests]
    curves = {}
    try:
        for tcfg in cfg["targets"]:
            tname = tcfg["name"]
            todo = [(b, r) for b, r in round_robin(requests)
                    if any(f"{tname}|{b}|{r['id']}|{v}" not in done
                           for v in (variant(m, s) for m, s in variants(methods, cfg["schedules"])))]
            if not todo:
                continue
            torch.set_num_threads(cfg["threads"] or len(available_cores()))
            dtype = resolve_dtype(tcfg.get("dtype", "auto"), tcfg.get("device", "cpu"))
            target = Target.load(tcfg["path"], dtype=dtype, device=tcfg.get("device", "cpu"),
                                 chat_template_kwargs=tcfg.get("chat_template_kwargs"),
                                 prefix_cache=cfg["prefix_cache"])
            target.name = tname
            if cfg["tree_budget"] == "auto":
                curves[tname] = target.calibrate().as_dict()
            peers = None
            if set(methods) & set(PEERS):
                peers = HFPeers(target, (cfg.get("assistant") or {}).get("path"), dtype, cfg["hf_pld_tokens"])
            sidecar = None
            if sc:
                sidecar = {"factory": FACTORY, "kwargs": {"model": sc["model"], "adapter": sc.get("adapter"),
                                                          "dtype": sc.get("dtype", "auto"),
                                                          "max_value_tokens": sc.get("max_value_tokens"),
                                                          "device": sc.get("device", "cpu")}}
            runner = Runner(target, methods, run=cfg["run"], schedules=cfg["schedules"], sidecar=sidecar,
                            peers=peers, max_new_tokens=cfg["max_new_tokens"], seed=cfg["seed"],
                            threads=cfg["threads"], sidecar_timeout_s=cfg["sidecar_timeout_s"],
                            tree_budget=cfg["tree_budget"])
            try:
                if cfg["warmup"]:
                    runner.warmup(todo[0][1])
                for bench, req in tqdm(todo, desc=f"eval {tname}", unit="req"):
                    for row in runner.run(bench, req, done):
                        writer.write(row)
            finally:
                runner.close()
            write_manifest(run_dir, "eval", recipe, inputs,
                           extra={"machine": machine(dtype, cfg["threads"]), "cost_curves": curves})
    finally:
        writer.close()
    writer.finish()
    return run_dir


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m pipeline.stages.eval", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("overrides", nargs="*", help="eval.key=value overrides")
    args = ap.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        run_dir = run(resolve(recipe, args.recipe), recipe)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from ..report import render

    render(run_dir)
    print((run_dir / "summary.md").read_text())
    return run_dir


if __name__ == "__main__":
    main()
