"""What the speculative loop needs of a target, and the table of target backends (transformers, llama.cpp).

`TargetBackend` is the protocol `generate` (loop.py), the eval's runner, the cost curve (budget.py) and the server
use; `Target` (transformers, target.py) and `LlamaCppTarget` (llama.cpp through llama-cpp-python, llamacpp.py) both
implement it, `ReplayTarget` (replay.py) the part the loop reads. `load_target(backend, ...)` loads either from the
same recipe keys, so a recipe switches backend with one word:

    target = load_target("llamacpp", path="checkpoints/base/qwen2.5-coder-1.5b-instruct",
                         gguf="checkpoints/.downloads/qwen2.5-coder-1.5b-instruct/<gguf_file>")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

from .verify import Tree


@runtime_checkable
class TargetBackend(Protocol):
    """A causal LM with one KV cache (batch 1, greedy) and the tokenizer whose ids the drafters speak.

    A round verifies a token tree: `verify(tree)` appends the tree's tokens to the cache and returns the target's
    argmax after every node; `keep(len(tree), path)` then keeps only the root's and the accepted path's entries."""

    name: str
    tokenizer: object            # a transformers tokenizer: prompt ids, drafters' encodings, call formats
    stop_ids: set[int]
    tree: bool                   # False: the target verifies only chains (the loop then drafts the best chain)
    curve: object | None         # CostCurve after `calibrate()`: the tree budget's cost of k tokens
    budgets: dict                # method -> TreeBudget (acceptance statistics of this run)
    histories: dict              # method -> History (earlier outputs of this run)
    memo: object | None          # PrefillMemo set by the eval's runner (variants share one measured prefill)
    cached_tokens: int           # prompt tokens the last prefill took from the prefix cache
    last_prefill: dict           # seconds charged, spent, cpu_s, reused

    def prompt_ids(self, request: dict) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def prefill(self, ids: list[int], key: str | None = None, reuse: bool = False, prefix_cache: bool = True,
                chunk: int | Callable[[], int | None] | None = None, between: Callable[[], None] | None = None,
                salt: str | None = None, inside: Callable[[], None] | None = None) -> float: ...

    def set_threads(self, n: int) -> None: ...

    def verify(self, tree: Tree) -> list[int]: ...

    def keep(self, tree_len: int, nodes: list[int]) -> None: ...

    def drop(self, n: int) -> None: ...

    def past(self) -> int: ...

    def calibrate(self, past: int = 512, reps: int = 3, cache: bool = True): ...

    def make_memo(self): ...


def gguf_of(model_dir: str | Path, downloads: str | Path = "checkpoints/.downloads") -> Path:
    """The GGUF a `make models` folder was converted from: its manifest's `source.gguf`, else
    <downloads>/<folder name>/<config.gguf_file> (where the models stage keeps it)."""
    model_dir = Path(model_dir)
    manifest = model_dir / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest}: missing; the llamacpp backend finds the GGUF of a `make models` folder "
                                "(or set the target's gguf: path)")
    doc = json.loads(manifest.read_text())
    if doc.get("adapter"):
        raise FileNotFoundError(f"{manifest}: the folder's weights are its GGUF's with the adapter "
                                f"{doc['adapter'].get('path')} merged; no GGUF of them exists for llama.cpp")
    source = Path((doc.get("source") or {}).get("gguf") or "-")
    if source.is_file():
        return source
    name = (doc.get("config") or {}).get("gguf_file")
    cached = Path(downloads) / model_dir.name / str(name)
    if name and cached.is_file():
        return cached
    raise FileNotFoundError(f"{manifest}: its GGUF ({source} or {cached}) is not there; `make models` fetches it")


def _transformers(path: str, dtype: str = "auto", device: str = "cpu", gguf: str | None = None, **kwargs):
    from .target import Target

    return Target.load(path, dtype=dtype, device=device, **kwargs)


def _llamacpp(path: str, dtype: str = "auto", device: str = "cpu", gguf: str | None = None, **kwargs):
    from .llamacpp import LlamaCppTarget

    if device != "cpu":
        raise ValueError(f"backend llamacpp runs on the CPU build of llama-cpp-python; device {device!r} is not "
                         "supported")
    return LlamaCppTarget.load(gguf or gguf_of(path), tokenizer_path=path, **kwargs)


# backend -> loader(path, dtype, device, gguf, chat_template_kwargs=..., prefix_cache=...)
BACKENDS: dict[str, Callable] = {"transformers": _transformers, "llamacpp": _llamacpp}


def load_target(backend: str, path: str, **kwargs) -> TargetBackend:
    """The target of `backend` ("transformers" or "llamacpp") from the model folder `path` (its tokenizer; the
    weights too for transformers) and, for llama.cpp, the GGUF file `gguf=` (default: the folder's source GGUF)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown target backend {backend!r}; expected one of {sorted(BACKENDS)}")
    return BACKENDS[backend](path, **kwargs)


__all__ = ["TargetBackend", "BACKENDS", "load_target", "gguf_of"]
