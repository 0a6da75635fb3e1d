"""Tool-call parsers and schema-directed argument normalisation (pure functions, no model, no I/O).

`parse_calls(text)` reads the calls a model wrote in any of the formats targets and teachers use:
- Qwen / Hermes tags:    <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>  (one tag per call)
- Llama 3.x JSON:        {"name": ..., "parameters": {...}}  (optionally after <|python_tag|>)
- fenced JSON:           ```json\\n{\\n  "name": ..., "arguments": {...}\\n}\\n```  (Qwen2.5-Coder's habit)
- bare JSON:             an object or a list of objects anywhere in the text
- API-Bank:              API-Request: [Name(key='value', ...)]  (`parse_api_request` reads one call as the benchmark
                         writes it, with each value's source text: the API-Bank converter's gold)
- Python call lists:     [name(key=value, ...), ...]  (BFCL's AST format)
A call object may spell its arguments `arguments` or `parameters`, may nest them under `function`, and may give them as
a JSON string (OpenAI style). The result lists every call found in text order with the format that produced them.

It is the project's one call parser: the labels stage, the eval report, the runtime's `ooo-oracle` hint and the
server's final answer all read calls with it (the server's streaming view, `pipeline.serve.calls`, decides the same
calls incrementally). `parse_calls(text, lenient=True)` also repairs what a target cut off or wrote as almost-JSON:
a bare word as a value (`"session": jdbcSession` -> "jdbcSession") and a call cut off inside its JSON by
`max_new_tokens` (kept up to its last complete member, closed); `Parsed.repair` says which repair was needed.

`normalise_arguments(args, schema)` coerces a value only where the JSON Schema says what it must be ("5" -> 5 for an
integer, "true" -> true for a boolean, 5 -> "5" for a string, an enum value in the wrong case or a boolean whose
string form is the enum's, an explicit null for an optional parameter that may not be null) and returns what it
changed, so the labels stage can report it.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

from .jsonscan import scan, scan_value

ARG_ALIASES = ("arguments", "parameters", "args")  # how call objects spell their arguments, in order of preference
TAG_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON|tool_call|python)?[ \t]*\n(.*?)(?:\n[ \t]*```|$)", re.S)
API_REQUEST_RE = re.compile(r"API-Request:\s*(\[.*?\))\s*\]", re.S)
PYTHON_CALLS_RE = re.compile(r"^\s*\[?\s*[A-Za-z_][\w.]*\s*\(.*\)\s*\]?\s*$", re.S)


@dataclass
class Parsed:
    """Calls found in one text, in order, and the format that produced them (None when nothing parsed)."""

    calls: list[dict] = field(default_factory=list)
    format: str | None = None
    problems: list[str] = field(default_factory=list)  # pieces that looked like calls but did not parse
    repair: str | None = None  # lenient parse: "bare_words" or "truncated" when the text needed it


def _loads(text: str) -> Any:
    """JSON, or (as a fallback for models that write Python literals) a Python literal; raises ValueError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise ValueError(f"not JSON ({e.msg} at char {e.pos})") from None


def as_call(obj: Any) -> dict | None:
    """A {"name", "arguments"} dict from one call object in any common spelling, or None if `obj` is not a call."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # OpenAI {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    for key in ARG_ALIASES:
        if key in obj:
            args = obj[key]
            break
    else:
        args = {} if set(obj) <= {"name", "type"} else None
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": name, "arguments": args}


def _calls_from_json(value: Any) -> list[dict] | None:
    """Calls from a decoded JSON value: a call object, a list of them, or {"tool_calls": [...]}."""
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    items = value if isinstance(value, list) else [value]
    calls = [as_call(v) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls


def _json_format(value: Any) -> str:
    first = value[0] if isinstance(value, list) and value else value
    if isinstance(first, dict) and "parameters" in first and "arguments" not in first:
        return "llama_json"
    return "bare_json"


def parse_tags(text: str) -> Parsed:
    """`<tool_call>{json}</tool_call>` blocks (an unterminated last block is read to the end of the text)."""
    out = Parsed()
    for m in TAG_RE.finditer(text):
        body = m.group(1).strip()
        if body.startswith("```"):
            body = re.sub(r"^```\w*\s*|\s*```$", "", body)
        try:
            calls = _calls_from_json(_loads(body))
        except ValueError as e:
            out.problems.append(f"tool_call tag: {e}")
            continue
        if calls is None:
            out.problems.append("tool_call tag: JSON is not a call object")
            continue
        out.calls += calls
    out.format = "tool_call_tag" if out.calls else None
    return out


def parse_fences(text: str) -> Parsed:
    """Fenced code blocks whose content is a call object or a list of them (or a Python call list)."""
    out = Parsed()
    for m in FENCE_RE.finditer(text):
        body = m.group(1).strip()
        if PYTHON_CALLS_RE.match(body) and not body.startswith(("{", "[{")):
            calls = parse_python_calls(body)
            if calls:
                out.calls += calls
                continue
        try:
            calls = _calls_from_json(_loads(body))
        except ValueError as e:
            out.problems.append(f"fenced block: {e}")
            continue
        if calls is None:
            out.problems.append("fenced block: JSON is not a call object")
            continue
        out.calls += calls
    out.format = "fenced_json" if out.calls else None
    return out


def parse_bare_json(text: str) -> Parsed:
    """JSON objects or lists anywhere in the text (Llama 3.x writes {"name", "parameters"} after <|python_tag|>)."""
    out = Parsed()
    text = text.replace("<|python_tag|>", "")
    decoder = json.JSONDecoder()
    i, fmt = 0, None
    while True:
        starts = [p for p in (text.find("{", i), text.find("[", i)) if p >= 0]
        if not starts:
            break
        start = min(starts)
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            i = start + 1
            continue
        calls = _calls_from_json(value)
        if calls:
            out.calls += calls
            fmt = fmt or _json_format(value)
            i = end
        else:
            i = start + 1  # not a call: look inside it (a call may be nested in prose-like JSON)
    out.format = fmt if out.calls else None
    return out


def _jsonable(value: Any) -> tuple[bool, Any]:
    """(ok, value with tuples as lists); literal_eval also yields sets, bytes, complex and Ellipsis, which are not."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True, value
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if isinstance(value, dict):
        items = {k: _jsonable(v) for k, v in value.items()}
        return all(isinstance(k, str) for k in value) and all(ok for ok, _ in items.values()), {
            k: v for k, (_, v) in items.items()}
    return False, value


def parse_python_calls(text: str) -> list[dict] | None:
    """`[name(key=value, ...), ...]` or `name(...)`: keyword arguments with literal values only; None otherwise."""
    text = text.strip()
    if not text.startswith("["):
        text = f"[{text}]"
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, (ast.List, ast.Tuple)) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                ok, args[kw.arg] = _jsonable(ast.literal_eval(kw.value))
            except (ValueError, SyntaxError, TypeError, RecursionError):
                return None
            if not ok:
                return None
        calls.append({"name": name, "arguments": args})
    return calls


_KW_SPLIT = re.compile(r",\s*(?=[A-Za-z_]\w*\s*=)")
_API_CALL_RE = re.compile(r"\[?\s*([A-Za-z_][\w.]*)\((.*)\)\s*\]?", re.S)


def parse_api_bank_call(text: str) -> dict | None:
    """API-Bank's own lenient reading of `Name(key='value', ...)`: values whose quotes do not nest, like
    attendees='['John', 'Jane']', are read as the literal inside the quotes (else as the raw text)."""
    m = _API_CALL_RE.fullmatch(text.strip())
    if not m:
        return None
    name, inner = m.groups()
    args = {}
    for part in _KW_SPLIT.split(inner) if inner.strip() else []:
        kv = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(.*?)\s*", part, re.S)
        if not kv:
            return None
        key, raw = kv.groups()
        for candidate in (raw, raw[1:-1] if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"" else None):
            if candidate is None:
                return None
            try:
                ok, value = _jsonable(ast.literal_eval(candidate))
            except (ValueError, SyntaxError, TypeError, RecursionError):
                ok, value = candidate is not raw, candidate  # unquoted raw text inside the quotes
            if ok:
                args[key] = value
                break
        else:
            return None
    return {"name": name, "arguments": args}


def scan_api_requests(text: str) -> Parsed:
    """Every API-Bank `API-Request: [Name(key='value', ...)]` in a model's text (JSON-able values; the lenient
    `parse_api_bank_call` where Python does not parse). The benchmark's own calls are read by `parse_api_request`."""
    out = Parsed()
    for m in API_REQUEST_RE.finditer(text):
        calls = parse_python_calls(m.group(1) + "]")
        if calls is None:
            call = parse_api_bank_call(m.group(1) + "]")
            calls = [call] if call else None
        if calls is None:
            out.problems.append(f"API-Request: cannot read {(m.group(1) + ']')[:80]!r}")
            continue
        out.calls += calls
    out.format = "api_request" if out.calls else None
    return out


class CallSyntaxError(ValueError):
    """A call text is not `[Name(key=literal, ...)]`."""


def _parse_call(text: str) -> tuple[str, dict[str, tuple[object, str]]]:
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise CallSyntaxError(f"not a Python expression ({e.msg})") from None
    if not (isinstance(tree, ast.List) and len(tree.elts) == 1 and isinstance(tree.elts[0], ast.Call)):
        raise CallSyntaxError("expected exactly one call inside [...]")
    call = tree.elts[0]
    if not isinstance(call.func, ast.Name) or call.args or any(k.arg is None for k in call.keywords):
        raise CallSyntaxError("expected Name(key=value, ...) with keyword arguments only")
    args = {}
    for kw in call.keywords:
        try:
            value = ast.literal_eval(kw.value)
        except ValueError:
            raise CallSyntaxError(f"argument {kw.arg!r} is not a literal") from None
        args[kw.arg] = (value, ast.get_source_segment(text, kw.value))
    return call.func.id, args


_OPEN_QUOTED = re.compile(r"(=\s*)'([\[{])")
_CLOSE_QUOTED = re.compile(r"([\]}])'(?=\s*(?:,\s*[A-Za-z_]\w*\s*=|\)\]\s*$))")


def parse_api_request(text: str) -> tuple[str, dict[str, tuple[object, str]], bool]:
    """One API-Bank call as the benchmark writes it (its gold and dialogue calls, `pipeline.sources.api_bank`):
    `[Name(k='v', ...)]` (optionally after `API-Request:`) -> (name, {arg: (value, source text)}, unwrapped);
    raises CallSyntaxError. `unwrapped` says whether quoted list/dict literals had to be unquoted to make it parse.
    """
    text = text.strip()
    if text.startswith("API-Request:"):
        text = text[len("API-Request:"):].strip()
    try:
        name, args = _parse_call(text)
        return name, args, False
    except CallSyntaxError as first:
        fixed = _CLOSE_QUOTED.sub(r"\1", _OPEN_QUOTED.sub(r"\1\2", text))
        if fixed == text:
            raise first
        name, args = _parse_call(fixed)
        return name, args, True


BARE_WORD = re.compile(r'(:\s*)(?!true\b|false\b|null\b)([A-Za-z_$][\w$.]*)(\s*[,}\]])')


def parse_calls(text: str, lenient: bool = False) -> Parsed:
    """Every call in `text`, trying the explicit formats (tags, API-Request, fences) before bare JSON / Python;
    `lenient` repairs bare-word values and a call cut off inside its JSON when nothing parses as written."""
    parsed = _parse_exact(text)
    if parsed.calls or not lenient:
        return parsed
    quoted = BARE_WORD.sub(r'\1"\2"\3', text)
    if quoted != text:
        repaired = _parse_exact(quoted)
        if repaired.calls:
            repaired.repair = "bare_words"
            return repaired
    closed = close_truncated(text)
    if closed is not None:
        repaired = _parse_exact(closed)
        if repaired.calls:
            repaired.repair = "truncated"
            return repaired
    return parsed


def close_truncated(text: str) -> str | None:
    """The JSON value `text` was cut off in, up to its last complete member and closed (None: nothing to close)."""
    pos = scan(text)
    if pos.state in ("start", "done", "invalid"):
        return None
    start = pos.root.start
    for end in range(len(text), start, -1):
        if text[end - 1] not in '"}]0123456789el':  # where a string, container, number or literal can end
            continue
        cut = scan_value(text[:end] + " ", start)  # strict JSON; the space ends a number or literal at the cut
        if cut.state == "after":
            return text[start:end] + "".join("}" if f.kind == "{" else "]" for f in reversed(cut.stack))
    return None


def _parse_exact(text: str) -> Parsed:
    problems: list[str] = []
    if "<tool_call>" in text:
        p = parse_tags(text)
        if p.calls:
            return p
        problems += p.problems
    if "API-Request:" in text:
        p = scan_api_requests(text)
        if p.calls:
            return p
        problems += p.problems
    if "```" in text:
        p = parse_fences(text)
        if p.calls:
            return p
        problems += p.problems
    p = parse_bare_json(text)
    if p.calls:
        return p
    if PYTHON_CALLS_RE.match(text):
        calls = parse_python_calls(text)
        if calls:
            return Parsed(calls, "python_call")
    return Parsed([], None, problems)


# --- schema-directed normalisation --------------------------------------------------------------------------------

_INT_RE = re.compile(r"[+-]?\d+")
_NUM_RE = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def _types(schema: dict) -> list[str]:
    t = schema.get("type")
    return t if isinstance(t, list) else [t] if isinstance(t, str) else []


def _fits(value: Any, t: str) -> bool:
    return {
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "array": isinstance(value, list),
        "object": isinstance(value, dict),
        "null": value is None,
    }.get(t, True)


def _coerce(value: Any, t: str) -> tuple[bool, Any]:
    """(changed, new value) turning `value` into JSON type `t` when that is unambiguous."""
    if t == "integer":
        if isinstance(value, str) and _INT_RE.fullmatch(value.strip()):
            return True, int(value.strip())
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
    elif t == "number":
        if isinstance(value, str) and _NUM_RE.fullmatch(value.strip()):
            v = float(value.strip())
            return True, int(v) if _INT_RE.fullmatch(value.strip()) else v
    elif t == "boolean":
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return True, value.strip().lower() == "true"
    elif t == "string":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, json.dumps(value)
    return False, value


def normalise_value(value: Any, schema: Any, path: str = "") -> tuple[Any, list[str]]:
    """`value` coerced to what `schema` says where it does not already fit, and a note per change."""
    if not isinstance(schema, dict):
        return value, []
    notes: list[str] = []
    types = _types(schema)
    if types and not any(_fits(value, t) for t in types):
        for t in types:
            changed, new = _coerce(value, t)
            if changed:
                notes.append(f"{path or '<root>'}: {json.dumps(value, ensure_ascii=False)} -> "
                             f"{json.dumps(new, ensure_ascii=False)} ({t})")
                value = new
                break
    enum = schema.get("enum")
    if isinstance(enum, list) and isinstance(value, bool) and value not in enum:
        same = [e for e in enum if isinstance(e, str) and e.lower() == str(value).lower()]
        if len(same) == 1:  # BFCL: enum ["True", "False", "dontcare"] of type string, written as a JSON boolean
            notes.append(f"{path or '<root>'}: {json.dumps(value)} -> {json.dumps(same[0])} (enum)")
            value = same[0]
    if isinstance(enum, list) and isinstance(value, str) and value not in enum:
        same = [e for e in enum if isinstance(e, str) and e.lower() == value.lower()]
        if len(same) == 1:
            notes.append(f"{path or '<root>'}: {json.dumps(value, ensure_ascii=False)} -> "
                         f"{json.dumps(same[0], ensure_ascii=False)} (enum)")
            value = same[0]
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        value, sub = normalise_object(value, schema, path)
        notes += sub
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        new_items = []
        for i, item in enumerate(value):
            item, sub = normalise_value(item, schema["items"], f"{path}/{i}")
            new_items.append(item)
            notes += sub
        value = new_items
    return value, notes


def normalise_object(obj: dict, schema: dict, path: str = "") -> tuple[dict, list[str]]:
    """Normalise each known property; drop an explicit null for an optional property whose schema forbids null."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    out, notes = {}, []
    for key, value in obj.items():
        sub_schema = props.get(key)
        where = f"{path}/{key}" if path else key
        if (value is None and key not in required and isinstance(sub_schema, dict)
                and _types(sub_schema) and "null" not in _types(sub_schema)):
            notes.append(f"{where}: null -> omitted (optional, not nullable)")
            continue
        out[key], sub = normalise_value(value, sub_schema, where)
        notes += sub
    return out, notes


def normalise_arguments(args: dict, parameters: dict) -> tuple[dict, list[str]]:
    """A call's arguments normalised against its tool's `parameters` schema, and the list of changes made."""
    return normalise_object(args, parameters)


__all__ = ["ARG_ALIASES", "Parsed", "parse_calls", "close_truncated", "parse_tags", "parse_fences", "parse_bare_json",
           "scan_api_requests", "parse_api_request", "CallSyntaxError", "parse_python_calls", "parse_api_bank_call",
           "as_call", "normalise_arguments", "normalise_value"]
