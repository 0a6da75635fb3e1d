"""Lossless by construction, proven in float64 on tiny targets of all three families: every method's tokens
equal `ar`'s, whatever the drafts and whatever the sidecar does (right, partly right, wrong, late, never, dying).
Random tiny models write no tool calls, so the cache paths (multi-token accepts, partial accepts, tree branches
that are not the first) are driven by a drafter that knows `ar`'s output and corrupts it; acceptance on real
tool-call text is measured with the replay target."""

import json
import os
import time

import pytest

from pipeline.runtime import METHODS, Ready, Sidecar, generate
from pipeline.runtime.drafters import History
from pipeline.payload import gold_payload
from pipeline.runtime.replay import ReplayTarget
from pipeline.testing import ScriptDrafter, tiny_target

N = 20  # new tokens per request: enough for several rounds, small enough for a fast suite


def _check(res, ref):
    assert res.token_ids == ref.token_ids and res.text == ref.text
    s = res.stats
    assert s.new_tokens == len(res.token_ids) == sum(s.accepted) and s.forwards == len(s.accepted)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_every_method_equals_ar(targets, requests, family):
    target = targets[family]
    for req in requests:
        ar = generate(target, req, "ar", max_new_tokens=N)
        assert ar.stats.forwards == ar.stats.new_tokens == N
        for method in METHODS[1:]:
            _check(generate(target, req, method, sidecar=Ready(gold_payload(req)), oracle=ar, max_new_tokens=N), ar)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_cache_paths_multi_token_partial_and_tree_accepts(targets, requests, family):
    target = targets[family]
    req = requests[1]
    ar = generate(target, req, "ar", max_new_tokens=3 * N)
    kept = []
    keep = target.keep

    def spy(tree_len, nodes):
        kept.append(nodes)
        keep(tree_len, nodes)

    target.keep = spy
    try:
        res = generate(target, req, "toolspec", max_new_tokens=3 * N, extra_drafters=[ScriptDrafter(ar.token_ids)])
    finally:
        del target.keep
    _check(res, ar)
    assert res.stats.mean_accepted > 2.5
    assert any(n and n != list(range(1, len(n) + 1)) for n in kept)  # a branch that is not the first: gathered
    assert any(0 < len(n) < 6 for n in kept)  # partial accepts: the rejected tail cropped
    chain = tiny_target(family, target.tokenizer, tree=False)  # fallback: only the best candidate, as a chain
    _check(generate(chain, req, "ooo", max_new_tokens=3 * N, extra_drafters=[ScriptDrafter(ar.token_ids)]), ar)


def test_max_new_tokens_cuts_inside_an_accepted_draft(targets, requests):
    target = targets["qwen3"]
    ar = generate(target, requests[0], "ar", max_new_tokens=9)
    res = generate(target, requests[0], "ar", max_new_tokens=9, extra_drafters=[ScriptDrafter(ar.token_ids + [0] * 9)])
    _check(res, ar)
    assert res.stats.stop == "length" and res.stats.forwards < 9


def wave(request):
    """Fake sidecar: behaviour chosen by the request's test tag."""
    kind = request["sidecar"]
    gold = gold_payload(request)
    if kind == "right":
        return gold
    if kind == "partly":
        args = dict(gold["arguments"])
        args[next(iter(args))] = "somewhere else"
        return {"tool_index": gold["tool_index"], "arguments": args}
    if kind == "wrong":
        return {"tool_index": len(request["tools"]) - 1 - gold["tool_index"], "arguments": {}}
    if kind == "late":
        time.sleep(0.3)
        return gold
    if kind == "never":
        time.sleep(60)
    if kind == "dies":
        time.sleep(0.05)
        os._exit(9)
    return {"garbage": [1, 2, 3]}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", ["right", "partly", "wrong", "late", "never", "dies", "garbage"])
def test_sidecar_behaviour_never_changes_the_output(targets, requests, kind, family):
    target = targets[family]
    with Sidecar(wave, timeout_s=1.0) as sidecar:
        for req in requests[:2]:
            req = dict(req, sidecar=kind)  # tells the fake wave how to behave
            ar = generate(target, req, "ar", max_new_tokens=N)
            if kind == "right":
                time.sleep(0.2)  # the hint is ready before the first round
            res = generate(target, req, "ooo", sidecar=sidecar, max_new_tokens=N,
                           extra_drafters=[ScriptDrafter(ar.token_ids)])
            _check(res, ar)
            if kind in ("never", "dies"):
                assert res.stats.hint_ready_s is None
            if kind == "garbage":
                assert res.stats.hint_error, kind
            if kind in ("right", "partly"):
                assert res.stats.hint_ready_s is not None and not res.stats.hint_error, kind
            if kind == "late" and res.stats.hint_ready_s is not None:
                assert res.stats.hint_ready_s >= 0.3  # measured when the wave finished, on the worker's clock


def _replay(tok, requests, fmt="fenced"):
    calls = {r["id"]: r["gold"][0] for r in requests}
    if fmt == "fenced":
        outputs = {i: "```json\n" + json.dumps(c, indent=2) + "\n```" for i, c in calls.items()}
    else:
        outputs = {i: "<tool_call>\n" + json.dumps(c) + "\n</tool_call>" for i, c in calls.items()}
    return ReplayTarget(tok, outputs)


@pytest.mark.parametrize("fmt", ["fenced", "tag"])
def test_replay_acceptance_hint_beats_schema_beats_lookup(tok, requests, fmt):
    target = _replay(tok, requests, fmt)
    totals = {m: [0, 0] for m in METHODS}
    for req in requests:
        expected = target.outputs[req["id"]]
        for method in METHODS:
            res = generate(target, req, method, sidecar=Ready(gold_payload(req)), max_new_tokens=300,
                           history=History())
            assert res.token_ids == expected
            totals[method][0] += res.stats.new_tokens
            totals[method][1] += res.stats.forwards
    mean = {m: a / f for m, (a, f) in totals.items()}
    assert mean["ar"] == 1.0 and mean["pld"] > 1.2
    assert mean["toolspec"] > 2 * mean["pld"]
    assert mean["ooo"] > 1.5 * mean["toolspec"] and mean["ooo-oracle"] >= mean["ooo"] >= 10


def test_replay_partly_right_hint_rejoins_after_the_wrong_values(tok, requests):
    target = _replay(tok, requests)
    req = requests[1]  # book_hotel(hotel="Grand Hotel", nights=3, guests=[...], options={...})
    gold = gold_payload(req)
    partly_payload = {"tool_index": gold["tool_index"], "arguments": dict(gold["arguments"], hotel="Lux", nights=5)}
    runs = {name: generate(target, req, "ooo", sidecar=Ready(p) if p else None, max_new_tokens=300, history=History())
            for name, p in [("right", gold), ("partly", partly_payload), ("none", None)]}
    assert runs["right"].token_ids == runs["partly"].token_ids == runs["none"].token_ids
    assert runs["right"].stats.forwards < runs["partly"].stats.forwards < runs["none"].stats.forwards
    partly = runs["partly"]
    text = target.decode(partly.token_ids)
    diverged = len(tok.encode(text[:text.index('"nights": 3') + 10], add_special_tokens=False))
    starts = [sum(partly.stats.accepted[:i]) for i in range(len(partly.stats.accepted))]
    # after the target wrote its own value (3, not 5), the hint re-joins: the rest comes in long rounds
    assert any(s >= diverged and a >= 10 for s, a in zip(starts, partly.stats.accepted))


def test_warm_up_runs_every_decode_and_waits_for_every_sidecar_then_forgets_the_run(targets, requests):
    """The one warm-up the eval's runner and the server share: no history or statistics survive it."""
    from pipeline.runtime import warm_up

    target, req = targets["qwen2"], requests[0]
    ran, answered = [], []

    class Spy:  # what warm-up asks of each sidecar: one wave for the request, waited for
        def __init__(self, inner):
            self.inner = inner

        def start(self, request):
            pending = self.inner.start(request)
            return type("P", (), {"wait": lambda _: answered.append(pending.wait()) or answered[-1]})()

    with Sidecar(gold_payload, timeout_s=10) as sidecar:
        warm_up(target, req, [lambda: ran.append(generate(target, req, "toolspec", max_new_tokens=8)),
                              lambda: ran.append(generate(target, req, "ooo", sidecar=sidecar, max_new_tokens=8))],
                [Spy(sidecar), None])
    assert [r.stats.method for r in ran] == ["toolspec", "ooo"] and answered == [gold_payload(req)]
    assert not target.histories and not target.budgets  # warm-up never drafts for the first measured request
