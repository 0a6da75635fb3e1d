"""The vLLM proposer's drafting on synthetic token arrays, without an engine: a simulated engine verifies each row's
chain greedily against a known output (the call as Qwen2.5's real template writes it, real tokenizer fixture), as
vLLM's rejection sampler does, so the number of steps is what the engine would take.

Right hint -> its tokens drafted and accepted (far fewer steps than toolspec); wrong hint -> no long wrong chains;
rows that move, rows with nothing sampled, two requests with the same prompt, ended requests forgotten, tenants
that never draft each other's history, a hint posted late."""

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.payload import gold_payload
from pipeline.requests import render_prompt
from pipeline.vllm_spec import HintBoard, Speculator

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EMAIL = {**json.loads((FIXTURES / "email_request.json").read_text()), "id": "fixture/email"}
K = 16


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(FIXTURES / "families" / "qwen2.5")


def prompt_ids(tok, request):
    return tok(render_prompt(tok, request), add_special_tokens=False).input_ids


def call_output(tok, call) -> list[int]:
    """What the target writes: Qwen2.5's <tool_call> rendering of `call`, then <|im_end|>."""
    text = "<tool_call>\n" + json.dumps({"name": call["name"], "arguments": call["arguments"]}) + "\n</tool_call>"
    return tok(text, add_special_tokens=False).input_ids + [tok.convert_tokens_to_ids("<|im_end|>")]


class Engine:
    """Greedy verification as vLLM does it: a row keeps the longest prefix of its draft that equals its output,
    plus the target's next token. rows: [prompt, output, produced]; `order` permutes the rows every step."""

    def __init__(self, spec: Speculator, width: int = 4096):
        self.spec, self.width, self.rows, self.steps = spec, width, [], 0
        self.drafted_wrong = 0

    def add(self, prompt, output) -> dict:
        row = {"prompt": list(prompt), "output": list(output), "produced": output[:1]}  # prefill sampled one token
        self.rows.append(row)
        return row

    def step(self, order=None, idle=()) -> None:
        live = [r for r in self.rows if len(r["produced"]) < len(r["output"])]
        order = order or list(range(len(live)))
        batch = [live[i] for i in order]
        tokens = np.zeros((len(batch) + len(idle), self.width), dtype=np.int32)
        rows = []
        for i, r in enumerate(batch):
            seq = r["prompt"] + r["produced"]
            tokens[i, :len(seq)] = seq
            rows.append((tokens[i], len(seq)))
        rows += [None] * len(idle)  # rows that sampled nothing this step (a prefill chunk)
        drafts = self.spec.speculate(rows)
        assert len(drafts) == len(rows) and all(d == [] for d in drafts[len(batch):])
        for r, d in zip(batch, drafts):
            assert len(d) <= K
            rest = r["output"][len(r["produced"]):]
            n = 0
            while n < len(d) and n < len(rest) - 1 and d[n] == rest[n]:
                n += 1
            self.drafted_wrong += len(d) - n
            r["produced"] += rest[:n + 1]
        self.steps += 1

    def run(self, limit=400) -> int:
        start = self.steps
        while any(len(r["produced"]) < len(r["output"]) for r in self.rows):
            self.step()
            assert self.steps - start < limit
        return self.steps - start


def decode_request(tok, tmp_path, method, payload=None, request=EMAIL, spec=None, tenant="", late_after=None):
    board = spec.board if spec else HintBoard(tmp_path / "board")
    spec = spec or Speculator(tok, board, K, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    prompt, output = prompt_ids(tok, request), call_output(tok, request["gold"][0])
    rid = f"r{spec.step}-{method}"
    board.start_request(rid, prompt, request, method, tenant=tenant, payload=None if late_after else payload)
    engine = Engine(spec)
    engine.add(prompt, output)
    if late_after:
        for _ in range(late_after):
            engine.step()
        board.post_hint(rid, payload=payload)
    steps = engine.run() + (late_after or 0)
    board.stop_request(rid, output)
    spec.refresh()
    return steps, board.figures(rid), engine, spec


def test_a_right_hint_is_drafted_and_accepted(tok, tmp_path):
    toolspec, _, _, _ = decode_request(tok, tmp_path / "a", "toolspec")
    ooo, fig, engine, _ = decode_request(tok, tmp_path / "b", "ooo", gold_payload(EMAIL))
    assert ooo <= 0.6 * toolspec, (ooo, toolspec)
    assert fig["hint_accepted"] >= 20 and fig["accepted"] >= fig["hint_accepted"]
    assert fig["method"] == "ooo" and fig["hint_error"] is None and fig["hint_ready_s"] is not None


def test_a_wrong_hint_gives_no_long_wrong_chains(tok, tmp_path):
    wrong = {"tool_index": 0, "arguments": {"to": "bob@corp.example", "subject": "Lunch plans for next week",
                                            "body": "Could we move lunch to Thursday at noon instead?"}}
    toolspec, _, ts_engine, _ = decode_request(tok, tmp_path / "a", "toolspec")
    steps, fig, engine, _ = decode_request(tok, tmp_path / "b", "ooo", wrong)
    assert steps <= toolspec + 2, (steps, toolspec)
    assert engine.drafted_wrong <= ts_engine.drafted_wrong + 6 * K  # the hint's rate falls: its chains shorten


def test_rows_that_move_and_rows_that_sample_nothing(tok, tmp_path):
    """Three requests (two tools, one with the same prompt as another) whose rows swap places every step, with
    idle rows between them: each row's draft is its own request's, so all end as fast as they would alone."""
    board = HintBoard(tmp_path / "board")
    spec = Speculator(tok, board, K, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    event = {**EMAIL, "id": "fixture/event", "messages": [{"role": "user", "content": "Put the review on Friday."}],
             "gold": [{"name": "create_event", "arguments": {"title": "Review", "date": "Friday"}}]}
    engine = Engine(spec)
    for i, req in enumerate((EMAIL, event, EMAIL)):
        prompt = prompt_ids(tok, req)
        board.start_request(f"r{i}", prompt, req, "ooo", payload=gold_payload(req))
        engine.add(prompt, call_output(tok, req["gold"][0]))
    alone = decode_request(tok, tmp_path / "alone", "ooo", gold_payload(EMAIL))[0]
    orders = [[0, 1, 2], [2, 0, 1], [1, 2, 0]]
    while any(len(r["produced"]) < len(r["output"]) for r in engine.rows):
        live = sum(len(r["produced"]) < len(r["output"]) for r in engine.rows)
        order = orders[engine.steps % 3][:live] if live == 3 else list(range(live))[::-1]
        engine.step(order, idle=[None] * (engine.steps % 2))
        assert engine.steps <= alone + 3
    assert len(spec.states) == 3


def test_ended_requests_are_forgotten_and_feed_their_tenants_history(tok, tmp_path):
    board = HintBoard(tmp_path / "board")
    spec = Speculator(tok, board, K, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    first, fig, _, _ = decode_request(tok, tmp_path, "toolspec", spec=spec, tenant="alice")
    assert spec.states == {} and fig is not None and fig["steps"] == first
    assert not list((board.root / "end").iterdir()) and not list((board.root / "req").iterdir())
    again = decode_request(tok, tmp_path, "toolspec", spec=spec, tenant="alice")[0]
    other = decode_request(tok, tmp_path, "toolspec", spec=spec, tenant="bob")[0]
    assert again < first / 4  # alice's history drafts her repeat whole
    assert other >= first - 2  # bob never sees alice's outputs (the acceptance rates per method are shared)
    assert len(spec.histories["alice"].kept) == 2 and len(spec.histories["bob"].kept) == 1


def test_a_row_without_a_registration_gets_no_draft(tok, tmp_path):
    spec = Speculator(tok, HintBoard(tmp_path / "board"), K, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    engine = Engine(spec)
    engine.add(prompt_ids(tok, EMAIL), call_output(tok, EMAIL["gold"][0]))
    engine.step()
    assert engine.drafted_wrong == 0 and spec.states == {} and len(engine.rows[0]["produced"]) == 2


def test_a_hint_posted_late_is_used_from_then_on(tok, tmp_path):
    toolspec = decode_request(tok, tmp_path / "a", "toolspec")[0]
    steps, fig, _, _ = decode_request(tok, tmp_path / "b", "ooo", gold_payload(EMAIL), late_after=3)
    assert steps < toolspec and fig["hint_accepted"] > 0


def test_a_hint_error_is_reported_and_drafting_goes_on(tok, tmp_path):
    board = HintBoard(tmp_path / "board")
    spec = Speculator(tok, board, K, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    prompt, output = prompt_ids(tok, EMAIL), call_output(tok, EMAIL["gold"][0])
    board.start_request("r", prompt, EMAIL, "ooo")
    board.post_hint("r", error="sidecar wave failed: boom")
    engine = Engine(spec)
    engine.add(prompt, output)
    engine.run()
    board.stop_request("r", output)
    spec.refresh()
    assert board.figures("r")["hint_error"] == "sidecar wave failed: boom"
