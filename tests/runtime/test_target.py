"""The target wrapper: a token tree verified in one forward with a 4-D mask equals each branch run as a chain,
and keeping a path leaves the cache exactly as if only that path had been fed (float64, all three families).
Eager attention computes its softmax in float32 even for float64 models, so it is compared at 1e-5; sdpa is exact."""

import pytest
import torch

from pipeline.testing import tiny_target
from pipeline.runtime.verify import build_tree

CANDS = [([5, 6, 7, 8], 1), ([5, 6, 9], 2), ([10, 11, 12], 4)]


def _chain_logits(t, prefix, root, toks):
    t.prefill(prefix)
    return t.logits(build_tree(root, [(toks, 1)], 64, 64))


def _node_path(tree, toks):
    kids, node, nodes = tree.children(), 0, [0]
    for x in toks:
        node = kids[node][x]
        nodes.append(node)
    return nodes


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tree_forward_equals_chains_and_keep_restores_the_path(tok, family, attn):
    t = tiny_target(family, tok, attn=attn)
    atol = 1e-12 if attn == "sdpa" else 1e-5
    assert t.tree  # every family takes a custom 4-D mask with eager and sdpa attention
    ids = tok.encode("what is the weather in paris today", add_special_tokens=False)
    prefix, root = ids[:-1], ids[-1]
    t.prefill(prefix)
    tree = build_tree(root, CANDS, 64, 64)
    assert not tree.is_chain()
    lt = t.logits(tree)
    for toks, _ in CANDS:
        lc = _chain_logits(t, prefix, root, toks)
        assert torch.allclose(lt[_node_path(tree, toks)], lc, atol=atol, rtol=0)
    # keep the middle branch (non-contiguous nodes), then decode one more token: equals the plain chain
    t.prefill(prefix)
    t.logits(tree)
    path = _node_path(tree, [5, 6, 9])[1:]
    t.keep(len(tree), path)
    assert t.past() == len(prefix) + 1 + len(path)
    after = t.logits(build_tree(42, [], 64, 64))[0]
    ref = _chain_logits(t, prefix, root, [5, 6, 9, 42])[-1]
    assert torch.allclose(after, ref, atol=atol, rtol=0)
    # a chain prefix is kept by cropping
    t.prefill(prefix)
    t.logits(tree)
    t.keep(len(tree), _node_path(tree, [5, 6])[1:])
    assert t.past() == len(prefix) + 3


def test_targets_without_mask_support_verify_chains_only(tok):
    t = tiny_target("qwen2", tok, tree=False)
    t.prefill(tok.encode("hello", add_special_tokens=False))
    with pytest.raises(ValueError, match="cannot verify a tree"):
        t.logits(build_tree(3, CANDS, 64, 64))


def test_prefill_memo_restores_the_same_cache_and_charges_the_measured_prefill(tok):
    from pipeline.runtime.target import PrefillMemo

    t = tiny_target("qwen2", tok)
    t.memo = PrefillMemo()
    ids = tok.encode("what is the weather in paris today and tomorrow please", add_special_tokens=False)
    prefix, root = ids[:-1], ids[-1]
    first = t.prefill(prefix, key="r1", reuse=True)
    assert not t.last_prefill["reused"] and first > 0
    ref = t.logits(build_tree(root, CANDS, 64, 64))
    again = t.prefill(prefix, key="r1", reuse=True)
    assert t.last_prefill["reused"] and again == first and t.memo.hits == 1
    assert torch.equal(t.logits(build_tree(root, CANDS, 64, 64)), ref)  # the restored KV is the computed one
    t.prefill(prefix, key="r1", reuse=True)  # ... and the decode above did not write into the memo's tensors
    assert torch.equal(t.logits(build_tree(root, CANDS, 64, 64)), ref)
    assert t.memo.hits == 2
    t.prefill(prefix, key="r1")  # reuse=False: computed
    assert not t.last_prefill["reused"]
    threads = torch.get_num_threads()
    try:  # another thread count is other work: computed, not restored
        torch.set_num_threads(threads + 1)
        t.prefill(prefix, key="r1", reuse=True)
        assert not t.last_prefill["reused"]
    finally:
        torch.set_num_threads(threads)
    t.prefill(prefix, key="r2", reuse=True)  # a new request drops the old request's entries
    assert not t.last_prefill["reused"] and t.memo.key == "r2" and len(t.memo.entries) == 1


def test_the_cost_curve_prompt_never_enters_the_prefix_cache(tok):
    t = tiny_target("qwen2", tok)
    t.calibrate(past=64, reps=1, cache=False)
    assert t.prefix_cache is not None and t.prefix_cache.entries == []


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fill_cache_writes_the_full_forwards_cache_without_running_the_output_layer(tok, family):
    from transformers import DynamicCache

    from pipeline.runtime.target import decoder_body, fill_cache

    t = tiny_target(family, tok)
    ids = torch.tensor([tok.encode("what is the weather in paris today", add_special_tokens=False)])
    full, body = DynamicCache(config=t.model.config), DynamicCache(config=t.model.config)
    with torch.inference_mode():
        t.model(input_ids=ids, cache=full, use_cache=True)
        head_calls = []
        hook = t.model.get_output_embeddings().register_forward_hook(lambda *a: head_calls.append(1))
        try:
            fill_cache(t.model, input_ids=ids, cache=body)
        finally:
            hook.remove()
    assert decoder_body(t.model) is not None and head_calls == []
    assert body.get_seq_length() == full.get_seq_length() == ids.shape[1]
    for a, b in zip(full.layers, body.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)

    class NoDecoder(torch.nn.Module):  # transformers cannot name its body: the whole forward, one position's logits
        def __init__(self):
            super().__init__()
            self.seen = {}

        def get_decoder(self):
            raise ValueError("no decoder")

        def forward(self, **kw):
            self.seen = kw

    odd = NoDecoder()
    assert decoder_body(odd) is None
    fill_cache(odd, input_ids=ids, cache=body)
    assert odd.seen["logits_to_keep"] == 1 and odd.seen["use_cache"] is True
