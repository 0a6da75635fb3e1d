"""Hardware-aware verification and the prefix cache: the budget's choices follow the cost curve, and neither the
budget, the prefix cache nor the thread schedule changes a single output token (float64 tiny targets)."""

import json

import pytest

from pipeline.runtime import Ready, generate
from pipeline.runtime.budget import Acceptance, CostCurve, TreeBudget, node_probs, subtree
from pipeline.runtime.parse import gold_payload
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


def test_curve_interpolates_and_cache_round_trips(tmp_path, monkeypatch):
    assert STEEP.cost(1) == pytest.approx(0.26) and STEEP.cost(32) == pytest.approx(5.08)
    assert 0.26 < STEEP.cost(4) < 1.30
    monkeypatch.setenv("OOO_COST_DIR", str(tmp_path))

    class Fake:  # CostCurve.cached must not measure when a file for the key exists
        pass

    key = {"machine": "x", "model": "m"}
    path = None
    curve = CostCurve((1, 2), (0.1, 0.2), {})
    import hashlib

    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = tmp_path / f"{digest}.json"
    path.write_text(json.dumps(curve.as_dict()))
    assert CostCurve.cached(Fake(), key).seconds == (0.1, 0.2)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_measured_budget_prefix_cache_and_schedule_are_lossless(targets, requests, family):
    target = targets[family]
    target.prefix_cache.clear()
    ref = {r["id"]: generate(target, r, "ar", max_new_tokens=16, tree_budget="fixed") for r in requests}
    curve = target.calibrate(past=32, reps=1, cache=False)
    assert len(curve.seconds) == 6 and all(s > 0 for s in curve.seconds)

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
            while pending.poll() is None and pending.error is None and time.perf_counter() - t0 < 10:
                time.sleep(0.01)
            assert not pending.running() and adaptive.threads(pending) == 2
            assert pending.cpu_s is not None and pending.cpu_s < 0.9  # the wave slept: little CPU is charged
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
