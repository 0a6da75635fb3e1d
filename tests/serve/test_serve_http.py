"""End to end through HTTP with the official openai client: answers, streams, forced tool choice, ar equality."""

from __future__ import annotations

import json

import pytest

from pipeline.parsers import parse_calls
from pipeline.runtime import Sidecar, generate
from pipeline.serve import Engine
from pipeline.serve.engine import Prompted

WEATHER = {"role": "user", "content": "What is the weather in Paris in fahrenheit?"}


def tools_of(requests):
    return requests[0]["tools"]  # get_weather, calculate


def collect(stream) -> dict:
    """A stream's deltas put together: content, calls by index, finish reason, number of chunks with a delta."""
    content, calls, finish, events, usage = "", {}, None, 0, None
    for ch in stream:
        usage = ch.usage or usage
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        finish = ch.choices[0].finish_reason or finish
        events += bool(d.content or d.tool_calls)
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = c["id"] or tc.id
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return {"content": content, "calls": [(c["name"], c["arguments"]) for _, c in sorted(calls.items())],
            "ids": [c["id"] for _, c in sorted(calls.items())], "finish": finish, "events": events, "usage": usage}


def flat(resp) -> dict:
    msg = resp.choices[0].message
    return {"content": msg.content or "", "calls": [(c.function.name, c.function.arguments) for c in msg.tool_calls or []],
            "finish": resp.choices[0].finish_reason}


def same_answer(streamed: dict, plain: dict) -> None:
    assert streamed["content"] == plain["content"]
    assert streamed["calls"] == plain["calls"]
    assert streamed["finish"] == plain["finish"]


def canonical(messages, tools) -> dict:
    return {"id": "reference", "messages": messages, "tools": tools}


@pytest.fixture(scope="module")
def scripted(tiny, serve, api):
    with serve(Engine(tiny.scripted(), "toolspec", model_name="scripted", max_context=4096)) as url:
        yield api(url)


def test_tool_call_non_streaming_and_streaming(scripted, tiny):
    tools = tools_of(tiny.requests)
    plain = scripted.chat.completions.create(model="scripted", messages=[WEATHER], tools=tools)
    msg = plain.choices[0].message
    assert plain.choices[0].finish_reason == "tool_calls"
    assert msg.content is None
    [call] = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "fahrenheit"}

    # the same answer as the runtime's ar on the same request, read by the project's own parser
    ar = generate(tiny.scripted(), canonical([WEATHER], tools), "ar")
    assert [(c["name"], c["arguments"]) for c in parse_calls(ar.text).calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert plain.usage.completion_tokens == len(ar.token_ids)
    spec = plain.usage.model_extra["speculative"]
    assert spec["method"] == "toolspec" and spec["forwards"] < len(ar.token_ids)

    streamed = collect(scripted.chat.completions.create(model="scripted", messages=[WEATHER], tools=tools,
                                                        stream=True, stream_options={"include_usage": True}))
    same_answer(streamed, flat(plain))
    assert streamed["ids"][0].startswith("call_")
    assert streamed["usage"].completion_tokens == len(ar.token_ids)
    # drafts accepted: fewer events than tokens (several tokens per event)
    assert 1 < streamed["events"] < len(ar.token_ids)


def test_parallel_calls_and_parallel_tool_calls_false(scripted, tiny):
    tools = tools_of(tiny.requests)
    both = [{"role": "user", "content": "Do both please"}]
    plain = scripted.chat.completions.create(model="scripted", messages=both, tools=tools)
    assert [c.function.name for c in plain.choices[0].message.tool_calls] == ["get_weather", "calculate"]
    streamed = collect(scripted.chat.completions.create(model="scripted", messages=both, tools=tools, stream=True))
    same_answer(streamed, flat(plain))
    one = scripted.chat.completions.create(model="scripted", messages=both, tools=tools, parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]


def test_text_answer_and_tool_choice_none(scripted, tiny):
    hello = [{"role": "user", "content": "hello there"}]
    plain = scripted.chat.completions.create(model="scripted", messages=hello, tools=tools_of(tiny.requests))
    assert plain.choices[0].message.content == "Hello! How can I help you today?"
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"
    streamed = collect(scripted.chat.completions.create(model="scripted", messages=hello, stream=True))
    same_answer(streamed, flat(plain))
    # tool_choice none: the tools are not rendered and the text is not parsed for calls
    none = scripted.chat.completions.create(model="scripted", messages=[WEATHER], tools=tools_of(tiny.requests),
                                            tool_choice="none")
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content.startswith("```json\n{")


def test_forced_function_is_a_prompt_prefix(scripted, tiny):
    tools = tools_of(tiny.requests)
    ask = [{"role": "user", "content": "forced: add one and one"}]
    choice = {"type": "function", "function": {"name": "calculate"}}
    plain = scripted.chat.completions.create(model="scripted", messages=ask, tools=tools, tool_choice=choice)
    [call] = plain.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculate", {"expression": "1+1"})
    streamed = collect(scripted.chat.completions.create(model="scripted", messages=ask, tools=tools,
                                                        tool_choice=choice, stream=True))
    same_answer(streamed, flat(plain))


def test_tiny_model_equals_ar_plain_and_streamed(tiny, serve, api):
    """A random float64 target with the ooo method and a sidecar process: every answer is ar's, streamed or not."""
    reference = tiny.target()
    with Sidecar(lambda request: {"tool_index": 0, "arguments": {"city": "Paris"}}) as sidecar:
        engine = Engine(tiny.target(), "ooo", sidecar, model_name="tiny", max_tokens=24)
        with serve(engine) as url:
            openai = api(url)
            for req in tiny.requests[:3]:
                ar = generate(reference, canonical(req["messages"], req["tools"]), "ar", max_new_tokens=24)
                body = {"model": "tiny", "messages": req["messages"], "tools": req["tools"], "max_tokens": 24}
                plain = openai.chat.completions.create(**body)
                streamed = collect(openai.chat.completions.create(**body, stream=True))
                same_answer(streamed, flat(plain))
                assert not parse_calls(ar.text).calls  # a random model writes no call: all of it is content
                assert plain.choices[0].message.content == ar.text
                assert plain.usage.completion_tokens == len(ar.token_ids)
                assert plain.choices[0].finish_reason == ("length" if ar.stats.stop == "length" else "stop")
                assert plain.usage.model_extra["speculative"]["method"] == "ooo"


def test_tiny_model_forced_tool_choice_equals_ar(tiny, serve, api):
    """tool_choice required / named: the answer is the forced opening + ar's continuation of prompt + opening."""
    reference = tiny.target()
    req = tiny.requests[0]
    with serve(Engine(tiny.target(), "toolspec", model_name="tiny", max_tokens=16)) as url:
        openai = api(url)
        for choice, opening in (("required", '<tool_call>\n{"name": "'),
                                ({"type": "function", "function": {"name": "calculate"}},
                                 '<tool_call>\n{"name": "calculate"')):
            ar = generate(Prompted(reference, opening), canonical(req["messages"], req["tools"]), "ar",
                          max_new_tokens=16)
            body = {"model": "tiny", "messages": req["messages"], "tools": req["tools"], "tool_choice": choice}
            plain = flat(openai.chat.completions.create(**body))
            streamed = collect(openai.chat.completions.create(**body, stream=True))
            same_answer(streamed, plain)
            assert not plain["calls"]  # random weights do not finish a call after the opening: all of it is content
            assert plain["content"] == opening + ar.text
