"""One sidecar, many targets: the hint in each family's own call format, with real tokenizers and chat templates.

The fixtures (tests/fixtures/families/, see its README) are real tokenizers (reduced vocabularies, real special tokens)
and real chat templates of Qwen2.5, Qwen3, Llama 3.2, Gemma and SmolLM2 (with the tool prompt its authors document). First, what `call_formats` learns from each template
(the opening, the closing, the arguments key, Qwen3's think block with and without `enable_thinking`); then, per family,
a tiny float64 target is trained in the test to answer a request with a call in its family's format (the template's
own rendering of the call; for Gemma, whose template renders none, a ```json fence) and the hint must pay: `ooo`
takes at most 0.6x `toolspec`'s forwards on a call of free-text values, a wrong hint at most 2 forwards more than
`toolspec`, and every output equals `ar`'s token for token.
"""

import json
from pathlib import Path

import pytest
import torch

from pipeline.runtime import Ready, Target, generate
from pipeline.runtime.families import tokenizer_family
from pipeline.runtime.hint import FENCED, call_formats, openings, render, template_format
from pipeline.payload import gold_payload
from pipeline.requests import render_prompt

FAMILY_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "families"
STEPS = 300
MAX = 160
REASONING = "Ann needs the new day and a request for the slides."
EMAIL = {**json.loads((FAMILY_DIR.parent / "email_request.json").read_text()), "id": "fixture/email-family"}
GEMMA_TOOLS = Path(__file__).resolve().parents[2] / "recipes" / "templates" / "gemma3-tools.jinja"
# case -> (fixture folder, tiny architecture, chat_template_kwargs, reasoning the target writes before its call)
CASES = {
    "qwen2.5": ("qwen2.5", "qwen2", {}, None),
    "qwen3-think": ("qwen3", "qwen3", {}, REASONING),
    "qwen3-nothink": ("qwen3", "qwen3", {"enable_thinking": False}, None),
    "llama3": ("llama3", "llama", {}, None),
    "gemma": ("gemma", "llama", {}, None),
    # the Gemma 3 target this repository fine-tunes: its template (recipes/models.yaml gemma3-270m-tools) on the
    # Gemma 3 tokenizer, and a tiny Gemma 3 (a sliding-window layer with a 32-token window: the prompt is longer)
    "gemma3-tools": ("gemma3-tools", "gemma3", {}, None),
    "smollm2": ("smollm2", "llama", {}, None),
}


def family_tokenizer(folder: str):
    """The fixture's tokenizer; `gemma3-tools`: Gemma's with the tool template recipes/models.yaml builds with."""
    from transformers import AutoTokenizer

    if folder == "gemma3-tools":
        tok = AutoTokenizer.from_pretrained(FAMILY_DIR / "gemma")
        tok.chat_template = GEMMA_TOOLS.read_text()
        return tok
    return AutoTokenizer.from_pretrained(FAMILY_DIR / folder)


def answer_text(tok, request: dict, kwargs: dict, reasoning: str | None) -> str:
    """The call as the target is taught to write it: the template's rendering of the assistant turn (after the
    generation prompt, before its end of turn); a ```json fence where the template renders no calls."""
    call = request["gold"][0]
    if template_format(tok, kwargs) is None:
        turn = {"role": "assistant", "content": "```json\n" + json.dumps(call, indent=2) + "\n```"}
    else:
        turn = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
        if reasoning:
            turn["reasoning_content"] = reasoning
    prompt = render_prompt(tok, request, kwargs)
    full = tok.apply_chat_template(request["messages"] + [turn], tools=request["tools"], tokenize=False, **kwargs)
    assert full.startswith(prompt), "the template renders the history differently with an assistant turn"
    text = full[len(prompt):]
    stops = [s for s in (tok.eos_token, *tokenizer_family(tok).stops) if s and s in text]
    return text[:min(text.index(s) for s in stops)] if stops else text


# --- what call_formats learns from each real template ------------------------------------------------------------

def test_qwen25_template_format_is_unchanged():
    fmts = call_formats(family_tokenizer("qwen2.5"))
    assert (fmts[0].prefix, fmts[0].suffix, fmts[0].args_key, fmts[0].skip) == (
        "<tool_call>\n", "\n</tool_call>", "arguments", None)
    assert fmts[1] is FENCED


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False}])
def test_qwen3_opening_is_the_tool_call_tag_with_or_without_thinking(kwargs):
    """The issue's bug: without the kwargs the opening was '<think>\\n\\n</think>\\n\\n<tool_call>\\n'."""
    tok = family_tokenizer("qwen3")
    fmt = call_formats(tok, kwargs)[0]
    assert (fmt.prefix, fmt.suffix) == ("<tool_call>\n", "\n</tool_call>")
    assert fmt.skip == (None if kwargs.get("enable_thinking") is False else ("<think>", "</think>\n\n"))
    fmts = call_formats(tok)
    assert openings("", fmts)[0][1] == "<tool_call>\n"  # thinking off: the prompt holds the think block
    assert openings("<tool_call>", fmts)[0][1] == "\n"
    assert [o for f, o in openings("<think>\nthe user wants", fmts) if f.skip] == []  # inside the block: nothing
    assert openings("<think>\nok\n</think>", fmts)[0][1] == "\n\n<tool_call>\n"
    assert openings("<think>\nok\n</think>\n\n", fmts)[0][1] == "<tool_call>\n"


def test_llama3_writes_parameters_and_may_open_with_python_tag():
    fmts = call_formats(family_tokenizer("llama3"))
    assert (fmts[0].prefix, fmts[0].suffix, fmts[0].args_key) == ("", "", "parameters")
    assert fmts[1].prefix == "<|python_tag|>" and fmts[1].args_key == "parameters"
    assert render(EMAIL["gold"][0], fmts[0]).startswith('{"name": "send_email", "parameters": {"to": "ann lee"')


def test_gemma_template_renders_no_calls():
    tok = family_tokenizer("gemma")
    assert tokenizer_family(tok).name == "gemma" and template_format(tok) is None
    assert call_formats(tok)[0] is FENCED


def test_gemma3_tools_calls_are_bare_json_with_parameters():
    tok = family_tokenizer("gemma3-tools")
    fmt = call_formats(tok)[0]
    assert tokenizer_family(tok).name == "gemma-tools"
    assert (fmt.name, fmt.prefix, fmt.suffix, fmt.args_key) == ("template", "", "", "parameters")
    assert render(EMAIL["gold"][0], fmt).startswith('{"name": "send_email", "parameters": {"to": ')
    prompt = render_prompt(tok, EMAIL, {})
    assert prompt.startswith("<bos><start_of_turn>user\nYou have access to functions.")
    assert prompt.endswith("<end_of_turn>\n<start_of_turn>model\n") and '"name": "send_email"' in prompt


def test_smollm2_calls_are_a_json_list_in_tool_call_tags():
    tok = family_tokenizer("smollm2")
    fmts = call_formats(tok)
    assert tokenizer_family(tok).name == "smollm2"
    assert (fmts[0].prefix, fmts[0].suffix, fmts[0].args_key) == ("<tool_call>[", "]</tool_call>", "arguments")
    assert len(tok.encode("<tool_call>[", add_special_tokens=False)) > 1  # plain text here, not a special token
    assert render(EMAIL["gold"][0], fmts[0]).startswith('<tool_call>[{"name": "send_email", "arguments": {"to": ')


# --- the hint pays in every family's format ----------------------------------------------------------------------

@pytest.fixture(scope="module", params=list(CASES))
def caller(request):
    """(case, target) where the tiny target's greedy answer to EMAIL is its call in the family's format."""
    from pipeline.testing import make_tiny_model

    folder, arch, kwargs, reasoning = CASES[request.param]
    tok = family_tokenizer(folder)
    torch.manual_seed(0)
    model, _ = make_tiny_model(arch, tokenizer=tok, dtype=torch.float64)
    target = Target(model, tok, name=f"tiny-{request.param}", chat_template_kwargs=kwargs, prefix_cache=False)
    text = answer_text(tok, EMAIL, kwargs, reasoning)
    prompt = target.prompt_ids(EMAIL)
    ids = torch.tensor([prompt + tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]])
    labels = ids.clone()
    labels[0, :len(prompt)] = -100  # learn the answer only
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    ar = generate(target, EMAIL, "ar", max_new_tokens=MAX)
    assert ar.text == text, f"the tiny {request.param} target did not learn its call: {ar.text!r}"
    return request.param, target


def decode(target, method: str, hint=None):
    target.histories.clear()  # no earlier run's output of this request in the history drafter
    return generate(target, EMAIL, method, sidecar=Ready(hint) if hint else None, max_new_tokens=MAX)


def test_the_hint_pays_in_the_family_format(caller):
    case, target = caller
    ar, ts = decode(target, "ar"), decode(target, "toolspec")
    ooo = decode(target, "ooo", gold_payload(EMAIL))
    assert ooo.token_ids == ar.token_ids and ts.token_ids == ar.token_ids, case
    assert ooo.stats.hint_error is None, (case, ooo.stats.hint_error)
    assert ooo.stats.forwards <= 0.6 * ts.stats.forwards, (case, ooo.stats.forwards, ts.stats.forwards)


def test_a_wrong_hint_costs_at_most_two_forwards_over_toolspec(caller):
    case, target = caller
    ar, ts = decode(target, "ar"), decode(target, "toolspec")
    wrong = decode(target, "ooo", {"tool_index": 1, "arguments": {"title": "lunch", "day": "monday"}})
    assert wrong.token_ids == ar.token_ids, case
    assert wrong.stats.forwards <= ts.stats.forwards + 2, (case, wrong.stats.forwards, ts.stats.forwards)


def test_eval_rows_record_the_family_and_whether_the_hint_opening_matched():
    from types import SimpleNamespace

    from pipeline.eval.runner import target_call_format

    target = SimpleNamespace(tokenizer=family_tokenizer("llama3"), chat_template_kwargs={})
    call = EMAIL["gold"][0]
    bare = json.dumps({"name": call["name"], "parameters": call["arguments"]})
    row = target_call_format(target, EMAIL, bare)
    assert row == {"family": "llama3", "vocab_size": len(target.tokenizer), "call_format": "'' parameters",
                   "hint_opening_match": True}
    assert target_call_format(target, EMAIL, "```json\n" + bare)["hint_opening_match"] is False
