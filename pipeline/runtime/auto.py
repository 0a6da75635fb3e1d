"""`backend: auto`: the target backend that runs a method fastest on this machine, chosen by measurement.

Which backend wins depends on the CPU (docs/experiments.md): on an AVX2-only CPU llama.cpp's quantized kernels are far
faster than torch; with AVX-512 BF16 the two are close; on Intel AMX torch's oneDNN runs bf16 on AMX and a verify of
32 tokens costs little more than one step, so the transformers path wins by a wide margin. So nothing here is a rule
per CPU: at start every installed backend loads the target and measures, on this machine,
- its cost curve (one forward of k tree tokens after a 512-token cache: what the tree budget reads anyway) and
- its prefill rate (the curve's 512-token prompt, timed),
and the request time of the method is predicted on each as

    prefill_s / 512 * prompt_tokens  +  new_tokens / tokens_per_forward * cost(tree_tokens)

with the workload's figures per backend and method (`WORKLOAD`: what the committed CPU tables measured per request;
a recipe may give its own). The faster backend serves; the other is closed. `Choice.record()` is what the server's
`/health`, the eval's rows and its manifest keep: the choice, both predictions, the curves and the CPU's flags.

A backend is a candidate where it can run: transformers always; llama.cpp where llama-cpp-python imports and the
model folder's GGUF is there (`make setup-llamacpp`, `make models`). A candidate that fails to load is recorded with
its error and the others still compete; a recipe that names its backend skips all of this.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("pipeline.runtime.auto")

# Per request, as the committed CPU tables measured them (eval/results/cpu and eval/results/cpu-llamacpp, the
# Qwen2.5-Coder-1.5B target on 52 test requests): prompt tokens not in the prefix cache, new tokens, and per backend
# and method the tokens one forward commits and the tree tokens it verifies (the tree budget chose those sizes from
# that machine's curve; a flatter curve buys larger trees, so these figures undersell the flatter backend).
WORKLOAD = {
    "prompt_tokens": 462,
    "new_tokens": 52,
    "methods": {
        "transformers": {"ar": (1.0, 1), "pld": (1.37, 2.5), "toolspec": (3.19, 6.2), "ooo": (4.73, 9.1)},
        "llamacpp": {"ar": (1.0, 1), "pld": (1.06, 1.1), "toolspec": (1.95, 2.6), "ooo": (2.92, 4.1)},
    },
}


@dataclass
class Estimate:
    backend: str
    prefill_s: float | None = None   # predicted prefill of the workload's prompt
    decode_s: float | None = None    # predicted decode of its new tokens with the method
    curve: dict | None = None
    error: str | None = None         # why the backend is not a candidate (not installed, failed to load)

    @property
    def total_s(self) -> float | None:
        return None if self.prefill_s is None else self.prefill_s + self.decode_s

    def as_dict(self) -> dict:
        out = {"backend": self.backend}
        if self.error is not None:
            return {**out, "error": self.error}
        return {**out, "predicted_s": round(self.total_s, 4), "prefill_s": round(self.prefill_s, 4),
                "decode_s": round(self.decode_s, 4), "curve": self.curve}


@dataclass
class Choice:
    backend: str
    method: str
    estimates: list[Estimate]
    cpu: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)

    def record(self) -> dict:
        """What the server's /health, the eval's manifest and rows keep of the choice."""
        won = next(e for e in self.estimates if e.backend == self.backend)
        others = [e for e in self.estimates if e.backend != self.backend and e.total_s is not None]
        why = (f"{self.method} predicted {won.total_s:.2f} s per request on {self.backend}"
               + "".join(f" vs {e.total_s:.2f} s on {e.backend}" for e in others)
               + ("" if others else " (the only backend that could run here)"))
        return {"choice": self.backend, "method": self.method, "why": why,
                "estimates": [e.as_dict() for e in self.estimates], "cpu": self.cpu,
                "workload": {"prompt_tokens": self.workload.get("prompt_tokens"),
                             "new_tokens": self.workload.get("new_tokens")}}

    def summary(self) -> dict:
        """The short form an eval row carries: the choice and each backend's predicted seconds."""
        return {"choice": self.backend,
                "predicted_s": {e.backend: (None if e.total_s is None else round(e.total_s, 4))
                                for e in self.estimates}}


def predict(curve, method: str, backend: str, workload: dict = WORKLOAD) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of the workload's request with `method` on a backend whose cost curve is
    `curve` (a `budget.CostCurve` with its prefill timed: meta prefill_s over meta past tokens)."""
    table = workload["methods"].get(backend) or workload["methods"]["transformers"]
    per_forward, tree = table.get(method) or table.get("ooo" if method.startswith("ooo") else "ar")
    prefill = curve.meta["prefill_s"] / curve.meta["past"] * workload["prompt_tokens"]
    decode = workload["new_tokens"] / per_forward * curve.cost(max(1, round(tree)))
    return prefill, decode


def candidates(path: str, gguf: str | None = None, device: str = "cpu") -> list[tuple[str, str | None]]:
    """(backend, None) for each backend that can run the model folder on `device` here; (backend, why not) for the
    others."""
    from pathlib import Path

    from .backend import gguf_of

    try:
        if device != "cpu":
            raise RuntimeError(f"llama.cpp runs on the CPU, not {device}")
        import llama_cpp  # noqa: F401
        if gguf is None:
            gguf_of(path)
        elif not Path(gguf).is_file():
            raise FileNotFoundError(f"{gguf}: no such GGUF")
    except ImportError:
        return [("transformers", None), ("llamacpp", "llama-cpp-python is not installed (make setup-llamacpp)")]
    except (RuntimeError, FileNotFoundError) as e:
        return [("transformers", None), ("llamacpp", str(e))]
    return [("transformers", None), ("llamacpp", None)]


def choose(path: str, method: str, load: Callable[[str], object], gguf: str | None = None, device: str = "cpu",
           workload: dict | None = None, only: list[tuple[str, str | None]] | None = None):
    """(the loaded target of the faster backend, its `Choice`). `load(backend)` loads and returns a target (its
    threads set as it will serve); each is calibrated (`calibrate()`: the cost curve, cached per machine, with
    its prefill timed), the others are closed."""
    from pipeline.hardware import cpu_info

    workload = workload or WORKLOAD
    estimates, loaded = [], {}
    for backend, why_not in only if only is not None else candidates(path, gguf, device):
        if why_not is not None:
            estimates.append(Estimate(backend, error=why_not))
            continue
        try:
            target = load(backend)
            curve = target.calibrate()
            prefill, decode = predict(curve, method, backend, workload)
        except Exception as e:  # noqa: BLE001 - a backend that cannot load or measure is no candidate
            log.warning("backend auto: %s cannot run %s here: %s", backend, path, e)
            estimates.append(Estimate(backend, error=f"{type(e).__name__}: {e}"))
            continue
        loaded[backend] = target
        estimates.append(Estimate(backend, prefill, decode, curve.as_dict()))
    ok = [e for e in estimates if e.total_s is not None]
    if not ok:
        raise RuntimeError(f"backend auto: no backend can run {path}: "
                           + "; ".join(f"{e.backend}: {e.error}" for e in estimates))
    best = min(ok, key=lambda e: e.total_s)
    for backend, target in loaded.items():
        if backend != best.backend and hasattr(target, "close"):
            target.close()
    info = cpu_info()
    choice = Choice(best.backend, method, estimates, cpu={"model": info.get("model"), "flags": info.get("flags")},
                    workload=workload)
    target = loaded[best.backend]
    target.backend_choice = choice.record()
    log.info("backend auto: %s", target.backend_choice["why"])
    return target, choice


__all__ = ["WORKLOAD", "Estimate", "Choice", "predict", "candidates", "choose"]
