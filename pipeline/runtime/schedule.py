"""Where the target and the sidecar compute on a CPU: the schedules `ooo` is measured under, on the same cores.

- `all-cores`: the target uses every core (the baselines: a user running plain decoding gets the whole machine);
- `split`: the target on n-1 cores, the sidecar on the last one (the analogue of the paper's separate GPUs);
- `colocated`: target and sidecar both use every core (they contend while the wave runs);
- `adaptive`: the sidecar on the last core; the target uses every core except while the wave is computing (the
  wave counts as running from the request's arrival until it answers or is cancelled; the target changes its thread
  count between prefill chunks and at round boundaries, and while the wave computes its prefill chunks are at most
  `wave_chunk` tokens: a chunk cannot give the core back before it ends, and 256 tokens of a 1.5B target on one
  core take ~3.5 s, twice a trained wave); with `layer_switch` the target asks before every decoder layer of a
  prefill forward instead (a layer of a 256-token chunk of the 1.5B on one core: ~0.1 s), so its chunks stay whole
  and the core comes back a layer, not a chunk, after the wave answers;
- `sequential`: the wave first, on every core, then the target on every core (no overlap: the honest reference for
  whether overlapping the two buys anything on a small machine);
- `deferred`: the target prefills on every core, then the wave starts on the last core while the target decodes on
  the others, and the target gets every core back when the wave answers. On a CPU a prefill is compute-bound (one
  core less costs it half its speed) while a decode round is partly bound by memory (a 1.5B target's round: 0.20 s
  on 2 cores, 0.35 s on 1, 0.36 s on 1 beside a running wave), so a wave costs the target less beside its decode
  than beside its prefill; the hint comes later, while the call's first tokens (its name, scaffolding) are written.
A schedule gives the sidecar's cores (where its worker is pinned) and, through `threads(pending)`, the target's
thread count before prefill and at every round boundary (see `generate(schedule=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.hardware import available_cores

SCHEDULES = ("all-cores", "split", "colocated", "adaptive", "sequential", "deferred")
WAVE_CHUNK = 64  # the default longest prefill chunk while the target runs on n-1 cores beside the wave (adaptive)


@dataclass
class Schedule:
    name: str
    cores: list[int]
    wave_chunk: int = WAVE_CHUNK
    layer_switch: bool = False  # adaptive: the threads may go back to n between two decoder layers of a prefill

    def __post_init__(self):
        if self.name not in SCHEDULES:
            raise ValueError(f"schedule {self.name!r}; expected one of {SCHEDULES}")

    @classmethod
    def on(cls, name: str, threads: int | None = None, wave_chunk: int = WAVE_CHUNK,
           layer_switch: bool = False) -> Schedule:
        cores = available_cores()
        return cls(name, cores[:threads] if threads else cores, wave_chunk=wave_chunk, layer_switch=layer_switch)

    @property
    def sequential(self) -> bool:
        """The target waits for the wave (answered, failed or timed out) before its prefill."""
        return self.name == "sequential"

    @property
    def deferred(self) -> bool:
        """The wave starts when the target's prefill ends (the prefill is the baselines' own, on every core)."""
        return self.name == "deferred"

    @property
    def sidecar_cores(self) -> list[int]:
        """The cores the sidecar worker is pinned to."""
        if self.name in ("split", "adaptive", "deferred") and len(self.cores) > 1:
            return self.cores[-1:]
        return list(self.cores)

    def chunk(self, threads: int, chunk: int | None) -> int | None:
        """The next prefill chunk's length: at most `wave_chunk` while `adaptive` holds a core for the wave (the
        target on fewer than every core) unless the cores come back between layers (`layer_switch`), else `chunk`
        (None: the rest of the prompt in one forward)."""
        if self.name == "adaptive" and chunk and threads < len(self.cores) and not self.layer_switch:
            return min(int(chunk), self.wave_chunk)
        return chunk

    def threads(self, pending) -> int:
        """The target's threads now: n-1 under `split`, and under `adaptive` / `deferred` while the wave computes."""
        n = len(self.cores)
        if n > 1 and (self.name == "split" or (self.name in ("adaptive", "deferred") and pending is not None
                                                and getattr(pending, "running", lambda: False)())):
            return n - 1
        return n


__all__ = ["Schedule", "SCHEDULES", "WAVE_CHUNK"]
