"""Every request error answers a 4xx in OpenAI's error shape naming the problem, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pipeline.serve import Engine

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny, serve, api):
    with serve(Engine(tiny.target(), "toolspec", model_name="tiny", max_tokens=8, max_context=256)) as url:
        yield url, api(url)


def error_of(exc_info) -> dict:
    return exc_info.value.body if isinstance(exc_info.value.body, dict) and "message" in exc_info.value.body \
        else exc_info.value.body["error"]


def post_raw(url: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", content=content, headers={"content-type": "application/json"},
                      timeout=60)


def test_malformed_json_and_missing_messages(server):
    url, _ = server
    r = post_raw(url, b'{"model": "tiny", "messages": [')
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json" and "not valid JSON" in r.json()["error"]["message"]
    r = post_raw(url, b'[1, 2]')
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = post_raw(url, b'{"model": "tiny"}')
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages" and "messages" in r.json()["error"]["message"]
    r = post_raw(url, b'{"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}')
    assert r.status_code == 400 and "wizard" in r.json()["error"]["message"]


def test_unknown_model_is_404(server):
    _, api = server
    with pytest.raises(openai.NotFoundError) as e:
        api.chat.completions.create(model="gpt-17", messages=USER)
    assert e.value.status_code == 404
    assert "gpt-17" in error_of(e)["message"] and error_of(e)["code"] == "model_not_found"


def test_invalid_tool_schema(server, tiny):
    _, api = server
    bad_tool = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"city": {"type": "town"}}, "required": "city"}}}
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=USER, tools=tiny.requests[0]["tools"] + [bad_tool])
    err = error_of(e)
    assert err["code"] == "invalid_tool_schema" and err["param"] == "tools[2].function.parameters"
    assert "'broken'" in err["message"] and "not a valid JSON Schema" in err["message"]


def test_prompt_longer_than_context(server):
    _, api = server
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "paris london " * 300}])
    err = error_of(e)
    assert err["code"] == "context_length_exceeded" and "256" in err["message"]


@pytest.mark.parametrize("sampling", [{"temperature": 0.7}, {"top_p": 0.5}, {"n": 2}, {"stop": ["\n"]},
                                      {"presence_penalty": 0.5}, {"logprobs": True}])
def test_unsupported_sampling(server, sampling):
    _, api = server
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=USER, **sampling)
    err = error_of(e)
    assert err["code"] == "unsupported_sampling" and err["param"] == next(iter(sampling))


def test_bad_tool_choice_and_max_tokens(server, tiny):
    _, api = server
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=USER, tools=tiny.requests[0]["tools"],
                                    tool_choice={"type": "function", "function": {"name": "fly"}})
    assert "'fly'" in error_of(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=USER, tool_choice="required")
    assert "tools" in error_of(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=USER, max_tokens=0)
    assert error_of(e)["param"] == "max_tokens"


def test_still_serving_after_errors(server):
    url, api = server
    for _ in range(2):
        post_raw(url, b"{oops")
        with pytest.raises(openai.BadRequestError):
            api.chat.completions.create(model="tiny", messages=USER, temperature=1.0)
    ok = api.chat.completions.create(model="tiny", messages=USER, temperature=0, top_p=1, n=1)
    assert ok.choices[0].finish_reason in ("stop", "length") and ok.usage.completion_tokens >= 1
    assert [m.id for m in api.models.list().data] == ["tiny"]
    health = httpx.get(url.removesuffix("/v1") + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["queue"]["waiting"] == 0 and health["served"] >= 1
    r = httpx.get(url + "/nowhere", timeout=10)
    assert r.status_code == 404 and "/v1/nowhere" in r.json()["error"]["message"]


def test_oversized_body_is_413_before_it_is_read(tiny, serve):
    """A body past `max_body_bytes` is refused with 413 by its Content-Length, and a chunked upload (no length) as
    soon as it passes the limit; smaller bodies are answered as before, and the refusals are counted."""
    limit = 2048
    with serve(Engine(tiny.target(), "toolspec", model_name="tiny", max_tokens=4, max_context=256),
               max_body_bytes=limit) as url:
        big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * 4000}]}).encode()
        r = post_raw(url, big)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and str(len(big)) in err["message"] and str(limit) in err["message"]

        def chunked():  # a generator body: httpx sends it chunked, without a Content-Length
            for at in range(0, len(big), 1000):
                yield big[at:at + 1000]
        r = httpx.post(f"{url}/chat/completions", content=chunked(), headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 413 and f"more than {limit}" in r.json()["error"]["message"]

        small = json.dumps({"model": "tiny", "messages": USER, "max_tokens": 2}).encode()
        assert len(small) < limit
        r = post_raw(url, small)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=60).text
        assert 'ooo_requests_total{status="client_error"} 2.0' in metrics, metrics
