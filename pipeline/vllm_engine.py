"""How a vLLM engine is set for the machine at hand, and how a dead engine is told from a bad request.

On vLLM's CPU build two defaults do not fit a small machine:
- `gpu_memory_utilization` (default 0.92) is the share of *RAM* the engine reserves for weights and KV cache: on a
  24 GiB machine it took 21.66 GiB and the engine then hung ("RPC call to execute_model timed out" after 6 min).
  `cpu_settings` gives the engine an explicit KV cache instead (`kv_cache_memory_bytes`, which vLLM's CPU worker
  honours before any share): `KV_CACHE_GIB` or a quarter of the RAM available, whichever is smaller. 4 GiB holds
  ~100k tokens of the 1.5B target (28 layers x 2 x 256 x bf16 = 28 KiB a token), far more than a CPU batch needs.
- `VLLM_CPU_OMP_THREADS_BIND=auto` keeps one core for the front end, so a 2-core machine decoded on one core (5
  requests, plain decoding: 59.8 s; bound to both cores 44.6 s). `cpu_settings` binds every core this process may
  run on: the offline front end only waits while the engine computes.
A recipe's own `vllm_kwargs` (`gpu_memory_utilization`, `kv_cache_memory_bytes`) or `env` (`VLLM_CPU_KVCACHE_SPACE`,
`VLLM_CPU_OMP_THREADS_BIND`) win; on a GPU nothing is changed. The settings are printed and go into the manifest.

`engine_dead(e)` says whether an exception means the engine is gone (every later request would fail the same way),
so a stage stops with that error instead of writing a row of it for every request left; `EngineWatch` turns an
engine process that exits during a call into that error instead of a call that never returns.
"""

from __future__ import annotations

import os

from .hardware import available_cores

KV_CACHE_GIB = 4
GIB = 1 << 30
# what the engine raises when its core process died or stopped answering (vllm.v1.engine.exceptions and the RPC layer)
DEAD_ENGINE_ERRORS = ("EngineDeadError", "EngineGenerateError")


def available_ram() -> int:
    """Bytes of RAM available now (MemAvailable), else the total; 0 where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f) if v.strip()}
        return info.get("MemAvailable") or info.get("MemTotal") or 0
    except (OSError, ValueError):
        return 0


def core_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (vLLM's VLLM_CPU_OMP_THREADS_BIND syntax)."""
    out, run = [], []
    for c in sorted(cores):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def cpu_settings(kwargs: dict, env: dict, *, ram: int | None = None, cores: list[int] | None = None,
                 environ=None) -> tuple[dict, dict, dict]:
    """(engine kwargs, environment, what was chosen) for a CPU engine: `kwargs` / `env` as the recipe gave them, with
    the KV cache and the thread binding added where neither the recipe nor the environment sets them."""
    environ = os.environ if environ is None else environ
    kwargs, env, chosen = dict(kwargs), {str(k): str(v) for k, v in env.items()}, {}
    memory_keys = ("gpu_memory_utilization", "kv_cache_memory_bytes")
    if not any(k in kwargs for k in memory_keys) and not (env.get("VLLM_CPU_KVCACHE_SPACE")
                                                          or environ.get("VLLM_CPU_KVCACHE_SPACE")):
        ram = available_ram() if ram is None else ram
        kv = min(KV_CACHE_GIB * GIB, ram // 4) if ram else KV_CACHE_GIB * GIB
        kwargs["kv_cache_memory_bytes"] = kv
        chosen["kv_cache_gib"] = round(kv / GIB, 2)
        chosen["ram_available_gib"] = round(ram / GIB, 2) if ram else None
    else:
        chosen["memory"] = "recipe/environment: " + ", ".join(
            f"{k}={kwargs[k]}" for k in memory_keys if k in kwargs) or "VLLM_CPU_KVCACHE_SPACE"
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND") or environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if not bind:
        bind = core_list(cores if cores is not None else available_cores())
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    chosen["threads_bind"] = bind
    return kwargs, env, chosen


def engine_settings(kwargs: dict, env: dict) -> tuple[dict, dict, dict]:
    """`cpu_settings` on vLLM's CPU platform; on any other platform the recipe's settings unchanged."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return dict(kwargs), dict(env), {"platform": str(current_platform.device_type)}
    kwargs, env, chosen = cpu_settings(kwargs, env)
    return kwargs, env, {"platform": "cpu", **chosen}


def engine_dead(e: BaseException) -> bool:
    """Whether `e` (or what it was raised from) says the engine itself died or hung, not that one request failed."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if isinstance(e, EngineFailed) or type(e).__name__ in DEAD_ENGINE_ERRORS or ("RPC call to" in text and "timed out" in text):
            return True
        e = e.__cause__ or e.__context__
    return False


class EngineFailed(RuntimeError):
    """The vLLM engine died or hung: the stage stops (non-zero exit), keeping the rows it wrote."""


class EngineWatch:
    """Watches the engine's processes (this process's children when the engine started) while a call runs in the
    main thread: vLLM's offline client waits for ever on an engine core that was killed (seen on vllm-cpu 0.32: a
    SIGKILLed core left the next `generate` blocked), so a process that exits interrupts the call, which then raises
    `EngineFailed` naming it.

        watch = EngineWatch.of_children()      # right after vllm.LLM(...)
        with watch:
            llm.generate(...)
    """

    def __init__(self, pids: list[int], every_s: float = 0.5):
        self.pids, self.every_s = list(pids), every_s
        self.dead: str | None = None
        self._stop = None

    @classmethod
    def of_children(cls) -> EngineWatch:
        import psutil

        return cls([p.pid for p in psutil.Process().children(recursive=True)])

    def check(self) -> str | None:
        """Why an engine process is gone (None while every one runs)."""
        import psutil

        for pid in self.pids:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return f"engine process {pid} exited"
            except psutil.NoSuchProcess:
                return f"engine process {pid} is gone"
        return None

    def __enter__(self) -> EngineWatch:
        import _thread
        import threading

        self._stop = threading.Event()

        def watch() -> None:
            while not self._stop.wait(self.every_s):
                why = self.check()
                if why:
                    self.dead = why
                    _thread.interrupt_main()  # the blocked call raises KeyboardInterrupt in the main thread
                    return

        why = self.check()
        if why:
            raise EngineFailed(why)
        threading.Thread(target=watch, daemon=True, name="engine-watch").start()
        return self

    def __exit__(self, kind, value, tb) -> bool:
        self._stop.set()
        if self.dead and (kind is None or issubclass(kind, (KeyboardInterrupt, Exception))):
            raise EngineFailed(self.dead) from value
        return False


__all__ = ["cpu_settings", "engine_settings", "engine_dead", "EngineFailed", "EngineWatch", "core_list", "KV_CACHE_GIB"]
