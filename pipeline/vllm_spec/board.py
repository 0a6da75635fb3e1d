"""The hint board: how a request's messages, tools and hint reach a proposer that lives inside vLLM's engine.

vLLM's proposer runs in the engine's worker process and sees token ids only. The front end (the server or a
benchmark: the process that receives messages and tools) and the proposer share a folder, by default on tmpfs:

    req/<rid>.json    the request, written when it arrives: its prompt's length and digest (how the proposer finds
                      its row), method, messages, tools, template variables, tenant
    hint/<rid>.json   the wave's answer, written when it is ready: {"payload"} or {"error"}, "ready_wall", "cpu_s"
    end/<rid>.json    the request's output ids, written when it ends (the tenant's history learns from them)
    done/<rid>.json   the proposer's figures for the request (drafted, accepted, hint tokens, time), once it saw the end

Every write is atomic (a temporary file renamed into place), every read is a non-blocking file read; a file that is
not there yet means "not yet". So a dead or slow front end or sidecar can only leave a request without a hint: the
proposer never waits, and the folder holds only the requests in flight (a request's files go when it ends; the
proposer removes `end/` and `done/` files older than `LINGER_S`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

ENV = "OOO_VLLM_BOARD"  # the folder, for proposers that are not given one in vLLM's additional_config
LINGER_S = 600.0        # end/ and done/ files older than this are removed (their reader went away)


def digest(ids) -> str:
    """The digest of a token sequence (a prompt): how a row of the engine's batch is matched to its request."""
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=12).hexdigest()


def _write(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read(path: Path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):  # not there yet, or (never with atomic writes) torn
        return None


class HintBoard:
    """One board folder. The front end calls `start_request`, `post_hint`, `stop_request`; the proposer reads."""

    def __init__(self, root: str | Path | None = None):
        if root is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
            root = tempfile.mkdtemp(prefix="ooo-board-", dir=base)
        self.root = Path(root)
        for sub in ("req", "hint", "end", "done"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    # --- the front end ---------------------------------------------------------------------------------------
    def start_request(self, rid: str, prompt_ids: list[int], request: dict, method: str, *, tenant: str = "",
                      payload=None, wave_cores: list[int] | None = None) -> None:
        """Register a request before it is submitted to the engine. `payload`: a hint already known (the oracle);
        `wave_cores`: the cores its wave may use (None: the wave service's own)."""
        if payload is not None:
            self.post_hint(rid, payload=payload)
        keep = {k: request[k] for k in ("id", "messages", "tools", "chat_template_kwargs") if k in request}
        _write(self.root / "req" / f"{rid}.json",
               {"rid": rid, "length": len(prompt_ids), "digest": digest(prompt_ids), "method": method,
                "tenant": tenant, "arrived": time.time(), "request": keep, "wave_cores": wave_cores})

    def post_hint(self, rid: str, payload=None, error: str | None = None, ready_wall: float | None = None,
                  cpu_s: float | None = None) -> None:
        _write(self.root / "hint" / f"{rid}.json", {"payload": payload, "error": error,
                                                    "ready_wall": ready_wall or time.time(), "cpu_s": cpu_s})

    def stop_request(self, rid: str, output_ids: list[int] | None = None) -> None:
        """The request ended (answered, failed or cancelled): the proposer forgets it; its output feeds the tenant's
        history."""
        _write(self.root / "end" / f"{rid}.json", {"output": list(output_ids or [])})
        for sub in ("req", "hint"):
            (self.root / sub / f"{rid}.json").unlink(missing_ok=True)

    def figures(self, rid: str, wait_s: float = 0.0) -> dict | None:
        """The proposer's figures for an ended request (None if it never saw it, or not yet after `wait_s`)."""
        end = time.perf_counter() + wait_s
        while True:
            got = _read(self.root / "done" / f"{rid}.json")
            if got is not None or time.perf_counter() >= end:
                return got
            time.sleep(0.01)

    # --- the proposer ----------------------------------------------------------------------------------------
    def registered(self, known: dict[str, dict] | None = None) -> dict[str, dict]:
        """rid -> registration, for every request in flight; a registration never changes, so those in `known` (an
        earlier answer) are not read again."""
        out = {}
        known = known or {}
        with os.scandir(self.root / "req") as it:
            for entry in it:
                if entry.name.endswith(".json") and not entry.name.startswith("."):
                    rid = entry.name[:-len(".json")]
                    got = known.get(rid) or _read(Path(entry.path))
                    if got is not None:
                        out[rid] = got
        return out

    def hint(self, rid: str) -> dict | None:
        return _read(self.root / "hint" / f"{rid}.json")

    def ended(self, rid: str) -> dict | None:
        return _read(self.root / "end" / f"{rid}.json")

    def record(self, rid: str, figures: dict) -> None:
        _write(self.root / "done" / f"{rid}.json", figures)
        (self.root / "end" / f"{rid}.json").unlink(missing_ok=True)

    def sweep(self, older_than_s: float = LINGER_S) -> None:
        """Remove end/ and done/ files nobody collected."""
        now = time.time()
        for sub in ("end", "done"):
            with os.scandir(self.root / sub) as it:
                for entry in it:
                    try:
                        if now - entry.stat().st_mtime > older_than_s:
                            os.unlink(entry.path)
                    except FileNotFoundError:
                        pass


class BoardHint:
    """A request's hint as the runtime's `HintDrafter` polls it (the `Pending` interface): never blocks."""

    def __init__(self, board: HintBoard, rid: str):
        self.board, self.rid = board, rid
        self.payload = None
        self.error: str | None = None
        self.ready_wall: float | None = None
        self.cpu_s: float | None = None

    def poll(self):
        if self.payload is not None or self.error is not None:
            return self.payload
        got = self.board.hint(self.rid)
        if got is not None:
            self.ready_wall, self.cpu_s = got.get("ready_wall"), got.get("cpu_s")
            self.payload, self.error = got.get("payload"), got.get("error")
            if self.payload is None and self.error is None:
                self.error = "sidecar returned null"
        return self.payload


__all__ = ["HintBoard", "BoardHint", "digest", "ENV"]
