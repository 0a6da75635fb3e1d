"""SIGTERM to `python -m pipeline.serve` (what a container stop or systemd sends) stops every child process: the
sidecar worker and multiprocessing's resource tracker are gone within a few seconds of the server's exit."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, limit_s: float = 240.0) -> None:
    end = time.time() + limit_s
    while time.time() < end:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"server not healthy after {limit_s} s")


def alive(p) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
        end = time.time() + 5
        while time.time() < end and any(alive(c) for c in children):
            time.sleep(0.1)
        left = [(c.pid, " ".join(c.cmdline())[:120]) for c in children if alive(c)]
        assert left == [], f"children still running 5 s after the server exited: {left}"
    finally:
        for c in children:  # only the processes this test started
            if alive(c):
                c.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
