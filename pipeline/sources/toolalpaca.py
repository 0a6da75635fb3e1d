"""ToolAlpaca eval sets (`eval_simulated.json`, `eval_real.json`) -> canonical requests.

Each file is a list of APIs; each API has an OpenAPI 3 `Documentation` (a JSON string), a
`Function_Projection` {tool name: [path, method]}, `Instructions` and a parallel `Golden_Answers` (ordered
steps {"Action", "Action_Input": JSON text}). Every instruction becomes one request
`toolalpaca/<subset>/<position of the instruction in the file>` with a single user turn.

Tools: one per `Function_Projection` entry, in its order. The projection is the benchmark's own list of
offered functions and carries the names gold uses (real APIs often lack an operationId; ToolAlpaca names them
`<path>_<method>`). Documentation operations outside the projection are not offered: in AviationAPI five path
items are mis-nested inside `/preferred-routes` and ToolAlpaca never offered them, although 6 gold answers
call them; those requests are kept and counted as `gold_tool_not_offered`. Parameters: path, query, header and
cookie parameters (path-level ones too; `schema`, `required`, `description`; enum, default and the other
keywords live in the schema) plus the properties of the `application/json` request body schema, with its
`required` list. Gold arguments are one flat object, so a body property named like a parameter (Améthyste
repeats its query parameters in the body) is the same argument: the parameter's schema (with its description
and enum) is kept, `body_property_same_as_parameter` counts it, and a clash of types raises. `$ref`s to
`#/components/...` are inlined (nested objects and arrays kept); a recursive `$ref` raises. OpenAPI 3.0 schema
objects become JSON Schema 2020-12: `nullable` -> a "null" type, boolean `exclusiveMinimum/Maximum` ->
numeric, `example` -> `examples`; annotations with no JSON Schema meaning (xml, externalDocs, discriminator,
x-*) are dropped and counted as `schema_keyword_dropped:<kw>`. The parameter list is the operation's whole
signature, so the top-level `additionalProperties` is false. A `type` outside JSON Schema's (e.g. "file")
raises `InputError` naming the file, API, operation, parameter and type: a new dialect needs a rule, not a
silent skip. A request body that is not a JSON object schema raises the same way.

Gold = the first step of the instruction's golden answer (later steps: `gold_later_steps_dropped`):
- first step `getDetails` (ask the user; not an offered tool, 8 simulated): the right first move is a
  question, not a call, so gold is [] (`gold_first_step_getDetails`);
- `Action_Input` that is not JSON (README: 32 simulated + 4 real over all steps,
  `action_input_not_json_all_steps`; 7 + 4 of them are first steps, `gold_action_input_not_json`): gold is [],
  because the text is a template like `{"ip": ${ip from getDetails}}` or `"symbols": "symbols": [...]` and no
  repair would be exact;
- valid JSON whose values hold `${...}` placeholders: kept raw, counted as `gold_placeholder_values`.
Empty-string values that mean "not given" (`"gender": ""`) are kept as written; the data stage counts them.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

from pipeline.io import InputError, read_json
from pipeline.sources import SourceResult

BENCHMARK = "toolalpaca"
# the data stage reports this for a benchmark without train/dev requests
NO_TRAINING_DATA = ("ToolAlpaca's training split (data/train_data.json) is not in the raw data: only the evaluation "
                    "sets eval_simulated and eval_real are converted")
SUBSETS = {"eval_simulated": "eval_simulated.json", "eval_real": "eval_real.json"}

JSON_TYPES = {"string", "integer", "number", "boolean", "array", "object", "null"}
_COPY = {"title", "description", "enum", "const", "default", "format", "pattern", "minLength", "maxLength",
         "minimum", "maximum", "multipleOf", "minItems", "maxItems", "uniqueItems", "minProperties",
         "maxProperties", "required", "readOnly", "writeOnly", "deprecated", "examples"}
_PARAM_LOCATIONS = {"path", "query", "header", "cookie"}


def resolve_ref(ref: str, doc: dict, where: str):
    if not ref.startswith("#/"):
        raise InputError(f"{where}: only local $ref '#/...' is supported, got {ref!r}")
    node = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise InputError(f"{where}: $ref {ref!r} does not resolve")
        node = node[part]
    return node


def convert_schema(schema, doc: dict, where: str, notes, refs: tuple = ()) -> dict:
    """OpenAPI 3.0 schema object -> JSON Schema 2020-12, `$ref`s inlined."""
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise InputError(f"{where}: expected a schema object, got {type(schema).__name__}")
    if "$ref" in schema:
        ref = schema["$ref"]
        if ref in refs:
            raise InputError(f"{where}: recursive $ref {ref!r} cannot be inlined")
        return convert_schema(resolve_ref(ref, doc, where), doc, where, notes, refs + (ref,))
    out = {}
    for key, value in schema.items():
        if key == "type":
            types = value if isinstance(value, list) else [value]
            bad = [t for t in types if t not in JSON_TYPES]
            if bad:
                raise InputError(f"{where}: unknown schema type {bad[0]!r}; expected one of {sorted(JSON_TYPES)}")
            out["type"] = value
        elif key in _COPY:
            out[key] = value
        elif key == "example":
            out["examples"] = [value]
        elif key in ("items", "not"):
            out[key] = convert_schema(value, doc, f"{where}.{key}", notes, refs)
        elif key == "properties":
            out[key] = {k: convert_schema(v, doc, f"{where}.{k}", notes, refs) for k, v in value.items()}
        elif key == "additionalProperties":
            out[key] = value if isinstance(value, bool) else convert_schema(value, doc, f"{where}.*", notes, refs)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [convert_schema(v, doc, f"{where}.{key}", notes, refs) for v in value]
        elif key not in ("nullable", "exclusiveMinimum", "exclusiveMaximum"):
            notes[f"schema_keyword_dropped:{key}"] += 1
    for bound in ("Minimum", "Maximum"):  # 3.0: boolean flag on minimum/maximum; 2020-12: the bound itself
        flag = schema.get(f"exclusive{bound}")
        if isinstance(flag, bool):
            if flag and bound.lower() in out:
                out[f"exclusive{bound}"] = out.pop(bound.lower())
        elif flag is not None:
            out[f"exclusive{bound}"] = flag
    if schema.get("nullable") is True and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = types + ["null"] if "null" not in types else types
    return out


def _request_body_schema(op: dict, doc: dict, where: str, notes) -> dict | None:
    body = op.get("requestBody")
    if body is None:
        return None
    if "$ref" in body:
        body = resolve_ref(body["$ref"], doc, where)
    content = body.get("content") or {}
    media = "application/json" if "application/json" in content else next(
        (m for m in content if "json" in m), None)
    if media is None:
        raise InputError(f"{where}: request body has no JSON content (got {sorted(content)})")
    schema = convert_schema(content[media].get("schema", {}), doc, f"{where} requestBody", notes)
    if schema.get("type", "object") != "object" or "properties" not in schema:
        raise InputError(f"{where}: request body schema must be an object with properties, got "
                         f"{json.dumps(schema)[:120]}")
    return schema


def operation_tool(name: str, path: str, method: str, doc: dict, where: str, notes) -> dict:
    """One OpenAPI operation -> OpenAI function tool named `name`."""
    where = f"{where} operation {name} ({method.upper()} {path})"
    item = (doc.get("paths") or {}).get(path)
    if not isinstance(item, dict) or not isinstance(item.get(method), dict):
        raise InputError(f"{where}: Function_Projection names an operation the Documentation lacks")
    op = item[method]
    props, required = {}, []
    params = {}
    for param in list(item.get("parameters", [])) + list(op.get("parameters", [])):
        if "$ref" in param:
            param = resolve_ref(param["$ref"], doc, where)
        if param.get("in") not in _PARAM_LOCATIONS or not isinstance(param.get("name"), str):
            raise InputError(f"{where}: parameter {param.get('name')!r} has location {param.get('in')!r}; "
                             f"expected one of {sorted(_PARAM_LOCATIONS)}")
        params[param["name"]] = param  # operation-level parameters override path-level ones
    for pname, param in params.items():
        if "schema" not in param:
            notes["parameter_without_schema"] += 1
        prop = convert_schema(param.get("schema", {}), doc, f"{where} parameter {pname}", notes)
        if param.get("description"):
            prop = {**prop, "description": param["description"]}
        props[pname] = prop
        if param.get("required"):
            required.append(pname)
        elif param["in"] == "path":  # OpenAPI: a path parameter is always required
            required.append(pname)
            notes["path_parameter_marked_required"] += 1
    body = _request_body_schema(op, doc, where, notes)
    if body is not None:
        for key, prop in body["properties"].items():
            if key not in props:
                props[key] = prop
            elif prop.get("type", props[key].get("type")) == props[key].get("type"):
                notes["body_property_same_as_parameter"] += 1  # one flat argument serves both; keep the parameter
            else:
                raise InputError(f"{where}: request body property {key!r} clashes with a parameter of another type")
        required += [r for r in body.get("required", []) if r not in required]
    parameters = {"type": "object", "properties": props}
    if required:
        parameters["required"] = required
    parameters["additionalProperties"] = False
    description = op.get("description") or op.get("summary") or ""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def api_tools(api: dict, where: str, notes) -> list[dict]:
    try:
        doc = json.loads(api["Documentation"])
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise InputError(f"{where}: Documentation is not an OpenAPI JSON string ({e})") from None
    projection = api.get("Function_Projection")
    if not isinstance(projection, dict):
        raise InputError(f"{where}: Function_Projection must map tool names to [path, method]")
    return [operation_tool(name, pm[0], pm[1], doc, where, notes) for name, pm in projection.items()]


def gold_from_steps(steps: list, tool_names: set, notes) -> list[dict]:
    """First golden step -> gold calls, following the rules in the module docstring."""
    for step in steps:
        try:
            json.loads(step.get("Action_Input", ""))
        except (TypeError, json.JSONDecodeError):
            notes["action_input_not_json_all_steps"] += 1
    if not steps:
        notes["gold_empty"] += 1
        return []
    if len(steps) > 1:
        notes["gold_later_steps_dropped"] += 1
    first = steps[0]
    if first.get("Action") == "getDetails":
        notes["gold_first_step_getDetails"] += 1
        return []
    text = first.get("Action_Input", "")
    try:
        args = json.loads(text)
    except (TypeError, json.JSONDecodeError):
        notes["gold_action_input_not_json"] += 1
        if "${" in str(text):
            notes["gold_action_input_not_json_with_placeholder"] += 1
        return []
    if not isinstance(args, dict):
        notes["gold_action_input_not_object"] += 1
        return []
    if "${" in json.dumps(args):
        notes["gold_placeholder_values"] += 1
    if first.get("Action") not in tool_names:
        notes["gold_tool_not_offered"] += 1
    return [{"name": first.get("Action"), "arguments": args}]


def load(root: Path) -> SourceResult:
    """Convert both eval sets under `root` (the ToolAlpaca raw folder); notes are keyed `<subset>/<counter>`."""
    result = SourceResult()
    for subset, rel in SUBSETS.items():
        notes = Counter()
        file = Path(root) / rel
        apis = read_json(file)
        if not isinstance(apis, list):
            raise InputError(f"{file}: expected a JSON list of APIs, got {type(apis).__name__}")
        position = 0
        for a, api in enumerate(apis):
            name = api.get("Name", "?") if isinstance(api, dict) else "?"
            instructions = api.get("Instructions", []) if isinstance(api, dict) else []
            answers = api.get("Golden_Answers", []) if isinstance(api, dict) else []
            tools = api_tools(api, f"{file} (API {a} {name!r})", notes)
            for i, instruction in enumerate(instructions):
                record = f"API {a} {name!r} instruction {i}"
                index, position = position, position + 1
                if i >= len(answers) or not isinstance(answers[i], list):
                    result.reject(file, record, "no_golden_answer", f"{len(answers)} golden answers")
                    continue
                if not isinstance(instruction, str) or not instruction.strip():
                    result.reject(file, record, "empty_instruction")
                    continue
                gold = gold_from_steps(answers[i], {t["function"]["name"] for t in tools}, notes)
                result.requests.append({
                    "id": f"{BENCHMARK}/{subset}/{index}", "benchmark": BENCHMARK, "subset": subset,
                    "messages": [{"role": "user", "content": instruction}], "tools": copy.deepcopy(tools),
                    "gold": gold})
                notes["requests"] += 1
        result.notes.update({f"{subset}/{key}": n for key, n in notes.items()})
    return result
