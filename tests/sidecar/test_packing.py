"""Prefix-shared packing: layout (prefix once, masks, positions, labels), and packed == row-by-row in float64."""

import pytest
import torch

from pipeline.io import InputError, read_jsonl
from pipeline.sidecar.packing import (IGNORE, PackedCollator, keep_row, pack_request, pack_rows,
                                      packed_attention_mask, unpacked_rows)
from pipeline.sidecar.rows import (answer_ids, build_rows, label_from_call, render_prefix_and_suffixes,
                                   wave_questions)
from pipeline.sidecar.trainer import answer_token_losses
from pipeline.testing import make_tiny_model, make_tokenizer

FIXTURES = "tests/fixtures/requests.jsonl"


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def requests():
    return read_jsonl(FIXTURES)


def gold_rows(request, **kw):
    return build_rows(request, label_from_call(request, request["gold"][0]), **kw)


@pytest.mark.parametrize("written,trained", [("long", "long"), ("short", "short"), ("long", "short")])
def test_sequence_is_prefix_once_then_each_row(tok, requests, written, trained):
    req = requests[1]
    rows = gold_rows(req, questions=written)
    (seq,), dropped = pack_request(tok, req, rows, questions=trained)
    assert dropped == 0 and seq["n_rows"] == len(rows)
    questions, keys = wave_questions(req, trained)
    asked = [("function",)] + [("slot", r["tool"], r["param"]) for r in rows[1:]]  # the called tool's rows
    questions = [questions[keys.index(k)] for k in asked]
    prefix, suffixes = render_prefix_and_suffixes(tok, req, questions)  # the wave's tokens
    P = len(prefix)
    assert seq["input_ids"][:P] == prefix and seq["segment_ids"][:P] == [0] * P
    t = P
    for j, (row, suffix) in enumerate(zip(rows, suffixes), 1):
        answer = answer_ids(tok, row["completion"][0]["content"])
        n = len(suffix) + len(answer)
        assert seq["input_ids"][t:t + n] == suffix + answer
        assert seq["segment_ids"][t:t + n] == [j] * n
        assert seq["position_ids"][t:t + n] == list(range(P, P + n))  # restart right after the prefix
        assert seq["labels"][t:t + n] == [IGNORE] * len(suffix) + answer  # loss on the answer (+ <|im_end|>) only
        # the row, unpacked, is exactly the chat its prompt + completion render to (in the style it was written in)
        if written == trained:
            text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            assert tok.decode(prefix + suffix + answer) == text + row["completion"][0]["content"] + "<|im_end|>"
        t += n
    assert t == len(seq["input_ids"])
    assert all(x == IGNORE for x in seq["labels"][:P])


def test_mask_rows_see_prefix_and_themselves_only():
    seg = torch.tensor([[0, 0, 1, 1, 2, 2, 2, -1]])
    m = packed_attention_mask(seg)[0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0, 0, 0, 0],
                 [1, 1, 1, 0, 0, 0, 0, 0],
                 [1, 1, 1, 1, 0, 0, 0, 0],
                 [1, 1, 0, 0, 1, 0, 0, 0],   # row 2 skips row 1
                 [1, 1, 0, 0, 1, 1, 0, 0],
                 [1, 1, 0, 0, 1, 1, 1, 0],
                 [0, 0, 0, 0, 0, 0, 0, 1]]   # padding sees only padding (never an empty row)


def test_function_rows_of_multi_tool_requests_are_repeated(tok, requests):
    byid = {r["id"]: r for r in requests}
    multi, single = requests[1], requests[2]  # 3 tools, 1 tool
    rows = [("f", row) for r in (multi, single) for row in gold_rows(r, questions="short")]
    once, stats1 = pack_rows(tok, byid, rows, questions="short")
    thrice, stats3 = pack_rows(tok, byid, rows, questions="short", function_repeat=3)
    assert stats1["function_copies"] == 0 and stats3["function_copies"] == 2
    assert [s["n_rows"] for s in thrice] == [once[0]["n_rows"] + 2, once[1]["n_rows"]]  # the single tool's: once
    prefix, (function_suffix,) = render_prefix_and_suffixes(tok, multi, ["tool"])
    copy = function_suffix + answer_ids(tok, gold_rows(multi)[0]["completion"][0]["content"])
    ids = thrice[0]["input_ids"]
    starts = [i for i in range(len(prefix), len(ids)) if ids[i:i + len(copy)] == copy]
    assert len(starts) == 3 and len({thrice[0]["segment_ids"][i] for i in starts}) == 3  # three rows of their own
    assert thrice[1] == once[1]
    with pytest.raises(ValueError, match="function_repeat=0"):
        pack_rows(tok, byid, rows, function_repeat=0)


def test_collator_pads_to_longest(tok, requests):
    seqs, _ = pack_rows(tok, {r["id"]: r for r in requests},
                        [("f", row) for r in requests[:2] for row in gold_rows(r)])
    batch = PackedCollator(tok.pad_token_id, pad_to_multiple_of=8)(seqs)
    L = max(len(s["input_ids"]) for s in seqs)
    assert batch["input_ids"].shape[1] == -(-L // 8) * 8
    assert batch["attention_mask"].shape == (2, 1, batch["input_ids"].shape[1], batch["input_ids"].shape[1])
    short = min(range(2), key=lambda i: len(seqs[i]["input_ids"]))
    n = len(seqs[short]["input_ids"])
    assert (batch["labels"][short, n:] == IGNORE).all() and (batch["position_ids"][short, n:] == 0).all()
    assert not batch["attention_mask"][short, 0, :n, n:].any()


def test_max_length_splits_with_prefix_repeated_and_drops_oversize(tok, requests):
    req = requests[1]
    rows = gold_rows(req)
    (whole,), _ = pack_request(tok, req, rows)
    P = whole["segment_ids"].count(0)
    row_lens = [whole["segment_ids"].count(j) for j in range(1, len(rows) + 1)]
    limit = P + max(row_lens) + 20
    seqs, dropped = pack_request(tok, req, rows, max_length=limit)
    assert dropped == 0 and len(seqs) > 1 and sum(s["n_rows"] for s in seqs) == len(rows)
    assert all(len(s["input_ids"]) <= limit and s["input_ids"][:P] == whole["input_ids"][:P] for s in seqs)
    seqs, dropped = pack_request(tok, req, rows, max_length=P + min(row_lens))
    assert dropped == sum(n > min(row_lens) for n in row_lens)


def test_null_subsampling_keeps_chosen_rows_and_is_deterministic(tok, requests):
    rows = [row for r in requests for row in gold_rows(r)]
    assert all(r["chosen"] for r in rows)  # build_rows writes the called tool's slots only
    unchosen = {**rows[1], "tool": 1 - rows[1]["tool"], "chosen": False, "null": True}  # a rows file of other origin
    rows.append(unchosen)
    for row in rows:
        assert keep_row(row, 1.0)
        if row["kind"] != "slot" or row["chosen"] or not row["null"]:
            assert keep_row(row, 0.0)
        else:
            assert not keep_row(row, 0.0)
    assert not keep_row(unchosen, 0.0) and keep_row(unchosen, 1.0)
    assert [keep_row(r, 0.5, seed=3) for r in rows] == [keep_row(r, 0.5, seed=3) for r in rows]


def test_rows_that_do_not_match_the_request_fail_loudly(tok, requests):
    rows = gold_rows(requests[0])
    with pytest.raises(InputError, match=r"rows\.jsonl:7 \(record nope\): request_id not found"):
        pack_rows(tok, {r["id"]: r for r in requests}, [("rows.jsonl:7", {**rows[0], "request_id": "nope"})])
    with pytest.raises(InputError, match="prompt does not match"):
        pack_request(tok, requests[1], rows)  # fixture/0's rows against fixture/1
    with pytest.raises(InputError, match="does not have"):
        pack_request(tok, requests[0], [{**rows[1], "param": "no_such_param"}])


def _lora(model, seed=0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,  # random A and B: every LoRA weight gets a gradient
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(model, cfg)


def _row_by_row(model, row):
    """Reference: one plain causal forward over prefix + suffix + answer, no custom mask, positions 0..n-1."""
    ids = torch.tensor([row["input_ids"]])
    labels = torch.tensor(row["labels"])
    logits = model(input_ids=ids).logits[0, :-1]
    keep = labels[1:] != IGNORE
    return torch.nn.functional.cross_entropy(logits[keep], labels[1:][keep], reduction="none")


def _float64_norms(model):
    """transformers' RMSNorm computes in float32 whatever the input dtype, so the backward of a prefix token rounds
    the sum of all rows' gradients to float32 once (packed) or each row's part (row by row): a 5e-8 relative
    difference that is rounding, not packing. Swap in the same norm in float64 so the comparison is exact."""
    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = forward.__get__(module)
    return model


def _packed_and_reference(tok, requests, family, attn):
    model, _ = make_tiny_model(family, tokenizer=tok, dtype=torch.float64)
    model.set_attn_implementation(attn)
    model = _lora(_float64_norms(model))
    seqs, _ = pack_rows(tok, {r["id"]: r for r in requests},
                        [("f", row) for r in (requests[0], requests[2]) for row in gold_rows(r)])
    return model, seqs


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_packed_loss_and_gradients_equal_row_by_row_float64(tok, requests, family):
    model, seqs = _packed_and_reference(tok, requests, family, "sdpa")
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)

    # packed: two requests in one padded batch, each prefix once
    packed = answer_token_losses(model, PackedCollator(tok.pad_token_id)(seqs))
    packed.sum().backward()
    g_packed = {n: p.grad.clone() for n, p in lora.items()}
    model.zero_grad()

    # row by row: prefix + suffix + answer, gradients summed over the rows
    ref = []
    for s in seqs:
        for row in unpacked_rows(s):
            losses = _row_by_row(model, row)
            losses.sum().backward()
            ref.append(losses.detach())
    ref = torch.cat(ref)
    assert packed.shape == ref.shape and packed.numel() == sum(x != IGNORE for s in seqs for x in s["labels"])
    torch.testing.assert_close(packed.detach(), ref, atol=1e-10, rtol=0)
    for n, p in lora.items():
        assert p.grad.abs().max() > 0, n
        diff = (g_packed[n] - p.grad).abs().max().item()
        assert diff < 1e-10, f"{n}: max |packed - row by row| = {diff:.3g}"


def test_eager_attention_takes_the_mask_as_additive_float(tok, requests):
    # eager attention runs its softmax in float32, so equality holds to float32 rounding only
    model, seqs = _packed_and_reference(tok, requests, "qwen2", "eager")
    with torch.no_grad():
        packed = answer_token_losses(model, PackedCollator(tok.pad_token_id)(seqs))
        ref = torch.cat([_row_by_row(model, row) for s in seqs for row in unpacked_rows(s)])
    torch.testing.assert_close(packed, ref, atol=1e-6, rtol=0)


def test_packed_batch_equals_each_sequence_alone(tok, requests):
    model, _ = make_tiny_model("qwen2", tokenizer=tok, dtype=torch.float64)
    seqs, _ = pack_rows(tok, {r["id"]: r for r in requests}, [("f", row) for r in requests for row in gold_rows(r)])
    collate = PackedCollator(tok.pad_token_id)
    with torch.no_grad():
        together = answer_token_losses(model, collate(seqs))
        alone = torch.cat([answer_token_losses(model, collate([s])) for s in seqs])
    torch.testing.assert_close(together, alone, atol=1e-10, rtol=0)
