"""The sidecar's own process for an engine-side proposer: it reads requests off the hint board and posts their hints.

Run as: python -m pipeline.vllm_spec.wave_service --board DIR --sidecar '{"model": ..., "adapter": ..., "cores": [1]}'
(`Frontend` starts it with the project's environment's Python: the wave needs peft and the project's transformers,
which vLLM's environment does not have.)

Each request registered on the board whose method takes a sidecar (`methods.py`) gets one wave, oldest first; the
payload (or the wave's error) is posted as soon as it is ready. A request that ended before its wave started is
skipped. The process exits when its parent exits, so it never outlives the server or benchmark that started it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..methods import METHOD_TABLE
from .board import HintBoard

POLL_S = 0.002  # how often the board is read while idle (a scandir of a tmpfs folder: ~20 us)


def serve(board: HintBoard, wave, parent: int | None = None, poll_s: float = POLL_S,
          cores: list[int] | None = None) -> None:
    """Answer the board's requests until the parent exits. A registration's `wave_cores` pins that wave (one
    thread per core); the service's own `cores` come back for the next one."""
    from ..hardware import pin

    done: set[str] = set()
    pinned, registered = cores, {}
    while parent is None or os.getppid() == parent:
        registered = board.registered(registered)  # new registrations only are read
        done &= set(registered)  # ended requests are forgotten
        todo = [r for rid, r in registered.items()
                if rid not in done and METHOD_TABLE.get(r.get("method"), METHOD_TABLE["ar"]).sidecar]
        if not todo:
            time.sleep(poll_s)
            continue
        reg = min(todo, key=lambda r: r["arrived"])
        done.add(reg["rid"])
        want = reg.get("wave_cores") or cores
        if want and want != pinned:
            pin(want)
            pinned = want
        c0 = time.process_time()
        try:
            payload, error = wave(reg["request"]), None
        except Exception as e:  # noqa: BLE001 - a failing wave leaves its request without a hint, nothing more
            payload, error = None, f"sidecar wave failed: {type(e).__name__}: {e}"
        if error is None and payload is None:
            error = "sidecar returned null"
        if (board.root / "req" / f"{reg['rid']}.json").exists():  # still in flight
            board.post_hint(reg["rid"], payload=payload, error=error, cpu_s=time.process_time() - c0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--board", required=True)
    ap.add_argument("--sidecar", required=True, help="make_wave's settings as JSON (SidecarConfig fields + cores)")
    ap.add_argument("--parent", type=int, default=None, help="exit when this process is no longer the parent")
    args = ap.parse_args(argv)
    from ..sidecar.factory import make_wave

    settings = json.loads(args.sidecar)
    wave = make_wave(**settings)
    board = HintBoard(args.board)
    (board.root / f"wave-{os.getpid()}.ready").write_text(str(time.time()))
    print(f"wave_service: ready on {args.board}", file=sys.stderr, flush=True)
    try:
        serve(board, wave, args.parent, cores=settings.get("cores"))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
