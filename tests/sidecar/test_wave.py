"""The slot wave: shared-prefix batch == each row run alone (float64, three families), adapter loading, predict
wiring, and the vLLM backend (through a fake engine here; the real engine where vllm is importable).

The reference for "alone" recomputes prefix + suffix + answer so far from scratch at every step: no cache, no mask,
no padding, nothing shared with the wave's code path.
"""

import json
from pathlib import Path

import pytest
import torch

from pipeline.sidecar.rows import answer_complete, wave_questions
from pipeline.sidecar import wave as wave_module
from pipeline.sidecar.wave import (SlotWave, load_sidecar, null_openings, prompt_settings, required_rows, tool_probs,
                                   tools_to_ask, top_tools, wave_inputs)
from pipeline.testing import FAMILIES, make_tiny_model, make_tiny_model_dir, make_tokenizer
from pipeline.io import InputError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "requests.jsonl"
REQUESTS = [json.loads(line) for line in FIXTURES.read_text().splitlines() if line.strip()]
CAP = 5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only fight over the shared cores
    yield
    torch.set_num_threads(threads)


def alone(model, prefix, suffix, stop_ids, cap=CAP):
    """Greedy tokens of prefix + suffix as one sequence, recomputed from scratch each step (no cache, no mask)."""
    seq, toks = list(prefix + suffix), []
    with torch.inference_mode():
        for _ in range(cap):
            toks.append(int(model(input_ids=torch.tensor([seq]), logits_to_keep=1).logits[0, -1].argmax()))
            if toks[-1] in stop_ids:
                break
            seq.append(toks[-1])
    return toks


def is_greedy_alone(model, prefix, suffix, toks, stop_ids, cap=CAP):
    """`toks` is what greedy decoding of prefix + suffix alone gives: one forward over the whole sequence (no
    cache, no mask, no padding) must have each token as the argmax before it; the row ends at a stop or the cap."""
    if not toks or any(t in stop_ids for t in toks[:-1]) or (len(toks) < cap and toks[-1] not in stop_ids):
        return False
    seq = prefix + suffix + toks
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([seq])).logits[0]
    start = len(prefix) + len(suffix) - 1
    return logits[start:start + len(toks)].argmax(-1).tolist() == toks


def spread(model, seed, std=0.3):
    """Redraw the matrices with a larger scale. At the default init (0.02) a tiny random model answers every row
    with the same repeated token, which would make "wave == alone" hold trivially; at 0.3 rows differ."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
    return model


@pytest.fixture(scope="module")
def tiny_models():
    tok = make_tokenizer()
    return {fam: (spread(make_tiny_model(fam, tokenizer=tok, dtype=torch.float64)[0], seed), tok)
            for seed, fam in enumerate(FAMILIES)}


@pytest.mark.parametrize("family", FAMILIES)
def test_wave_equals_each_row_alone(tiny_models, family):
    model, tok = tiny_models[family]
    wave = SlotWave(model, tokenizer=tok, max_value_tokens=CAP)
    for request in REQUESTS:
        prefix, suffixes, keys = wave_inputs(tok, request)
        assert len(keys) == len(suffixes) == 1 + sum(len(t["function"]["parameters"]["properties"])
                                                      for t in request["tools"])
        assert len({len(s) for s in suffixes}) > 1  # rows of different lengths: left padding is exercised
        rows, timings = wave.run(prefix, suffixes)
        assert len({tuple(r) for r in rows}) > 1  # rows answer differently: the comparison below is not vacuous
        for suffix, toks in zip(suffixes, rows):
            assert is_greedy_alone(model, prefix, suffix, toks, wave.stop_ids), (request["id"], toks)
        assert timings["prefill"] > 0 and timings["decode"] >= 0
    # and, for one request, token for token what transformers' own generate gives for each row alone
    prefix, suffixes, _ = wave_inputs(tok, REQUESTS[0])
    for suffix, toks in zip(suffixes, wave.run(prefix, suffixes)[0]):
        ids = torch.tensor([prefix + suffix])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CAP, do_sample=False,
                             eos_token_id=wave.stop_ids, pad_token_id=wave.pad_id)
        assert out[0, ids.shape[1]:].tolist()[:len(toks)] == toks


@pytest.mark.parametrize("family", ["qwen3"])
def test_rows_stop_at_their_own_stop_token_and_leave_the_batch(tiny_models, family):
    model, tok = tiny_models[family]
    request = REQUESTS[1]
    prefix, suffixes, _ = wave_inputs(tok, request)
    free = SlotWave(model, tokenizer=tok, max_value_tokens=CAP).run(prefix, suffixes)[0]
    # A token some rows (not all) emit mid-answer becomes the stop token: those rows end there, the others run on.
    counts = {}
    for row in free:
        for t in set(row[1:-1]):
            counts[t] = counts.get(t, 0) + 1
    stop = max((t for t in counts if counts[t] < len(free)), key=counts.get)
    for prune in (True, False):
        wave = SlotWave(model, tokenizer=tok, max_value_tokens=CAP, stop_ids=[stop], prune_finished=prune)
        rows = wave.run(prefix, suffixes)[0]
        assert rows == [alone(model, prefix, s, [stop]) for s in suffixes]
        assert any(len(r) < CAP for r in rows) and any(len(r) == CAP and stop not in r for r in rows)


def test_wave_with_adapter_from_folders_equals_rows_alone(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    base_dir = make_tiny_model_dir(tmp_path / "base", "qwen2")
    base, tok = load_sidecar(base_dir, dtype="float64")
    spread(base, seed=5).save_pretrained(base_dir)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                           init_lora_weights=False))  # random B: the adapter changes the outputs
    adapter = tmp_path / "adapter"
    lora.save_pretrained(adapter)
    tok.save_pretrained(adapter)
    (adapter / "recipe.yaml").write_text("train:\n  compact: true\n  chat_template_kwargs: {}\n")

    wave = SlotWave(base_dir, adapter, dtype="float64", max_value_tokens=CAP, merge_adapter=False)
    assert isinstance(wave.model, PeftModel)
    prefix, suffixes, _ = wave_inputs(wave.tokenizer, REQUESTS[0])
    rows = wave.run(prefix, suffixes)[0]
    assert len({tuple(r) for r in rows}) > 1
    assert all(is_greedy_alone(wave.model, prefix, s, t, wave.stop_ids) for s, t in zip(suffixes, rows))
    plain = SlotWave(base_dir, dtype="float64", max_value_tokens=CAP)
    assert plain.run(prefix, suffixes)[0] != rows  # the adapter is really applied
    merged = SlotWave(base_dir, adapter, dtype="float64", max_value_tokens=CAP)
    assert not isinstance(merged.model, PeftModel) and merged.model.dtype == torch.float64
    assert merged.run(prefix, suffixes)[0] == rows  # folded into the weights: the same greedy answers

    pred = wave.predict(REQUESTS[0])
    assert pred.n_prompts == len(suffixes) and set(pred.timings) >= {"prefill", "decode", "join", "total"}
    assert pred.token_counts["prefix"] == len(prefix)
    json.dumps(pred.to_json())


def test_prompt_settings_come_from_the_adapter_recipe(tmp_path):
    assert prompt_settings(None) == (True, {}, "long")
    (tmp_path / "recipe.yaml").write_text("train:\n  compact: false\n"
                                          "  chat_template_kwargs: {enable_thinking: false}\n  questions: short\n")
    assert prompt_settings(tmp_path) == (False, {"enable_thinking": False}, "short")
    assert prompt_settings(tmp_path, compact=True, chat_template_kwargs={}, questions="long") == (True, {}, "long")
    (tmp_path / "recipe.yaml").write_text("train:\n  questions: terse\n")
    with pytest.raises(ValueError, match="terse"):
        prompt_settings(tmp_path)


def test_short_questions_ask_the_same_rows_in_fewer_tokens(tiny_models):
    model, tok = tiny_models["llama"]
    request = REQUESTS[0]
    long_ = wave_inputs(tok, request)
    short = wave_inputs(tok, request, questions="short")
    assert short[0] == long_[0] and short[2] == long_[2]  # the same prefix and the same questions, in order
    assert sum(map(len, short[1])) < sum(map(len, long_[1])) / 2
    name = request["tools"][0]["function"]["name"]
    param = short[2][1][2]
    assert tok.decode(short[1][1]).startswith(f"[0] {name}.{param}")
    wave = SlotWave(model, tokenizer=tok, max_value_tokens=CAP, questions="short")
    pred = wave.predict(request)
    assert pred.token_counts["suffix"] == sum(map(len, short[1]))


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_sidecar(tmp_path / "nowhere")
    base_dir = make_tiny_model_dir(tmp_path / "base", "llama")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_sidecar(base_dir, tmp_path / "empty")


def _scripted_run(tok, answers_by_key, request):
    """A `run` replacement that answers each row with a fixed text + <|im_end|> (tests predict's wiring)."""
    _, keys = wave_questions(request)
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def run(prefix, suffixes, complete=None, cancelled=None, not_null=None, rows_of=None, key=None, salt=None):
        assert len(suffixes) == len(keys)
        rows = [tok(answers_by_key.get(k, "null"), add_special_tokens=False)["input_ids"] + [end] for k in keys]
        return rows, {"prefill": 0.01, "decode": 0.02}
    return run


def test_a_row_leaves_the_batch_as_soon_as_its_answer_is_whole(tiny_models):
    """Early stop truncates a row where `complete` says so and leaves every other row's tokens unchanged."""
    model, tok = tiny_models["qwen2"]
    wave = SlotWave(model, tokenizer=tok, max_value_tokens=8, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    request = REQUESTS[1]
    prefix, suffixes, keys = wave_inputs(tok, request)
    full, _ = wave.run(prefix, suffixes)
    calls = [0] * len(suffixes)

    def complete(r, text):  # asked once per new token: an even row r is "whole" after r + 1 tokens
        calls[r] += 1
        return calls[r] >= r + 1 and r % 2 == 0

    early, _ = wave.run(prefix, suffixes, complete)
    for r, (a, b) in enumerate(zip(full, early)):
        if r % 2 == 0 and len(full[r]) > r + 1:
            assert len(b) < len(a) and b == a[:len(b)], r
        else:
            assert b == a, r
    assert any(len(b) < len(a) for a, b in zip(full, early))


@pytest.mark.parametrize("text,kind,n_tools,whole", [
    ('"Par', "slot", 3, False), ('"Paris"', "slot", 3, True), ("nul", "slot", 3, False), ("null", "slot", 3, True),
    ("12", "slot", 3, False), ("true", "slot", 3, True), ("[1, 2]", "slot", 3, True), ('{"a": 1}', "slot", 3, True),
    ('{"a": 1', "slot", 3, False), (r'"a\\"', "slot", 3, True), (r'"a\"', "slot", 3, False),
    ("1", "function", 5, True), ("1", "function", 12, False), ("11", "function", 12, True), ("", "slot", 3, False),
])
def test_answer_complete(text, kind, n_tools, whole):
    assert answer_complete(text, kind, n_tools) is whole


def test_predict_decodes_parses_and_joins(tiny_models, monkeypatch):
    model, tok = tiny_models["qwen2"]
    wave = SlotWave(model, tokenizer=tok)
    request = REQUESTS[1]
    script = {("function",): "1", ("slot", 1, "hotel"): '"Grand Hotel"', ("slot", 1, "nights"): "0",
              ("slot", 1, "guests"): '["Ann","Bob"]', ("slot", 1, "options"): '{"breakfast":true',
              ("slot", 0, "city"): '"Paris"'}
    monkeypatch.setattr(wave, "run", _scripted_run(tok, script, request))
    pred = wave.predict(request)
    assert pred.payload == {"tool_index": 1, "arguments": {"hotel": "Grand Hotel", "guests": ["Ann", "Bob"]},
                            "others": {"0": {"city": "Paris"}}}  # the other tool's draft rides along
    assert pred.payload_bytes == len(b'{"tool_index":1,"arguments":{"hotel":"Grand Hotel","guests":["Ann","Bob"]},'
                                     b'"others":{"0":{"city":"Paris"}}}')
    assert pred.join_report["dropped"][0]["param"] == "nights"  # minimum 1
    assert pred.join_report["missing_required"] == ["nights"]
    assert [a["text"] for a in pred.answers][:2] == ["1", '"Paris"']
    assert pred.timings["prefill"] == 0.01 and pred.timings["total"] >= pred.timings["join"]


# ---------------------------------------------------------------- vLLM backend

class FakeSamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeLoRARequest:
    def __init__(self, name, int_id, path):
        self.lora_name, self.lora_int_id, self.lora_path = name, int_id, path


class FakeLLM:
    """vllm.LLM's generate contract, answered by a transformers model one prompt at a time."""

    def __init__(self, model, tok):
        self.model, self.tok, self.calls = model, tok, []

    def get_tokenizer(self):
        return self.tok

    def generate(self, prompts, sampling_params, *, use_tqdm=True, lora_request=None):
        self.calls.append((len(prompts), sampling_params, lora_request))
        outs = []
        for i, p in enumerate(prompts):
            sp = sampling_params[i] if isinstance(sampling_params, list) else sampling_params
            toks = alone(self.model, p["prompt_token_ids"], [], sp.stop_token_ids, cap=sp.max_tokens)
            completion = {"token_ids": toks}
            if getattr(sp, "logprobs", None):  # the first token's top candidates, as {id: Logprob}
                with torch.inference_mode():
                    logits = self.model(input_ids=torch.tensor([p["prompt_token_ids"]])).logits[0, -1]
                top = torch.log_softmax(logits, -1).topk(sp.logprobs)
                completion["logprobs"] = [{int(t): type("Logprob", (), {"logprob": float(v)})()
                                           for v, t in zip(top.values, top.indices)}]
            outs.append(type("RequestOutput", (), {"outputs": [type("Completion", (), completion)()]})())
        return outs


def test_vllm_backend_batches_a_wave_into_one_call_and_matches_the_wave(tiny_models, tmp_path):
    from pipeline.sidecar.vllm_backend import VllmWave

    model, tok = tiny_models["llama"]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 32, "lora_alpha": 64}))
    llm = FakeLLM(model, tok)
    vw = VllmWave("unused", adapter, max_value_tokens=CAP, llm=llm,
                  api=(None, FakeSamplingParams, FakeLoRARequest))
    preds = vw.predict_many(REQUESTS[:2])
    n_prompts, sampling, lora = llm.calls[0]
    assert len(llm.calls) == 1 and n_prompts == sum(p.n_prompts for p in preds)
    assert sampling.temperature == 0.0 and sampling.max_tokens == CAP and sampling.stop_token_ids == vw.stop_ids
    assert lora.lora_int_id == 1 and lora.lora_path == str(adapter.resolve())
    wave = SlotWave(model, tokenizer=tok, max_value_tokens=CAP)
    for request, pred in zip(REQUESTS[:2], preds):
        ref = wave.predict(request)
        assert [a["text"] for a in pred.answers] == [a["text"] for a in ref.answers]
        assert pred.payload == ref.payload and set(pred.timings) >= {"generate", "join", "total"}


def test_vllm_backend_without_vllm_says_how_to_get_it():
    try:
        import vllm  # noqa: F401
    except ImportError:
        from pipeline.sidecar.vllm_backend import vllm_api

        with pytest.raises(ImportError, match="vllm_setup.sh"):
            vllm_api()
    else:
        pytest.skip("vllm is importable here; the missing-vllm message cannot be observed")


@pytest.mark.vllm
def test_vllm_engine_wave_with_lora(tmp_path):
    pytest.importorskip("vllm", reason="vllm is not importable in this environment (scripts/vllm_setup.sh)")
    pytest.importorskip("peft", reason="peft is needed to write the test adapter")
    from peft import LoraConfig, get_peft_model

    from pipeline.sidecar.vllm_backend import VllmWave

    # head_dim 64: vLLM's attention kernels do not take the default tiny model's head_dim of 16
    base_dir = make_tiny_model_dir(tmp_path / "base", "qwen2", hidden=128, heads=2, kv_heads=1, intermediate=256)
    base, tok = load_sidecar(base_dir)
    lora = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    vw = VllmWave(base_dir, tmp_path / "adapter", max_value_tokens=CAP, dtype="float32", max_model_len=2048,
                  gpu_memory_utilization=0.1)  # on CPU this is the share of RAM vLLM reserves
    preds = vw.predict_many(REQUESTS)
    for request, pred in zip(REQUESTS, preds):
        assert pred.n_prompts == len(wave_questions(request)[1])
        assert all(len(vw.tokenizer(a["text"], add_special_tokens=False)["input_ids"]) <= CAP + 1 for a in pred.answers)


def test_a_cancelled_wave_stops_before_its_next_forward(tiny_models):
    from pipeline.sidecar.wave import Cancelled

    model, tok = tiny_models["qwen2"]
    wave = SlotWave(model, tokenizer=tok, max_value_tokens=8, early_stop=False)
    prefix, suffixes, _ = wave_inputs(tok, REQUESTS[1])
    asked = []

    def cancelled():  # the request ends after the wave's second forward
        asked.append(1)
        return len(asked) > 2

    with pytest.raises(Cancelled):
        wave.run(prefix, suffixes, cancelled=cancelled)
    assert len(asked) == 3


# ---------------------------------------------------------------- required parameters never answer null

def alone_banned(model, tok, prefix, suffix, stop_ids, banned, cap=CAP):
    """`alone`, with `banned` token ids masked while the answer is still blank (from scratch each step)."""
    seq, toks = list(prefix + suffix), []
    with torch.inference_mode():
        for _ in range(cap):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            if not tok.decode(toks).strip():
                logits[sorted(banned)] = float("-inf")
            toks.append(int(logits.argmax()))
            if toks[-1] in stop_ids:
                break
            seq.append(toks[-1])
    return toks


def test_null_openings_are_the_tokens_that_open_null():
    tok = make_tokenizer()
    ids = set(null_openings(tok, len(tok)))
    assert tok("null", add_special_tokens=False)["input_ids"][0] in ids
    assert tok(" null", add_special_tokens=False)["input_ids"][0] in ids
    for text in ('"', "1", "[", "{", "true", "-"):
        assert tok(text, add_special_tokens=False)["input_ids"][0] not in ids, text
    assert all(tok.decode([i]).lstrip().startswith("n") for i in ids)


def test_required_rows_are_the_required_parameters_slots():
    _, keys = wave_questions(REQUESTS[1])  # get_weather(city*), book_hotel(hotel*, nights*, guests, options), calculate
    assert [keys[r] for r in required_rows(REQUESTS[1], keys)] == [
        ("slot", 0, "city"), ("slot", 1, "hotel"), ("slot", 1, "nights"), ("slot", 2, "expression")]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_required_row_skips_what_it_may_not_open_and_the_rest_is_unchanged(tiny_models, family, monkeypatch):
    """The random model's own first tokens of the required rows stand in for the null openings (it never answers a
    real `null`): the ban must give exactly greedy-with-those-tokens-masked, and every other row its free tokens."""
    model, tok = tiny_models[family]
    request = REQUESTS[1]
    prefix, suffixes, keys = wave_inputs(tok, request)
    free = SlotWave(model, tokenizer=tok, max_value_tokens=CAP, required_values=False)
    free_rows = free.run(prefix, suffixes)[0]
    required = required_rows(request, keys)
    banned = {free_rows[r][0] for r in required}
    monkeypatch.setattr(wave_module, "null_openings", lambda tokenizer, vocab_size: sorted(banned))
    wave = SlotWave(model, tokenizer=tok, max_value_tokens=CAP)
    rows = wave.run(prefix, suffixes, not_null=required)[0]
    for r, (suffix, toks) in enumerate(zip(suffixes, rows)):
        if r in required:
            assert toks[0] not in banned and toks == alone_banned(model, tok, prefix, suffix, wave.stop_ids, banned)
        else:
            assert toks == free_rows[r]
    pred = wave.predict(request)  # predict bans them for the required rows on its own
    assert [a["text"] for a in pred.answers] != [a["text"] for a in free.predict(request).answers]

    from pipeline.sidecar import vllm_backend  # the vLLM backend answers those rows again, the same way
    from pipeline.sidecar.vllm_backend import VllmWave

    monkeypatch.setattr(vllm_backend, "null_openings", lambda tokenizer, vocab_size: sorted(banned))
    llm = FakeLLM(model, tok)
    vw = VllmWave("unused", None, max_value_tokens=CAP, llm=llm, api=(None, FakeSamplingParams, FakeLoRARequest))
    got = vw.predict(request)
    assert [a["text"] for a in got.answers] == [a["text"] for a in pred.answers] and got.payload == pred.payload
    assert len(llm.calls) >= 3 and llm.calls[1][0] == len(required)  # the wave, the next-token ask, the rest
    off = VllmWave("unused", None, max_value_tokens=CAP, llm=FakeLLM(model, tok), required_values=False,
                   api=(None, FakeSamplingParams, FakeLoRARequest))
    assert [a["text"] for a in off.predict(request).answers] == [a["text"] for a in free.predict(request).answers]


# ---------------------------------------------------------------- staged wave: the function row first

def test_tools_to_ask_keeps_the_function_row_and_the_top_tools_slots():
    _, keys = wave_questions(REQUESTS[1])  # tools 0 (1 param), 1 (4 params), 2 (2 params)
    logits = torch.zeros(50)
    logits[[7, 8, 9]] = torch.tensor([0.5, 2.0, 1.0])  # the tokens of "0", "1", "2"
    assert [keys[r] for r in tools_to_ask(logits, keys, [7, 8, 9], 1)] == [("function",)] + [
        k for k in keys if k[0] == "slot" and k[1] == 1]
    assert {keys[r][1] for r in tools_to_ask(logits, keys, [7, 8, 9], 2)[1:]} == {1, 2}
    assert tools_to_ask(logits, keys, [7, 8, 9], 3) is None and tools_to_ask(logits, keys, None, 1) is None


def test_top_tools_ranks_by_probability_and_a_mass_asks_fewer_where_the_row_is_sure():
    probs = torch.tensor([0.1, 0.6, 0.3])
    assert top_tools(probs, 1) == [1] and top_tools(probs, 2) == [1, 2] and top_tools(probs, 5) == [1, 2, 0]
    assert top_tools(probs, 3, 0.5) == [1] and top_tools(probs, 3, 0.85) == [1, 2] and top_tools(probs, 3, 1.0) == [1, 2, 0]
    assert top_tools(probs, 1, 0.99) == [1]  # the mass never asks more than n
    assert top_tools(torch.tensor([0.5, 0.5]), 1) == [0]  # a tie goes to the lower index, every time
    logits = torch.full((20,), -5.0)
    logits[[3, 4]] = torch.tensor([1.0, 1.0 + torch.log(torch.tensor(3.0)).item()])
    assert tool_probs(logits, [3, 4]).tolist() == pytest.approx([0.25, 0.75])


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_staged_wave_answers_the_rows_it_asks_as_the_whole_wave_does(tiny_models, family):
    model, tok = tiny_models[family]
    request = REQUESTS[1]
    whole = SlotWave(model, tokenizer=tok, max_value_tokens=CAP)
    staged = SlotWave(model, tokenizer=tok, max_value_tokens=CAP, slot_tools=1)
    prefix, suffixes, keys = wave_inputs(tok, request)
    rows = whole.run(prefix, suffixes)[0]
    logits = staged._first_logits(staged._prefix_cache(prefix), len(prefix), suffixes[0])
    # the first row's next-token logits alone equal the whole wave's first token for it
    assert int(logits.argmax()) == rows[0][0]
    ids = staged._tool_ids(len(request["tools"]))
    asked = tools_to_ask(logits, keys, ids, 1)
    got, timings = staged.run(prefix, suffixes, rows_of=lambda lg: asked)
    assert 1 < len(asked) < len(keys) and timings["prefill"] > 0
    for r, toks in enumerate(got):
        assert toks == (rows[r] if r in asked else []), r
    pred = staged.predict(request)
    assert pred.token_counts["rows"] == len(asked) and pred.n_prompts == len(keys)
    texts = [a["text"] for a in pred.answers]
    assert [t for r, t in enumerate(texts) if r not in asked] == [""] * (len(keys) - len(asked))
    assert [texts[r] for r in asked] == [a["text"] for r, a in enumerate(whole.predict(request).answers) if r in asked]
    with pytest.raises(ValueError, match="slot_tools"):
        SlotWave(model, tokenizer=tok, slot_tools=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_wave_from_the_prefix_cache_answers_as_a_cold_wave(tiny_models, family):
    """Two requests with the same tools and another dialogue: the second wave starts from the first one's prefix
    (system prompt + tool list) and answers token for token as a cold wave; a request's own earlier wave is never
    offered to it, nor one of another `cache_salt`; staged waves too."""
    import copy as copy_module

    model, tok = tiny_models[family]
    first = REQUESTS[1]
    second = copy_module.deepcopy(first)
    second["id"] = first["id"] + "-other"
    second["messages"][-1]["content"] = "Something else entirely: " + second["messages"][-1]["content"][::-1]
    for slot_tools in (None, 1):
        cold = SlotWave(model, tokenizer=tok, max_value_tokens=CAP, slot_tools=slot_tools)
        warm = SlotWave(model, tokenizer=tok, max_value_tokens=CAP, slot_tools=slot_tools, prefix_cache=4096)
        assert [a["text"] for a in warm.predict(first).answers] == [a["text"] for a in cold.predict(first).answers]
        assert warm.cached_tokens == 0
        again = warm.predict(first)                          # its own prefix is in the cache: not offered
        assert again.token_counts["cached"] == 0
        pred, ref = warm.predict(second), cold.predict(second)
        prefix = wave_inputs(tok, second)[0]
        assert 16 <= pred.token_counts["cached"] < len(prefix)  # the shared system prompt and tools, not the dialogue
        assert [a["text"] for a in pred.answers] == [a["text"] for a in ref.answers]
        assert pred.payload == ref.payload
        salted = dict(second, id=second["id"] + "-salted", cache_salt="tenant-b")  # another tenant: not shared
        assert warm.predict(salted).token_counts["cached"] == 0
        assert warm.predict(dict(salted, id=salted["id"] + "-2")).token_counts["cached"] == len(prefix)
    with pytest.raises(ValueError, match="prefix_cache"):
        SlotWave(model, tokenizer=tok, prefix_cache=-1)


def test_prepacked_linears_answer_as_the_plain_model():
    """`prepack`: every linear of a float32 model (the output layer too) is swapped for a oneDNN-prepacked one whose
    logits match the plain model's and whose wave gives the same tokens; float64 models are left as they are."""
    from pipeline.sidecar.wave import prepack_linears

    tok = make_tokenizer()
    plain = spread(make_tiny_model("llama", tokenizer=tok, dtype=torch.float32)[0], 7)
    packed = spread(make_tiny_model("llama", tokenizer=tok, dtype=torch.float32)[0], 7)
    wave = SlotWave(packed, tokenizer=tok, max_value_tokens=CAP, prepack=True)
    if wave.prepacked == 0:
        pytest.skip("this torch has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)")
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    assert wave.prepacked == n_linear and not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    ids = torch.tensor([wave_inputs(tok, REQUESTS[0])[0]])
    with torch.inference_mode():
        assert torch.allclose(packed(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    reference = SlotWave(plain, tokenizer=tok, max_value_tokens=CAP)
    for request in REQUESTS:
        prefix, suffixes, _ = wave_inputs(tok, request)
        rows = reference.run(prefix, suffixes)[0]
        assert len({tuple(r) for r in rows}) > 1 and wave.run(prefix, suffixes)[0] == rows, request["id"]
    exact = make_tiny_model("llama", tokenizer=tok, dtype=torch.float64)[0]
    assert prepack_linears(exact) == 0 and any(isinstance(m, torch.nn.Linear) for m in exact.modules())


def test_int8_linears_answer_close_to_the_float_model(monkeypatch):
    """`quantize="int8"`: every linear of a float32 model (the output layer too) multiplies in int8; its logits stay
    close to the float model's and its wave answers every row; the settings it cannot run with are refused by name."""
    from pipeline.sidecar.factory import sidecar_kwargs
    from pipeline.sidecar.wave import quantize_linears

    tok = make_tokenizer()
    plain = spread(make_tiny_model("llama", tokenizer=tok, dtype=torch.float32)[0], 7, std=0.05)
    quant = spread(make_tiny_model("llama", tokenizer=tok, dtype=torch.float32)[0], 7, std=0.05)
    names = [n for n, m in plain.named_modules() if type(m) is torch.nn.Linear]
    kept = [n for n in names if n.endswith(".down_proj")]
    try:
        wave = SlotWave(quant, tokenizer=tok, max_value_tokens=CAP, quantize="int8")
    except RuntimeError as err:  # a torch built without a quantized CPU engine
        pytest.skip(str(err))
    assert kept and wave.quantized == len(names) - len(kept)  # the MLP's down_proj stays out of int8
    int8 = {n for n in names if type(quant.get_submodule(n)).__module__.startswith("torch.ao.nn.quantized")}
    assert int8 == set(names) - set(kept)
    ids = torch.tensor([wave_inputs(tok, REQUESTS[0])[0]])
    with torch.inference_mode():
        a, b = quant(input_ids=ids).logits.flatten(), plain(input_ids=ids).logits.flatten()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    assert 0.99 < cos < 1.0  # int8: close, not equal (an unquantized model would give 1.0)
    for request in REQUESTS:
        prefix, suffixes, _ = wave_inputs(tok, request)
        rows = wave.run(prefix, suffixes)[0]
        assert len(rows) == len(suffixes) and all(rows), request["id"]
    with pytest.raises(ValueError, match="float32"):
        quantize_linears(make_tiny_model("llama", tokenizer=tok, dtype=torch.float64)[0])
    # a CPU without native bf16: down_proj stays a float32 nn.Linear (emulated bf16 would be slower)
    import pipeline.hardware

    monkeypatch.setattr(pipeline.hardware, "native_bf16", lambda device="cpu": False)
    plain32 = make_tiny_model("llama", tokenizer=tok, dtype=torch.float32)[0]
    assert quantize_linears(plain32) == len(names) - len(kept)
    assert all(type(plain32.get_submodule(n)) is torch.nn.Linear and plain32.get_submodule(n).weight.dtype == torch.float32
               for n in kept)
    fresh = make_tiny_model("llama", tokenizer=tok, dtype=torch.float32)[0]
    for kw, match in (({"quantize": "int4"}, "quantize='int4'"), ({"quantize": "int8", "prepack": True}, "prepack"),
                      ({"quantize": "int8", "dtype": "bfloat16"}, "float32")):
        with pytest.raises(ValueError, match=match):
            SlotWave(fresh, tokenizer=tok, **kw)
    base = {"model": str(Path(__file__)), "adapter": None}  # an existing path stands for the model folder
    assert sidecar_kwargs({**base, "quantize": "int8"})["quantize"] == "int8"
    assert sidecar_kwargs(base)["quantize"] is None
    for extra, match in (({"quantize": "int4"}, "sidecar.quantize='int4'"), ({"prepack": True}, "prepack: false"),
                         ({"dtype": "bfloat16"}, "float32"), ({"device": "cuda"}, "CPU only")):
        with pytest.raises(InputError, match=match):
            sidecar_kwargs({**base, "quantize": "int8", **extra}, "recipes/eval/x.yaml")
