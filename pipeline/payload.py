"""The sidecar payload: what one wave decided, as the runtime receives it. Written once, for the sidecar's join, the
wave, the runtime's hint drafter, the oracle/gold hints and the reports.

Wire form (compact JSON; `bytes` is its UTF-8 length):

    {"tool_index": 1, "arguments": {"city": "Paris"}, "others": {"0": {"expression": "2+2"}}}

`tool_index` is the function answer (0-based into the request's tools) and `arguments` that tool's slots (the paper's
payload); `others` holds, per other tool index, the non-null slots the wave answered for that tool ("if tool [i] is
called, its p is ..."), so the runtime still has a hint when the target calls another tool. `others` is left out
when empty; an optional `"name"` wins over `tool_index` (a sidecar that names the tool). Arguments are drafts:
they are checked against each tool's schema with `required` / `dependentRequired` lifted (`schema.draft_schema`),
so a partial call is usable and the target writes what it leaves out.

Only `jsonschema` is needed: the runtime imports this without the sidecar's training stack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .schema import draft_schema, find_tool, tool_name, tool_params, validation_errors


class PayloadError(ValueError):
    """A payload that cannot be used: the message says why (the runtime reports it as the hint's error)."""


def _index(value, n_tools: int | None, what: str) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (n_tools is not None and
                                                                              value >= n_tools):
        within = f" into {n_tools} tools" if n_tools is not None else ""
        raise PayloadError(f"{what} {value!r} is not an index{within}")
    return value


def _arguments(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise PayloadError(f"{what} is {type(value).__name__}, expected an object")
    return value


@dataclass(frozen=True)
class Payload:
    tool_index: int
    arguments: dict
    others: dict[int, dict] = field(default_factory=dict)  # other tool index -> its non-null arguments
    name: str | None = None  # the top tool by name (wins over tool_index)

    # ---------------------------------------------------------------- wire form

    @classmethod
    def parse(cls, obj) -> Payload:
        """A payload from its JSON form (or a Payload, returned as is); PayloadError says what is wrong."""
        if isinstance(obj, Payload):
            return obj
        if not isinstance(obj, dict):
            raise PayloadError(f"payload is {type(obj).__name__}, expected an object")
        name = obj.get("name") if isinstance(obj.get("name"), str) else None
        index = obj.get("tool_index", 0 if name is not None else None)
        index = _index(index, None, "tool_index")
        others = obj.get("others")
        others = {} if others is None else others
        if not isinstance(others, dict):
            raise PayloadError(f"others is {type(others).__name__}, expected an object of tool index -> arguments")
        parsed = {_index(k, None, "others key"): _arguments(v, f"others[{k!r}]") for k, v in others.items()}
        return cls(index, _arguments(obj.get("arguments"), "arguments"), parsed, name)

    def to_json(self) -> dict:
        out: dict = {"tool_index": self.tool_index, "arguments": self.arguments}
        if self.others:
            out["others"] = {str(i): args for i, args in sorted(self.others.items())}
        if self.name is not None:
            out["name"] = self.name
        return out

    def encode(self) -> str:
        """Compact JSON of the wire form."""
        return json.dumps(self.to_json(), ensure_ascii=False, separators=(",", ":"))

    @property
    def bytes(self) -> int:
        return len(self.encode().encode("utf-8"))

    # ---------------------------------------------------------------- calls

    def top_index(self, tools: list[dict]) -> int:
        """The top tool's index into `tools` ("name" wins over "tool_index")."""
        if self.name is not None:
            index = find_tool(tools, self.name)
            if index is None:
                raise PayloadError(f"payload names unknown tool {self.name!r}")
            return index
        return _index(self.tool_index, len(tools), "tool_index")

    def call(self, tools: list[dict], validate: bool = True) -> dict:
        """The top tool's call {"name", "arguments"}; PayloadError when it does not fit `tools`."""
        index = self.top_index(tools)
        return _checked_call(tools, index, self.arguments, validate)

    def calls(self, tools: list[dict], validate: bool = True) -> list[dict]:
        """A call per tool the payload drafts: the top tool first (even without arguments), then every other tool
        with arguments, in tool order. Any part that does not fit `tools` rejects the payload (PayloadError)."""
        top = self.top_index(tools)
        out = [_checked_call(tools, top, self.arguments, validate)]
        for index, args in sorted(self.others.items()):
            _index(index, len(tools), "others key")
            if index != top and args:
                out.append(_checked_call(tools, index, args, validate))
        return out

    @classmethod
    def from_call(cls, call: dict, tools: list[dict]) -> Payload:
        """The payload that drafts exactly `call` (the oracle's and gold hints); PayloadError for an unknown tool."""
        index = find_tool(tools, call["name"])
        if index is None:
            raise PayloadError(f"call names {call['name']!r}, not one of the offered tools")
        return cls(index, _arguments(call.get("arguments") or {}, "arguments"))


def _checked_call(tools: list[dict], index: int, args: dict, validate: bool) -> dict:
    if validate:
        errors = validation_errors(args, draft_schema(tool_params(tools[index])))  # partial hints are drafts
        if errors:
            raise PayloadError(f"arguments do not fit the schema of {tool_name(tools[index])}: {errors[0]}")
    return {"name": tool_name(tools[index]), "arguments": args}


def payload_from_call(call: dict, tools: list[dict]) -> dict | None:
    """The JSON form of the payload that drafts `call` (None when its tool is not in `tools`)."""
    try:
        return Payload.from_call(call, tools).to_json()
    except PayloadError:
        return None


def gold_payload(request: dict) -> dict | None:
    """The payload of the request's first gold call (a wave for `--hint gold` and the traces' teacher hint; clearly
    not a sidecar)."""
    gold = request.get("gold") or []
    return payload_from_call(gold[0], request.get("tools") or []) if gold else None


def payload_bytes(payload) -> int:
    """Bytes of a payload's compact JSON (0 for none); a JSON form that is not a valid payload counts as it is."""
    if payload is None:
        return 0
    try:
        return Payload.parse(payload).bytes
    except PayloadError:
        return len(json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))


__all__ = ["Payload", "PayloadError", "payload_bytes", "payload_from_call", "gold_payload"]
