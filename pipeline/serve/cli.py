"""`make serve`: the recipe's `serve:` section -> target, sidecar process, engine -> uvicorn.

Run as: python -m pipeline.serve --recipe recipes/serve/qwen2.5-coder-1.5b-cpu.yaml [serve.port=8001 ...]

Cores follow the runtime's schedules (pipeline/runtime/schedule.py): `adaptive` (default) pins the sidecar process to
the last core and gives the target every core except while a wave computes; `deferred` does the same but starts the
wave when the prefill ends (the CPU recipe's choice); `split` keeps the target on n-1 cores; `colocated` puts both on
every core. The target's tree budget comes from its measured cost curve (cached per machine), and the prefix cache
reuses a shared prompt prefix (system prompt, the same tools) across requests.
With method `ooo`, a missing sidecar model or adapter folder stops start-up with an error that names it and the
command that builds it (`sidecar.adapter: null` runs the base model without an adapter).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.hardware import resolve_dtype
from pipeline.io import InputError, interrupt_on_sigterm, looks_like_hub_id
from pipeline.runtime.schedule import SCHEDULES, Schedule
from pipeline.sidecar.config import SidecarConfig
from pipeline.recipes import load_recipe, section
from pipeline.methods import METHOD_TABLE

from .engine import CALL_FORMATS, Engine
from .protocol import MAX_BODY_BYTES

log = logging.getLogger("pipeline.serve")
SERVABLE = tuple(m for m, spec in METHOD_TABLE.items() if not spec.upper_bound)  # an upper bound needs ar first


@dataclass
class ServeConfig:
    target: str                          # model folder (or a Hub id on machines that can download)
    backend: str = "transformers"        # transformers | llamacpp (llama.cpp over the folder's source GGUF; the
                                         # extra `llamacpp`: make setup-llamacpp) | auto (each installed backend
                                         # measured at start, the faster for `method` serves: runtime/auto.py;
                                         # ~1 min more start-up the first time on a machine, the curves are cached)
                                         # | vllm (vLLM's engine with the proposer inside:
                                         # pipeline/vllm_spec/serving.py; run from .venv-vllm)
    gguf: str | None = None              # llamacpp: the GGUF (default: the one `make models` converted the folder from)
    dtype: str = "auto"                  # auto: bfloat16 where native (AVX-512 BF16 / AMX / GPU), else float32
    device: str = "cpu"
    attn: str | None = None              # attention implementation; eager / sdpa verify token trees
    method: str = "ooo"                  # ar | pld | toolspec | ooo (the answer is the same; only speed differs)
    model_name: str | None = None        # the id clients send as `model` (default: the target folder's name)
    sidecar: dict = field(default_factory=dict)  # model, adapter, dtype, max_value_tokens, timeout_s, device
    call_format: str = "auto"            # how tool_choice required / named is forced: auto = the template's
    chat_template_kwargs: dict = field(default_factory=dict)  # the target's template variables (e.g. Qwen3's
                                         # {enable_thinking: false}); a request's body may set others over them
    queue_size: int = 8                  # requests waiting behind the running one; more are refused with 503
    max_tokens: int = 256                # default max_tokens of a request
    max_context: int | None = None       # prompt limit in tokens (default: the model's max_position_embeddings)
    host: str = "127.0.0.1"
    port: int = 8000
    schedule: str = "adaptive"           # pipeline/runtime/schedule.py: adaptive, deferred, sequential, split, ...
    tree_budget: str = "auto"            # auto: tree size per round from the measured cost curve; fixed: 32 nodes
    prefix_cache: bool = True            # reuse the KV cache of a shared prompt prefix across requests
    prefill_chunk: int | None = 256      # prefill in chunks: the adaptive schedule gives the core back mid-prefill
    layer_switch: bool = False           # adaptive: the core comes back between two decoder layers, not chunks
    request_timeout_s: float | None = 600.0  # a request still unanswered this long after its arrival ends with 504
    max_body_bytes: int = MAX_BODY_BYTES  # 8 MiB; a larger body is refused with 413 before it is read in full
    shared_history: bool = False         # true: every tenant's calls draft for every other (a timing side channel)
    history_tenants: int = 64            # tenants whose history is kept (LRU); a tenant = API key, else `user`
    history_outputs: int = 256           # outputs kept per tenant history
    shared_prefix_cache: bool = False    # true: tenants share the prefix caches' KV (a timing side channel); else
                                         # each tenant (and each body `cache_salt`) has its own partition
    num_speculative_tokens: int = 16     # vllm: the longest draft chain a step verifies (vLLM's K)
    vllm_kwargs: dict = field(default_factory=dict)  # vllm: more engine arguments (e.g. gpu_memory_utilization)
    warmup: bool = True                  # one short generation (and one wave) before the port opens
    log_level: str = "info"

    @classmethod
    def from_recipe(cls, recipe: dict, where: str = "recipe") -> ServeConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        sec = section(recipe, "serve", known, where)
        if "target" not in sec:
            raise InputError(f"{where}: serve.target is required (a model folder)")
        cfg = cls(**sec)
        if cfg.sidecar:
            SidecarConfig.from_section(cfg.sidecar, f"{where} serve.sidecar")
        from .protocol import TEMPLATE_RESERVED
        kw = cfg.chat_template_kwargs
        if not isinstance(kw, dict) or any(not isinstance(k, str) or k in TEMPLATE_RESERVED for k in kw):
            raise InputError(f"{where}: serve.chat_template_kwargs={kw!r}; expected a mapping of template variables "
                             f"(not {sorted(TEMPLATE_RESERVED)})")
        if not isinstance(cfg.max_body_bytes, int) or isinstance(cfg.max_body_bytes, bool) or cfg.max_body_bytes < 1:
            raise InputError(f"{where}: serve.max_body_bytes={cfg.max_body_bytes!r}; expected a number of bytes >= 1")
        for key, value, allowed in (("method", cfg.method, SERVABLE), ("schedule", cfg.schedule, SCHEDULES),
                                    ("call_format", cfg.call_format, CALL_FORMATS)):
            if value not in allowed:
                raise InputError(f"{where}: serve.{key}={value!r}; expected one of {list(allowed)}")
        return cfg


def _exists(path) -> bool:
    return bool(path) and (Path(path).exists() or looks_like_hub_id(path))


def make_sidecar(cfg: ServeConfig, cores: list[int]):
    """(sidecar, method): the wave in its own process for `ooo`; a missing sidecar model or adapter stops start-up."""
    from pipeline.runtime import Sidecar
    from pipeline.sidecar.factory import FACTORY, sidecar_kwargs

    if cfg.method != "ooo":
        return None, cfg.method
    kwargs = {**sidecar_kwargs(cfg.sidecar, "serve.sidecar"), "cores": cores}
    return Sidecar(factory=FACTORY, factory_kwargs=kwargs, start_method="spawn",
                   timeout_s=SidecarConfig.from_section(cfg.sidecar).timeout_s), "ooo"


def warm_up(engine: Engine) -> None:
    """One short generation and one wave, so the first client does not pay for loading (`pipeline.runtime.warm_up`:
    the same warm-up the eval's runner does)."""
    from pipeline.runtime import generate
    from pipeline.runtime import warm_up as runtime_warm_up

    request = {"id": "warmup", "messages": [{"role": "user", "content": "hello"}], "tools": []}
    t0 = time.perf_counter()
    if hasattr(engine.target, "generate"):  # an engine target (vLLM) decodes itself
        decode = lambda: engine.target.generate(engine.target, request, engine.method, max_new_tokens=4)  # noqa: E731
    else:
        decode = lambda: generate(engine.target, request, "ar", max_new_tokens=4)  # noqa: E731
    runtime_warm_up(engine.target, request, [decode], [engine.sidecar])
    log.info("warm-up done in %.1f s", time.perf_counter() - t0)


def build_engine(cfg: ServeConfig) -> Engine:
    from pipeline.runtime.backend import BACKENDS, load_target

    if cfg.backend not in (*BACKENDS, "auto", "vllm"):
        raise InputError(f"serve.backend {cfg.backend!r}; expected one of {sorted(BACKENDS) + ['auto', 'vllm']}")
    if not _exists(cfg.target):
        raise InputError(f"serve.target {cfg.target!r} not found: build it first (`make models` for the CPU "
                         "targets, `python -m pipeline.testing DIR` for a tiny random one)")
    if cfg.backend == "vllm":
        return build_vllm_engine(cfg)
    schedule = Schedule.on(cfg.schedule, layer_switch=cfg.layer_switch)
    sidecar, method = make_sidecar(cfg, schedule.sidecar_cores)
    t0 = time.perf_counter()

    def load(backend: str):
        kw = {"attn": cfg.attn} if backend == "transformers" else {"gguf": cfg.gguf}
        target = load_target(backend, cfg.target, dtype=resolve_dtype(cfg.dtype, cfg.device), device=cfg.device,
                             prefix_cache=cfg.prefix_cache, chat_template_kwargs=cfg.chat_template_kwargs, **kw)
        target.set_threads(schedule.threads(None))
        return target

    try:
        if cfg.backend == "auto":
            from pipeline.runtime.auto import choose

            target, _ = choose(cfg.target, method, load, gguf=cfg.gguf, device=cfg.device)
        else:
            target = load(cfg.backend)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # no GGUF, a GGUF that does not load, a device
        raise InputError(f"serve.target {cfg.target!r} (backend {cfg.backend}): {e}") from e
    if cfg.tree_budget == "auto":
        curve = target.calibrate()
        log.info("cost curve (s per forward of %s tree tokens): %s", list(curve.sizes),
                 [round(x, 3) for x in curve.seconds])
    log.info("target %s loaded in %.1f s (%s, method %s)", cfg.target, time.perf_counter() - t0,
             getattr(target, "dtype", cfg.backend), method)
    engine = Engine(target, method, sidecar, model_name=cfg.model_name or Path(cfg.target).name,
                    queue_size=cfg.queue_size, max_tokens=cfg.max_tokens,
                    max_context=cfg.max_context or getattr(target, "max_context", None),
                    call_format=cfg.call_format, schedule=schedule, prefill_chunk=cfg.prefill_chunk,
                    request_timeout_s=cfg.request_timeout_s, shared_history=cfg.shared_history,
                    history_tenants=cfg.history_tenants, history_outputs=cfg.history_outputs,
                    shared_prefix_cache=cfg.shared_prefix_cache)
    if cfg.warmup:
        warm_up(engine)
    return engine


def build_vllm_engine(cfg: ServeConfig) -> Engine:
    """vLLM's engine with the proposer inside (pipeline/vllm_spec/serving.py); the sidecar is its wave service,
    pinned to the last core on a CPU (vLLM's threads are bound to every core)."""
    from pipeline.hardware import available_cores
    from pipeline.sidecar.factory import sidecar_kwargs

    try:
        from pipeline.vllm_spec.serving import VllmTarget
    except ImportError as e:
        raise InputError(f"serve.backend vllm: {e}; run the server from vLLM's environment (make vllm-setup; "
                         "make serve runs .venv-vllm/bin/python for a vllm recipe)") from e
    sidecar = None
    if cfg.method == "ooo":
        sidecar = sidecar_kwargs(cfg.sidecar, "serve.sidecar")
        if cfg.device == "cpu":
            sidecar["cores"] = available_cores()[-1:]
    t0 = time.perf_counter()
    target = VllmTarget(cfg.target, method=cfg.method, sidecar=sidecar, dtype=resolve_dtype(cfg.dtype, cfg.device),
                        k=cfg.num_speculative_tokens, chat_template_kwargs=cfg.chat_template_kwargs,
                        engine_kwargs=cfg.vllm_kwargs, max_context=cfg.max_context)
    log.info("vLLM target %s loaded in %.1f s (method %s)", cfg.target, time.perf_counter() - t0, cfg.method)
    engine = Engine(target, cfg.method, None, model_name=cfg.model_name or Path(cfg.target).name,
                    queue_size=cfg.queue_size, max_tokens=cfg.max_tokens, max_context=target.max_context,
                    call_format=cfg.call_format, request_timeout_s=cfg.request_timeout_s,
                    shared_history=cfg.shared_history, shared_prefix_cache=cfg.shared_prefix_cache)
    if cfg.warmup:
        warm_up(engine)
    return engine


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from .app import create_app

    ap = argparse.ArgumentParser(prog="python -m pipeline.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True, help="a recipes/serve/*.yaml file")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. serve.port=8001 serve.method=toolspec")
    args = ap.parse_args(argv)
    cfg = ServeConfig.from_recipe(load_recipe(args.recipe, args.overrides), args.recipe)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn handles SIGTERM (graceful shutdown) and then raises it again: with the default handler the process
    # would die there, skipping `engine.close()` and leaving the sidecar worker and multiprocessing's resource
    # tracker running with the model loaded; raised as KeyboardInterrupt, the `finally` below stops them
    interrupt_on_sigterm()
    engine = build_engine(cfg)
    try:
        log.info("serving %s on http://%s:%d/v1 (queue %d)", engine.model_name, cfg.host, cfg.port, cfg.queue_size)
        uvicorn.run(create_app(engine, cfg.max_body_bytes), host=cfg.host, port=cfg.port, log_level=cfg.log_level)
    except KeyboardInterrupt:  # SIGTERM or Ctrl-C after uvicorn's graceful shutdown: a normal stop
        log.info("stopped by a signal")
    finally:
        engine.close()


__all__ = ["ServeConfig", "build_engine", "make_sidecar", "main"]
