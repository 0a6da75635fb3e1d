"""The transformers peers of `make eval` against `ar` on a target whose output depends on its context."""

from pathlib import Path

import pytest
import torch

from pipeline.io import read_jsonl
from pipeline.eval.runner import HFPeers, token_digest
from pipeline.runtime import generate
from pipeline.testing import make_tokenizer, tiny_target

REQUESTS = read_jsonl(Path(__file__).parents[1] / "fixtures" / "requests.jsonl")


@pytest.fixture(scope="module")
def peers():
    torch.set_num_threads(1)
    tok = make_tokenizer()
    target = tiny_target("qwen2", tok)
    p = HFPeers(target)
    p.assistant, p.same_vocab = tiny_target("llama", tok).model, True  # a draft model with the same vocabulary
    return p


@pytest.mark.parametrize("method", ["hf-pld", "hf-assisted"])
def test_peers_write_ar_tokens_and_time_their_own_prefill(peers, method):
    """Continued from a prefilled cache, transformers' prompt lookup wrote other tokens from the first one on (every
    fixture request); from the whole prompt the peers write `ar`'s tokens."""
    target = peers.target
    for req in REQUESTS:
        ar = generate(target, req, "ar", max_new_tokens=24)
        out = peers.generate(req, method, 24)
        assert token_digest(out["token_ids"], target.stop_ids) == token_digest(ar.token_ids, target.stop_ids), \
            (method, req["id"])
        assert out["prefix_cache"] is False and out["cached_tokens"] == 0 and not out["prefill_reused"]
        assert 0 < out["prefill_s"] <= out["wall_s"] and out["decode_s"] >= 0
        assert out["prefill_s"] + out["decode_s"] == pytest.approx(out["wall_s"])


def _raising_wave(request):
    raise RuntimeError("CUDA error: out of memory")


def _null_wave(request):
    return None


def test_a_sidecar_that_fails_its_warm_up_wave_fails_the_run():
    """A wave that raises on the warm-up request would raise on every row (ooo measured as toolspec): the run stops,
    naming the device and the error; a wave that answers without a call is a model's answer and is not a failure."""
    from pipeline.eval.runner import Runner
    from pipeline.runtime.sidecar_client import SidecarLoadError

    target = tiny_target("qwen2", make_tokenizer())
    req = read_jsonl(Path(__file__).parents[1] / "fixtures" / "requests.jsonl")[0]
    runner = Runner(target, ["ar", "ooo"], sidecar={"wave": _raising_wave}, max_new_tokens=4)
    try:
        with pytest.raises(SidecarLoadError, match=r"device cpu failed its warm-up wave: .*out of memory"):
            runner.warmup(req, max_new_tokens=4)
    finally:
        runner.close()
    runner = Runner(target, ["ar", "ooo"], sidecar={"wave": _null_wave}, max_new_tokens=4)
    try:
        runner.warmup(req, max_new_tokens=4)
    finally:
        runner.close()
