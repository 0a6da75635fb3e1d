"""A device-aware clock: wall time read only after the device has finished the work queued before it.

On a GPU a forward returns as soon as its kernels are queued; `time.perf_counter()` right after it measures the
launches, not the work (a prefill looks ~free and its real cost lands in whatever reads a tensor next: the first
verify of `ooo@split`, which then looks slower than the `ar` that was charged the too-small memoised figure). Every
timed region of the runtime, the eval's runner and the cost curve therefore reads `Clock.now()`, which synchronizes
the device first; on a CPU there is nothing to wait for and `now()` is `perf_counter()`.

Which call waits for which device kind is data (`SYNC`), not branches: a new accelerator is a table entry.
`Target.prefill`, `Target.verify` and `Target.keep` end with `clock.sync()`, so the decode loop's own
`perf_counter()` boundaries (pipeline/runtime/loop.py) already see finished work without reading the clock itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def _cuda_sync(device: torch.device) -> None:
    torch.cuda.synchronize(device)


def _mps_sync(device: torch.device) -> None:
    torch.mps.synchronize()


# device type -> the call that blocks until every kernel queued on that device has finished (None: synchronous)
SYNC: dict[str, Callable[[torch.device], None] | None] = {"cpu": None, "cuda": _cuda_sync, "mps": _mps_sync,
                                                          "meta": None}


class Clock:
    """`now()`: seconds (perf_counter) after the device's queued work is done; `sync()`: only the wait.

    sync: a replacement for the device's wait (tests record where it is called: a fake device on CPU)."""

    def __init__(self, device: torch.device | str = "cpu", sync: Callable[[], None] | None = None):
        self.device = torch.device(device)
        if sync is None:
            if self.device.type not in SYNC:
                raise ValueError(f"no synchronize rule for device {self.device} (known: {sorted(SYNC)}): "
                                 "add one to pipeline/runtime/clock.py SYNC")
            wait = SYNC[self.device.type]
            sync = (lambda: wait(self.device)) if wait is not None else None
        self._sync = sync
        self.syncs = 0  # how many times the device was waited for (a GPU run can check it is not zero)

    def sync(self) -> None:
        if self._sync is not None:
            self._sync()
            self.syncs += 1

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def __repr__(self) -> str:
        return f"Clock({self.device}, {'sync' if self._sync is not None else 'no sync'})"


def clock_of(obj) -> Clock:
    """The clock of a target (its `clock` attribute), else one for its `device` (replay targets and test doubles)."""
    clock = getattr(obj, "clock", None)
    if isinstance(clock, Clock):
        return clock
    return Clock(getattr(obj, "device", "cpu"))


__all__ = ["Clock", "SYNC", "clock_of"]
