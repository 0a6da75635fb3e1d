"""The sidecar wave in its own process, polled without blocking; stalls, crashes and garbage cost nothing but speed.

The wave contract: a callable `wave(request: dict) -> dict` returning the payload
`{"tool_index": <0-based index into request["tools"]>, "arguments": {...}}` (an optional "name" wins over the index).
It runs in a worker process so the target keeps decoding while the wave runs (the overlap is real):
- `Sidecar(wave)` with the default "fork" start method accepts any callable (closures too);
- `Sidecar(factory="pkg.module:make_wave", factory_kwargs={...}, start_method="spawn")` builds the wave inside
  the worker once (e.g. loads a model), so every request reuses it.
`sidecar.start(request)` sends the request and returns a `Pending` at once; `pending.cancel()` drops a queued wave and
abandons a running one at its next decode step (a wave callable that accepts `cancelled=` is handed a check; one that
raises `WaveCancelled` is reported as cancelled); `pending.poll()` returns the payload
once ready, else None; `pending.running()` says whether the wave is still in flight (the adaptive schedule gives the
target the sidecar's core back the moment it answers); `pending.cpu_s` is the wave's CPU time (charged to the method that uses it). Timeouts, a worker that dies, exceptions and payloads that are not JSON set
`pending.error` (logged by the caller) and the loop simply goes on without a hint.
`sidecar.wait_loaded()` blocks until the worker has built its wave and raises `SidecarLoadError` (naming the device
and the worker's error) when it cannot: the eval calls it so that a sidecar that fails to load stops the run instead
of measuring `ooo` without a hint.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import logging
import multiprocessing as mp
import os
import queue
import time

from ..sidecar.config import SidecarConfig

DEFAULT_TIMEOUT_S = SidecarConfig.timeout_s  # a wave slower than this is dropped (`sidecar.timeout_s`)

log = logging.getLogger("pipeline.runtime")
PARENT_CHECK_S = 1.0  # an idle worker checks this often that its parent is alive (an orphan exits)


def load_factory(spec: str):
    """'package.module:function' -> the function."""
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"sidecar factory {spec!r}: expected 'package.module:function'")
    return getattr(importlib.import_module(module), name)


class WaveCancelled(Exception):
    """Raised inside a wave whose request has ended (the worker reports it as cancelled)."""


def takes_cancelled(wave) -> bool:
    """Whether a wave callable accepts `cancelled=` (a check it calls between decode steps)."""
    try:
        return "cancelled" in inspect.signature(wave).parameters
    except (TypeError, ValueError):
        return False


def _worker(wave, factory, factory_kwargs, inbox, outbox, cancel_through) -> None:
    if factory is not None:
        try:
            wave = load_factory(factory)(**(factory_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which ignores the sidecar
            outbox.put((None, "error", f"sidecar factory failed: {e!r}", time.time(), None))
            return
    outbox.put((None, "loaded", "", time.time(), None))  # `Sidecar.wait_loaded` returns on this
    checks = takes_cancelled(wave)
    parent = os.getppid()
    while True:
        try:
            item = inbox.get(timeout=PARENT_CHECK_S)
        except queue.Empty:
            if os.getppid() != parent:  # the parent died without closing us (SIGKILL, OOM killer): do not linger
                return
            continue
        if item is None:
            return
        rid, request = item
        if rid <= cancel_through.value:  # its request ended while it waited: never started
            outbox.put((rid, "cancelled", "", time.time(), 0.0))
            continue
        cpu0 = time.process_time()
        try:
            out = wave(request, cancelled=lambda r=rid: r <= cancel_through.value) if checks else wave(request)
            outbox.put((rid, "ok", json.dumps(out), time.time(), time.process_time() - cpu0))
        except WaveCancelled:  # abandoned at a decode step: its request ended
            outbox.put((rid, "cancelled", "", time.time(), time.process_time() - cpu0))
        except Exception as e:  # noqa: BLE001 - a failing wave is a missing hint, never a failed request
            outbox.put((rid, "error", repr(e), time.time(), time.process_time() - cpu0))


class SidecarLoadError(RuntimeError):
    """The worker could not build its wave (the factory raised, the process died, or it did not load in time)."""


class Pending:
    """One request's wave in flight."""

    def __init__(self, sidecar: Sidecar, rid: int, timeout_s: float):
        self.sidecar, self.rid, self.timeout_s = sidecar, rid, timeout_s
        self.started = time.perf_counter()
        self.payload = None
        self.error: str | None = None
        self.done_s: float | None = None
        self.ready_wall: float | None = None  # wall clock (time.time) when the worker finished the wave
        self.cpu_s: float | None = None       # CPU seconds of the worker process for this wave
        self.cancelled = False

    def cancel(self) -> None:
        """The request no longer wants its wave (it ended, or its output is past the arguments): a queued wave is
        dropped, a running one abandoned at its next decode step, and a late answer discarded. Idempotent."""
        if self.cancelled or self.payload is not None or self.error is not None:
            return
        self.cancelled = True
        self.sidecar.cancel(self.rid)

    def running(self) -> bool:
        """Whether this request's wave is still in flight: sent at the request's arrival and neither answered nor
        cancelled (a wave the worker has not picked up yet is about to compute: the adaptive schedule must not give
        its core to the target's prefill; waves of ended requests are cancelled, so it is never another's). Never
        blocks."""
        if self.payload is not None or self.error is not None or self.done_s is not None or self.cancelled:
            return False
        self.sidecar._drain()
        return self.rid not in self.sidecar._results and self.sidecar.alive()

    def wait(self, limit_s: float = 600.0):
        """Block until the wave answers, fails or `limit_s` passes (warm-ups: a worker loading its model); returns
        the payload or None."""
        end = time.perf_counter() + limit_s
        while self.poll() is None and self.error is None and time.perf_counter() < end:
            time.sleep(0.02)
        return self.payload

    def poll(self):
        """The payload if it has arrived, else None. Never blocks."""
        if self.payload is not None or self.error is not None or self.cancelled:
            return self.payload
        self.sidecar._drain()
        msg = self.sidecar._results.pop(self.rid, None)
        if msg is not None:
            status, body, self.ready_wall, self.cpu_s = msg
            self.done_s = time.perf_counter() - self.started
            if status == "cancelled":
                self.error = "sidecar wave cancelled"
                return None
            if status != "ok":
                self.error = f"sidecar wave failed: {body}"
                return None
            try:
                self.payload = json.loads(body)
            except ValueError:
                self.error = "sidecar returned text that is not JSON"
            if self.payload is None and self.error is None:
                self.error = "sidecar returned null"
            return self.payload
        if not self.sidecar.alive():
            self.error = f"sidecar process died (exit code {self.sidecar.exitcode()})"
        elif time.perf_counter() - self.started > self.timeout_s:
            self.error = f"sidecar timed out after {self.timeout_s:.1f} s"
            self.sidecar.stop()  # a stuck wave must not block the next request
        return None


class Ready:
    """A hint that is there from the start (ooo-oracle, gold hints): same interface as `Pending`."""

    error = None
    cpu_s = None

    def __init__(self, payload):
        self.payload = payload
        self.ready_wall = time.time()

    def poll(self):
        return self.payload

    def running(self) -> bool:
        return False

    def cancel(self) -> None:
        pass


class Sidecar:
    def __init__(self, wave=None, *, factory: str | None = None, factory_kwargs: dict | None = None,
                 start_method: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        if (wave is None) == (factory is None):
            raise ValueError("Sidecar needs exactly one of wave= (a callable) or factory= ('module:function')")
        self.wave, self.factory, self.factory_kwargs = wave, factory, factory_kwargs
        methods = mp.get_all_start_methods()
        self.ctx = mp.get_context(start_method or ("fork" if "fork" in methods else "spawn"))
        self.timeout_s = timeout_s
        self._ids = itertools.count()
        self._proc = None
        self._results: dict[int, tuple[str, str, float, float | None]] = {}
        self._cancel = self.ctx.Value("q", -1)  # waves with id <= this are cancelled (requests run one at a time)
        self.restarts = 0                      # workers started after the first (a crash, a stuck wave)
        self._started_at: float | None = None
        self._retry_at = 0.0                   # no new worker before this (back-off after quick deaths)
        self._quick = 0                        # deaths in a row within a minute of their start
        self.loaded = False                    # the current worker has built its wave
        self.load_error: str | None = None     # what the current worker's factory raised

    def _ensure(self) -> bool:
        """Start the worker if it is not running. A worker that died (or was stopped) within a minute of its start
        is restarted at once the first time, then after a back-off of 1, 2, 4 ... 60 s (a crash-looping factory must
        not load its model on every request); False while in back-off."""
        if self._proc is not None and self._proc.is_alive():
            return True
        now = time.perf_counter()
        if self._started_at is not None:  # a worker ran and is gone
            if self._retry_at == 0.0:     # noticed now: decide when to try again
                self._quick = 0 if now - self._started_at > 60 else self._quick + 1
                self._retry_at = now + (0.0 if self._quick <= 1 else min(2.0 ** (self._quick - 2), 60.0))
            if now < self._retry_at:
                return False
            self._retry_at = 0.0
            self.restarts += 1
        self.stop()
        self._inbox, self._outbox = self.ctx.Queue(), self.ctx.Queue()
        self._proc = self.ctx.Process(target=_worker, daemon=True,
                                      args=(self.wave, self.factory, self.factory_kwargs, self._inbox, self._outbox,
                                            self._cancel))
        self.loaded, self.load_error = False, None
        self._proc.start()
        self._started_at = time.perf_counter()
        return True

    def device(self) -> str:
        """Where the wave runs (the factory's `device` argument; a wave callable runs on the CPU)."""
        return str((self.factory_kwargs or {}).get("device", "cpu"))

    def wait_loaded(self, limit_s: float = 900.0) -> None:
        """Start the worker and block until its wave is built; raises `SidecarLoadError` naming the device and the
        worker's error when the factory fails, the process dies or `limit_s` passes. Callers for which a sidecar that
        cannot load must not turn `ooo` into `toolspec` (the eval) call it before any clock starts."""
        end = time.perf_counter() + limit_s
        if not self._ensure():
            raise SidecarLoadError(f"sidecar on {self.device()} is down after {self.restarts} restart(s)")
        while True:
            self._drain()
            if self.loaded:
                return
            if self.load_error is not None:
                break
            if not self._proc.is_alive():
                self._drain()  # the error may have arrived just before the exit
                if self.loaded or self.load_error is not None:
                    continue
                self.load_error = f"worker process exited with code {self._proc.exitcode} before loading"
                break
            if time.perf_counter() > end:
                self.load_error = f"not loaded after {limit_s:.0f} s"
                break
            time.sleep(0.02)
        error = self.load_error
        self.stop()
        raise SidecarLoadError(f"sidecar ({self.factory or 'wave callable'}) could not load on device "
                               f"{self.device()}: {error}")

    def start(self, request: dict) -> Pending:
        """Send `request` to the wave (starting the worker if needed); returns at once. While a dead worker is in
        its back-off the Pending fails at once ("sidecar down") and the request goes on without a hint."""
        rid = next(self._ids)
        pending = Pending(self, rid, self.timeout_s)
        if not self._ensure():
            pending.error = f"sidecar down (restarting in {max(0.0, self._retry_at - time.perf_counter()):.0f} s)"
            return pending
        self._inbox.put((rid, request))
        return pending

    def status(self) -> str:
        """"up", "down" (died; restarting after its back-off) or "idle" (never started)."""
        if self.alive():
            return "up"
        return "down" if self._started_at is not None else "idle"

    def cancel(self, rid: int) -> None:
        """Cancel wave `rid` and every earlier one: requests run one at a time, so an earlier wave's request has
        ended too. Results nobody waits for are dropped."""
        with self._cancel.get_lock():
            self._cancel.value = max(self._cancel.value, rid)
        for done in [r for r in self._results if r <= rid]:
            del self._results[done]

    def _drain(self) -> None:
        while self._proc is not None:
            try:
                rid, status, body, at, cpu = self._outbox.get_nowait()
            except queue.Empty:
                return
            except (EOFError, OSError):
                return
            if rid is None:  # about the worker, not a wave: loaded, or its factory failed
                if status == "loaded":
                    self.loaded = True
                else:
                    self.load_error = body
                    log.warning("%s", body)
                continue
            if rid <= self._cancel.value:
                continue  # cancelled: nobody waits for it
            self._results[rid] = (status, body, at, cpu)

    def pid(self) -> int | None:
        return self._proc.pid if self.alive() else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def exitcode(self):
        return None if self._proc is None else self._proc.exitcode

    def stop(self) -> None:
        """End the worker (the next `start` begins a fresh one)."""
        if self._proc is None:
            return
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=5)
        self._proc = None
        self._results.clear()

    def close(self) -> None:
        if self.alive():
            try:
                self._inbox.put(None)
                self._proc.join(timeout=2)
            except (OSError, ValueError):
                pass
        self.stop()

    def __enter__(self) -> Sidecar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
