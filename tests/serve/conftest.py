"""Fixtures for the server tests: tiny targets, a scripted target that writes tool calls, uvicorn on loopback."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pipeline.io import read_jsonl
from pipeline.runtime.replay import ReplayTarget
from pipeline.testing import tiny_target
from pipeline.runtime.target import encode

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "requests.jsonl"

# The scripted target's answers, chosen by a word of the last user message (see ScriptTarget).
SCRIPTS = {
    "weather": '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n'
               '    "unit": "fahrenheit"\n  }\n}\n```',
    "both": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12*7+3"}}\n</tool_call>',
    "hello": "Hello! How can I help you today?",
    "forced": ', "arguments": {"expression": "1+1"}}\n</tool_call>',  # after the forced `{"name": "calculate"`
}


class ScriptTarget(ReplayTarget):
    """A target whose greedy answer is SCRIPTS[word] for the first word of SCRIPTS in the prompt's last user turn.

    The script is chosen from the prompt ids the loop prefills (the server renders the prompt itself), so the
    same target serves many requests. It verifies drafts like a real model (ReplayTarget), so speculative methods
    commit several tokens per round.
    """

    def __init__(self, tokenizer):
        super().__init__(tokenizer, dict(SCRIPTS), name="scripted")

    def prefill(self, ids: list[int], key: str | None = None, **kw) -> float:
        last_turn = self.decode(ids).rsplit("<|im_start|>user", 1)[-1]
        word = min((w for w in SCRIPTS if w in last_turn), key=last_turn.index)
        self.script = self.outputs[word]
        return super().prefill(ids, key, **kw)

    def prompt_ids(self, request: dict) -> list[int]:
        from pipeline.requests import render_prompt

        return encode(self.tokenizer, render_prompt(self.tokenizer, request))


@dataclass
class Tiny:
    """What the server tests share: the local tokenizer, the fixture requests and target factories."""

    tok: object
    requests: list

    def target(self):
        """A fresh tiny float64 Qwen2 target (the same weights every call: a server's and a reference are twins)."""
        return tiny_target("qwen2", self.tok)

    def scripted(self) -> ScriptTarget:
        return ScriptTarget(self.tok)


@pytest.fixture(scope="session")
def tiny() -> Tiny:
    from pipeline.testing import make_tokenizer

    torch.set_num_threads(1)  # tiny models run fastest on one thread
    return Tiny(make_tokenizer(), read_jsonl(FIXTURES))


@pytest.fixture(scope="session")
def serve():
    """`with serve(engine) as url:` the server on loopback; the engine is closed afterwards."""
    return serving


@pytest.fixture(scope="session")
def api():
    """`api(url)`: an openai client for the server (no retries: a 503 must reach the test)."""
    return client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(engine, **app_kw):
    """uvicorn with the app over `engine` (`create_app(engine, **app_kw)`) in a thread on a free loopback port; yields
    the base URL (…/v1)."""
    import uvicorn

    from pipeline.serve import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, **app_kw), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.close()


def client(base_url: str, **kw):
    import openai

    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120, **kw)
