"""The front end's half of OoO-Spec on vLLM: a request's lifecycle on the hint board, and the sidecar's process.

    front = Frontend(sidecar={"model": ..., "adapter": ..., "cores": [1]})   # starts the wave service
    llm = LLM(..., **front.engine_kwargs(k=16))                              # the proposer reads front.board
    rid = front.start_request(request, prompt_ids, "ooo")                    # before the engine sees the prompt
    out = llm.generate([{"prompt_token_ids": prompt_ids}], params)
    front.stop_request(rid, out[0].outputs[0].token_ids)
    front.close()                                                             # the wave service and the board go

`start_request / stop_request` is the whole lifecycle (ArcticInference's suffix decoding has the same shape): the
wave starts when the request is registered, in the sidecar's own process (`wave_service.py`, with the project's
environment's Python), and its payload reaches the engine's proposer through the board the moment it is posted.
A sidecar that dies is started again at the next request; while it is down, requests run without hints.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..methods import METHOD_TABLE
from .board import ENV, HintBoard

PROPOSER = "pipeline.vllm_spec.proposer.OooProposer"


def project_python() -> str:
    """The Python of the project's own environment (.venv beside this package), else this one."""
    root = Path(__file__).resolve().parents[2]
    for cand in (os.environ.get("OOO_SIDECAR_PYTHON"), root / ".venv" / "bin" / "python"):
        if cand and Path(cand).is_file():
            return str(cand)
    return sys.executable


class Frontend:
    """Registers requests on a board and runs the sidecar's wave service (see the module docstring).

    sidecar: `make_wave`'s settings (SidecarConfig fields, plus `cores` to pin the wave to); None: no sidecar (the
      `toolspec` method, or `ooo` without hints).
    python: the interpreter of the wave service (default: the project's .venv)."""

    def __init__(self, sidecar: dict | None = None, *, board: str | Path | None = None, python: str | None = None,
                 load_timeout_s: float = 600.0):
        self.board = HintBoard(board)
        self.sidecar, self.python = sidecar, python or project_python()
        self.proc: subprocess.Popen | None = None
        self.restarts = -1
        self._ids = itertools.count()
        self.load_timeout_s = load_timeout_s
        if sidecar is not None:
            self._ensure(wait=True)

    def engine_kwargs(self, k: int, min_p: float = 0.05, chat_template_kwargs: dict | None = None) -> dict:
        """The `vllm.LLM` / engine arguments that put the proposer in the engine, reading this board."""
        os.environ[ENV] = str(self.board.root)  # for engines started without additional_config
        return {"speculative_config": {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k},
                "additional_config": {"ooo_spec": {"board": str(self.board.root), "min_p": min_p,
                                                   "chat_template_kwargs": chat_template_kwargs or {}}}}

    def _ensure(self, wait: bool = False) -> bool:
        if self.sidecar is None:
            return False
        if self.proc is not None and self.proc.poll() is None:
            return True
        self.restarts += 1
        for old in self.board.root.glob("wave-*.ready"):
            old.unlink(missing_ok=True)
        self.proc = subprocess.Popen([self.python, "-m", "pipeline.vllm_spec.wave_service", "--board",
                                      str(self.board.root), "--sidecar", json.dumps(self.sidecar),
                                      "--parent", str(os.getpid())],
                                     cwd=str(Path(__file__).resolve().parents[2]))
        if wait:
            end = time.perf_counter() + self.load_timeout_s
            while not any(self.board.root.glob("wave-*.ready")):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the sidecar's wave service exited with code {self.proc.returncode} before "
                                       f"loading (settings {self.sidecar}); its error is above")
                if time.perf_counter() > end:
                    self.close()
                    raise RuntimeError(f"the sidecar's wave service did not load in {self.load_timeout_s:.0f} s")
                time.sleep(0.05)
        return True

    def start_request(self, request: dict, prompt_ids: list[int], method: str, *, tenant: str = "",
                      payload=None, wave_cores: list[int] | None = None) -> str:
        """Register `request` (before it reaches the engine); its wave starts now when `method` takes a sidecar.
        payload: a hint known in advance (the oracle's), posted at once. wave_cores: the cores this request's wave
        may use (a caller that holds the engine back until the hint is ready gives it every core); None: the
        sidecar settings' `cores`. Returns the request's board id."""
        if method not in METHOD_TABLE:
            raise ValueError(f"unknown method {method!r}; expected one of {list(METHOD_TABLE)}")
        rid = f"{os.getpid()}-{next(self._ids)}"
        if METHOD_TABLE[method].sidecar:
            self._ensure()
        self.board.start_request(rid, prompt_ids, request, method, tenant=tenant, payload=payload,
                                 wave_cores=wave_cores)
        return rid

    def stop_request(self, rid: str, output_ids=None) -> None:
        self.board.stop_request(rid, output_ids)

    def figures(self, rid: str, wait_s: float = 1.0) -> dict | None:
        """The proposer's figures for an ended request (it writes them at its next step or board read)."""
        return self.board.figures(rid, wait_s)

    def proposer_figures(self) -> dict:
        """The proposer's own figures (time per step, acceptance), as it last wrote them."""
        got = {}
        for path in self.board.root.glob("proposer-*.json"):
            try:
                got[path.stem] = json.loads(path.read_text())
            except ValueError:
                pass
        return got

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self.board.root, ignore_errors=True)

    def __enter__(self) -> Frontend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Frontend", "PROPOSER", "project_python"]
