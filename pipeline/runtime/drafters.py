"""Drafters: small classes with one method, `propose(ctx) -> list[list[int]]`, candidate continuations, best first.

- `PromptLookup`: n-gram match of the context's suffix over prompt + output (the PLD baseline).
- `SchemaDrafter` (ToolSpec): the call's scaffolding from the request's tool schemas in the target's call formats:
  the opening, tool names, name / arguments / parameter keys in schema order, quotes, separators, enum members,
  true/false; never a free value.
- `HistoryDrafter`: suffix match over earlier committed outputs of the same run (ToolSpec's retrieval).
- `HintDrafter`: the sidecar's calls (the top tool's, then the one of whichever tool the output names), aligned with
  the output structurally (see continuation.py) and as whole-text renderings; polls the sidecar without blocking.
- `RealignDrafter`: where the output's string value has left the hint's (`"/projects/..."` for the hint's
  `"projects/..."`, `"expert"` for `"an expert"`), the hint's value from where the two meet again, then the rest of
  the hint's call (`continuation.resync`); its own source bit, so the budget learns its (lower) acceptance apart.
Every drafter only proposes; the target verifies, so no drafter can change the output.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from itertools import islice

from pipeline.parsers import ARG_ALIASES
from pipeline.payload import payload_bytes
from pipeline.schema import tool_name, tool_params

from .continuation import Arr, Choice, Obj, Open, Writer, continue_at
from .hint import CallFormat, args_key_for, call_formats, hint_calls, openings, render, seam_tokens, spell, suffix_for
from ..jsonscan import JsonPos, scan

log = logging.getLogger("pipeline.runtime")


@dataclass
class Context:
    """What the drafters see in one round: prompt, committed output (ids and text), the JSON position."""

    tokenizer: object
    prompt: list[int]
    output: list[int]
    eos: int | None
    max_depth: int
    text: str = ""

    @cached_property
    def pos(self) -> JsonPos:
        return scan(self.text)

    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def encode(self, text: str, complete: bool) -> list[int]:
        """Continuation text -> target tokens (+ end of turn when the text finishes the call)."""
        ids = seam_tokens(self.tokenizer, self.tokens(), text[: 8 * self.max_depth])
        if complete and self.eos is not None and len(ids) < self.max_depth:
            ids.append(self.eos)
        return ids[: self.max_depth]


class NgramIndex:
    """End positions of every n-gram (n_min..n_max) of a growing token sequence."""

    def __init__(self, n_max: int = 3, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min
        self.seq: list[int] = []
        self.table: dict[tuple, list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            self.seq.append(tok)
            end = len(self.seq)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.table.setdefault(tuple(self.seq[end - n:end]), []).append(end)

    def lookup(self, context: list[int], k: int, max_cands: int) -> list[list[int]]:
        """Continuations of the longest n-gram suffix of `context` (most recent occurrence first)."""
        out: list[list[int]] = []
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(context) < n:
                continue
            for end in reversed(self.table.get(tuple(context[-n:]), ())):
                cont = [t for t in self.seq[end:end + k] if t >= 0]
                if cont and cont not in out:
                    out.append(cont)
                    if len(out) >= max_cands:
                        return out
            if out:
                return out
        return out


class PromptLookup:
    def __init__(self, prompt: list[int], k: int = 10, max_cands: int = 1, n_max: int = 3, n_min: int = 1):
        self.index = NgramIndex(n_max, n_min)
        self.index.extend(prompt)
        self.seen, self.k, self.max_cands = 0, k, max_cands

    def propose(self, ctx: Context) -> list[list[int]]:
        self.index.extend(ctx.output[self.seen:])
        self.seen = len(ctx.output)
        return self.index.lookup(self.index.seq, self.k, self.max_cands)


class History:
    """Earlier committed outputs of a run: one n-gram index over them (each led by the end of its prompt), and
    the call formats the target was seen to write (its opening, closing and JSON style), most frequent first:
    first those it wrote under the same system message (`context_of`: one application's prompt, where a target
    keeps one format; across applications it may write fenced JSON for one and bare JSON for another), then all.

    Bounded: it keeps the last `max_outputs` outputs; past that the oldest half is dropped and the index rebuilt (a
    server's history must not grow for ever: ~5 index entries per output token)."""

    LEAD = 3

    def __init__(self, max_outputs: int = 512):
        self.max_outputs = max_outputs
        self.index = NgramIndex(n_max=6, n_min=2)
        self.seen: Counter = Counter()
        self.seen_in: dict[str, Counter] = {}  # context -> formats written there
        self.kept: list[list[int]] = []

    def add(self, prompt: list[int], output: list[int], text: str | None = None, context: str = "") -> None:
        seq = prompt[-self.LEAD:] + output + [-1]  # -1 keeps matches inside one output
        self.kept.append(seq)
        if len(self.kept) > self.max_outputs:
            self.kept = self.kept[len(self.kept) - self.max_outputs // 2:]
            self.index = NgramIndex(n_max=6, n_min=2)
            for old in self.kept:
                self.index.extend(old)
        else:
            self.index.extend(seq)
        pos = scan(text) if text is not None else None
        if pos is not None and pos.calls and pos.style.indent is not None:
            keys = pos.root.keys if pos.root is not None else []
            key = next((k for k in keys if k in ARG_ALIASES), "arguments")  # the key the target wrote
            fmt = CallFormat("observed", pos.prefix, pos.suffix, pos.style.variants()[0], key)
            self.seen[fmt] += 1
            if len(self.seen_in) < 1024 or context in self.seen_in:  # bounded, like the outputs
                self.seen_in.setdefault(context, Counter())[fmt] += 1

    def formats(self, base: list[CallFormat], context: str = "") -> list[CallFormat]:
        """The formats observed in `context` first, then those observed anywhere, then `base` (without repeats)."""
        out: list[CallFormat] = []
        for f, _ in self.seen_in.get(context, Counter()).most_common(3) + self.seen.most_common(3):
            if f not in out:
                out.append(f)
        return out + [f for f in base if all((f.prefix, f.style.indent) != (g.prefix, g.style.indent) for g in out)]


def context_of(request: dict) -> str:
    """The part of a request one application keeps from request to request: its system message."""
    msgs = request.get("messages") or []
    first = msgs[0] if msgs and isinstance(msgs[0], dict) else {}
    content = first.get("content") if first.get("role") == "system" else ""
    return content if isinstance(content, str) else json.dumps(content, sort_keys=True)


class HistoryDrafter:
    def __init__(self, history: History, k: int = 24, max_cands: int = 1):
        self.history, self.k, self.max_cands = history, k, max_cands

    def propose(self, ctx: Context) -> list[list[int]]:
        return self.history.index.lookup(ctx.tokens()[-8:], self.k, self.max_cands)


def skeleton(schema: dict):
    """What the schema says about a value before the target writes it (see continuation.py)."""
    if not isinstance(schema, dict):
        return Open("")
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0] if len(schema["enum"]) == 1 else Choice(list(schema["enum"]))
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "boolean":
        return Choice([True, False])
    if kind == "string":
        return Open('"')
    if kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
        return Obj({k: skeleton(v) for k, v in schema["properties"].items()}, set(schema.get("required") or []))
    if kind == "array":
        return Arr(skeleton(schema["items"])) if isinstance(schema.get("items"), dict) else Open("[")
    return Open("")


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", re.sub(r"([a-z])([A-Z])", r"\1 \2", text).lower()))


class SchemaDrafter:
    """ToolSpec's state machine: scaffolding of a call to one of the request's tools, in the target's formats."""

    def __init__(self, request: dict, formats: list[CallFormat], max_cands: int = 6):
        self.formats, self.max_cands = formats, max_cands
        user = " ".join(str(m.get("content") or "") for m in request.get("messages", []) if m.get("role") == "user")
        words = _words(user)
        tools = sorted(request.get("tools") or [], key=lambda t: -len(_words(tool_name(t)) & words))
        self.calls = {tool_name(t): {"name": tool_name(t), "arguments": skeleton(tool_params(t))} for t in tools}

    def skeletons(self, pos: JsonPos) -> list:
        root = pos.stack[0] if pos.stack else None
        name = root.values.get("name") if root is not None and root.kind == "{" else None
        if isinstance(name, str):
            return [self.calls[name]] if name in self.calls else []
        return list(self.calls.values())

    def propose(self, ctx: Context) -> list[list[int]]:
        return propose_structural(ctx, self.skeletons(ctx.pos), self.formats, self.max_cands)


class HintDrafter:
    """The sidecar's calls, once its payload is ready (polled without blocking at the top of every round).

    Until the output names a tool it drafts the payload's top call (the tool name first, then its arguments); once
    the output's JSON names a tool (the root object's "name"), it drafts that tool's call from the payload, whichever
    tool it is (the top one or one of `others`), and nothing when the payload has no draft for it.
    `other_tool` is True while the tool being drafted is not the payload's top tool: the loop counts the hint tokens
    accepted then (hints that a payload of the top tool alone would not have given). `error` says why a payload was
    not used (it does not parse, or a draft does not fit its tool's schema); None otherwise.
    """

    def __init__(self, request: dict, formats: list[CallFormat], pending, arrived: float, validate: bool = True):
        self.request, self.formats, self.pending, self.arrived = request, formats, pending, arrived
        self.validate = validate
        self.calls: dict[str, dict] = {}  # tool name -> call, the top tool first
        self.renderings: dict[str, list[str]] = {}
        self.other_tool = False
        self.ready_s: float | None = None
        self.bytes: int | None = None
        self.error: str | None = None

    @property
    def top(self) -> str | None:
        """The name of the payload's top tool (None before a usable payload)."""
        return next(iter(self.calls), None)

    def poll(self) -> None:
        if self.pending is None or self.calls or self.error is not None:
            return
        payload = self.pending.poll()
        if payload is None:
            if getattr(self.pending, "error", None):
                self.error = self.pending.error
                log.warning("sidecar hint ignored for %s: %s", self.request.get("id"), self.error)
            return
        # when the wave finished (worker clock), else when this poll saw it; arrived = the request's time.time()
        ready = getattr(self.pending, "ready_wall", None) or time.time()
        self.ready_s = max(0.0, ready - self.arrived)
        self.bytes = payload_bytes(payload)
        self.calls, why = hint_calls(payload, self.request.get("tools") or [], self.validate)
        self.renderings = {name: [render(call, f) for f in self.formats] for name, call in self.calls.items()}
        if not self.calls:
            self.error = why
            log.warning("sidecar payload ignored for %s: %s", self.request.get("id"), why)

    def call_for(self, pos: JsonPos) -> tuple[str | None, dict | None]:
        """(tool name, the payload's call of it) for the output at `pos`: the tool its JSON names, else the top one."""
        root = pos.stack[0] if pos.stack else None
        named = root.values.get("name") if root is not None and root.kind == "{" else None
        name = self.top if named is None else named
        return name, self.calls.get(name)

    def propose(self, ctx: Context) -> list[list[int]]:
        self.poll()
        self.other_tool = False
        if not self.calls:
            return []
        name, call = self.call_for(ctx.pos)
        if call is None:
            return []  # the target chose a tool the payload has no draft for
        self.other_tool = name != self.top
        cands = propose_structural(ctx, [call], self.formats, 4)
        for text in self.renderings[name]:  # whole-text renderings, where the output so far is a prefix of one
            if len(text) > len(ctx.text) and text.startswith(ctx.text):
                ids = ctx.encode(text[len(ctx.text):], True)
                if ids not in cands:
                    cands.append(ids)
        return cands


class RealignDrafter:
    """The hint's call realigned inside a string value the output wrote otherwise (see the module docstring): shares
    the `HintDrafter`'s payload, proposes nothing anywhere else."""

    def __init__(self, hint: HintDrafter | None = None, max_cands: int = 2):
        self.hint, self.max_cands = hint, max_cands

    def propose(self, ctx: Context) -> list[list[int]]:
        hint = self.hint
        if hint is None or not hint.calls or ctx.pos.state != "in_value":
            return []
        call = hint.call_for(ctx.pos)[1]
        if call is None:
            return []
        return propose_structural(ctx, [call], self.formats, self.max_cands, realign=True)

    @property
    def formats(self) -> list[CallFormat]:
        return self.hint.formats


def propose_structural(ctx: Context, skeletons: list, formats: list[CallFormat], max_cands: int,
                       realign: bool = False) -> list[list[int]]:
    """Continuations of the output towards each skeleton, from its JSON position, as token candidates (realign:
    see `continue_at`; for known values only). Skeletons spell their arguments key as the call's format does."""
    pos, texts = ctx.pos, []
    if pos.state == "start":
        for fmt, rest in openings(ctx.text, formats):
            for sk in skeletons:
                texts += [(rest + t + (fmt.suffix if done else ""), done)
                          for t, done in continue_from_start(spell(sk, fmt.args_key), fmt)]
    elif pos.state == "done":
        suffix = suffix_for(pos.prefix, formats)
        if suffix.startswith(pos.suffix):
            texts.append((suffix[len(pos.suffix):], True))
    else:
        suffix, key = suffix_for(pos.prefix, formats), args_key_for(pos.prefix, formats)
        for style in pos.style.variants():
            for sk in (spell(s, key) for s in skeletons):
                texts += [(t + (suffix if done else ""), done) for t, done in continue_at(pos, sk, style, realign=realign)]
    out: list[list[int]] = []
    for text, done in dict.fromkeys(texts):
        ids = ctx.encode(text, done) if text else ([ctx.eos] if done and ctx.eos is not None else [])
        if ids and ids not in out:
            out.append(ids)
            if len(out) >= max_cands:
                break
    return out


def continue_from_start(sk, fmt: CallFormat, limit: int = 8) -> list[tuple[str, bool]]:
    return list(islice(Writer(fmt.style).value(sk, 0), limit))


__all__ = ["Context", "NgramIndex", "PromptLookup", "History", "HistoryDrafter", "context_of", "SchemaDrafter",
           "HintDrafter", "RealignDrafter",
           "skeleton", "propose_structural", "call_formats"]
