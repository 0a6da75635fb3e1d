"""Liveness: /health tells ok / degraded / failing; a dead worker thread is restarted and its job answered 500; a
dead sidecar process leaves requests answered without hints and is restarted."""

from __future__ import annotations

import threading
import time

import httpx

from pipeline.runtime import Sidecar
from pipeline.runtime.parse import gold_payload
from pipeline.serve import Engine


def ask(tiny, word="weather"):
    return {"model": "scripted", "messages": [{"role": "user", "content": f"{word} please"}],
            "tools": tiny.requests[0]["tools"]}


def test_a_dead_worker_gives_503_on_health_500_to_its_job_and_is_restarted(tiny, serve):
    target = tiny.scripted()
    verify, calls = target.verify, []

    def dies_once(tree):
        calls.append(1)
        if len(calls) == 1:
            raise SystemExit("the worker thread dies")  # not an Exception: the job's own handler does not catch it
        return verify(tree)

    target.verify = dies_once
    engine = Engine(target, "toolspec", model_name="scripted", max_context=4096, watchdog_s=3600)
    with serve(engine) as url:
        base = url.rsplit("/v1", 1)[0]
        with httpx.Client(timeout=30) as http:
            answer = {}
            t = threading.Thread(target=lambda: answer.setdefault("r", http.post(f"{url}/chat/completions",
                                                                               json=ask(tiny))))
            t.start()
            deadline = time.time() + 10
            while engine._thread.is_alive() and time.time() < deadline:
                time.sleep(0.02)
            assert not engine._thread.is_alive()
            health = http.get(f"{base}/health")
            assert health.status_code == 503 and health.json()["status"] == "failing"
            t.join(timeout=10)
            assert answer["r"].status_code == 500 and "worker died" in answer["r"].json()["error"]["message"]
            assert http.get(f"{base}/health").json()["status"] == "ok" and engine.worker_restarts == 1
            again = http.post(f"{url}/chat/completions", json=ask(tiny))
            assert again.status_code == 200 and again.json()["choices"][0]["message"]["tool_calls"]


def test_a_dead_sidecar_degrades_to_hintless_answers_and_is_restarted(tiny, serve):
    sidecar = Sidecar(gold_payload, timeout_s=10)
    engine = Engine(tiny.scripted(), "ooo", sidecar, model_name="scripted", max_context=4096)
    with serve(engine) as url:
        base = url.rsplit("/v1", 1)[0]
        with httpx.Client(timeout=30) as http:
            first = http.post(f"{url}/chat/completions", json=ask(tiny)).json()
            assert sidecar.status() == "up" and http.get(f"{base}/health").json()["status"] == "ok"
            sidecar._proc.kill()
            sidecar._proc.join(timeout=5)
            health = http.get(f"{base}/health").json()
            assert health["status"] == "degraded" and health["detail"] == "sidecar down, serving toolspec"
            second = http.post(f"{url}/chat/completions", json=ask(tiny)).json()
            def call(r):
                return [c["function"] for c in r["choices"][0]["message"]["tool_calls"]]

            assert call(second) == call(first)  # the same answer regardless
            assert sidecar.status() == "up" and sidecar.restarts == 1  # the next request restarted it
            assert http.get(f"{base}/health").json()["status"] == "ok"
