"""Batch 1 behind a bounded queue: 32 concurrent clients, each answered 200 (equal to ar) or refused 503."""

from __future__ import annotations

import threading

import httpx
import openai

from pipeline.runtime import generate
from pipeline.serve import Engine

N_CLIENTS = 32


def test_32_concurrent_requests_small_queue(tiny, serve, api):
    reference = tiny.target()
    ar = {r["id"]: generate(reference, {"id": "ref", "messages": r["messages"], "tools": r["tools"]}, "ar",
                            max_new_tokens=16).text for r in tiny.requests}
    outcomes: list = [None] * N_CLIENTS
    barrier = threading.Barrier(N_CLIENTS)

    def one(i: int, openai_client) -> None:
        req = tiny.requests[i % len(tiny.requests)]
        body = {"model": "tiny", "messages": req["messages"], "tools": req["tools"], "max_tokens": 16}
        barrier.wait()
        try:
            if i % 2:  # half of them stream
                text = "".join(ch.choices[0].delta.content or "" for ch in
                               openai_client.chat.completions.create(**body, stream=True) if ch.choices)
            else:
                text = openai_client.chat.completions.create(**body).choices[0].message.content or ""
            outcomes[i] = (200, req["id"], text)
        except openai.APIStatusError as e:
            outcomes[i] = (e.status_code, e.response.headers.get("retry-after"), e.body)

    with serve(Engine(tiny.target(), "toolspec", model_name="tiny", queue_size=2, max_tokens=16)) as url:
        openai_client = api(url)
        threads = [threading.Thread(target=one, args=(i, openai_client)) for i in range(N_CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        health = httpx.get(url.removesuffix("/v1") + "/health", timeout=10).json()
        after = openai_client.chat.completions.create(model="tiny", messages=tiny.requests[0]["messages"],
                                                      max_tokens=4)

    assert all(o is not None for o in outcomes), "a request was lost (no answer, no refusal)"
    ok = [o for o in outcomes if o[0] == 200]
    refused = [o for o in outcomes if o[0] == 503]
    assert len(ok) + len(refused) == N_CLIENTS, [o[:2] for o in outcomes if o[0] not in (200, 503)]
    assert ok and refused, f"{len(ok)} answered, {len(refused)} refused: the queue bound was not exercised"
    for _, rid, text in ok:
        assert text == ar[rid]
    for _, retry_after, body in refused:
        assert int(retry_after) >= 1
        assert "busy" in str(body)
    assert health["queue"]["waiting"] == 0 and health["served"] == len(ok)
    assert after.choices[0].finish_reason in ("stop", "length")


def test_client_disconnect_cancels_the_job(tiny, serve, api, caplog):
    import logging
    import time

    caplog.set_level(logging.INFO, logger="pipeline.serve")
    target = tiny.scripted()
    verify = target.verify
    target.verify = lambda tree: (time.sleep(0.05), verify(tree))[1]  # ~50 ms per round, one token per round (ar)
    ask = {"model": "scripted", "messages": [{"role": "user", "content": "both please"}],
           "tools": tiny.requests[0]["tools"]}
    with serve(Engine(target, "ar", model_name="scripted", max_context=4096)) as url:
        client = api(url)
        t0 = time.perf_counter()
        full = client.chat.completions.create(**ask)
        full_s = time.perf_counter() - t0
        assert len(full.choices[0].message.tool_calls) == 2 and full_s > 1.0
        stream = client.chat.completions.create(**ask, stream=True)
        next(iter(stream))
        stream.close()  # the client goes away after the first chunk
        deadline = time.time() + full_s
        while "client disconnected" not in caplog.text and time.time() < deadline:
            time.sleep(0.05)
        assert "client disconnected" in caplog.text, "the worker ran the abandoned request to the end"
        again = client.chat.completions.create(**ask)
        assert again.choices[0].message.tool_calls[1].function.name == "calculate"


def test_a_non_streaming_client_that_leaves_cancels_its_job_and_a_slow_job_times_out(tiny, serve, api):
    """The next request starts within a round or so of a plain (non-streaming) client going away; a job past
    request_timeout_s ends with 504; /health counts each outcome."""
    import time

    target = tiny.scripted()
    verify = target.verify
    target.verify = lambda tree: (time.sleep(0.05), verify(tree))[1]  # ~50 ms per round, one token per round (ar)
    ask = {"model": "scripted", "messages": [{"role": "user", "content": "both please"}],
           "tools": tiny.requests[0]["tools"]}
    engine = Engine(target, "ar", model_name="scripted", max_context=4096)
    with serve(engine) as url:
        base = url.rsplit("/v1", 1)[0]
        t0 = time.perf_counter()
        api(url).chat.completions.create(**ask)
        full_s = time.perf_counter() - t0
        assert full_s > 1.0
        with httpx.Client(timeout=0.4) as http:  # gives up long before the answer
            try:
                http.post(f"{url}/chat/completions", json=ask)
            except httpx.TimeoutException:
                pass
        deadline = time.perf_counter() + full_s
        while engine.outcomes["cancelled"] == 0 and time.perf_counter() < deadline:
            time.sleep(0.02)
        assert engine.outcomes["cancelled"] == 1, "the worker ran the abandoned request to the end"
        engine.request_timeout_s = 0.5
        with __import__("pytest").raises(openai.APIStatusError) as err:
            api(url).chat.completions.create(**ask)
        assert err.value.status_code == 504 and "request_timeout_s" in str(err.value)
        health = httpx.get(f"{base}/health").json()
        assert health["outcomes"] == {"answered": 1, "failed": 0, "cancelled": 1, "timed_out": 1}
        assert health["served"] == 1
