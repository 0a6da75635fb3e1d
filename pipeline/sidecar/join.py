"""Join a wave's answers into the sidecar payload (pure: no model, no tokenizer).

A wave answers one function question and one slot question per (tool, parameter) of every tool ("if tool [i] is
called, the value of p"). For every tool, the join keeps the slot values that are neither `null` (such a call would
omit the parameter) nor unknown (the answer was neither JSON nor a bare word) and that satisfy the parameter's own
schema. The tool the function answer names becomes the payload's top call and every other tool with such values goes
into `others` (`pipeline.payload.Payload`):

    {"tool_index": i, "arguments": {param: value, ...}, "others": {"j": {...}}}   (compact JSON; bytes = UTF-8 length)

Whole-call check, per tool: the joined arguments are validated against the tool's `parameters` schema with `required`
and `dependentRequired` lifted (`schema.draft_schema`: a hint is a draft and the target writes what it leaves out,
so a missing required parameter of the top tool is reported in `missing_required`, never an error). A whole-call
error located inside one parameter (a `$ref` into the tool's `$defs` that the parameter schema alone cannot resolve,
`patternProperties`) drops that parameter; errors at the root that no single parameter explains (`minProperties`,
`oneOf` over parameters ...) are reported in `call_errors` for the top tool, whose payload is kept (the runtime
decides), and drop an other tool's arguments altogether (`others` holds only schema-valid drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator
from referencing.exceptions import Unresolvable

from ..payload import Payload
from ..schema import draft_schema, tool_params, validation_errors
from .rows import UNKNOWN, Unknown, parse_function_answer, parse_slot_answer


@dataclass
class Join:
    """The payload (None when the function answer is not a valid tool index) and why slots were left out."""

    payload: Payload | None
    dropped: list[dict] = field(default_factory=list)  # [{"tool", "param", "value", "reason"}]
    missing_required: list[str] = field(default_factory=list)  # of the top tool
    call_errors: list[str] = field(default_factory=list)  # of the top tool

    @property
    def report(self) -> dict:
        return {"dropped": self.dropped, "missing_required": self.missing_required, "call_errors": self.call_errors}


def parse_answers(keys: list[tuple], texts: list[str], n_tools: int) -> list[dict]:
    """Decoded texts of a wave -> answers [{"kind", "tool", "param", "text", "value"}].

    `keys` are `rows.wave_questions`' keys: ("function",) or ("slot", tool, param). The function answer's value is
    the tool index or None (not an integer in range); a slot answer's value is the JSON value, `None` for `null`,
    a bare word as the string it spells (`rows.parse_slot_answer`), or `rows.UNKNOWN` when the text is none of these.
    """
    if len(keys) != len(texts):
        raise ValueError(f"{len(keys)} wave questions but {len(texts)} answers")
    answers = []
    for key, text in zip(keys, texts):
        if key[0] == "function":
            answers.append({"kind": "function", "tool": None, "param": None, "text": text,
                            "value": parse_function_answer(text, n_tools)})
        elif key[0] == "slot":
            answers.append({"kind": "slot", "tool": key[1], "param": key[2], "text": text,
                            "value": parse_slot_answer(text)})
        else:
            raise ValueError(f"unknown wave question kind {key[0]!r}; expected 'function' or 'slot'")
    return answers


def function_choice(answers: list[dict]) -> int | None:
    for a in answers:
        if a["kind"] == "function":
            return a["value"]
    return None


def slot_values(answers: list[dict]) -> dict[tuple[int, str], Any]:
    """{(tool, param): value} of the slot answers (values may be None or UNKNOWN)."""
    return {(a["tool"], a["param"]): a["value"] for a in answers if a["kind"] == "slot"}


def tool_arguments(tool: dict, index: int, slots: dict[tuple[int, str], Any]) -> tuple[dict, list[dict], list[str]]:
    """(arguments, dropped, root errors) of one tool: its non-null, known, schema-valid slot values (module doc)."""
    params = tool_params(tool)
    arguments: dict[str, Any] = {}
    dropped: list[dict] = []
    for name, prop_schema in (params.get("properties", {}) or {}).items():
        value = slots.get((index, name))
        if value is None or isinstance(value, Unknown):
            continue
        try:
            errors = validation_errors(value, prop_schema) if isinstance(prop_schema, (dict, bool)) else []
        except Unresolvable:
            errors = []  # a $ref into the tool's $defs: the whole-call check below resolves it
        if errors:
            dropped.append({"tool": index, "param": name, "value": value, "reason": "; ".join(errors)})
            continue
        arguments[name] = value

    # Whole call, `required` lifted: a draft may leave parameters for the target to write.
    validator = Draft202012Validator(draft_schema(params))
    while True:  # drop the parameters errors point into, then look again at what is left
        errors = list(validator.iter_errors(arguments))
        inside = {str(e.absolute_path[0]): e.message for e in errors if e.absolute_path}
        for name, message in inside.items():
            dropped.append({"tool": index, "param": name, "value": arguments.pop(name), "reason": f"call: {message}"})
        if not inside:
            break
    return arguments, dropped, [e.message for e in errors]


def join(tools: list[dict], function_index: int | None, slots: dict[tuple[int, str], Any]) -> Join:
    """The payload for `tools` given the function answer and the slot values (see the module docstring)."""
    if function_index is None or not 0 <= function_index < len(tools):
        return Join(payload=None)
    arguments, dropped, call_errors = tool_arguments(tools[function_index], function_index, slots)
    params = tool_params(tools[function_index])
    needed = list(params.get("required", []))
    for trigger, deps in (params.get("dependentRequired") or {}).items():
        if trigger in arguments:
            needed += [d for d in deps if d not in needed]
    missing = [p for p in needed if p not in arguments]
    others: dict[int, dict] = {}
    for index, tool in enumerate(tools):
        if index == function_index:
            continue
        args, tool_dropped, root_errors = tool_arguments(tool, index, slots)
        dropped += tool_dropped
        if root_errors:  # no single parameter to blame: this tool's draft is left out
            dropped += [{"tool": index, "param": None, "value": args, "reason": "call: " + "; ".join(root_errors)}]
        elif args:
            others[index] = args
    return Join(payload=Payload(function_index, arguments, others), dropped=dropped, missing_required=missing,
                call_errors=call_errors)


def join_answers(tools: list[dict], answers: list[dict]) -> Join:
    return join(tools, function_choice(answers), slot_values(answers))


def answer_json(answer: dict) -> dict:
    """An answer as plain JSON: UNKNOWN becomes {"value": null, "unknown": true}."""
    out = dict(answer)
    out["unknown"] = isinstance(answer["value"], Unknown)
    if out["unknown"]:
        out["value"] = None
    return out


def answer_from_json(obj: dict) -> dict:
    out = dict(obj)
    if out.pop("unknown", False):
        out["value"] = UNKNOWN
    return out
