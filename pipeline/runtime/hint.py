"""From a sidecar payload to target text and tokens: the calls, the target's call formats, renderings, seams.

- `hint_calls` turns a payload (`pipeline.payload.Payload` or its JSON form) into the calls it drafts, keyed by tool
  name, the top tool first, each checked against the request's tools and schemas (`required` lifted: a partial call
  drafts what it has); a payload that does not fit gives no calls and the reason.
- `call_formats` lists the ways a target may write a call: the format its chat template renders (probed by
  rendering an assistant turn with a sentinel call), and what real targets write instead (a ```json fence around
  2-space-indented JSON, bare indented JSON, bare one-line JSON).
- `openings` aligns output text that has not reached the JSON yet with those formats.
- `seam_tokens` turns continuation text into target tokens: it re-tokenizes (recent committed text + continuation)
  with the target tokenizer and splits where the committed tokens end, so a first hint token that merges with the
  text before it (`"` + `:` -> `":`) is tokenized the way the target would; where no clean split exists, the
  continuation is tokenized on its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from pipeline.payload import Payload, PayloadError

from .continuation import Writer
from ..jsonscan import Style, scan
from .target import decode, encode

PROBE_NAME, PROBE_ARG, PROBE_VALUE = "probe_fn_q7", "probe_arg_q7", "probe_value_q7"


@dataclass(frozen=True)
class CallFormat:
    name: str
    prefix: str          # text before the JSON (the call opening)
    suffix: str          # text after the JSON, before end of turn
    style: Style


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


def template_format(tokenizer) -> CallFormat | None:
    """The call format the chat template renders, probed with a sentinel call (None if it renders none)."""
    return _template_format(tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
                            id(tokenizer), tokenizer)


@lru_cache(maxsize=32)
def _template_format(_template, _tok_id, tokenizer) -> CallFormat | None:
    tool = {"type": "function", "function": {"name": PROBE_NAME, "description": "probe", "parameters": {
        "type": "object", "properties": {PROBE_ARG: {"type": "string"}}, "required": [PROBE_ARG]}}}
    user = [{"role": "user", "content": "probe"}]
    call = {"type": "function", "function": {"name": PROBE_NAME, "arguments": {PROBE_ARG: PROBE_VALUE}}}
    try:
        head = tokenizer.apply_chat_template(user, tools=[tool], add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": [call]}],
                                             tools=[tool], tokenize=False)
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
            for stop in (tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<|eom_id|>"):
                if stop and stop in suffix:
                    suffix = suffix[:suffix.index(stop)]
            return CallFormat("template", turn[:start], suffix, scan(turn[start:end]).style.variants()[0])
        start = turn.rfind("{", 0, start)
    return None


def call_formats(tokenizer) -> list[CallFormat]:
    """Template format first (what the target was trained to write), then what real targets write instead."""
    fmt = template_format(tokenizer)
    out = [fmt] if fmt else []
    for f in (FENCED, BARE_INDENTED, BARE_COMPACT):
        if all((f.prefix, f.style) != (g.prefix, g.style) for g in out):
            out.append(f)
    return out


def suffix_for(opening: str, formats: list[CallFormat]) -> str:
    """The closing text that goes with an opening the output has written (bare JSON: nothing)."""
    for f in formats:
        if f.prefix.strip() and opening.rstrip().endswith(f.prefix.strip()):
            return f.suffix
    if opening.rstrip().endswith("```"):
        return FENCED.suffix
    return ""


def openings(text: str, formats: list[CallFormat]) -> list[tuple[CallFormat, str]]:
    """For output text that has not reached the JSON: (format, the rest of its opening) where the text aligns."""
    out = []
    for f in formats:
        if not f.prefix:
            if not text.strip():
                out.append((f, ""))
            continue
        if f.prefix.startswith(text):
            out.append((f, f.prefix[len(text):]))
            continue
        for n in range(min(len(text), len(f.prefix)), 2, -1):  # the text ends with the format's opening, re-joined
            if f.prefix.startswith(text[-n:]):
                out.append((f, f.prefix[n:]))
                break
    return out


def render(call: dict, fmt: CallFormat) -> str:
    """One text rendering of a call in a format (the whole call, prefix and suffix included)."""
    text = next(t for t, _ in Writer(fmt.style).value(call, 0))
    return fmt.prefix + text + fmt.suffix


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
