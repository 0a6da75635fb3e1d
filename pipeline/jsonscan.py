"""Where is the output inside its JSON tool call? A tolerant scanner over partial JSON text, and the style seen.

The drafters align hints and schema scaffolding *structurally* (docs/architecture.md, "Call formats"): a target
does not write what its template says (Qwen2.5-Coder writes a ```json fence around 2-space-indented JSON), so
text-level matching fails at the first whitespace. `scan(text)` reads the output so far and returns a `JsonPos`:
the container stack (which keys are written, which key's value is being written), the lexical state, the partial
token, the whitespace written since the last significant character, the text before the JSON (the call opening),
and the `Style` the output has shown (indent, separator after `:` and after `,`, inline or broken arrays).

It is the project's one incremental JSON scanner: the runtime's drafters use `scan` (tolerant: a bare word some
targets write as a value, `"session": jdbcSession`, keeps the structure going), the server's streaming call view and
the parsers' repair of a cut-off call use `read_value` (one value from a given `{` / `[`, strict JSON unless told
otherwise). Both record where every value starts and ends (`Node`), so a caller can cut a member's text out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# States of the scanner:
#   start     no JSON value has begun (the call opening / prose)
#   key       inside an object, expecting a key or `}`          (after `{` or `,`)
#   in_key    inside a key string                               (partial = raw text from its quote)
#   colon     a key is complete, expecting `:`
#   value     expecting a value                                 (after `:`, or after `[` / `,` in an array)
#   in_value  inside a scalar: string, number or literal        (partial = raw text so far)
#   after     a value is complete, expecting `,` or a close
#   done      the top-level value is closed
#   invalid   the text stopped being JSON
SCALAR_START = set("-0123456789")        # and letters: true/false/null, or a bare word some targets write
SCALAR_CHARS = set("0123456789+-._$")     # and letters
WS = " \t\r\n"


@dataclass(unsafe_hash=True)  # hashed only once complete (CallFormat keys); the scanner fills it in place
class Style:
    """How the output writes JSON. None = not seen yet (the drafters try the usual choices)."""

    indent: int | None = None        # spaces per level when objects break lines; 0 = objects on one line
    colon: str | None = None         # text after `:` (" " or "")
    comma: str | None = None         # text after `,` on one line (" " or "")
    array_inline: bool | None = None  # arrays on one line even when objects break lines

    def complete(self) -> bool:
        return None not in (self.indent, self.colon, self.comma, self.array_inline)

    def variants(self) -> list[Style]:
        """Fully specified styles consistent with what was seen: indented first, then one-line; indented objects
        with arrays on one line (what Qwen2.5-Coder writes) before arrays broken like objects (json.dumps)."""
        out = []
        for indent in ([self.indent] if self.indent is not None else [2, 0]):
            inline = [self.array_inline] if self.array_inline is not None else [True] if indent == 0 else [True, False]
            for arrays in inline:
                s = Style(indent, " " if self.colon is None else self.colon, " " if self.comma is None else self.comma,
                          arrays)
                if s not in out:
                    out.append(s)
        return out


@dataclass(eq=False)
class Node:
    """A JSON value as far as the text goes: kind "{", "[", '"' (string) or "s" (number / literal / bare word)."""

    kind: str
    start: int = 0                                      # index of its first character in the scanned text
    end: int | None = None                              # exclusive; None while the value is not closed
    members: list = field(default_factory=list)         # container: [(key or None, Node)] in text order


@dataclass(eq=False)
class Frame(Node):
    """An open (or closed) container: a `Node` that also keeps what the drafters ask about it."""

    keys: list[str] = field(default_factory=list)       # object: keys begun, in order (the last is current)
    count: int = 0                                      # array: elements begun
    values: dict = field(default_factory=dict)          # completed scalar values by key / index

    def member(self):
        """The key (object) or index (array) of the member being written or just written."""
        if self.kind == "{":
            return self.keys[-1] if self.keys else None
        return self.count - 1 if self.count else None


@dataclass
class JsonPos:
    state: str = "start"
    stack: list[Frame] = field(default_factory=list)
    partial: str = ""              # raw text of the unfinished key / scalar
    ws: str = ""                   # whitespace written since the last significant character
    last: str = ""                 # the last significant character
    prefix: str = ""               # text before the current JSON value (the call opening)
    suffix: str = ""               # text after the last closed JSON value
    style: Style = field(default_factory=Style)
    calls: int = 0                 # top-level values closed so far
    root: Frame | None = None      # the current (or last) top-level value
    stop: int | None = None        # state "invalid": where the text stopped being JSON
    token_start: int = 0           # where the unfinished key / scalar began
    node: Node | None = None       # the scalar being written
    strict: bool = False           # a bare word is invalid (not a value)

    def path(self) -> list:
        return [f.member() for f in self.stack]


def _json_start(text: str, i: int) -> bool:
    """A `{` anywhere, or a `[` at the start of a line, opens the JSON (prose rarely has either)."""
    if text[i] == "{":
        return True
    j = i - 1
    while j >= 0 and text[j] in " \t":
        j -= 1
    return j < 0 or text[j] == "\n" or text[j] == ">"


def scan(text: str) -> JsonPos:
    """Scan `text` (the output so far) and return the position of its end inside the last JSON value."""
    return _run(JsonPos(), text, 0, single=False)


def read_value(text: str, i: int, strict: bool = True) -> tuple[Frame, int | None]:
    """The JSON container opening at text[i] read as far as the text goes (its `Node` tree), and where it stopped
    being JSON (None when it is JSON as far as it goes, closed or not). `strict=False` reads bare words as values."""
    pos = scan_value(text, i, strict)
    return pos.root, pos.stop


def scan_value(text: str, i: int, strict: bool = True) -> JsonPos:
    """The position after reading the one JSON container that opens at text[i] (state "done" once it closed)."""
    if text[i:i + 1] not in ("{", "["):
        raise ValueError(f"scan_value: text[{i}] is {text[i:i + 1]!r}, not '{{' or '['")
    pos = JsonPos(strict=strict)
    _open(pos, text[i], i)
    return _run(pos, text, i + 1, single=True)


def _run(pos: JsonPos, text: str, i: int, single: bool) -> JsonPos:
    start = 0
    esc = False
    n = len(text)
    while i < n:
        c = text[i]
        st = pos.state
        if st in ("start", "done"):
            if single:
                break
            if c in "{[" and _json_start(text, i):
                style = pos.style
                pos = JsonPos(prefix=text[start:i], style=style, calls=pos.calls, strict=pos.strict)
                _open(pos, c, i)
            elif st == "done":
                pos.suffix += c
            i += 1
            continue
        if st == "invalid":
            break
        if st in ("in_key", "in_value") and pos.partial[:1] == '"':
            pos.partial += c
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                _close_token(pos, i + 1)
            i += 1
            continue
        if st == "in_value":  # number or literal
            if c in SCALAR_CHARS or c.isalpha():
                pos.partial += c
                i += 1
                continue
            _close_token(pos, i)
            if pos.state == "invalid":
                break
            continue  # re-read c in state "after"
        if c in WS:
            pos.ws += c
            i += 1
            continue
        _significant(pos, c, i)
        if pos.state == "done":
            start = i + 1
        i += 1
    return pos


def _invalid(pos: JsonPos, at: int) -> None:
    pos.state, pos.stop = "invalid", at


def _open(pos: JsonPos, c: str, i: int) -> None:
    frame = Frame(c, i)
    if pos.stack:
        _add_member(pos.stack[-1], frame)
    else:
        pos.root = frame
    pos.stack.append(frame)
    pos.state = "key" if c == "{" else "value"
    pos.last, pos.ws = c, ""


def _add_member(top: Frame, node: Node) -> None:
    """`node` is the value of the key being written (object) or the next element (array) of `top`."""
    top.members.append((top.keys[-1] if top.kind == "{" and top.keys else None, node))


def _learn_ws(pos: JsonPos, c: str) -> None:
    """Learn the style from the whitespace between the last significant character and `c`."""
    ws, st, depth = pos.ws, pos.style, len(pos.stack)
    if pos.last in "{[" and c not in "}]":
        if "\n" in ws:
            unit = len(ws.rsplit("\n", 1)[1])
            if pos.last == "{" and st.indent is None and depth:
                st.indent = unit // depth
            if pos.last == "[":
                st.array_inline = False
        else:
            if pos.last == "{" and st.indent is None:
                st.indent = 0
            if pos.last == "[" and st.array_inline is None:
                st.array_inline = True
    elif pos.last == ":" and st.colon is None and "\n" not in ws:
        st.colon = ws
    elif pos.last == "," and "\n" not in ws and st.comma is None:
        st.comma = ws


def _significant(pos: JsonPos, c: str, i: int) -> None:
    st = pos.state
    _learn_ws(pos, c)
    top = pos.stack[-1]
    if st == "key":
        if c == '"':
            pos.state, pos.partial, pos.token_start = "in_key", c, i
        elif c == "}" and pos.last == "{":
            _close_container(pos, c, i)
            return
        else:
            _invalid(pos, i)
    elif st == "colon":
        if c == ":":
            pos.state = "value"
        else:
            _invalid(pos, i)
    elif st == "value":
        if top.kind == "[" and pos.last in "[,":
            if c == "]" and pos.last == "[":
                _close_container(pos, c, i)
                return
            top.count += 1
        if c in "{[":
            _open(pos, c, i)
            return
        if c == '"' or c in SCALAR_START or c.isalpha() or c in "_$":
            pos.state, pos.partial, pos.token_start = "in_value", c, i
            pos.node = Node('"' if c == '"' else "s", i)
            _add_member(top, pos.node)
        else:
            _invalid(pos, i)
    elif st == "after":
        if c == ",":
            pos.state = "key" if top.kind == "{" else "value"
        elif c == "}]"[top.kind == "["]:
            _close_container(pos, c, i)
            return
        else:
            _invalid(pos, i)
    pos.last, pos.ws = c, ""


def _close_token(pos: JsonPos, end: int) -> None:
    """The key or scalar in `pos.partial` ends before text[end]."""
    raw, pos.partial = pos.partial, ""
    try:
        value = json.loads(raw)
    except ValueError:
        if raw[:1] == '"' or pos.state == "in_key" or pos.strict:
            _invalid(pos, pos.token_start)
            return
        value = raw  # a bare word (`"session": jdbcSession`): not JSON, but the structure goes on
    top = pos.stack[-1]
    if pos.state == "in_key":
        if not isinstance(value, str):
            _invalid(pos, pos.token_start)
            return
        top.keys.append(value)
        pos.state = "colon"
    else:
        top.values[top.member()] = value
        pos.node.end, pos.node = end, None
        pos.state = "after"
    pos.last, pos.ws = raw[-1], ""


def _close_container(pos: JsonPos, c: str, i: int) -> None:
    pos.stack.pop().end = i + 1
    pos.last, pos.ws = c, ""
    if pos.stack:
        pos.state = "after"
    else:
        pos.state = "done"
        pos.calls += 1
        pos.suffix = ""
