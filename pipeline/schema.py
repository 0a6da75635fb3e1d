"""JSON Schema helpers shared by every stage: meta-schema checks, argument validation, tool accessors."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jsonschema
from jsonschema import Draft202012Validator


_META = Draft202012Validator(Draft202012Validator.META_SCHEMA)


def schema_errors(schema: dict) -> list[str]:
    """Problems of `schema` as a JSON Schema 2020-12 document (empty list = valid)."""
    import json

    return list(_schema_errors(json.dumps(schema, sort_keys=True)))


@lru_cache(maxsize=65536)
def _schema_errors(schema_json: str) -> tuple[str, ...]:
    import json

    return tuple(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                 for e in _META.iter_errors(json.loads(schema_json)))


def check_schema(schema: dict) -> None:
    Draft202012Validator.check_schema(schema)


@lru_cache(maxsize=4096)
def _validator(schema_json: str) -> Draft202012Validator:
    import json

    return Draft202012Validator(json.loads(schema_json))


def validation_errors(instance: Any, schema: dict) -> list[str]:
    """Why `instance` does not satisfy `schema` (empty list = valid)."""
    import json

    v = _validator(json.dumps(schema, sort_keys=True))
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(instance)]


def draft_schema(params: dict) -> dict:
    """A tool's parameters schema as a *draft* call must satisfy: `required` and `dependentRequired` lifted.

    A hint is a draft: the target writes what it leaves out, so a partial call is usable. Shared by the sidecar's
    join and the runtime's hint check, so both accept exactly the same payloads.
    """
    if not isinstance(params, dict):
        return params
    return {k: v for k, v in params.items() if k not in ("required", "dependentRequired")}


def is_valid(instance: Any, schema: dict) -> bool:
    return not validation_errors(instance, schema)


def tool_name(tool: dict) -> str:
    return tool["function"]["name"]


def tool_params(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def param_names(tool: dict) -> list[str]:
    """Parameter names of a tool in schema order (the order the sidecar's slot rows use)."""
    return list(tool_params(tool).get("properties", {}).keys())


def find_tool(tools: list[dict], name: str) -> int | None:
    for i, t in enumerate(tools):
        if tool_name(t) == name:
            return i
    return None


__all__ = ["schema_errors", "check_schema", "validation_errors", "is_valid", "tool_name", "tool_params",
           "param_names", "find_tool", "draft_schema", "jsonschema"]
