"""The text -> content + tool_calls view: every prefix's view extends the previous one, so streams equal answers."""

from __future__ import annotations

import json
import random

import pytest

from pipeline.parsers import parse_calls
from pipeline.serve.calls import CallStream, compact, view

CALL_TEXTS = [
    # what Qwen2.5-Coder writes
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n    "unit": "celsius"\n  }\n}\n```',
    # template tags, two calls, a quote and a brace inside a string
    '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {"y": "q \\" }"}}\n</tool_call>',
    'Sure, I will call it.\n```json\n{"name": "f", "arguments": {"k": [1, 2.5e3, {"z": null}], "t": true}}\n```\nDone.',
    '[{"name": "a", "parameters": {"p": true}}, {"name": "b", "parameters": {}}]',  # Llama style list
    '{"type": "function", "function": {"name": "f", "arguments": "{\\"a\\": 1}"}}',  # OpenAI style, string arguments
    "API-Request: [GetWeather(city='Paris')]",
    '[get_weather(city="Paris", n=3)]',
    '```python\nprint("x")\n```\nthen {"name": "g", "arguments": {}}',
    '<|python_tag|>{"name": "h", "parameters": {"u": "é€ \\n x"}}',
    '{"name": "x", "foo": 1} and then {"name": "y"}',
    '```\n{"a": 1}\n```\n\n{"name": "z", "arguments": {"q": 1}}',
    '{"tool_calls": [{"name": "m", "arguments": {"v": [1]}}]}',
]
TEXT_ONLY = ["The answer is 42.", "Use {name} to say hi [1] and ```code``` ok", "x = [a for a in b] {", "  \n ", ""]


def streamed(text: str, cuts: list[int], **kw) -> tuple[str, list[tuple[str, str]]]:
    """Feed the prefixes ending at `cuts`, then the whole text as final; return what the deltas add up to."""
    stream = CallStream(**kw)
    deltas = [d for c in cuts for d in stream.feed(text[:c])] + stream.feed(text, final=True)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], ["", ""])
            c[0] += tc["function"].get("name", "")
            c[1] += tc["function"]["arguments"]
    return "".join(d.get("content", "") for d in deltas), [tuple(c) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("text", CALL_TEXTS + TEXT_ONLY)
def test_every_prefix_extends_the_last_and_ends_at_the_answer(text):
    final = view(text, final=True)
    expected = (final.content, [(c.name, c.arguments) for c in final.calls])
    assert streamed(text, list(range(len(text) + 1))) == expected  # one character at a time
    rng = random.Random(len(text))
    for _ in range(5):  # a few random token-like chunkings
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        assert streamed(text, cuts) == expected
    assert streamed(text, []) == expected  # everything at once


@pytest.mark.parametrize("text", CALL_TEXTS)
def test_calls_agree_with_the_project_parser(text):
    mine = [(c.name, json.loads(c.arguments)) for c in view(text, final=True).calls]
    assert mine == [(c["name"], c["arguments"]) for c in parse_calls(text).calls]
    assert mine, text


@pytest.mark.parametrize("text", TEXT_ONLY)
def test_text_is_content(text):
    answer = view(text, final=True)
    assert answer.calls == [] and answer.content == (text if text.strip() else "")


def test_content_before_a_call_and_what_is_held_back():
    text = CALL_TEXTS[2]
    assert view(text, final=True).content == "Sure, I will call it.\n"
    assert view("Sure, I will call it.\n``").content == "Sure, I will call it.\n"  # may open a fence
    assert view("Sure, I will <tool_").content == "Sure, I will "
    assert view('Sure: {"na').content == "Sure: "                               # may open a call
    assert view('Sure: {"na', final=True).content == 'Sure: {"na'               # ... but the text ended
    assert view("Plain words").content == "Plain words"


def test_call_streams_once_its_name_is_known():
    text = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Par'
    assert view(text[:text.index("get_weather") + 4]).calls == []
    [call] = view(text).calls
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Par')
    # cut off by max_tokens: the call keeps its incomplete arguments
    assert view(text, final=True).calls[0].arguments == '{"city":"Par'


def test_parallel_tool_calls_false_and_no_tools():
    text = CALL_TEXTS[1]
    assert [c.name for c in view(text, final=True, max_calls=1).calls] == ["a"]
    assert streamed(text, list(range(len(text))), max_calls=1)[1] == [("a", '{"x":1}')]
    assert view(text, final=True, find_calls=False).content == text


def test_cut_multibyte_character_waits():
    stream = CallStream()
    assert stream.feed("caf\ufffd") == [{"content": "caf"}]
    assert stream.feed("café!") == [{"content": "é!"}]


def test_compact_keeps_strings():
    assert compact('{\n  "a b": "x \\" y",\n  "c": [1, 2]\n}') == '{"a b":"x \\" y","c":[1,2]}'
