"""Hardware-aware verification and the prefix cache: the budget's choices follow the cost curve, and neither the
budget, the prefix cache nor the thread schedule changes a single output token (float64 tiny targets)."""

import json

import pytest

from pipeline.runtime import Ready, generate
from pipeline.runtime.budget import Acceptance, CostCurve, TreeBudget, alternatives, best_chain, node_probs, subtree
from pipeline.payload import gold_payload
from pipeline.runtime.replay import ReplayTarget
from pipeline.runtime.verify import build_tree

STEEP = CostCurve((1, 8, 32), (0.26, 1.30, 5.08))  # bf16 on an AVX2-only EPYC: k tokens cost ~k/6 steps
FLAT = CostCurve.flat()                            # an accelerator: 32 tokens cost one step


def _tree():
    return build_tree(0, [(list(range(100, 116)), 1), (list(range(200, 210)), 2), (list(range(300, 312)), 8)], 32, 24)


def _budget(curve, rate):
    return TreeBudget(curve, acceptance=Acceptance({b: rate for b in (1, 2, 4, 8, 16)}, weight=1e6))


def test_flat_curve_takes_the_whole_tree_steep_curve_takes_few():
    tree = _tree()
    assert len(_budget(FLAT, 0.7).choose(tree)[0]) == len(tree) == 32
    steep = len(_budget(STEEP, 0.7).choose(tree)[0])
    assert 1 < steep <= 8
    # drafts that are rarely right are not worth any extra token on the steep curve: a plain decode step
    assert len(_budget(STEEP, 0.1).choose(tree)[0]) == 1
    # ... but on a flat one they cost nothing
    assert len(_budget(FLAT, 0.1).choose(tree)[0]) > 1


def test_chosen_tree_is_ancestor_closed_and_the_best_chain_first():
    tree = _tree()
    probs = node_probs(tree, Acceptance({1: 0.9, 2: 0.5, 8: 0.2}, weight=1e6))
    sub, expected = _budget(STEEP, 0.9).choose(tree)
    for i, p in enumerate(sub.parents):
        assert p < i and (p >= 0 or i == 0)
    assert expected > 1.0
    keep = [0, 1, 2, 3]
    assert subtree(tree, keep).tokens == [0, 100, 101, 102]
    assert probs[1] > probs[2] > probs[3]


def test_acceptance_learns_per_source():
    acc = Acceptance({1: 0.5, 2: 0.5}, weight=1.0)
    tree = build_tree(0, [([5, 6, 7], 1), ([8, 9], 2)], 32, 24)
    for _ in range(20):
        acc.update(tree, [1, 2, 3])  # the hint chain is always accepted, the schema branch never
    assert acc.rate(1) > 0.9 and acc.rate(2) < 0.1


def test_a_sources_alternatives_do_not_count_against_its_chains():
    # the hint proposes its call in three formats: the first is the target's, the other two diverge at once
    tree = build_tree(0, [([5, 6, 7, 8], 1), ([9, 6, 7, 8], 1), ([10, 6, 7], 1), ([11], 2)], 32, 24)
    assert alternatives(tree) == [0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0]  # the schema's 11 is its own first child
    acc = Acceptance({1: 0.5, 2: 0.5}, weight=1.0)
    for _ in range(20):
        acc.update(tree, [1, 2, 3, 4])
    # one rate for both would be 4 accepted of 6 tries per round (~0.67): each chain token would look like a gamble
    assert acc.rate(1) > 0.95 and acc.rate(1, alt=True) < 0.05 and acc.rate(2) < 0.05
    probs = node_probs(tree, acc)
    assert probs[4] > 0.85 and max(probs[5], probs[9]) < 0.05
    # on the 1.5B target's measured curve (bf16, 2 cores) the budget verifies the whole chain and no alternative
    curve = CostCurve((1, 2, 4, 8, 16, 32), (0.198, 0.179, 0.219, 0.241, 0.315, 0.446))
    sub, _ = TreeBudget(curve, acceptance=acc).choose(tree)
    assert sub.tokens[:5] == [0, 5, 6, 7, 8] and not {9, 10} & set(sub.tokens)


def test_curve_interpolates_and_cache_round_trips(tmp_path, monkeypatch):
    assert STEEP.cost(1) == pytest.approx(0.26) and STEEP.cost(32) == pytest.approx(5.08)
    assert 0.26 < STEEP.cost(4) < 1.30
    monkeypatch.setenv("OOO_COST_DIR", str(tmp_path))

    class Fake:  # CostCurve.cached must not measure when a file for the key exists
        pass

    key = {"machine": "x", "model": "m"}
    path = None
    curve = CostCurve((1, 2), (0.1, 0.2), {"past": 512, "prefill_s": 1.5})
    import hashlib

    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = tmp_path / f"{digest}.json"
    path.write_text(json.dumps(curve.as_dict()))
    got = CostCurve.cached(Fake(), key)
    assert got.seconds == (0.1, 0.2) and got.meta["prefill_s"] == 1.5
    # a curve cached before the prefill was timed is measured again (backend: auto predicts prefills from it)
    path.write_text(json.dumps(CostCurve((1, 2), (0.1, 0.2), {}).as_dict()))
    with pytest.raises(AttributeError):  # Fake cannot be measured: it was tried
        CostCurve.cached(Fake(), key)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_measured_budget_prefix_cache_and_schedule_are_lossless(targets, requests, family):
    target = targets[family]
    target.prefix_cache.clear()
    ref = {r["id"]: generate(target, r, "ar", max_new_tokens=16, tree_budget="fixed") for r in requests}
    curve = target.calibrate(past=32, reps=1, cache=False)
    assert len(curve.seconds) == 6 and all(s > 0 for s in curve.seconds)
    assert curve.meta["prefill_s"] > 0 and curve.meta["past"] == 32  # the prefill of the curve's cache, timed

    class Halve:  # a schedule that changes the thread count every round
        n = 0

        def threads(self, pending):
            self.n += 1
            return 1 + self.n % 2

    try:
        for req in requests:
            for method in ("toolspec", "ooo"):
                res = generate(target, req, method, sidecar=Ready(gold_payload(req)), max_new_tokens=16,
                               schedule=Halve())
                assert res.token_ids == ref[req["id"]].token_ids
                assert len(res.stats.tree_sizes) == res.stats.forwards and set(res.stats.threads) <= {1, 2}
    finally:
        target.curve = None
        target.budgets.clear()
        import torch

        torch.set_num_threads(1)


def test_prefix_cache_reuses_a_shared_prefix_and_not_the_same_request(targets, requests):
    target = targets["qwen2"]
    target.prefix_cache.clear()
    a, b = requests[0], dict(requests[0], id="other-id")
    first = generate(target, a, "ar", max_new_tokens=12)
    assert first.stats.cached_tokens == 0
    again = generate(target, a, "ar", max_new_tokens=12)  # same id: the entry is not offered to itself
    assert again.stats.cached_tokens == 0
    other = generate(target, b, "ar", max_new_tokens=12)  # same prompt, another request: all but the root reused
    assert other.stats.cached_tokens == other.stats.prompt_tokens - 1
    assert other.token_ids == first.token_ids
    target.prefix_cache = None
    off = generate(target, dict(a, id="third"), "ar", max_new_tokens=12)
    assert off.stats.cached_tokens == 0 and off.token_ids == first.token_ids
    from pipeline.runtime.target import PrefixCache

    target.prefix_cache = PrefixCache()


def test_replay_with_a_curve_chooses_by_the_curve(tok, requests):
    req = requests[0]
    text = '```json\n{\n  "name": "x",\n  "arguments": {}\n}\n```'
    sizes = {}
    for name, curve in (("flat", FLAT), ("steep", STEEP)):
        target = ReplayTarget(tok, {req["id"]: text}, curve=curve)
        res = generate(target, req, "toolspec", max_new_tokens=64)
        assert target.decode(res.token_ids[:-1]) == text
        sizes[name] = max(res.stats.tree_sizes)
        assert target.simulated_s > 0
    assert sizes["flat"] > sizes["steep"]


def _slow_gold(request):
    import time

    time.sleep(1.0)
    return gold_payload(request)


def test_adaptive_schedule_yields_a_core_while_the_wave_computes(targets, requests):
    import time

    from pipeline.runtime import Sidecar
    from pipeline.runtime.schedule import Schedule

    target, req = targets["qwen2"], requests[0]
    ar = generate(target, req, "ar", max_new_tokens=12)
    adaptive, split = Schedule("adaptive", [0, 1]), Schedule("split", [0, 1])
    assert adaptive.sidecar_cores == [1] and Schedule("colocated", [0, 1]).sidecar_cores == [0, 1]
    assert adaptive.threads(None) == 2 and split.threads(None) == 1
    try:
        with Sidecar(_slow_gold) as sidecar:
            pending = sidecar.start(req)
            t0 = time.perf_counter()
            while not pending.running() and time.perf_counter() - t0 < 10:
                time.sleep(0.01)
            assert pending.running() and adaptive.threads(pending) == 1
            res = generate(target, req, "ooo", sidecar=pending, schedule=adaptive, max_new_tokens=12)
            assert res.token_ids == ar.token_ids and res.stats.threads[0] == 1
            # the request ended before its wave answered: the wave is cancelled and its core is the target's again
            assert pending.cancelled and not pending.running() and adaptive.threads(pending) == 2
            answered = sidecar.start(req)
            assert _wait_payload(answered) == gold_payload(req)
            assert answered.cpu_s is not None and answered.cpu_s < 0.9  # the wave slept: little CPU is charged
    finally:
        import torch

        torch.set_num_threads(1)


def test_rounds_that_do_not_pay_stop_drafting_until_the_next_exploration():
    budget = _budget(STEEP, 0.05)
    tree = _tree()
    sub, _ = budget.choose(tree)
    assert len(sub) == 1 and budget.skip  # drafts this weak do not pay for themselves on a steep curve
    drafted = []
    for _ in range(16):
        drafted.append(budget.should_draft())
        budget.choose(tree if drafted[-1] else build_tree(0, [], 32, 24))
    assert 1 <= sum(drafted) <= 3  # only the exploration rounds draft
    good = _budget(FLAT, 0.7)
    good.choose(tree)
    assert not good.skip and good.should_draft()


def test_drafting_resumes_when_a_hint_arrives(targets, requests):
    """A hint that becomes ready while drafting is skipped is drafted at once (and the output stays ar's)."""
    from pipeline.runtime.budget import CostCurve as Curve

    target, req = targets["qwen2"], requests[0]
    ar = generate(target, req, "ar", max_new_tokens=16)

    class Later:  # ready from the 3rd poll on
        error, cpu_s = None, None

        def __init__(self):
            self.n, self.ready_wall = 0, None

        def poll(self):
            self.n += 1
            return gold_payload(req) if self.n >= 3 else None

        def running(self):
            return False

    target.curve = Curve((1, 32), (1.0, 100.0))  # drafting never pays on this curve
    try:
        res = generate(target, req, "ooo", sidecar=Later(), max_new_tokens=16)
        assert res.token_ids == ar.token_ids and res.stats.hint_ready_s is not None
    finally:
        target.curve = None
        target.budgets.clear()


def test_chunked_prefill_equals_one_forward_cold_and_after_a_partial_prefix_hit(targets, requests):
    """Chunked prefill (any chunk size) and a prefill that reuses part of another prompt's KV give the cache a cold,
    whole prefill gives (float64), so the next forward's logits are the same."""
    import torch

    from pipeline.runtime.target import PrefixCache
    from pipeline.runtime.verify import build_tree as tree_of

    target, req = targets["qwen2"], requests[0]
    ids = target.prompt_ids(req)
    prefix, root = ids[:-1], ids[-1]
    target.prefix_cache = None

    def next_logits():
        return target.logits(tree_of(root, [], 4, 4))

    target.prefill(prefix)
    cold = next_logits()
    calls = []
    for chunk in (1, 5, 16, len(prefix) + 3):
        target.prefill(prefix, chunk=chunk, between=lambda c=chunk: calls.append(c))
        assert torch.allclose(next_logits(), cold, atol=1e-12, rtol=0), chunk
    assert calls.count(5) == -(-len(prefix) // 5) - 1 and calls.count(len(prefix) + 3) == 0  # between chunks only
    sizes = iter([1, 3, 2, None])  # a callable gives each chunk's length (None: the rest in one forward)
    target.prefill(prefix, chunk=lambda: next(sizes))
    assert next(sizes, "used") == "used" and torch.allclose(next_logits(), cold, atol=1e-12, rtol=0)
    # partial reuse: another request shares the first half of the prompt (its KV computed under other tokens after)
    target.prefix_cache = PrefixCache(min_tokens=4)
    half = len(prefix) // 2
    target.prefill(prefix[:half] + [7] * 9, key="other")
    target.prefill(prefix, key="this", chunk=4)
    assert target.cached_tokens == half
    assert torch.allclose(next_logits(), cold, atol=1e-12, rtol=0)
    # a salt (a server's tenant) partitions the cache: another salt's entries are never reused, its own are
    target.prefill(prefix, key="b1", salt="tenant-b")
    assert target.cached_tokens == 0
    target.prefill(prefix, key="b2", salt="tenant-b")
    assert target.cached_tokens == len(prefix) and torch.allclose(next_logits(), cold, atol=1e-12, rtol=0)
    target.prefix_cache = PrefixCache()


def test_the_budget_state_of_a_request_does_not_depend_on_the_request_before(tok, requests):
    """A text-only answer sets the skip flag and round counter; the next request starts fresh (same forwards as with
    nothing before it), while the learned acceptance rates carry over."""
    call = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
    text = "I cannot help with that, but here is a long answer without any tool call at all, as models write."
    req, other = requests[0], dict(requests[0], id="text-only")
    fresh = ReplayTarget(tok, {req["id"]: call}, curve=STEEP)
    alone = generate(fresh, req, "toolspec", max_new_tokens=64)
    after = ReplayTarget(tok, {req["id"]: call, other["id"]: text}, curve=STEEP)
    generate(after, other, "toolspec", max_new_tokens=64)
    budget = after.budgets["toolspec"]
    learned = budget.acceptance.as_dict()
    second = generate(after, req, "toolspec", max_new_tokens=64)
    assert second.token_ids == alone.token_ids
    assert budget.rounds == len(second.stats.tree_sizes)  # counted from this request's start
    assert learned != Acceptance().as_dict()  # the first request taught it something, and it was kept


def _slow_wave(request, cancelled=None):
    """30 s unless cancelled (checked every 10 ms, as the real wave checks between decode steps); `fast` answers."""
    import time

    t0 = time.perf_counter()
    while not request.get("fast") and time.perf_counter() - t0 < 30:
        if cancelled is not None and cancelled():
            from pipeline.runtime.sidecar_client import WaveCancelled

            raise WaveCancelled
        time.sleep(0.01)
    return gold_payload(request)


def test_a_finished_request_cancels_its_wave_and_the_next_wave_starts_at_once(targets, requests):
    import time

    from pipeline.runtime import Sidecar

    target, req = targets["qwen2"], requests[0]
    fast = dict(req, fast=True)
    with Sidecar(_slow_wave) as sidecar:
        res = generate(target, req, "ooo", sidecar=sidecar, max_new_tokens=6)
        assert res.stats.hint_ready_s is None  # the wave never answered: the request ended without it
        t0 = time.perf_counter()
        assert _wait_payload(sidecar.start(fast)) == gold_payload(req)
        assert time.perf_counter() - t0 < 5    # the old wave was abandoned, not run for its 30 s
        slow, after = sidecar.start(req), sidecar.start(fast)  # a running wave and one queued behind it
        assert slow.running()
        slow.cancel()
        assert not slow.running() and slow.poll() is None and slow.error is None
        t0 = time.perf_counter()
        assert _wait_payload(after) == gold_payload(req) and time.perf_counter() - t0 < 5
        gone = sidecar.start(req)
        gone.cancel()                           # cancelled before the worker picked it up: dropped unstarted
        assert _wait_payload(sidecar.start(fast)) == gold_payload(req)
        sidecar._drain()
        assert sidecar._results == {}           # nobody waits for cancelled results: none are kept


def _wait_payload(pending, limit=20.0):
    import time

    end = time.perf_counter() + limit
    while time.perf_counter() < end and pending.poll() is None and pending.error is None:
        time.sleep(0.01)
    return pending.poll()


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="the adaptive schedule needs 2 cores")
def test_adaptive_schedule_gives_every_core_back_mid_prefill_and_sequential_waits(targets, requests):
    """A wave that answers during a chunked prefill: the per-chunk thread counts go n-1 -> n within the prefill.
    Under `sequential` the hint is ready before the prefill starts. Outputs stay ar's."""
    import time

    import torch

    from pipeline.runtime.schedule import Schedule
    from pipeline.runtime.target import decoder_body

    target, req = targets["qwen2"], requests[0]
    ar = generate(target, req, "ar", max_new_tokens=12)

    class AnswersAfter:  # running for the first n questions (running or poll), then ready
        error, cpu_s, ready_wall = None, None, None

        def __init__(self, n):
            self.n = n

        def running(self):
            self.n -= 1
            return self.n >= 0

        def poll(self):
            self.n -= 1
            if self.n < 0 and self.ready_wall is None:
                self.ready_wall = time.time()
            return gold_payload(req) if self.n < 0 else None

        def cancel(self):
            pass

    try:
        res = generate(target, req, "ooo", sidecar=AnswersAfter(3), schedule=Schedule("adaptive", [0, 1]),
                       max_new_tokens=12, prefill_chunk=2)
        assert res.token_ids == ar.token_ids
        prefill_threads = res.stats.threads[:-(len(res.stats.tree_sizes) - 1) or None]
        assert prefill_threads[:3] == [1, 1, 1] and 2 in prefill_threads  # n-1 while it computes, then n
        # chunks beside the wave are at most `wave_chunk` tokens (a chunk keeps its core until it ends), then full
        sizes = []
        hook = decoder_body(target.model).register_forward_pre_hook(  # prefill chunks run the body alone
            lambda m, args, kw: sizes.append(kw["input_ids"].shape[1]), with_kwargs=True)
        try:
            short = generate(target, req, "ooo", sidecar=AnswersAfter(3), max_new_tokens=12, prefill_chunk=4,
                             schedule=Schedule("adaptive", [0, 1], wave_chunk=1))
        finally:
            hook.remove()
        assert short.token_ids == ar.token_ids
        n_prefill = len(short.stats.threads) - (len(short.stats.tree_sizes) - 1)
        assert sizes[:3] == [1, 1, 1] and 4 in sizes[3:n_prefill]
        assert Schedule("adaptive", [0, 1]).chunk(1, 256) == 64 and Schedule("adaptive", [0, 1]).chunk(2, 256) == 256
        assert Schedule("split", [0, 1]).chunk(1, 256) == 256 and Schedule("adaptive", [0, 1]).chunk(1, None) is None
        # `layer_switch`: a prefill in one forward (no chunks) still gives the core back, between two of its layers
        layers = []
        hooks = [layer.register_forward_hook(lambda m, a, out: layers.append(torch.get_num_threads()))
                 for layer in decoder_body(target.model).layers]
        try:
            whole = generate(target, req, "ooo", sidecar=AnswersAfter(2), max_new_tokens=12, prefill_chunk=None,
                             schedule=Schedule("adaptive", [0, 1], layer_switch=True))
        finally:
            for h in hooks:
                h.remove()
        n_layers = len(decoder_body(target.model).layers)
        assert whole.token_ids == ar.token_ids and n_layers == 2
        assert layers[:n_layers] == [1, 2]  # threads after each layer ran: n-1 for the first, n for the second
        assert whole.stats.threads[:2] == [1, 2]  # before the prefill, then the switch inside it (recorded once)
        assert Schedule("adaptive", [0, 1], layer_switch=True).chunk(1, 256) == 256  # chunks stay whole
        seq = generate(target, req, "ooo", sidecar=AnswersAfter(3), schedule=Schedule("sequential", [0, 1]),
                       max_new_tokens=12)
        assert seq.token_ids == ar.token_ids and set(seq.stats.threads) == {2}
        before_prefill = seq.stats.wall_s - seq.stats.decode_s - seq.stats.prefill_s
        assert seq.stats.hint_ready_s is not None and seq.stats.hint_ready_s <= before_prefill + 0.005
    finally:
        torch.set_num_threads(1)


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="the deferred schedule needs 2 cores")
def test_deferred_schedule_starts_the_wave_after_the_prefill_on_every_core(targets, requests):
    """`deferred`: the prefill runs on every core with no wave started; the wave starts when it ends, the target
    decodes on n-1 cores while it computes and gets every core back when it answers. Outputs stay ar's, and the hint's
    ready time still counts from the request's arrival."""
    import torch

    from pipeline.runtime.schedule import Schedule
    from pipeline.runtime.target import PrefillMemo, decoder_body

    target, req = targets["qwen2"], requests[0]
    ar = generate(target, req, "ar", max_new_tokens=12)
    forwards = []
    hook = decoder_body(target.model).register_forward_pre_hook(lambda m, a, kw: forwards.append(1), with_kwargs=True)

    class Deferred:  # a sidecar whose wave answers after 3 questions (running or poll)
        started_after = None

        def start(self, request):
            self.started_after = len(forwards)
            return self

        error, cpu_s, n = None, None, 3

        def running(self):
            self.n -= 1
            return self.n >= 0

        def poll(self):
            self.n -= 1
            return gold_payload(req) if self.n < 0 else None

        def cancel(self):
            pass

    sidecar = Deferred()
    try:
        res = generate(target, req, "ooo", sidecar=sidecar, schedule=Schedule("deferred", [0, 1]),
                       max_new_tokens=12, prefill_chunk=4)
        # with the eval's shared prefill (restored in milliseconds, charged its measured seconds) the hint's ready
        # time still counts that prefill: the wave started after it
        target.memo = PrefillMemo()
        generate(target, req, "toolspec", schedule=Schedule("all-cores", [0, 1]), max_new_tokens=2, reuse_prefill=True)
        shared = generate(target, req, "ooo", sidecar=Deferred(), schedule=Schedule("deferred", [0, 1]),
                          max_new_tokens=12, reuse_prefill=True)
    finally:
        hook.remove()
        target.memo = None
        torch.set_num_threads(1)
    assert shared.stats.prefill_reused and shared.token_ids == ar.token_ids
    assert shared.stats.hint_ready_s >= shared.stats.prefill_s
    chunks = -(-(res.stats.prompt_tokens - 1 - res.stats.cached_tokens) // 4)  # a prefix-cache hit is not computed
    assert res.token_ids == ar.token_ids
    assert sidecar.started_after == chunks                 # not before the prefill's last chunk, and before decoding
    threads = res.stats.threads
    assert threads[:chunks] == [2] * chunks and threads[chunks] == 1 and threads[-1] == 2
    assert res.stats.payload_bytes and res.stats.hint_ready_s > 0  # the hint arrived (a random target ignores it)
    sched = Schedule("deferred", [0, 1])
    assert sched.sidecar_cores == [1] and sched.threads(None) == 2 and sched.chunk(2, 256) == 256


def test_a_fixed_drafting_time_replaces_the_measured_one():
    """Replays compare exactly only if the budget does not read the clock: `draft_s` fixes its drafting overhead."""
    fixed, measured = TreeBudget(STEEP, draft_s=0.01), TreeBudget(STEEP)
    tree = _tree()
    for budget in (fixed, measured):
        sub, _ = budget.choose(tree)
        budget.update(sub, [], 0.5)
    assert fixed.overhead_s == 0.01 and measured.overhead_s == 0.5


def test_best_chain_takes_the_path_with_the_most_expected_tokens_within_k_and_min_p():
    # a hint candidate (bit 1, rate 0.9) of 6 tokens and a schema candidate (bit 2, rate 0.3) of 8 tokens
    tree = build_tree(0, [([1, 2, 3, 4, 5, 6], 1), ([7, 8, 9, 10, 11, 12, 13, 14], 2)], 64, 24)
    acc = Acceptance(prior={1: 0.9, 2: 0.3})
    assert [tree.tokens[i] for i in best_chain(tree, acc, 16)] == [1, 2, 3, 4, 5, 6]
    assert [tree.tokens[i] for i in best_chain(tree, acc, 4)] == [1, 2, 3, 4]          # at most K draft tokens
    assert [tree.tokens[i] for i in best_chain(tree, acc, 16, min_p=0.6)] == [1, 2, 3, 4]  # 0.9^5 = 0.59 < 0.6
    low = Acceptance(prior={1: 0.1, 2: 0.3})  # a hint that keeps failing: the other branch, short
    assert [tree.tokens[i] for i in best_chain(tree, low, 16, min_p=0.05)] == [7, 8]
