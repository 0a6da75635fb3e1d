"""A target's text as OpenAI sees it: `content` and `tool_calls`, decided as early as a prefix of the text allows.

`view(text, final)` reads the text a target has written so far and returns only what no continuation can change:
the content before the first call (text that might still open a call is held back), and the calls whose name is
known. `CallStream` feeds it every committed prefix and sends the difference as chat-completion deltas; the
non-streaming answer is the same `view` of the whole text, so the concatenated stream equals it by construction
(each view extends the previous one; tests check that on every prefix of many texts).

Where a call may begin (in text order; the first one that is a call starts the call region, content is what comes
before it, anything after the calls that is not a call is dropped):
- `<tool_call>` tags, ```` ``` ```` fences (json, or a Python call list), `<|python_tag|>`: a JSON value after the opener;
- a bare `{` or `[`: a call object, a list of them, `{"tool_calls": [...]}` or OpenAI's `{"function": {...}}`;
- `API-Request: [Name(k='v')]` and `[name(k=v), ...]`: decided when the text is complete (the project's parsers).
A JSON call is certain once its "name" string is complete and its arguments object (`arguments` / `parameters` /
`args`) has begun; from then on its arguments stream. `function.arguments` is the target's own JSON text with the
whitespace outside strings removed (so it grows character by character and parses to the same object as
`pipeline.parsers.parse_calls` finds); a call cut off by `max_tokens` keeps its incomplete arguments. A JSON value
that completes without a call (or stops being JSON) is ordinary content; calls nested inside it are not searched.

The JSON is read by the project's one incremental scanner (`pipeline.jsonscan.read_value`), and what is a call object
follows the one call parser's rules (`pipeline.parsers.as_call`): this module only decides how early each is certain.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from pipeline.jsonscan import WS, Node, read_value
from pipeline.parsers import API_REQUEST_RE, ARG_ALIASES, parse_python_calls, scan_api_requests

OPENERS = ("<tool_call>", "```", "<|python_tag|>", "API-Request:")
MARKER_RE = re.compile(r"<tool_call>|```|<\|python_tag\|>|API-Request:|[{\[]")
FENCE_OPEN_RE = re.compile(r"```[ \t]*[\w+-]*[ \t]*\n")
FENCE_PARTIAL_RE = re.compile(r"```[ \t]*[\w+-]*[ \t]*\Z")
PY_LIST_RE = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*")
PY_BARE_RE = re.compile(r"[A-Za-z_][\w.]*\s*")
JSON_START_RE = re.compile(r"[{\[]")


@dataclass
class Call:
    name: str
    arguments: str          # compact JSON text (possibly incomplete while the call is written or when cut off)


@dataclass
class View:
    content: str = ""       # "" when there is no content (or only whitespace)
    calls: list[Call] = field(default_factory=list)


def compact(raw: str) -> str:
    """JSON text without the whitespace outside strings (character by character, so a prefix maps to a prefix)."""
    out, in_str, esc = [], False, False
    for c in raw:
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c in WS:
            continue
        else:
            in_str = c == '"'
        out.append(c)
    return "".join(out)


def _member(obj: Node, key: str, kind: str) -> Node | None:
    """The first member `key` of an object node if its value is of `kind` (and the object has no "name" itself)."""
    if any(k == "name" for k, _ in obj.members):
        return None
    return next((v for k, v in obj.members if k == key and v.kind == kind), None)


def _call_objects(node: Node) -> list[Node]:
    """The objects of a JSON value that may be calls: itself, its list items, OpenAI's tool_calls / function."""
    if node.kind == "{" and (listed := _member(node, "tool_calls", "[")) is not None:
        node = listed
    items = [v for _, v in node.members if v.kind == "{"] if node.kind == "[" else [node]
    return [_member(o, "function", "{") or o for o in items]


def _certain_call(text: str, obj: Node, limit: int) -> Call | None:
    """The call `obj` is, once its name is complete and its arguments object has begun (None: not (yet) a call)."""
    members = dict(reversed(obj.members))  # the first occurrence of a key wins
    name_node = members.get("name")
    if name_node is None or name_node.kind != '"' or name_node.end is None:
        return None
    name = json.loads(text[name_node.start:name_node.end])
    args = next((members[k] for k in sorted(members, key=lambda k: members[k].start) if k in ARG_ALIASES), None)
    if not name:
        return None
    if args is not None and args.kind == "{":
        return Call(name, compact(text[args.start:args.end if args.end is not None else limit]))
    if obj.end is None:
        return None
    if args is None:  # {"name": "f"} alone is a call without arguments
        return Call(name, "{}") if set(members) <= {"name", "type"} else None
    if args.kind == '"':  # OpenAI style: the arguments as a JSON-encoded string
        try:
            decoded = json.loads(json.loads(text[args.start:args.end]))
        except ValueError:
            return None
        return Call(name, json.dumps(decoded, ensure_ascii=False, separators=(",", ":"))) \
            if isinstance(decoded, dict) else None
    return None


def _json_verdict(text: str, j: int, final: bool) -> tuple[str, list[Call], int]:
    """("call" | "dead" | "open", calls, where to go on) for the JSON value opening at text[j]."""
    node, stop = read_value(text, j)
    limit = stop if stop is not None else len(text)
    calls = [c for c in (_certain_call(text, o, limit) for o in _call_objects(node)) if c is not None]
    if calls:
        return "call", calls, node.end if node.end is not None else limit
    if node.end is not None:
        return "dead", [], node.end
    if stop is not None or final:
        return "dead", [], j + 1
    return "open", [], j


def _python_verdict(text: str, j: int, end: int, final: bool) -> tuple[str, list[Call], int]:
    """A Python call list `[name(k=v), ...]` in text[j:end] (decided once the text is complete)."""
    if not final:
        return "open", [], j
    for close in (k for k in range(j, end) if text[k] == "]"):
        calls = parse_python_calls(text[j:close + 1])
        if calls:
            return "call", [_parsed(c) for c in calls], close + 1
    calls = parse_python_calls(text[j:end])
    return ("call", [_parsed(c) for c in calls], end) if calls else ("dead", [], j + 1)


def _parsed(call: dict) -> Call:
    return Call(call["name"], json.dumps(call["arguments"], ensure_ascii=False, separators=(",", ":")))


def _body_verdict(text: str, j: int, final: bool, end: int | None = None,
                  fenced: bool = False) -> tuple[str, list[Call], int]:
    """The verdict on what follows an opener at text[j]: JSON, a Python call list (bare only in a fence), or not a
    call."""
    end = len(text) if end is None else end
    while j < end and text[j] in WS:
        j += 1
    if j >= end:
        return ("dead" if final else "open"), [], j
    head_re = PY_LIST_RE if text[j] == "[" else PY_BARE_RE if fenced else None
    head = head_re.match(text, j, end) if head_re else None
    if head and (head.end() == end or text[head.end()] == "("):
        return _python_verdict(text, j, end, final)
    if text[j] in "{[":
        return _json_verdict(text, j, final)
    return "dead", [], j


def _verdict(text: str, m: int, marker: str, final: bool) -> tuple[str, list[Call], int]:
    """Whether the possible call opening at text[m] is a call, cannot be one, or is still undecided."""
    if marker in "{[":
        return _body_verdict(text, m, final)
    if marker in ("<tool_call>", "<|python_tag|>"):
        return _body_verdict(text, m + len(marker), final)
    if marker == "API-Request:":
        hit = API_REQUEST_RE.match(text, m)
        calls = [_parsed(c) for c in scan_api_requests(hit.group(0)).calls] if hit else []
        if calls:
            return "call", calls, hit.end()
        return ("dead" if final else "open"), [], m + 1
    opener = FENCE_OPEN_RE.match(text, m)  # a fence: its body up to the closing fence
    if opener is None:
        partial = FENCE_PARTIAL_RE.match(text, m) and not final
        return ("open" if partial else "dead"), [], m + 3
    close = text.find("\n```", opener.end())
    body_end = close if close >= 0 else len(text)
    verdict, calls, after = _body_verdict(text, opener.end(), final or close >= 0, body_end, fenced=True)
    if verdict == "dead":  # not a call: the whole block is content, its closing fence included
        after = close + 4 if close >= 0 else len(text)
    return verdict, calls, after


def _held(text: str) -> int:
    """Where content must stop: before a trailing piece of text that may grow into a call opener."""
    for k in range(min(max(map(len, OPENERS)) - 1, len(text)), 0, -1):
        if any(len(o) > k and o.startswith(text[-k:]) for o in OPENERS):
            return len(text) - k
    return len(text)


def view(text: str, final: bool = False, find_calls: bool = True, max_calls: int | None = None) -> View:
    """What is certain about `text` (the whole output when `final`); see the module docstring. `find_calls=False`
    (a request without tools) makes all of it content."""
    if not find_calls:
        return View(text if text.strip() else "")
    pos, start, calls = 0, None, []
    while start is None:
        hit = MARKER_RE.search(text, pos)
        if hit is None:
            break
        verdict, found, after = _verdict(text, hit.start(), hit.group(), final)
        if verdict == "open":
            return View(_content(text[:hit.start()]))
        if verdict == "call":
            start, calls, pos = hit.start(), found, after
        else:
            pos = max(after, hit.start() + 1)
    if start is None:
        return View(_content(text if final else text[:_held(text)]))
    while max_calls is None or len(calls) < max_calls:  # more calls after the first: JSON values only
        nxt = JSON_START_RE.search(text, pos)
        if nxt is None:
            break
        verdict, found, after = _json_verdict(text, nxt.start(), final)
        if verdict == "open":
            break
        calls += found
        pos = max(after, nxt.start() + 1)
    return View(_content(text[:start]), calls[:max_calls])


def _content(text: str) -> str:
    return text if text.strip() else ""


class CallStream:
    """Chat-completion deltas for a growing text: `feed(text)` after each commit, `feed(text, final=True)` last."""

    def __init__(self, find_calls: bool = True, max_calls: int | None = None, call_id=None):
        self.find_calls, self.max_calls = find_calls, max_calls
        self.call_id = call_id or (lambda i: f"call_{i}")
        self.sent = View()
        self.ids: list[str] = []

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """The deltas that take the stream from what it has sent to `view(text, final)`."""
        if not final:
            text = text.rstrip("\ufffd")  # a multi-byte character cut between tokens: wait for its other bytes
        new = view(text, final, self.find_calls, self.max_calls)
        deltas = []
        if new.content != self.sent.content:
            if not new.content.startswith(self.sent.content):
                raise RuntimeError(f"stream content diverged: sent {self.sent.content!r}, now {new.content!r}")
            deltas.append({"content": new.content[len(self.sent.content):]})
        for i, call in enumerate(new.calls):
            if i < len(self.sent.calls):
                old = self.sent.calls[i]
                if old.name != call.name or not call.arguments.startswith(old.arguments):
                    raise RuntimeError(f"stream call {i} diverged: sent {old}, now {call}")
                if call.arguments != old.arguments:
                    deltas.append({"tool_calls": [{"index": i, "function": {
                        "arguments": call.arguments[len(old.arguments):]}}]})
                continue
            self.ids.append(self.call_id(i))
            deltas.append({"tool_calls": [{"index": i, "id": self.ids[i], "type": "function",
                                           "function": {"name": call.name, "arguments": call.arguments}}]})
        if len(new.calls) < len(self.sent.calls):
            raise RuntimeError(f"stream calls diverged: sent {len(self.sent.calls)}, now {len(new.calls)}")
        self.sent = View(new.content, [Call(c.name, c.arguments) for c in new.calls])
        return deltas


__all__ = ["view", "View", "Call", "CallStream", "compact"]
