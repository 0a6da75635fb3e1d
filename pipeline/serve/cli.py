"""`make serve`: the recipe's `serve:` section -> target, sidecar process, engine -> uvicorn.

Run as: python -m pipeline.serve --recipe recipes/serve/qwen2.5-coder-1.5b-cpu.yaml [serve.port=8001 ...]

Placement on CPU follows the eval stage's measured choice: with `placement: split` the target (and the HTTP server)
run on all cores but the last and the sidecar process on the last one; `colocated` puts both on every core.
A missing sidecar adapter is not fatal (the base model answers the wave, with a warning); a missing sidecar model
turns `ooo` into `toolspec` (same output, no hint), also with a warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.hardware import available_cores, pin, resolve_dtype
from pipeline.io import InputError, looks_like_hub_id
from pipeline.recipes import load_recipe, section
from pipeline.runtime import METHODS

from .engine import CALL_FORMATS, Engine

log = logging.getLogger("pipeline.serve")
PLACEMENTS = ("split", "colocated")
SIDECAR_KEYS = {"model", "adapter", "dtype", "max_value_tokens", "timeout_s", "device"}


@dataclass
class ServeConfig:
    target: str                          # model folder (or a Hub id on machines that can download)
    dtype: str = "auto"                  # auto: bfloat16 where native (AVX-512 BF16 / AMX / GPU), else float32
    device: str = "cpu"
    attn: str | None = None              # attention implementation; eager / sdpa verify token trees
    method: str = "ooo"                  # ar | pld | toolspec | ooo (the answer is the same; only speed differs)
    model_name: str | None = None        # the id clients send as `model` (default: the target folder's name)
    sidecar: dict = field(default_factory=dict)  # model, adapter, dtype, max_value_tokens, timeout_s, device
    call_format: str = "auto"            # how tool_choice required / named is forced: auto = the template's
    queue_size: int = 8                  # requests waiting behind the running one; more are refused with 503
    max_tokens: int = 256                # default max_tokens of a request
    max_context: int | None = None       # prompt limit in tokens (default: the model's max_position_embeddings)
    host: str = "127.0.0.1"
    port: int = 8000
    placement: str = "split"
    warmup: bool = True                  # one short generation (and one wave) before the port opens
    log_level: str = "info"

    @classmethod
    def from_recipe(cls, recipe: dict, where: str = "recipe") -> ServeConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        sec = section(recipe, "serve", known, where)
        if "target" not in sec:
            raise InputError(f"{where}: serve.target is required (a model folder)")
        cfg = cls(**sec)
        section({"sidecar": cfg.sidecar}, "sidecar", SIDECAR_KEYS, f"{where} serve")
        for key, value, allowed in (("method", cfg.method, METHODS[:-1]), ("placement", cfg.placement, PLACEMENTS),
                                    ("call_format", cfg.call_format, CALL_FORMATS)):
            if value not in allowed:
                raise InputError(f"{where}: serve.{key}={value!r}; expected one of {list(allowed)}")
        return cfg


def _exists(path) -> bool:
    return bool(path) and (Path(path).exists() or looks_like_hub_id(path))


def make_sidecar(cfg: ServeConfig, cores: list[int]):
    """(sidecar, method): the wave in its own process for `ooo`, or toolspec when the sidecar model is missing."""
    from pipeline.runtime import Sidecar
    from pipeline.sidecar.factory import FACTORY

    sc = cfg.sidecar
    if cfg.method != "ooo":
        return None, cfg.method
    if not _exists(sc.get("model")):
        log.warning("sidecar model %r not found: serving with method toolspec (same output, no hint); "
                    "build it with `make models`", sc.get("model"))
        return None, "toolspec"
    adapter = sc.get("adapter")
    if adapter and not _exists(adapter):
        log.warning("sidecar adapter %r not found: the sidecar runs its base model %s without it (hints are drafts; "
                    "output unchanged); train it with `make train`", adapter, sc["model"])
        adapter = None
    kwargs = {"model": sc["model"], "adapter": adapter, "dtype": sc.get("dtype", "auto"), "cores": cores,
              "max_value_tokens": sc.get("max_value_tokens"), "device": sc.get("device", "cpu")}
    return Sidecar(factory=FACTORY, factory_kwargs=kwargs, start_method="spawn",
                   timeout_s=float(sc.get("timeout_s", 60))), "ooo"


def warm_up(engine: Engine) -> None:
    """One short generation and one wave, so the first client does not pay for loading."""
    from pipeline.runtime import generate

    request = {"id": "warmup", "messages": [{"role": "user", "content": "hello"}], "tools": []}
    t0 = time.perf_counter()
    generate(engine.target, request, "ar", max_new_tokens=4)
    engine.target.histories.clear()
    if engine.sidecar is not None:
        pending = engine.sidecar.start(request)
        while pending.poll() is None and pending.error is None and time.perf_counter() - t0 < 600:
            time.sleep(0.05)
    log.info("warm-up done in %.1f s", time.perf_counter() - t0)


def build_engine(cfg: ServeConfig) -> Engine:
    from pipeline.runtime import Target

    if not _exists(cfg.target):
        raise InputError(f"serve.target {cfg.target!r} not found: build it first (`make models` for the CPU "
                         "targets, `python -m pipeline.testing DIR` for a tiny random one)")
    cores = available_cores()
    target_cores, sidecar_cores = (cores[:-1], cores[-1:]) if cfg.placement == "split" and len(cores) > 1 \
        else (cores, cores)
    pin(target_cores)
    sidecar, method = make_sidecar(cfg, sidecar_cores)
    t0 = time.perf_counter()
    target = Target.load(cfg.target, dtype=resolve_dtype(cfg.dtype, cfg.device), device=cfg.device, attn=cfg.attn)
    log.info("target %s loaded in %.1f s (%s, method %s)", cfg.target, time.perf_counter() - t0, target.dtype, method)
    engine = Engine(target, method, sidecar, model_name=cfg.model_name or Path(cfg.target).name,
                    queue_size=cfg.queue_size, max_tokens=cfg.max_tokens, max_context=cfg.max_context,
                    call_format=cfg.call_format)
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
    engine = build_engine(cfg)
    try:
        log.info("serving %s on http://%s:%d/v1 (queue %d)", engine.model_name, cfg.host, cfg.port, cfg.queue_size)
        uvicorn.run(create_app(engine), host=cfg.host, port=cfg.port, log_level=cfg.log_level)
    finally:
        engine.close()


__all__ = ["ServeConfig", "build_engine", "make_sidecar", "main"]
