"""The llama.cpp target (pipeline/runtime/llamacpp.py) on tiny GGUFs written here with the `gguf` package: random
Qwen2 weights in F32 and the project's tiny tokenizer. Through llama.cpp: a tree decode's logits equal the chain
decodes' of each path, every method's tokens equal `ar`'s (trees gathered from a non-first leaf included), a right
hint cuts target decodes and a wrong one costs at most two over toolspec, prefix-cache and memo reuse equal a cold
prefill, and the cost curve is measured on it."""

import json

import numpy as np
import pytest
import torch

from pipeline.payload import gold_payload
from pipeline.runtime import METHODS, Ready, generate
from pipeline.runtime.verify import build_tree
from pipeline.testing import ScriptDrafter

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make setup-llamacpp)")

N = 20
CANDS = [([5, 9, 11], 1), ([5, 9, 12, 13], 2), ([7, 8], 4), ([5, 30], 1)]


def gguf_target(tmp_path_factory, tok, model, name, **kw):
    from pipeline.runtime.llamacpp import LlamaCppTarget
    from pipeline.testing import write_gguf

    path = write_gguf(model, tok, tmp_path_factory.mktemp(name) / f"{name}.gguf")
    return LlamaCppTarget(path, tok, model.generation_config, name=name, threads=1, n_ctx=4096, **kw)


@pytest.fixture(scope="module")
def random_target(tmp_path_factory, tok):
    """A context-sensitive random tiny Qwen2 (the weights of `tiny_target`) as a GGUF."""
    from pipeline.testing import tiny_target

    model = tiny_target("qwen2", tok).model.to(torch.float32)
    return gguf_target(tmp_path_factory, tok, model, "tiny-random")


@pytest.fixture(scope="module")
def taught(tok, requests):
    """A tiny Qwen2 (transformers) taught to answer two requests with their fenced gold calls."""
    from pipeline.testing import make_tiny_model, teach

    torch.manual_seed(0)
    model, _ = make_tiny_model("qwen2", tokenizer=tok, dtype=torch.float32)
    reqs = requests[:2]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    from pipeline.runtime.target import Target

    renderer = Target(model, tok, prefix_cache=False)  # the prompt ids are the tokenizer's: alike on both backends
    examples = [(renderer.prompt_ids(r), tok.encode(fenced(r), add_special_tokens=False) + [eos]) for r in reqs]
    teach(model, examples, steps=300)
    return model, reqs


@pytest.fixture(scope="module")
def caller(tmp_path_factory, tok, taught):
    """The taught tiny Qwen2 as an F32 GGUF."""
    model, reqs = taught
    target = gguf_target(tmp_path_factory, tok, model, "tiny-caller", prefix_cache=False)
    for req in reqs:
        ar = generate(target, req, "ar", max_new_tokens=120)
        assert ar.text == fenced(req), f"the tiny GGUF target did not learn its call: {ar.text!r}"
    return target, reqs


def fenced(req) -> str:
    return "```json\n" + json.dumps(req["gold"][0], indent=2) + "\n```"


def chain_logits(target, prompt, tokens):
    target.prefill(prompt, prefix_cache=False)
    return target.logits(build_tree(tokens[0], [(tokens[1:], 1)], 64, 64))


def test_tree_logits_equal_each_paths_chain_logits(random_target, tok, requests):
    t = random_target
    prompt = t.prompt_ids(requests[0])[:-1]
    root = t.prompt_ids(requests[0])[-1]
    tree = build_tree(root, CANDS, 64, 64)
    t.prefill(prompt, prefix_cache=False)
    got = t.logits(tree)
    assert got.shape == (len(tree), t.n_vocab)
    kids = tree.children()
    for toks, _ in CANDS:
        nodes, node = [0], 0
        for tk in toks:
            node = kids[node][tk]
            nodes.append(node)
        ref = chain_logits(t, prompt, [root] + toks)
        np.testing.assert_allclose(got[nodes], ref, rtol=1e-4, atol=1e-4)


def test_keep_a_later_branch_equals_decoding_that_path(random_target, requests):
    """keep() of a path that is not the first leaf's: the next decode equals one after the plain chain."""
    t = random_target
    ids = t.prompt_ids(requests[1])
    prompt, root = ids[:-1], ids[-1]
    tree = build_tree(root, CANDS, 64, 64)
    t.prefill(prompt, prefix_cache=False)
    t.logits(tree)
    path = [tree.children()[0][7]]
    path.append(tree.children()[path[0]][8])  # the candidate [7, 8]: the third leaf
    t.keep(len(tree), path)
    assert t.past() == len(prompt) + 3
    after = t.logits(build_tree(42, [], 64, 64))[0]
    ref = chain_logits(t, prompt, [root, 7, 8, 42])[-1]
    np.testing.assert_allclose(after, ref, rtol=1e-4, atol=1e-4)


def test_every_method_equals_ar(random_target, requests):
    t = random_target
    for req in requests:
        ar = generate(t, req, "ar", max_new_tokens=N)
        assert ar.stats.forwards == ar.stats.new_tokens == N
        for method in METHODS[1:]:
            res = generate(t, req, method, sidecar=Ready(gold_payload(req)), oracle=ar, max_new_tokens=N)
            assert res.token_ids == ar.token_ids, (req["id"], method)
        # drafts that are right, partly right and right only on a later branch: the cache paths of keep()
        res = generate(t, req, "toolspec", max_new_tokens=N, extra_drafters=[ScriptDrafter(ar.token_ids)])
        assert res.token_ids == ar.token_ids and res.stats.forwards < N, req["id"]


def test_prefix_cache_and_memo_reuse_equal_a_cold_prefill(random_target, requests):
    from pipeline.runtime.llamacpp import SeqPrefixCache

    t = random_target
    t.prefix_cache.clear()  # earlier tests' entries give their sequences back
    t.prefix_cache = SeqPrefixCache(t, 2048, min_tokens=4)
    ids = t.prompt_ids(requests[2])
    prompt, root = ids[:-1], ids[-1]
    cold = chain_logits(t, prompt, [root])
    t.prefill(prompt, key="a")   # stored under "a"
    t.prefill(prompt, key="a")   # a request never reuses its own entry
    assert t.cached_tokens == 0
    t.prefill(prompt, key="b")   # another request with the same prompt: all of it from the cache
    assert t.cached_tokens == len(prompt)
    np.testing.assert_allclose(t.logits(build_tree(root, [], 4, 4)), cold, rtol=1e-5, atol=1e-5)
    half = prompt[: len(prompt) // 2] + [3, 4, 5]
    t.prefill(half, key="c")      # a shared prefix: the rest computed
    assert t.cached_tokens == len(prompt) // 2
    ref = chain_logits(t, half, [root])
    t.prefill(half, key="d")
    np.testing.assert_allclose(t.logits(build_tree(root, [], 4, 4)), ref, rtol=1e-5, atol=1e-5)
    t.prefix_cache.clear()
    assert len(t.free_seqs) == 64
    t.memo = t.make_memo()       # the eval's memo: a second prefill of the same request is restored and charged
    first = t.prefill(prompt, key="m", reuse=True, prefix_cache=False)
    again = t.prefill(prompt, key="m", reuse=True, prefix_cache=False)
    assert again == first and t.last_prefill["reused"] and t.memo.hits == 1
    np.testing.assert_allclose(t.logits(build_tree(root, [], 4, 4)), cold, rtol=1e-5, atol=1e-5)
    t.memo.clear()
    t.memo = None
    assert len(t.free_seqs) == 64


def test_chunked_prefill_sets_threads_between_chunks(random_target, requests):
    t = random_target
    ids = t.prompt_ids(requests[0])
    prompt, root = ids[:-1], ids[-1]
    cold = chain_logits(t, prompt, [root])
    calls = []
    t.prefill(prompt, prefix_cache=False, chunk=7, between=lambda: (calls.append(1), t.set_threads(1)))
    assert len(calls) == -(-len(prompt) // 7) - 1
    # llama.cpp's CPU kernels round differently for a 7-token batch than for a whole prompt (measured: 4e-3 at
    # most on logits of magnitude ~10); the decode tests compare outputs of the same chunking, so they stay exact
    np.testing.assert_allclose(t.logits(build_tree(root, [], 4, 4)), cold, rtol=0, atol=2e-2)


def test_cost_curve_measures_the_llamacpp_target(random_target):
    from pipeline.runtime.budget import CostCurve

    curve = CostCurve.measure(random_target, past=64, reps=1, sizes=(1, 4))
    assert curve.sizes == (1, 4) and all(s > 0 for s in curve.seconds)
    assert random_target.past() == 64


def test_right_hint_cuts_decodes_wrong_costs_at_most_two(caller):
    target, reqs = caller
    for req in reqs:
        target.histories.clear()
        ar = generate(target, req, "ar", max_new_tokens=120)
        target.histories.clear()
        right = generate(target, req, "ooo", sidecar=Ready(gold_payload(req)), max_new_tokens=120)
        assert right.token_ids == ar.token_ids and right.stats.hint_error is None
        assert right.stats.forwards <= ar.stats.forwards / 3, (right.stats.forwards, ar.stats.forwards)
        target.histories.clear()
        toolspec = generate(target, req, "toolspec", max_new_tokens=120)
        gold = gold_payload(req)
        wrong = {"tool_index": 1 - gold["tool_index"] if len(req["tools"]) > 1 else 0, "arguments": {}}
        target.histories.clear()
        bad = generate(target, req, "ooo", sidecar=Ready(wrong), max_new_tokens=120)
        assert bad.token_ids == ar.token_ids
        assert bad.stats.forwards <= toolspec.stats.forwards + 2, (bad.stats.forwards, toolspec.stats.forwards)


def test_a_quantized_gguf_decodes_and_every_method_equals_ar(tmp_path_factory, tok, taught):
    """The taught tiny Qwen2 as a Q4_0 GGUF, whose matrices llama.cpp repacks for its CPU kernels (q4_0_8x8 on x86; a
    verbose load prints `repack tensor ... with q4_0_8x8`) and, in a build with them, for its AMX kernels, which
    crash on AMX machines (`make setup-llamacpp` leaves them out there): prefill,
    tree verifies and whole decodes through the llama.cpp target; the taught call survives quantization and every
    method's tokens equal `ar`'s (a confident model: random weights meet near-ties that the quantized batched and
    single-token kernels round differently). An F32 GGUF is never repacked, so the other tests cannot catch a crash."""
    import gguf

    from pipeline.runtime.llamacpp import LlamaCppTarget
    from pipeline.testing import write_gguf

    model, reqs = taught
    path = write_gguf(model, tok, tmp_path_factory.mktemp("q4") / "tiny-q4_0.gguf", quant="q4_0")
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert "Q4_0" in kinds, kinds
    target = LlamaCppTarget(path, tok, model.generation_config, name="tiny-q4_0", threads=2, n_ctx=4096,
                            prefix_cache=False)
    for req in reqs:
        ar = generate(target, req, "ar", max_new_tokens=120)
        assert ar.text == fenced(req), f"the Q4_0 GGUF lost the taught call: {ar.text!r}"
        for method in METHODS[1:]:
            res = generate(target, req, method, max_new_tokens=120, oracle=ar)
            assert res.token_ids == ar.token_ids, (req["id"], method)
