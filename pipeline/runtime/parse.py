"""Tool calls out of a target's text: ```json fences, <tool_call> tags, or bare JSON, as [{"name", "arguments"}].

Used by `ooo-oracle` (the call the target itself wrote, given back as an instantly ready hint) and by the benchmark.
Robust by design: every `{` / `[` is tried as the start of a JSON value; values that look like calls (a "name" and
an "arguments" / "parameters" object, possibly JSON-encoded as a string, or OpenAI's {"function": {...}}) are kept.
"""

from __future__ import annotations

import json
import re

from .continuation import ARG_ALIASES


def _as_call(obj) -> dict | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str):
        return None
    args = next((obj[a] for a in ARG_ALIASES if a in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": name, "arguments": args}


def parse_calls(text: str) -> list[dict]:
    """Every tool call found in `text`, in order (nested values are not searched again)."""
    dec = json.JSONDecoder()
    calls, i = [], 0
    while i < len(text):
        if text[i] not in "{[":
            i += 1
            continue
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        found = [c for c in map(_as_call, obj if isinstance(obj, list) else [obj]) if c]
        if found:
            calls.extend(found)
            i = end
        else:
            i += 1
    return calls


BARE_WORD = re.compile(r'(:\s*)(?!true\b|false\b|null\b)([A-Za-z_$][\w$.]*)(\s*[,}\]])')


def parse_lenient(text: str) -> list[dict]:
    """Calls in text that is not quite JSON: a bare word as a value (`"session": jdbcSession`) or a cut-off end."""
    return parse_calls(text) or parse_calls(BARE_WORD.sub(r'\1"\2"\3', text)) or close_truncated(text)


def close_truncated(text: str) -> list[dict]:
    """The call of an output cut off inside its JSON (max_new_tokens): its last complete member, closed."""
    from .jsonstate import scan

    if scan(text).state in ("start", "done", "invalid"):
        return []
    for end in range(len(text), max(text.find("{"), 0), -1):
        if text[end - 1] not in '"}]0123456789el':
            continue
        pos = scan(text[:end])
        if pos.state == "after":
            closers = "".join("}" if f.kind == "{" else "]" for f in reversed(pos.stack))
            return parse_calls(text[len(pos.prefix):end] + closers)
    return []


def payload_from_call(call: dict, tools: list[dict]) -> dict | None:
    """The JSON form of the payload that drafts `call` (None when its tool is not in `tools`)."""
    from pipeline.payload import Payload, PayloadError

    try:
        return Payload.from_call(call, tools).to_json()
    except PayloadError:
        return None


def gold_payload(request: dict) -> dict | None:
    """The payload of the request's first gold call (a wave for `--hint gold`; clearly not a sidecar)."""
    gold = request.get("gold") or []
    return payload_from_call(gold[0], request.get("tools") or []) if gold else None
