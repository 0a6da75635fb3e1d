"""The `eval` stage: targets x benchmarks x methods through the runtime, beside transformers' own speculation.

Run as: python -m pipeline.stages.eval --recipe recipes/eval/cpu.yaml [eval.key=value ...]     (`make eval`)

For every target, every benchmark's test requests (evenly spaced with an optional limit) are decoded by the runner
(pipeline/eval/runner.py: every variant warmed up, shuffled per request, timed from arrival, baselines on every core,
`ooo` under each of `eval.schedules`); one row per (target, benchmark, request, variant) is appended to
`eval/results/<run>/rows.jsonl` (a rerun skips finished rows), then the report (`pipeline.eval.report`) is rendered from
the rows. Methods: the runtime's table (`pipeline.runtime.loop.METHOD_TABLE`) and the peers of the target's backend
in the same process: on transformers prompt-lookup decoding (`hf-pld`) and assisted generation with a small draft model
(`hf-assisted`; the universal path with `assistant_tokenizer` when the tokenizers differ); on llama.cpp
llama-cpp-python's prompt lookup (`llama-pld`) and draft-model speculation with the assistant's GGUF (`llama-draft`).
A target's `backend` (transformers, the default, or llamacpp) picks its `TargetBackend` (pipeline/runtime/backend.py);
`auto` measures every installed one here and runs the faster (pipeline/runtime/auto.py; rows and manifest record the
choice and both predictions); a llamacpp target reads the GGUF `make models` verified (its folder's manifest; `gguf:`
names another file).
The manifest records the machine (CPU model and flags, torch's CPU capability, dtype, threads) and each target's
measured cost curve, the tree budget's input.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..hardware import available_cores, machine, resolve_dtype
from ..artifacts import seal
from ..io import InputError, ResumableJsonl, interrupt_on_sigterm, read_json, write_manifest
from ..methods import PEER_BACKENDS, uses_sidecar
from ..recipes import load_recipe, section
from ..requests import load_requests
from ..eval.runner import ALL_METHODS, PEERS, HFPeers, Runner, variant, variants
from ..runtime.schedule import WAVE_CHUNK
from ..sidecar.config import SidecarConfig
from ..sidecar.factory import FACTORY, sidecar_kwargs
from . import StageConfig
from . import main as stage_main


@dataclass
class Config(StageConfig):
    """The `eval:` section (recipes/eval/cpu.yaml says what each key does and costs)."""

    targets: list[dict]                     # [{name, path, dtype?, device?, chat_template_kwargs?, backend?, gguf?}]
    benchmarks: dict[str, int | None]       # benchmark -> evenly spaced test requests (None: all)
    run: str = "run"                        # eval/results/<run>/; default: the recipe's name
    out: str = "eval/results"
    requests_root: str = "data/requests"
    split: str = "test"
    methods: list[str] = field(default_factory=lambda: list(ALL_METHODS))
    schedules: list[str] = field(default_factory=lambda: ["adaptive"])
    sidecar: dict | None = None             # the ooo sidecar: SidecarConfig's fields (pipeline/sidecar/config.py)
    assistant: dict | None = None           # hf-assisted's draft model: {path}
    max_new_tokens: int = 256
    hf_pld_tokens: int = 10
    threads: int | None = None
    warmup: bool = True
    seed: int = 0
    prefix_cache: bool = True
    tree_budget: str | int = "auto"
    prefill_once: bool = True
    drop_busy_rows: bool = True
    prefill_chunk: int | None = None
    wave_chunk: int = WAVE_CHUNK
    layer_switch: bool = False


def round_robin(requests: dict[str, list[dict]]) -> list[tuple[str, dict]]:
    """(benchmark, request) pairs taking one request of each benchmark in turn."""
    from itertools import zip_longest

    rows = zip_longest(*[[(b, r) for r in reqs] for b, reqs in requests.items()])
    return [pair for row in rows for pair in row if pair is not None]


def benchmark_requests(cfg: Config) -> dict[str, list[dict]]:
    """Each benchmark's test requests; a limit takes evenly spaced ones (every subset in proportion)."""
    return {bench: load_requests(Path(cfg.requests_root) / bench / f"{cfg.split}.jsonl", limit, how="even")
            for bench, limit in (cfg.benchmarks or {}).items()}


def resolve(recipe_path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """The `eval:` section with defaults, checked: known keys, methods, schedules, targets and benchmarks present."""
    from ..runtime.backend import BACKENDS
    from ..runtime.schedule import SCHEDULES

    if recipe_path is None:
        raise InputError("eval: --recipe is required (a recipes/eval/*.yaml file)")
    recipe, where = load_recipe(recipe_path, overrides), str(recipe_path)
    sec = dict(section(recipe, "eval", known=Config.keys(), where=where))
    sec.setdefault("run", recipe.get("recipe_name", "run"))
    for k in ("targets", "benchmarks"):
        if not sec.get(k):
            raise InputError(f"{where}: eval.{k} is required")
    cfg = Config(**sec, recipe=recipe)
    unknown = sorted(set(cfg.methods) - set(ALL_METHODS))
    if unknown:
        raise InputError(f"{where}: eval.methods: unknown {unknown}; expected some of {ALL_METHODS}")
    bad = sorted(set(cfg.schedules) - set(SCHEDULES))
    if bad:
        raise InputError(f"{where}: eval.schedules: unknown {bad}; expected some of {SCHEDULES}")
    for i, t in enumerate(cfg.targets):
        extra = sorted(set(t) - {"name", "path", "dtype", "device", "chat_template_kwargs", "backend", "gguf"})
        if not {"name", "path"} <= set(t) or extra:
            raise InputError(f"{where}: eval.targets[{i}] needs name and path (and may set dtype, device, "
                             f"chat_template_kwargs, backend, gguf); got {sorted(t)}")
        if t.get("backend", "transformers") not in (*BACKENDS, "auto"):
            raise InputError(f"{where}: eval.targets[{i}].backend {t['backend']!r}; expected one of "
                             f"{sorted(BACKENDS) + ['auto']}")
    if "ooo" in cfg.methods and not cfg.sidecar:
        raise InputError(f"{where}: eval.methods has 'ooo' but eval.sidecar is not set (model, adapter)")
    return cfg


def run(cfg: Config) -> Path:
    """Decode every missing row, render the report and print its summary; returns the run folder."""
    interrupt_on_sigterm()
    run_dir = decode(cfg)
    from ..eval.report import render

    render(run_dir, drop_busy=cfg.drop_busy_rows)
    print((run_dir / "summary.md").read_text())
    return run_dir


def decode(cfg: Config) -> Path:
    run_dir = Path(cfg.out) / cfg.run
    methods = list(cfg.methods)
    if "ooo" in methods:  # a missing sidecar model or adapter stops the run once, before any target loads
        sidecar_kwargs(cfg.sidecar, "eval.sidecar")
    requests = benchmark_requests(cfg)
    sc = cfg.sidecar or None
    ident = sidecar_identity(sc) if sc and "ooo" in methods else None
    chunk, switch = wave_chunk(cfg.prefill_chunk, cfg.wave_chunk, cfg.layer_switch), bool(cfg.layer_switch)
    # rows accumulate over sessions: a sidecar row made with another adapter (or an unrecorded one), or an adaptive
    # row made with another prefill chunk beside the wave or another layer switch, is redone
    writer = ResumableJsonl(run_dir / "rows.jsonl", key="key",
                            redo=lambda row: stale_sidecar_row(row, ident, chunk, switch))
    done = writer.rows()  # by key: a finished ar row is the oracle's hint
    inputs = [Path(cfg.requests_root) / b / f"{cfg.split}.jsonl" for b in requests]
    old = run_dir / "manifest.json"  # rows accumulate over runs: keep the curves of targets measured before
    curves = dict(read_json(old).get("cost_curves") or {}) if old.is_file() else {}
    choices = dict(read_json(old).get("backend_choices") or {}) if old.is_file() else {}
    dtype, decoded = resolve_dtype("auto"), False
    try:
        for tcfg in cfg.targets:
            tname = tcfg["name"]
            tmethods = target_methods(cfg, tcfg)
            todo = [(b, r) for b, r in round_robin(requests)
                    if any(f"{tname}|{b}|{r['id']}|{v}" not in done
                           for v in (variant(m, s) for m, s in variants(tmethods, cfg.schedules)))]
            if not todo:
                continue
            decoded = True
            dtype = resolve_dtype(tcfg.get("dtype", "auto"), tcfg.get("device", "cpu"))
            target = None
            if tcfg.get("backend") == "auto":  # measured on this machine: the faster backend for ooo (else the
                target, choice = auto_target(cfg, tcfg, dtype)  # first method) runs every method of this target
                choices[tname] = choice.record()
                tcfg = {**tcfg, "backend": choice.backend, "backend_choice": choice.summary()}
                tmethods = target_methods(cfg, tcfg)
            eval_target(cfg, tcfg, todo, tmethods, dtype, writer, done, curves, ident, chunk, switch, run_dir,
                        target)
            release()  # the target, its runner, peers and caches are gone before the next target loads
    finally:
        writer.finish()  # also when stopped: the rows so far, whole, for the next run (and git) to continue
        if decoded or not old.is_file():  # a run that decoded nothing keeps the manifest of the run that did
            write_manifest(run_dir, "eval", cfg.recipe, inputs,
                           extra={"machine": machine(dtype, cfg.threads), "cost_curves": curves,
                                  "backend_choices": choices,
                                  "sidecar": ident,
                                  "git_commit": git_commit(run_dir)})
        seal(run_dir)
    return run_dir


def load_eval_target(cfg: Config, tcfg: dict, backend: str, dtype):
    """The target of one `eval.targets` entry on `backend`, on every core the run has."""
    from ..runtime.backend import load_target

    torch.set_num_threads(cfg.threads or len(available_cores()))
    kw = {"threads": cfg.threads or len(available_cores())} if backend == "llamacpp" else {}
    return load_target(backend, tcfg["path"], dtype=dtype, device=tcfg.get("device", "cpu"), gguf=tcfg.get("gguf"),
                       chat_template_kwargs=tcfg.get("chat_template_kwargs"), prefix_cache=cfg.prefix_cache, **kw)


def auto_target(cfg: Config, tcfg: dict, dtype):
    """`backend: auto`: (the target on the backend predicted faster here for the run's `ooo`, else its first
    method, and the `Choice`): pipeline/runtime/auto.py."""
    from ..runtime.auto import choose

    method = "ooo" if "ooo" in cfg.methods else cfg.methods[0]
    return choose(tcfg["path"], method, lambda backend: load_eval_target(cfg, tcfg, backend, dtype),
                  gguf=tcfg.get("gguf"), device=tcfg.get("device", "cpu"))


def eval_target(cfg: Config, tcfg: dict, todo: list, tmethods: list[str], dtype, writer, done: dict, curves: dict,
                ident: dict | None, chunk: int | None, switch: bool, run_dir: Path, target=None) -> None:
    """One target's rows. Everything it loads (target, runner, peers, sidecar workers, prefix cache, memo) lives in
    this call's frame only, so it can be freed before the next target loads (`release`): 14B then 32B on one 80 GB
    GPU must not hold both. A sidecar that cannot load on its device fails the run here (`Runner`). `target`: one
    `backend: auto` already loaded (on `tcfg`'s backend)."""
    tname = tcfg["name"]
    backend = tcfg.get("backend", "transformers")
    if target is None:
        target = load_eval_target(cfg, tcfg, backend, dtype)
    target.name = tname
    if cfg.tree_budget == "auto":
        curves[tname] = target.calibrate().as_dict()
    peers = make_peers(cfg, backend, target, dtype) if set(tmethods) & set(PEERS) else None
    sidecar = None
    sc = cfg.sidecar or None
    if sc and "ooo" in tmethods:
        sidecar = {"factory": FACTORY, "kwargs": sidecar_kwargs(sc, "eval.sidecar")}
    runner = None
    try:
        runner = Runner(target, tmethods, run=cfg.run, schedules=cfg.schedules, sidecar=sidecar,
                        peers=peers, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                        threads=cfg.threads, sidecar_timeout_s=SidecarConfig.from_section(sc or {}).timeout_s,
                        tree_budget=cfg.tree_budget, prefill_once=cfg.prefill_once,
                        prefill_chunk=cfg.prefill_chunk, wave_chunk=cfg.wave_chunk, layer_switch=switch)
        if cfg.warmup:
            runner.warmup(todo[0][1])
        mach = machine(dtype, cfg.threads)  # rows accumulate over sessions: each says where it ran
        where = {"cpu": mach["cpu"]["model"], "flags": mach["cpu"]["flags"], "torch": mach.get("torch"),
                 "dtype": mach.get("dtype"), "commit": git_commit(run_dir), **gpu_stamp(mach)}
        for bench, req in tqdm(todo, desc=f"eval {tname}", unit="req"):
            for row in runner.run(bench, req, done):
                stamp = {"sidecar": ident} if uses_sidecar(row["method"]) else {}
                if tcfg.get("backend_choice"):
                    stamp["backend_choice"] = tcfg["backend_choice"]
                if row.get("schedule") == "adaptive":
                    stamp["wave_chunk"] = chunk
                    if switch:
                        stamp["layer_switch"] = True
                writer.write({**row, "machine": where, **stamp})
    finally:
        if runner is not None:
            runner.close()
        if target.prefix_cache is not None:
            target.prefix_cache.clear()
        if target.memo is not None:
            target.memo.clear()
        if hasattr(target, "close"):  # llama.cpp: its context and model are freed now, not at garbage collection
            target.close()


def gpu_stamp(mach: dict) -> dict:
    """A row's GPU fields from `machine()` (model, driver, torch's CUDA version); nothing on a CPU-only machine."""
    gpu = mach.get("gpu")
    return {"gpu": gpu} if gpu else {}


def release() -> None:
    """Free what the last target left: reference cycles (the peers' forward hook holds the runner side) and the CUDA
    caching allocator's blocks, so the next target loads into an empty device."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def wave_chunk(prefill_chunk: int | None, chunk: int, layer_switch: bool = False) -> int | None:
    """The longest prefill chunk of an adaptive row while the wave holds a core (None: prefill is not chunked; with
    `layer_switch` the chunks stay whole: the core comes back between layers)."""
    if not prefill_chunk:
        return None
    return int(prefill_chunk) if layer_switch else min(int(prefill_chunk), int(chunk))


def stale_sidecar_row(row: dict, ident: dict | None, chunk: int | None = None, layer_switch: bool = False) -> bool:
    """True for a row of a sidecar method whose adapter is not the recipe's (by the weights' sha256), or unrecorded:
    its figures belong to another sidecar, so a resumed run measures it again; and for an adaptive row whose prefill
    chunk beside the wave (`wave_chunk`, None when unrecorded: rows before it prefilled whole chunks) is not `chunk`
    or whose `layer_switch` (unrecorded: false) is not the recipe's;
    a wave revision, `required_values` (unrecorded: false), `slot_tools`, the wave's `prefix_cache` (unrecorded: 0) or
    `prepack` (unrecorded: false) or `quantize` (unrecorded: none) other than the recipe's is redone too.
    Rows of every other method stay."""
    if not uses_sidecar(row.get("method", "")) or ident is None:
        return False
    if row.get("schedule") == "adaptive" and (row.get("wave_chunk") != chunk
                                               or row.get("layer_switch", False) != layer_switch):
        return True
    made = row.get("sidecar") or {}
    return (made.get("adapter_sha256") != ident["adapter_sha256"] or made.get("model") != ident["model"]
            or made.get("merged", False) != ident.get("merged", False) or made.get("wave", 1) != ident.get("wave", 1)
            or made.get("required_values", False) != ident.get("required_values", False)
            or made.get("slot_tools") != ident.get("slot_tools")
            or made.get("prefix_cache", 0) != ident.get("prefix_cache", 0)
            or made.get("prepack", False) != ident.get("prepack", False)
            or made.get("quantize") != ident.get("quantize"))


def target_methods(cfg: Config, tcfg: dict) -> list[str]:
    """The methods run on one target: the peers of its backend only, and no peer that would draft with a model no
    smaller than the target (the target itself, or a larger model: no one drafts that way)."""
    assistant = (cfg.assistant or {}).get("path")
    same = assistant and (Path(assistant).resolve() == Path(tcfg["path"]).resolve()
                          or _weights_bytes(assistant) >= _weights_bytes(tcfg["path"]) > 0)
    backend = tcfg.get("backend", "transformers")
    return [m for m in cfg.methods if not (m in ("hf-assisted", "llama-draft") and same)
            and PEER_BACKENDS.get(m, backend) == backend]


def _weights_bytes(folder: str) -> int:
    """The size of a model folder's safetensors (0 where it has none)."""
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def make_peers(cfg: Config, backend: str, target, dtype):
    """The peers of the target's backend: transformers' (`HFPeers`) or llama-cpp-python's (`LlamaCppPeers`, its
    draft model the assistant's GGUF: `eval.assistant.gguf`, else the assistant folder's source GGUF)."""
    assistant = cfg.assistant or {}
    if backend == "transformers":
        return HFPeers(target, assistant.get("path"), dtype, cfg.hf_pld_tokens)
    from ..eval.llamacpp_peers import LlamaCppPeers
    from ..runtime.backend import gguf_of

    draft = assistant.get("gguf") or (gguf_of(assistant["path"]) if assistant.get("path") else None)
    return LlamaCppPeers(target, draft, cfg.hf_pld_tokens)


def sidecar_identity(sc: dict) -> dict:
    """The sidecar a report names: model and adapter paths, the adapter weights' sha256, whether the adapter is
    folded into the base weights (rows measured before `merge_adapter` existed ran it unmerged), the wave's code
    revision (`wave.WAVE_REVISION`; rows without one ran revision 1)."""
    from ..io import sha256_file
    from ..sidecar.wave import WAVE_REVISION

    adapter = sc.get("adapter")
    weights = Path(adapter or "-") / "adapter_model.safetensors"
    kw = sidecar_kwargs(sc)
    return {"model": sc.get("model"), "adapter": adapter,
            "adapter_sha256": sha256_file(weights) if weights.is_file() else None,
            "merged": bool(adapter) and kw["merge_adapter"], "wave": WAVE_REVISION,
            "required_values": kw["required_values"], "slot_tools": kw["slot_tools"],
            "prefix_cache": kw["prefix_cache"], "prepack": kw["prepack"], "quantize": kw["quantize"]}


def git_commit(own: Path | None = None) -> str | None:
    """HEAD, with `+dirty` when a tracked file differs; the run's own folder `own` is left out (its committed rows
    are renamed to rows.jsonl.partial while the run writes them)."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        spec = ["--", ".", f":(exclude){own}"] if own is not None else []
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", *spec], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> Path:
    """The command line (the stage contract: pipeline/stages/__init__.py)."""
    return stage_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
