"""Liveness: /health tells ok / degraded / failing; a dead worker thread is restarted and its job answered 500; a
dead sidecar process leaves requests answered without hints and is restarted."""

from __future__ import annotations

import threading
import time

import httpx

from pipeline.runtime import Sidecar
from pipeline.payload import gold_payload
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


def test_metrics_count_what_the_clients_saw_and_each_request_logs_one_line(tiny, serve, caplog):
    import logging

    from prometheus_client.parser import text_string_to_metric_families

    caplog.set_level(logging.INFO, logger="pipeline.serve.access")
    engine = Engine(tiny.scripted(), "toolspec", model_name="scripted", max_context=4096)
    with serve(engine) as url:
        base = url.rsplit("/v1", 1)[0]
        with httpx.Client(timeout=30) as http:
            seen = [http.post(f"{url}/chat/completions", json=ask(tiny)).status_code for _ in range(2)]
            seen.append(http.post(f"{url}/chat/completions", content=b"{not json").status_code)
            seen.append(http.post(f"{url}/chat/completions", json=dict(ask(tiny), model="other")).status_code)
            text = http.get(f"{base}/metrics").text
    assert seen == [200, 200, 400, 404]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("ooo_requests_total", (("status", "answered"),))] == 2
    assert samples[("ooo_requests_total", (("status", "client_error"),))] == 2
    assert samples[("ooo_requests_total", (("status", "refused"),))] == 0
    assert samples[("ooo_hint_outcomes_total", (("outcome", "none"),))] == 2
    assert samples[("ooo_tokens_per_forward_count", ())] == 2
    assert samples[("ooo_time_to_first_token_seconds_count", ())] == 2
    assert samples[("ooo_e2e_request_latency_seconds_count", ())] == 2
    assert samples[("ooo_queue_depth", ())] == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.serve.access"]
    assert len(lines) == 4 and sum("status=200 outcome=answered" in x for x in lines) == 2
    assert all("hint=none" in x and "forwards=" in x for x in lines if "status=200" in x)
