"""Shared fixtures for the runtime tests: the tiny tokenizer, tiny float64 targets, the fixture requests."""

import pytest
import torch

from pipeline.io import read_jsonl
from pipeline.testing import tiny_target

FIXTURES = "tests/fixtures/requests.jsonl"


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tok():
    from pipeline.testing import make_tokenizer

    return make_tokenizer()


@pytest.fixture(scope="session")
def requests():
    from pathlib import Path

    return read_jsonl(Path(__file__).resolve().parents[1] / "fixtures" / "requests.jsonl")


@pytest.fixture(scope="session")
def targets(tok):
    """One context-sensitive tiny float64 target per family."""
    return {f: tiny_target(f, tok) for f in ("llama", "qwen2", "qwen3")}
