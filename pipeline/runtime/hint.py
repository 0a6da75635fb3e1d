"""From a sidecar payload to target text and tokens: the calls, the target's call formats, renderings, seams.

- `hint_calls` turns a payload (`pipeline.payload.Payload` or its JSON form) into the calls it drafts, keyed by tool
  name, the top tool first, each checked against the request's tools and schemas (`required` lifted: a partial call
  drafts what it has); a payload that does not fit gives no calls and the reason.
- `call_formats` lists the ways a target may write a call: the format its chat template renders (probed by
  rendering an assistant turn with a sentinel call, with the request's `chat_template_kwargs`: the opening, the
  closing, the JSON style and the key the arguments go under), its family's extra openings (`families.py`), and what
  real targets write instead (a ```json fence around 2-space-indented JSON, bare indented JSON, bare one-line JSON).
  A reasoning block the template renders before the call (Qwen3's `<think>...</think>`) is not part of the opening:
  it is the format's `skip`, which `openings` steps over in the output.
- `openings` aligns output text that has not reached the JSON yet with those formats; `format_for` names the format
  of an opening the output has written (its closing and its arguments key).
- `seam_tokens` turns continuation text into target tokens: it re-tokenizes (recent committed text + continuation)
  with the target tokenizer and splits where the committed tokens end, so a first hint token that merges with the
  text before it (`"` + `:` -> `":`) is tokenized the way the target would; where no clean split exists, the
  continuation is tokenized on its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache

from pipeline.payload import Payload, PayloadError

from .continuation import Writer
from .families import tokenizer_family
from ..jsonscan import Style, scan
from .target import decode, encode

PROBE_NAME, PROBE_ARG, PROBE_VALUE = "probe_fn_q7", "probe_arg_q7", "probe_value_q7"


@dataclass(frozen=True)
class CallFormat:
    name: str
    prefix: str          # text before the JSON (the call opening)
    suffix: str          # text after the JSON, before end of turn
    style: Style
    args_key: str = "arguments"              # the key the call's arguments go under (Llama 3.x: "parameters")
    skip: tuple[str, str] | None = None      # (open, close + the whitespace after it) of a block before the opening


FENCED = CallFormat("fenced", "```json\n", "\n```", Style(2, " ", " ", True))  # Qwen2.5-Coder: arrays on one line
BARE_INDENTED = CallFormat("indented", "", "", Style(2, " ", " ", False))
BARE_COMPACT = CallFormat("compact", "", "", Style(0, " ", " ", True))


def hint_calls(payload, tools: list[dict], validate: bool = True) -> tuple[dict[str, dict], str]:
    """({tool name: call}, "") for a usable payload, the top tool first; ({}, why) for one that is not usable."""
    try:
        calls = Payload.parse(payload).calls(tools, validate)
    except PayloadError as e:
        return {}, str(e)
    return {c["name"]: c for c in calls}, ""


def spell(call, key: str):
    """A call (or call skeleton) `{"name", "arguments"}` with its arguments under `key`, in the same place."""
    if key == "arguments" or not isinstance(call, dict) or "arguments" not in call:
        return call
    return {(key if k == "arguments" else k): v for k, v in call.items()}


def template_format(tokenizer, chat_template_kwargs: dict | None = None) -> CallFormat | None:
    """The call format the chat template renders with `chat_template_kwargs`, probed with a sentinel call (None if
    it renders none)."""
    kwargs = json.dumps(chat_template_kwargs or {}, sort_keys=True)
    return _template_format(tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
                            id(tokenizer), kwargs, tokenizer)


@lru_cache(maxsize=32)
def _template_format(_template, _tok_id, kwargs: str, tokenizer) -> CallFormat | None:
    family = tokenizer_family(tokenizer)
    extra = json.loads(kwargs)
    tool = {"type": "function", "function": {"name": PROBE_NAME, "description": "probe", "parameters": {
        "type": "object", "properties": {PROBE_ARG: {"type": "string"}}, "required": [PROBE_ARG]}}}
    user = [{"role": "user", "content": "probe"}]
    call = {"type": "function", "function": {"name": PROBE_NAME, "arguments": {PROBE_ARG: PROBE_VALUE}}}
    try:
        head = tokenizer.apply_chat_template(user, tools=[tool], add_generation_prompt=True, tokenize=False, **extra)
        full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": [call]}],
                                             tools=[tool], tokenize=False, **extra)
    except Exception:  # noqa: BLE001 - a template without tool-call support simply has no template format
        return None
    if not full.startswith(head):
        return None
    turn = full[len(head):]
    at = turn.find(PROBE_NAME)
    start = turn.rfind("{", 0, at)
    while start >= 0:
        try:
            obj, end = json.JSONDecoder().raw_decode(turn, start)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and PROBE_NAME in obj.values() and PROBE_ARG in json.dumps(obj):
            suffix = turn[end:]
            for stop in (tokenizer.eos_token, *family.stops):
                if stop and stop in suffix:
                    suffix = suffix[:suffix.index(stop)]
            key = next((k for k, v in obj.items() if isinstance(v, dict) and PROBE_ARG in v), "arguments")
            prefix, skip = _split_skip(turn[:start], family.think)
            return CallFormat("template", prefix, suffix, scan(turn[start:end]).style.variants()[0], key, skip)
        start = turn.rfind("{", 0, start)
    return None


def _split_skip(prefix: str, think: tuple[str, str] | None) -> tuple[str, tuple[str, str] | None]:
    """(the call opening, the reasoning block's (open, close + whitespace)) of a rendered opening."""
    if think is None or think[1] not in prefix:
        return prefix, None
    end = prefix.index(think[1]) + len(think[1])
    rest = prefix[end:].lstrip("\n")
    return rest, (think[0], prefix[prefix.index(think[1]):len(prefix) - len(rest)])


def call_formats(tokenizer, chat_template_kwargs: dict | None = None) -> list[CallFormat]:
    """Template format first (what the target was trained to write), its family's other openings, then what real
    targets write instead (with the template's reasoning block, where it has one)."""
    fmt = template_format(tokenizer, chat_template_kwargs)
    out = [fmt] if fmt else []
    if fmt:
        out += [replace(fmt, name="opener", prefix=o) for o in tokenizer_family(tokenizer).openers]
    skip = fmt.skip if fmt else None
    for f in (FENCED, BARE_INDENTED, BARE_COMPACT):
        if all((f.prefix, f.style) != (g.prefix, g.style) for g in out):
            out.append(replace(f, skip=skip) if skip else f)
    return out


def format_for(opening: str, formats: list[CallFormat]) -> CallFormat | None:
    """The format of an opening the output has written: the one whose opening it ends with; for bare JSON the first
    bare format; None where no format fits."""
    for f in formats:
        if f.prefix.strip() and opening.rstrip().endswith(f.prefix.strip()):
            return f
    if opening.rstrip().endswith("```"):
        return FENCED
    return next((f for f in formats if not f.prefix), None)


def suffix_for(opening: str, formats: list[CallFormat]) -> str:
    """The closing text that goes with an opening the output has written (bare JSON: nothing)."""
    f = format_for(opening, formats)
    return f.suffix if f is not None and f.prefix else ""


def args_key_for(opening: str, formats: list[CallFormat]) -> str:
    """The key the arguments go under in the format of an opening the output has written."""
    f = format_for(opening, formats)
    return f.args_key if f is not None else "arguments"


def _after_skip(text: str, f: CallFormat) -> str | None:
    """The output text after the format's reasoning block; None while the output is inside it."""
    if f.skip is None:
        return text
    opened, closing = f.skip
    at = text.rfind(closing.rstrip())
    if at >= 0:
        after = text[at:]
        return after[len(closing):] if after.startswith(closing) else after[len(closing.rstrip()):].lstrip()
    return None if opened in text else text


def openings(text: str, formats: list[CallFormat]) -> list[tuple[CallFormat, str]]:
    """For output text that has not reached the JSON: (format, the rest of its opening) where the text aligns.
    A format's reasoning block (`skip`) is stepped over: inside it nothing aligns, right after its close marker the
    rest of the block's closing whitespace leads the opening."""
    out = []
    for f in formats:
        if f.skip is not None:
            at = text.rfind(f.skip[1].rstrip())
            if at >= 0 and f.skip[1].startswith(text[at:]) and text[at:] != f.skip[1]:
                out.append((f, f.skip[1][len(text) - at:] + f.prefix))
                continue
        text_f = _after_skip(text, f)
        if text_f is None:
            continue
        if not f.prefix:
            if not text_f.strip():
                out.append((f, ""))
            continue
        if f.prefix.startswith(text_f):
            out.append((f, f.prefix[len(text_f):]))
            continue
        for n in range(min(len(text_f), len(f.prefix)), 2, -1):  # the text ends with the format's opening, re-joined
            if f.prefix.startswith(text_f[-n:]):
                out.append((f, f.prefix[n:]))
                break
    return out


def render(call: dict, fmt: CallFormat) -> str:
    """One text rendering of a call in a format (the whole call, prefix and suffix included)."""
    text = next(t for t, _ in Writer(fmt.style).value(spell(call, fmt.args_key), 0))
    return fmt.prefix + text + fmt.suffix


def opening_matches(tokenizer, call: dict, fmt: CallFormat, output: str) -> bool | None:
    """Whether the call rendered in `fmt` (the hint's first rendering) starts with the token the target wrote first;
    None for an empty output."""
    wrote = encode(tokenizer, output)[:1]
    return wrote == encode(tokenizer, render(call, fmt))[:1] if wrote else None


def seam_tokens(tokenizer, committed: list[int], text: str, tail: int = 4) -> list[int]:
    """Target tokens for `text` continuing `committed` (see the module docstring)."""
    if not text:
        return []
    tail_ids = committed[-tail:]
    if tail_ids:
        tail_text = decode(tokenizer, tail_ids)
        ids = encode(tokenizer, tail_text + text)
        n = len(tail_ids)
        for k in (n, n - 1, n + 1, n - 2, n + 2):  # where the committed text ends in the re-tokenization
            if 0 < k < len(ids) and ids[k - 1] == tail_ids[-1] and decode(tokenizer, ids[:k]) == tail_text:
                return ids[k:]
    return encode(tokenizer, text)
