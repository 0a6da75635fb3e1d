"""`make serve` on vLLM's engine (`backend: vllm`), end to end on a tiny model: the OpenAI route answers with
`usage.speculative`, `/health` names the engine and its wave service, `/metrics` counts the request, and SIGTERM
stops the server with every child (vLLM's engine core, the wave service) gone."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not importable in this environment (it lives in .venv-vllm: make vllm-setup; make test-vllm)")]


def get(port: int, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.status, r.read().decode()


def test_serve_on_vllm_answers_and_sigterm_stops_every_child(tmp_path):
    psutil = pytest.importorskip("psutil")
    from pipeline.testing import alive, free_port, make_tiny_model_dir, still_running, wait_healthy

    # vLLM's CPU attention takes head sizes of 32 and up: 2 heads of 64
    model = make_tiny_model_dir(tmp_path / "tiny-qwen2", "qwen2", hidden=128, heads=2, kv_heads=1)
    port = free_port()
    cmd = [sys.executable, "-m", "pipeline.serve", "--recipe", "recipes/serve/tiny.yaml", "serve.backend=vllm",
           f"serve.target={model}", f"serve.sidecar.model={model}", f"serve.port={port}", "serve.max_context=1024",
           "serve.vllm_kwargs={enforce_eager: true}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    children = []
    try:
        wait_healthy(port, proc, limit_s=600)
        children = psutil.Process(proc.pid).children(recursive=True)
        body = {"model": "tiny-qwen2", "max_tokens": 16,
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        spec = answer["usage"]["speculative"]
        assert answer["usage"]["completion_tokens"] > 0 and spec["method"] == "ooo" and spec["forwards"] >= 1
        status, health = get(port, "/health")
        health = json.loads(health)
        assert status == 200 and health["backend"] == "vllm" and health["engine"]["wave_service"] == "up", health
        assert 'ooo_requests_total{status="answered"} 1.0' in get(port, "/metrics")[1]
        assert any("wave_service" in " ".join(c.cmdline()) for c in children), "no wave service among the children"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        left = still_running(children, within_s=10)
        assert left == [], f"children still running 10 s after the server exited: {left}"
    finally:
        for c in children:
            if alive(c):
                c.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
