"""Continue a partial JSON tool call from where the output is, in the output's own style.

The value to write is a *skeleton*: plain JSON where everything is known (the sidecar hint), or, for the schema
drafter, a mix of plain values and
- `Open(head)`: a value whose first characters are known and the rest is not (a string value opens with `"`);
- `Choice(options)`: one of several values (tool names, enum members, true/false);
- `Obj(members, required)`: an object whose members follow a schema: keys in schema order, optional ones may be
  skipped, so after each member both "the next key" and "close" are candidates;
- `Arr(item)`: an array of unknown length whose items look like `item`.
`continue_at(pos, skeleton, style)` yields (text, complete) candidates that start right after the output's last
character: complete = the top-level value is closed by the text; an incomplete text stops where knowledge ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Iterator

from ..jsonscan import WS, Frame, JsonPos, Style
from ..parsers import ARG_ALIASES

MISSING = object()


@dataclass
class Open:
    head: str


@dataclass
class Choice:
    options: list


@dataclass
class Obj:
    members: dict
    required: set = field(default_factory=set)


@dataclass
class Arr:
    item: object


Cands = Iterator[tuple[str, bool]]


def _key(k: str) -> str:
    return json.dumps(k, ensure_ascii=False)


ARR_LOOKAHEAD = 2  # elements of a schema array (unknown length) drafted ahead


class Writer:
    """Serializes skeletons in one fully specified `Style` (see `Style.variants`)."""

    def __init__(self, style: Style):
        self.s = style

    def _lines(self, array: bool) -> bool:
        return bool(self.s.indent) and not (array and self.s.array_inline)

    def open_ws(self, depth: int, array: bool = False) -> str:
        return "\n" + " " * (self.s.indent * (depth + 1)) if self._lines(array) else ""

    def sep(self, depth: int, array: bool = False) -> str:
        return self.open_ws(depth, array) if self._lines(array) else self.s.comma

    def close_ws(self, depth: int, array: bool = False) -> str:
        return "\n" + " " * (self.s.indent * depth) if self._lines(array) else ""

    def value(self, v, depth: int) -> Cands:
        if isinstance(v, Open):
            yield v.head, False
        elif isinstance(v, Choice):
            for o in v.options:
                yield from self.value(o, depth)
        elif isinstance(v, (dict, Obj)):
            yield from cat(iter([("{", True)]), lambda: self.members(v, [], depth, "open"))
        elif isinstance(v, (list, Arr)):
            yield from cat(iter([("[", True)]), lambda: self.elements(v, 0, depth, "open"))
        else:
            yield json.dumps(v, ensure_ascii=False), True

    def members(self, obj, written: list[str], depth: int, mode: str) -> Cands:
        """The rest of object `obj` at `depth` whose `written` keys are done; mode: right after `{` ("open"), right
        after `,` ("comma") or right after a member's value ("after")."""
        items = obj.members if isinstance(obj, Obj) else obj
        rest = [k for k in items if k not in written]
        if isinstance(obj, Obj):
            nexts = rest[:1] + [k for k in rest if k in obj.required][:1]
            can_close = obj.required <= set(written)
        else:
            nexts, can_close = rest[:1], not rest
        lead = {"open": self.open_ws(depth), "comma": self.sep(depth), "after": "," + self.sep(depth)}[mode]
        for k in dict.fromkeys(nexts):
            yield from self.member(obj, k, written, depth, lead + _key(k))
        if can_close and mode != "comma":
            yield ("}" if mode == "open" else self.close_ws(depth) + "}"), True

    def member(self, obj, k: str, written: list[str], depth: int, head: str) -> Cands:
        items = obj.members if isinstance(obj, Obj) else obj
        start = iter([(head + ":" + self.s.colon, True)])
        yield from cat(cat(start, lambda: self.value(items[k], depth + 1)),
                       lambda: self.members(obj, written + [k], depth, "after"))

    def elements(self, arr, index: int, depth: int, mode: str, left: int = ARR_LOOKAHEAD) -> Cands:
        """The rest of array `arr` from element `index`. A schema array (`Arr`) has no length: at most `left` more
        elements are drafted (an enum item would otherwise expand element after element without end)."""
        lead = {"open": self.open_ws(depth, True), "comma": self.sep(depth, True),
                "after": "," + self.sep(depth, True)}[mode]
        if isinstance(arr, Arr):
            more, item, can_close = left > 0, arr.item, True
        else:
            more = index < len(arr)
            item, can_close = (arr[index] if more else None), not more
        if more:
            yield from cat(cat(iter([(lead, True)]), lambda: self.value(item, depth + 1)),
                           lambda: self.elements(arr, index + 1, depth, "after", left - 1))
        if can_close and mode != "comma":
            yield ("]" if mode == "open" else self.close_ws(depth, True) + "]"), True


def cat(first: Cands, rest) -> Cands:
    """Concatenate: every complete text of `first` continues with every text of `rest()`."""
    for text, complete in first:
        if not complete:
            yield text, False
        else:
            for more, done in rest():
                yield text + more, done


def _child(v, frame: Frame, at_root: bool):
    m = frame.member()
    if frame.kind == "{":
        items = v.members if isinstance(v, Obj) else v if isinstance(v, dict) else None
        if items is None or m is None:
            return MISSING
        if m not in items and at_root and m in ARG_ALIASES:
            m = next((a for a in ARG_ALIASES if a in items), m)
        return items.get(m, MISSING)
    if isinstance(v, Arr):
        return v.item
    return v[m] if isinstance(v, list) and m is not None and m < len(v) else MISSING


def _written(v, frame: Frame, at_root: bool) -> list[str]:
    items = v.members if isinstance(v, Obj) else v
    if not at_root:
        return frame.keys
    alias = next((a for a in ARG_ALIASES if a in items), None)
    return [alias if (k in ARG_ALIASES and k not in items and alias) else k for k in frame.keys]


def _fits(v, kind: str) -> bool:
    return isinstance(v, (dict, Obj)) if kind == "{" else isinstance(v, (list, Arr))


def _rest(w: Writer, v, frame: Frame, depth: int, at_root: bool, mode: str = "after") -> Cands:
    if frame.kind == "{":
        return w.members(v, _written(v, frame, at_root), depth, mode)
    return w.elements(v, frame.count, depth, mode)


def continue_at(pos: JsonPos, skeleton, style: Style, limit: int = 8, realign: bool = False) -> list[tuple[str, bool]]:
    """Up to `limit` (text, complete) continuations of the output at `pos` towards `skeleton`, in `style`.
    realign: only the continuations from inside a string argument value that has left the skeleton's (a known value,
    the sidecar's): from where the two realign (`resync`), then the rest of the skeleton; nothing elsewhere."""
    if pos.state not in ("key", "in_key", "colon", "value", "in_value", "after") or not pos.stack:
        return []
    stack = pos.stack
    vals = [[skeleton] if stack[0].kind == "[" and not _fits(skeleton, "[") else skeleton]
    for i, frame in enumerate(stack[:-1]):
        vals.append(_child(vals[i], frame, i == 0))
    if any(not _fits(v, f.kind) for v, f in zip(vals, stack)):
        return []
    w, depth, top, v = Writer(style), len(stack) - 1, stack[-1], vals[-1]
    at_root = depth == 0
    if realign and (at_root or pos.state != "in_value"):
        return []
    inner = _inner(w, pos, v, top, depth, at_root, realign)
    for i in range(depth - 1, -1, -1):
        inner = cat(inner, lambda i=i: _rest(w, vals[i], stack[i], i, i == 0))
    out = []
    for text, complete in islice(inner, limit):
        if pos.ws:
            text = text[len(pos.ws):] if text.startswith(pos.ws) else text.lstrip(WS)
        if text:
            out.append((text, complete))
    return out


def _inner(w: Writer, pos: JsonPos, v, top: Frame, depth: int, at_root: bool, realign: bool = False) -> Cands:
    st = pos.state
    if st == "after":
        return _rest(w, v, top, depth, at_root)
    if st == "key":
        return _rest(w, v, top, depth, at_root, "open" if pos.last == "{" else "comma")
    if st == "in_key":
        items = v.members if isinstance(v, Obj) else v
        written = _written(v, top, at_root)
        return _in_key(w, v, items, written, depth, pos.partial)
    if top.kind == "[":
        index = top.count if st == "value" else top.count - 1
        item = v.item if isinstance(v, Arr) else (v[index] if index < len(v) else MISSING)
        if st == "value" and pos.last in "[,":
            return w.elements(v, index, depth, "open" if pos.last == "[" else "comma")
    else:
        key = top.keys[-1] if top.keys else None
        items = v.members if isinstance(v, Obj) else v
        if at_root and key not in items and key in ARG_ALIASES:
            key = next((a for a in ARG_ALIASES if a in items), key)
        item = items.get(key, MISSING)
    if item is MISSING:
        return iter(())
    after = lambda: _rest(w, v, top, depth, at_root)  # noqa: E731
    if st == "colon":
        return cat(cat(iter([(":" + w.s.colon, True)]), lambda: w.value(item, depth + 1)), after)
    if st == "value":
        return cat(cat(iter([(w.s.colon if pos.last == ":" else "", True)]), lambda: w.value(item, depth + 1)), after)
    if realign:  # in_value, where the output's string has left the known one: realign
        if isinstance(item, str) and pos.partial[:1] == '"' and not _key(item).startswith(pos.partial):
            return cat(resync(_key(item), pos.partial), after)
        return iter(())
    known = cat(_strip(w.value(item, depth + 1), pos.partial), after)  # in_value
    if pos.partial[:1] != '"' and _scalar(pos.partial):
        return chain(known, after())  # a number or literal may end here (the hint's or not)
    return known


RESYNC_MIN = 3  # characters of the output's string that must recur in the known one to realign there


def resync(known: str, partial: str) -> Cands:
    """Where the output's string (`partial`, from its opening quote) has left the known one (`known`, a JSON string
    with its quotes): the rest of `known` after the longest recent stretch of the output it contains (at least
    `RESYNC_MIN` characters: the output copied on after writing something else); where none recurs and the output
    has written only a little of its own, the whole of `known`'s text (it put something before it: a leading `/`)."""
    body, written = known[1:], partial[1:]
    for n in range(min(len(written), len(body) - 1), RESYNC_MIN - 1, -1):
        at = body.find(written[-n:], 0, len(body) - 1)
        if at >= 0:
            yield body[at + n:], True
            return
    if 0 < len(written) < RESYNC_MIN + 2:
        yield body, True


def _scalar(raw: str) -> bool:
    try:
        json.loads(raw)
    except ValueError:
        return False
    return True


def _in_key(w: Writer, obj, items, written, depth: int, partial: str) -> Cands:
    keys = [k for k in items if k not in written and _key(k).startswith(partial)]
    if isinstance(obj, Obj):  # schema order: the next key and the next required one first
        first = keys[:1] + [k for k in keys if k in obj.required][:1]
        keys = list(dict.fromkeys(first + keys))[:3]
    for k in keys:
        yield from w.member(obj, k, written, depth, _key(k)[len(partial):])


def _strip(cands: Cands, partial: str) -> Cands:
    """Keep the candidates that extend the partial token the output has written, minus that part."""
    for text, complete in cands:
        if text.startswith(partial) and (complete or len(text) > len(partial)):
            yield text[len(partial):], complete
