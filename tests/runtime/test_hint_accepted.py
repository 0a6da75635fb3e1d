"""Hint tokens really accepted, in float64: a tiny Qwen2 target is trained inside the test (a few seconds) to answer
two requests with their fenced tool calls, so greedy decoding writes real calls; every sidecar behaviour then asserts
its own outcome (`hint_tokens`, `hint_error`, `hint_ready_s`) and the output equals `ar`'s token for token.
The second request (`EMAIL`) has several free-text values that neither the schema nor the prompt spells out, and no
enum: there the hint must beat `toolspec` by itself (the first request's call is mostly scaffolding and a copied city,
which `toolspec` drafts well without a hint).
Timing is made explicit: a drafter that sleeps per round makes each decode last long enough that a timeout fires,
and a wave that sleeps longer than the whole decode is really late."""

import json
import os
import time
from pathlib import Path

import pytest
import torch

from pipeline.runtime import Sidecar, Target, generate
from pipeline.payload import gold_payload

STEPS = 300
MAX = 200  # new tokens: the tiny tokenizer spends many on free text
EMAIL = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "email_request.json").read_text())


def fenced(call: dict) -> str:
    return "```json\n" + json.dumps(call, indent=2) + "\n```"


def answers(target, reqs) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the fenced gold call + end of turn) per request: what the tiny target is taught to answer."""
    eos = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    return [(target.prompt_ids(req), target.tokenizer.encode(fenced(req["gold"][0]), add_special_tokens=False) + [eos])
            for req in reqs]


@pytest.fixture(scope="module")
def caller(tok, requests):
    """(target, requests) where the target's greedy answer to the request is its gold call, fenced."""
    from pipeline.testing import make_tiny_model, teach

    torch.manual_seed(0)
    model, _ = make_tiny_model("qwen2", tokenizer=tok, dtype=torch.float64)
    target = Target(model, tok, name="tiny-caller", prefix_cache=False)
    reqs = requests[:1] + [EMAIL]
    teach(model, answers(target, reqs), STEPS)
    for req in reqs:
        ar = generate(target, req, "ar", max_new_tokens=MAX)
        assert ar.text == fenced(req["gold"][0]), f"the tiny target did not learn its call: {ar.text!r}"
    return target, reqs


class Sleepy:
    """Proposes nothing; sleeps `first` seconds in the first round and `s` in every other, so a decode takes a known
    minimum time (a stalled or dead sidecar is noticed at the next round's poll)."""

    def __init__(self, s, first=0.0):
        self.s, self.first, self.rounds = s, first, 0

    def propose(self, ctx):
        time.sleep(self.first if self.rounds == 0 else self.s)
        self.rounds += 1
        return []


def wave(request):
    kind, gold = request["sidecar"], gold_payload(request)
    if kind == "right":
        return gold
    if kind == "partly":  # the first value wrong, the rest right
        args = dict(gold["arguments"])
        args[next(iter(args))] = "Somewhere Else"
        return {"tool_index": gold["tool_index"], "arguments": args}
    if kind == "partial":  # a required slot missing: still a usable draft
        args = dict(gold["arguments"])
        args.pop(next(iter(args)))
        return {"tool_index": gold["tool_index"], "arguments": args}
    if kind == "wrong":  # another tool, no arguments for the one the target calls
        return {"tool_index": 1 - gold["tool_index"] if len(request["tools"]) > 1 else 0, "arguments": {}}
    if kind == "invalid":  # a value the schema forbids: rejected by validation
        return {"tool_index": gold["tool_index"], "arguments": {k: 12345 for k in gold["arguments"]}}
    if kind in ("late", "never"):
        time.sleep(3.0 if kind == "late" else 60)
        return gold
    if kind == "crash":
        os._exit(3)
    return ["garbage"]


def run(target, req, kind, timeout_s=30.0, sleepy=0.0, first=0.0):
    target.histories.clear()  # no earlier run's output of this very request in the history drafter
    ar = generate(target, req, "ar", max_new_tokens=MAX)
    with Sidecar(wave, timeout_s=timeout_s) as sidecar:
        pending = sidecar.start(dict(req, sidecar=kind))
        if kind in ("right", "partly", "partial", "wrong", "invalid", "garbage"):
            t0 = time.perf_counter()  # ready before the first round: what a sidecar faster than the prefill gives
            while pending.poll() is None and pending.error is None and time.perf_counter() - t0 < 20:
                time.sleep(0.01)
        res = generate(target, req, "ooo", sidecar=pending, max_new_tokens=MAX,
                       extra_drafters=[Sleepy(sleepy, first)] if sleepy or first else None)
    assert res.token_ids == ar.token_ids and res.text == ar.text, kind
    return res.stats, ar.stats


def test_right_hint_drafts_most_of_the_call(caller):
    target, reqs = caller
    for req in reqs:
        st, ar = run(target, req, "right")
        assert st.hint_error is None and st.hint_ready_s is not None
        assert st.hint_shared_tokens >= 0.6 * st.new_tokens, (st.hint_shared_tokens, st.new_tokens)
        assert st.forwards <= ar.forwards / 3


def toolspec_stats(target, req):
    target.histories.clear()
    return generate(target, req, "toolspec", max_new_tokens=MAX).stats


def test_the_hint_pays_where_the_schema_and_the_prompt_cannot_guess(caller):
    """Free-text values: ooo takes at most 0.6x toolspec's forwards, and most accepted draft tokens came from the
    hint alone (no other drafter proposed them)."""
    target, reqs = caller
    st, ar = run(target, EMAIL, "right")
    ts = toolspec_stats(target, EMAIL)
    assert st.forwards <= 0.6 * ts.forwards, (st.forwards, ts.forwards, ar.forwards)
    assert st.hint_tokens >= 0.4 * st.draft_tokens, (st.hint_tokens, st.draft_tokens)


@pytest.mark.parametrize("kind", ["wrong", "partly", "invalid", "garbage"])
def test_a_bad_hint_costs_at_most_two_forwards_over_toolspec(caller, kind):
    target, reqs = caller
    st, _ = run(target, EMAIL, kind)
    assert st.forwards <= toolspec_stats(target, EMAIL).forwards + 2, kind


def test_partly_right_and_partial_hints_are_used(caller):
    target, reqs = caller
    right, _ = run(target, EMAIL, "right")
    for kind in ("partly", "partial"):
        st, _ = run(target, EMAIL, kind)
        assert st.hint_error is None, (kind, st.hint_error)
        assert 0 < st.hint_tokens < right.hint_tokens, (kind, st.hint_tokens, right.hint_tokens)


def test_wrong_tool_hint_gives_only_what_it_has(caller):
    target, reqs = caller
    right, _ = run(target, EMAIL, "right")
    st, _ = run(target, EMAIL, "wrong")
    assert st.hint_error is None and st.hint_tokens < right.hint_tokens


@pytest.mark.parametrize("kind, error", [("invalid", "schema"), ("garbage", "expected an object")])
def test_rejected_hints_say_why(caller, kind, error):
    target, reqs = caller
    st, _ = run(target, reqs[0], kind)
    assert st.hint_tokens == 0 and st.hint_error and error in st.hint_error, st.hint_error


def test_late_hint_is_not_ready_and_changes_nothing(caller):
    target, reqs = caller
    st, _ = run(target, reqs[0], "late", sleepy=0.005)
    assert st.hint_ready_s is None and st.hint_tokens == 0 and st.hint_error is None
    assert st.wall_s < 3.0  # the decode really finished before the wave


def test_stalled_and_crashed_sidecars_are_errors(caller):
    target, reqs = caller
    st, _ = run(target, reqs[0], "never", timeout_s=0.2, first=0.4)  # round 2 polls after the timeout
    assert st.forwards >= 2 and st.hint_tokens == 0 and "timed out" in st.hint_error
    st, _ = run(target, reqs[0], "crash", first=0.4)
    assert st.hint_tokens == 0 and "died" in st.hint_error
