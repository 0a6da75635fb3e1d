"""When is a value, a slot or a call right? The one set of rules that labels, sidecar accuracy and the eval report use.

- `values_equal`: strict JSON equality: numbers by value (5 == 5.0), booleans only equal booleans (true != 1),
  objects regardless of key order, lists in order, strings exactly.
- BFCL acceptable values (a request's `gold_accept`: {"name", "arguments": {param: [acceptable values]}}), as BFCL's
  AST checker applies them: a given value must equal one of the options; strings compare after `bfcl_string`
  (spaces and , . / - _ * ^ dropped, lower case, ' as "), inside lists and objects too; a list option matches a list
  element by element; an object option is again {key: [options]} matched key by key; `""` (or null) among the options
  means the parameter may be omitted (an omitted value is `None` here, as the sidecar's `null`).
- `slot_match`: a predicted slot value (None = omitted) against the reference value, with the options where given.
- `call_equal` / `call_accepted`: a call {"name", "arguments"} against a request's gold calls, exactly or with the
  acceptable values.
A value that is not JSON (the sidecar's UNKNOWN) equals nothing here.
"""

from __future__ import annotations

import re
from typing import Any

_BFCL_DROP = re.compile(r"[ ,./\-_*^]")


def values_equal(a: Any, b: Any) -> bool:
    """Strict JSON equality (see the module docstring)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def bfcl_string(s: str) -> str:
    """A string as BFCL's checker compares it: spaces and , . / - _ * ^ dropped, lower case, ' as "."""
    return _BFCL_DROP.sub("", s).lower().replace("'", '"')


def omission_ok(options: list) -> bool:
    """The options let the parameter be left out ("" or null among them)."""
    return any(o is None or (isinstance(o, str) and o == "") for o in options)


def _as_options(options: Any) -> list:
    return options if isinstance(options, list) else [options]


def _option_matches(value: Any, option: Any) -> bool:
    """One given value against one acceptable option."""
    if isinstance(option, dict) and isinstance(value, dict):
        return arguments_accepted(value, option)
    if isinstance(option, list) and isinstance(value, list):
        return len(option) == len(value) and all(_option_matches(v, o) for v, o in zip(value, option))
    if isinstance(option, str) and isinstance(value, str):
        return bfcl_string(value) == bfcl_string(option)
    return values_equal(value, option)


def value_accepted(value: Any, options: Any) -> bool:
    """`value` (None = omitted) is acceptable under BFCL's `options` for one parameter."""
    options = _as_options(options)
    if value is None:
        return omission_ok(options)
    return any(_option_matches(value, o) for o in options)


def arguments_accepted(args: dict, accept: dict) -> bool:
    """Every given argument is known and acceptable; every omitted one may be omitted (BFCL)."""
    if any(key not in accept or not value_accepted(value, accept[key]) for key, value in args.items()):
        return False
    return all(key in args or omission_ok(_as_options(options)) for key, options in accept.items())


def slot_match(pred: Any, gold: Any, options: list | None = None) -> bool:
    """A slot's predicted value (None = omitted) against the reference value, or its BFCL options when given."""
    if options is not None:
        return value_accepted(pred, options)
    return values_equal(pred, gold)


def call_equal(call: dict, gold: list[dict]) -> bool:
    """`call` names the tool of one of the gold calls and has exactly its arguments."""
    return any(call["name"] == g["name"] and values_equal(call.get("arguments") or {}, g.get("arguments") or {})
               for g in gold)


def call_accepted(call: dict, gold: list[dict], gold_accept: list[dict] | None = None) -> bool:
    """Agreement with gold: with the acceptable values where the request has `gold_accept`, exact otherwise."""
    if not gold_accept:
        return call_equal(call, gold)
    return any(call["name"] == a["name"] and arguments_accepted(call.get("arguments") or {}, a.get("arguments") or {})
               for a in gold_accept)


__all__ = ["values_equal", "bfcl_string", "omission_ok", "value_accepted", "arguments_accepted", "slot_match",
           "call_equal", "call_accepted"]
