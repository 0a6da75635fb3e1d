"""SIGTERM to `python -m pipeline.serve` (what a container stop or systemd sends) stops every child process: the
sidecar worker and multiprocessing's resource tracker are gone within a few seconds of the server's exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
ROOT = Path(__file__).resolve().parents[2]

from pipeline.testing import alive, free_port, still_running, wait_healthy  # noqa: E402


def test_sigterm_stops_the_server_and_every_child(tmp_path):
    from pipeline.testing import build_tiny_serving_model

    model = build_tiny_serving_model(tmp_path / "tiny-qwen2")
    port = free_port()
    cmd = [sys.executable, "-m", "pipeline.serve", "--recipe", "recipes/serve/tiny.yaml", f"serve.target={model}",
           f"serve.sidecar.model={model}", f"serve.port={port}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    children = []
    try:
        wait_healthy(port, proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the ooo server should run a sidecar worker (and multiprocessing's resource tracker)"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        left = still_running(children, within_s=5)
        assert left == [], f"children still running 5 s after the server exited: {left}"
    finally:
        for c in children:  # only the processes this test started
            if alive(c):
                c.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
