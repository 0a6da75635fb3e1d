"""The proposer inside vLLM's engine (its CPU build in CI, `make test-vllm`), on a tiny random model in float32.

Each fixture request is decoded three times: by vLLM without speculation, then twice by the engine with the
`OooProposer` (method toolspec, one tenant): the second time the tenant's history (the first output) drafts the
whole answer. Greedy output must equal the plain engine's every time, and the proposer's drafts must have been
accepted (by the proposer's own count and by vLLM's spec-decode counters)."""

import gc
import importlib.util
import os
from pathlib import Path

import pytest

from pipeline.io import read_jsonl
from pipeline.requests import render_prompt
from pipeline.testing import make_tiny_model_dir

FIXTURE_REQUESTS = Path(__file__).parents[1] / "fixtures" / "requests.jsonl"

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not importable in this environment (it lives in .venv-vllm: make vllm-setup; make test-vllm)")]


def engine(model: Path, **extra):
    from vllm import LLM

    from pipeline.vllm_engine import engine_settings

    kwargs, env, _ = engine_settings({"enforce_eager": True, "enable_prefix_caching": False}, {})
    os.environ.update(env)
    if "speculative_config" in extra:  # vLLM's per-request count of accepted draft tokens
        kwargs["per_request_spec_decode_metrics"] = "summary"
    return LLM(model=str(model), dtype="float32", max_model_len=2048, seed=0, disable_log_stats=False,
               **kwargs, **extra)


def test_the_proposer_in_vllm_is_lossless_and_its_drafts_are_accepted(tmp_path):
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from pipeline.vllm_spec import Frontend

    model = make_tiny_model_dir(tmp_path / "tiny-vllm", "qwen2", hidden=128, heads=2, kv_heads=1)
    tok = AutoTokenizer.from_pretrained(model)
    requests = read_jsonl(FIXTURE_REQUESTS)[:3]
    prompts = [tok(render_prompt(tok, r), add_special_tokens=False).input_ids for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=32)

    accepted = []  # vLLM's own count of accepted draft tokens per request

    def run(llm, ids):
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
        spec = getattr(out, "spec_decode_metrics", None)
        accepted.append(spec.to_dict()["num_accepted_draft_tokens"] if spec is not None else 0)
        return list(out.token_ids)

    plain = engine(model)
    want = [run(plain, ids) for ids in prompts]
    accepted.clear()
    del plain
    gc.collect()

    with Frontend() as front:
        llm = engine(model, **front.engine_kwargs(k=8))
        rids = []
        for _ in range(2):  # the second pass is drafted from the tenant's history of the first
            for req, ids, expected in zip(requests, prompts, want):
                rid = front.start_request(req, ids, "toolspec", tenant="t")
                got = run(llm, ids)
                front.stop_request(rid, got)
                assert got == expected, f"{req['id']}: the proposer changed the greedy output"
                rids.append(rid)
        run(llm, prompts[0])  # one more step: the proposer records the last request's figures
        figures = [front.figures(rid, wait_s=2.0) for rid in rids]
        del llm
        gc.collect()
    assert all(f is not None for f in figures), figures
    second = figures[len(requests):]
    assert sum(f["accepted"] for f in second) >= sum(len(w) for w in want) // 2, second
    assert sum(accepted[len(requests):2 * len(requests)]) >= sum(len(w) for w in want) // 2, accepted
    assert [f["accepted"] for f in figures] == accepted[:2 * len(requests)]  # the proposer counts what vLLM counts
