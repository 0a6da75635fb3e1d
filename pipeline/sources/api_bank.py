"""API-Bank level-1 / level-2 test data and the level-3 training data -> canonical requests.

Two record layouts (LAYOUTS), one request `api_bank/<subset>/<position in the file>` per record (the source "id"
is not unique, the position is):
  - `level-1`, `level-2` (`test-data/level-{1,2}-api.json`, evaluation): {"file", "id", "instruction", "input",
    "expected_output"}; the API descriptions are the JSON lines after `API descriptions:` in `instruction`
    ({"name", "description", "input_parameters", "output_parameters"}), the dialogue is `input`.
  - `lv3-train` (`training-data/lv3-api-train.json`, the benchmark's training split, 907 records): {"instruction",
    "input", "output"}; `input` opens with one JSON line per offered API ({"apiCode", "description", "parameters",
    "response"}, renamed to the keys above; always just ToolSearcher) and then holds the dialogue. Its instruction
    has no year (`The current time is {{time}}.` is an unfilled template; the user turns end in `TIME: ...`), so
    these requests have no system message (counted: `no_current_year`). The data stage assigns train/dev.

Tools: the `API descriptions:` lines of `instruction` (one JSON object per line). API-Bank types are
python-ish and map onto JSON Schema as `str`->string, `int`->integer, `float`->number, `bool`->boolean,
`dict`->object, `list`->array (items unconstrained), `list(X)`->array of X, and (training data only) `date`,
`time`, `datetime`->string: their values are written like '2034-04-15 10:00:00', not RFC 3339, so no `format`. Any other input-parameter type
raises `InputError` naming the file, record, tool, parameter and type: the vocabulary is small and closed, so
a new type means this converter needs a rule, not that the record should vanish. Output parameters are not
part of a function schema and are left out. The source has no "required" lists and the gold calls often omit
described parameters (`ForgotPassword` with status='Forgot Password' passes no verification code), so no
parameter is marked required. The described parameters are the API's whole signature as the benchmark states
it, so `additionalProperties` is false: an argument the description does not name (8 level-1 `TimedSwitch`
golds pass `device_id` where the description says `name`) is left for the data stage to count. Nothing in a
schema is derived from gold.

Level-2 offers only `ToolSearcher` in the instruction, but 90 of its 135 gold calls name another API. The
descriptions of those APIs reach the model through the dialogue, as the results of earlier ToolSearcher calls
(`API-Request: [ToolSearcher(...)]->{'name': 'BookHotel', ...}` or a list of such dicts). Those retrieved
tools are offered too, after ToolSearcher, in the order they were retrieved (`offer_retrieved=False` restores
the prompt-only tool list). 14 level-2 gold calls name an API whose description appears nowhere in the record;
they are kept with the tools the record does describe and counted as `gold_tool_not_offered`. The training data
retrieves the same way. Some of its ToolSearcher results write a parameter type as a bare name (`'type': str`
instead of `'type': 'str'`); such a name from the type vocabulary is read as that type name
(`toolsearcher_result_bare_type_name`). A result that still is not a Python literal (an unescaped apostrophe in
`'the user's goal'`, a description cut off with `...`) offers nothing (`toolsearcher_result_unparsed`), nor does
a description whose `input_parameters` is not a mapping (`{'none'}`: `toolsearcher_result_invalid_api`); a later
call to that API counts as not offered.

Dialogue (`input`): one turn per line, `User: ...` -> user, `AI: ...` -> assistant text, `API-Request:
[Name(k='v')]->result` -> an assistant message with `tool_calls` (arguments as a dict, as chat templates
expect) followed by a `tool` message whose content is the raw result text. The trailing `Generate API
Request:` line is the task marker and is dropped. The instruction's `The current year is 2023.` sentence
becomes the system message (gold dates depend on it); the rest of the instruction describes the source's own
output format and is not carried over. A line with no known speaker makes the record a reject.

Calls (`expected_output` and the dialogue) are parsed with `ast` as one Python call expression. Some source
calls quote a list literal as if it were a string (`attendees='['John', 'Jane']'`), which is not Python; for
those alone the quotes around a `[...]`/`{...}` value are removed (the step API-Bank's own evaluator sketches)
and counted as `quoted_literal_unwrapped`. Every value is written as a string literal in the source
(`room_count='1'`, `on='True'`); a value is typed by its tool's declared parameter type only when the
conversion is exact (`'1'`->1, `'True'`->true, `'[...]'`->list; a str parameter keeps the quoted text
verbatim). Values that do not convert stay as written and the data stage counts them against the schema.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from pathlib import Path

from pipeline.io import InputError, read_json
from pipeline.parsers import CallSyntaxError, parse_api_request
from pipeline.sources import SourceResult

BENCHMARK = "api_bank"
# subset -> (file under the raw folder, record layout); lv3-train is training data (the data stage splits it)
SUBSETS = {"level-1": ("test-data/level-1-api.json", "test"), "level-2": ("test-data/level-2-api.json", "test"),
           "lv3-train": ("training-data/lv3-api-train.json", "train")}

_SCALARS = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "dict": "object",
            "date": "string", "time": "string", "datetime": "string"}
_LIST_OF = re.compile(r"list\((?P<inner>[^()]+)\)")
_SPEAKERS = {"User": "user", "AI": "assistant"}
_YEAR = re.compile(r"The current year is \d{4}\.")
_MARKER = "Generate API Request:"


def param_schema(ptype: str, where: str) -> dict:
    """JSON Schema for an API-Bank parameter type (`str`, `int`, `list(str)`...); unknown types raise."""
    ptype = ptype.strip()
    if ptype in _SCALARS:
        return {"type": _SCALARS[ptype]}
    if ptype == "list":
        return {"type": "array"}
    m = _LIST_OF.fullmatch(ptype)
    if m:
        return {"type": "array", "items": param_schema(m["inner"], where)}
    raise InputError(f"{where}: unknown API-Bank parameter type {ptype!r}; expected one of "
                     f"{sorted(_SCALARS) + ['list', 'list(<type>)']}")


def api_to_tool(api: dict, where: str) -> dict:
    """An API-Bank API description {"name", "description", "input_parameters"} -> OpenAI function tool."""
    if not isinstance(api, dict) or not isinstance(api.get("name"), str):
        raise InputError(f"{where}: expected an API description object with a 'name', got {str(api)[:80]!r}")
    params = api.get("input_parameters") or {}
    if not isinstance(params, dict):
        raise InputError(f"{where}: input_parameters of {api['name']} is not a mapping: {str(params)[:80]!r}")
    props = {}
    for pname, spec in params.items():
        if not isinstance(spec, dict) or "type" not in spec:
            raise InputError(f"{where}: parameter {api['name']}.{pname} has no 'type'")
        prop = param_schema(str(spec["type"]), f"{where} ({api['name']}.{pname})")
        if spec.get("description"):
            prop["description"] = spec["description"]
        props[pname] = prop
    return {"type": "function", "function": {"name": api["name"], "description": api.get("description", ""),
                                             "parameters": {"type": "object", "properties": props,
                                                            "additionalProperties": False}}}


def type_value(value, source: str, ptype: str | None):
    """Type a parsed value by its declared API-Bank type when the conversion is exact; else return it as is."""
    if ptype is None:
        return value
    ptype = ptype.strip()
    if ptype == "str":
        return source if isinstance(value, (list, dict)) else value  # an unquoted literal keeps its text
    if not isinstance(value, str):
        return value
    if ptype == "int" and re.fullmatch(r"[+-]?\d+", value):
        return int(value)
    if ptype == "float" and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", value):
        return float(value)
    if ptype == "bool" and value in ("True", "False", "true", "false"):
        return value in ("True", "true")
    if ptype == "list" or _LIST_OF.fullmatch(ptype) or ptype == "dict":
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
        if isinstance(parsed, dict if ptype == "dict" else list):
            return parsed
    return value


def typed_arguments(args: dict, api: dict | None, notes: Counter | None = None) -> dict:
    """Parsed call arguments typed by `api`'s declared parameter types; conversions are counted in `notes`."""
    types = {p: str(s.get("type")) for p, s in ((api or {}).get("input_parameters") or {}).items()}
    out = {}
    for key, (value, source) in args.items():
        typed = type_value(value, source, types.get(key))
        if notes is not None and typed is not value:
            notes[f"gold_typed_{types[key]}"] += 1
        out[key] = typed
    return out


class _TypeNames(ast.NodeTransformer):
    """Bare type names (`str`, `datetime`) -> their name as a string constant; counts how many it replaced."""

    def __init__(self):
        self.replaced = 0

    def visit_Name(self, node: ast.Name):
        if node.id in _SCALARS or node.id == "list":
            self.replaced += 1
            return ast.copy_location(ast.Constant(node.id), node)
        return node


def _retrieved_apis(result_text: str, notes: Counter) -> list[dict] | None:
    """A ToolSearcher result (one API description dict or a list of them) -> list of descriptions, None if not one."""
    try:
        tree = ast.parse(result_text.strip(), mode="eval")
        names = _TypeNames()
        found = ast.literal_eval(names.visit(tree).body)
    except (ValueError, SyntaxError):
        return None
    found = [found] if isinstance(found, dict) else found
    if not isinstance(found, list) or not all(isinstance(a, dict) and "name" in a for a in found):
        return None
    if names.replaced:
        notes["toolsearcher_result_bare_type_name"] += 1
    return found


def _split_request_line(line: str):
    """`API-Request: [Call(...)]->result` -> (parsed call, result); the call ends at the first `)]->` that parses."""
    body = line[len("API-Request:"):]
    start = 0
    while (cut := body.find(")]->", start)) != -1:
        try:
            return parse_api_request(body[:cut + 2]), body[cut + 4:]
        except CallSyntaxError:
            start = cut + 1
    raise CallSyntaxError("no `[Name(...)]->result` call found")


class RecordRejected(ValueError):
    """A record that cannot become a request: `reason` (short key) and `detail` for the rejects file."""

    def __init__(self, reason: str, detail: str):
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


def _test_layout(rec: dict) -> tuple[str, list[str], str, str]:
    """level-1/2: (instruction head, API description lines, dialogue, gold text), or RecordRejected."""
    instruction, dialogue, expected = rec.get("instruction"), rec.get("input"), rec.get("expected_output")
    if not all(isinstance(x, str) for x in (instruction, dialogue, expected)):
        raise RecordRejected("missing_field", "instruction, input and expected_output must be strings")
    head, sep, desc_block = instruction.partition("API descriptions:")
    if not sep:
        raise RecordRejected("no_api_descriptions", "instruction has no 'API descriptions:' block")
    return head, desc_block.strip().splitlines(), dialogue, expected


def _train_layout(rec: dict) -> tuple[str, list[str], str, str]:
    """lv3 training data: the API description lines open `input`, the dialogue follows, the gold is `output`."""
    instruction, text, expected = rec.get("instruction"), rec.get("input"), rec.get("output")
    if not all(isinstance(x, str) for x in (instruction, text, expected)):
        raise RecordRejected("missing_field", "instruction, input and output must be strings")
    lines = text.split("\n")
    n = next((i for i, line in enumerate(lines) if not line.startswith("{")), len(lines))
    if n == 0:
        raise RecordRejected("no_api_descriptions", "input does not open with a JSON API description line")
    return instruction, lines[:n], "\n".join(lines[n:]), expected


LAYOUTS = {"test": _test_layout, "train": _train_layout}
# the training data's description keys -> the test data's (the converter reads the latter)
_API_KEYS = {"apiCode": "name", "parameters": "input_parameters", "response": "output_parameters"}


def convert_record(rec: dict, file: Path, index: int, subset: str, result: SourceResult, notes: Counter,
                   offer_retrieved: bool = True, layout: str = "test") -> dict | None:
    """One source record -> request, or None after recording a reject in `result`; counters go to `notes`."""
    where = f"{file} (record {index})"
    try:
        head, desc_lines, dialogue, expected = LAYOUTS[layout](rec)
    except RecordRejected as e:
        result.reject(file, index, e.reason, e.detail)
        return None
    apis = {}
    for line in desc_lines:
        try:
            api = json.loads(line)
        except json.JSONDecodeError as e:
            result.reject(file, index, "api_description_not_json", f"{e.msg}: {line[:120]}")
            return None
        if isinstance(api, dict):
            api = {_API_KEYS.get(k, k): v for k, v in api.items()}
        if not (isinstance(api, dict) and isinstance(api.get("name"), str)):
            result.reject(file, index, "api_description_invalid", f"expected an object with a name: {line[:120]}")
            return None
        apis[api["name"]] = api
    tools = [api_to_tool(api, where) for api in apis.values()]

    messages = []
    year = _YEAR.search(head)
    if year:
        messages.append({"role": "system", "content": year.group(0)})
    else:
        notes["no_current_year"] += 1
    lines = dialogue.rstrip("\n").split("\n")
    if lines and lines[-1].strip() == _MARKER:
        lines.pop()
    calls = []  # (assistant message, parsed args) typed once all tools are known
    for n, line in enumerate(lines, 1):
        speaker, sep, text = line.partition(": ")
        if line.startswith("API-Request:"):
            try:
                (name, args, _), output = _split_request_line(line)
            except CallSyntaxError as e:
                result.reject(file, index, "dialogue_call_unparsed", f"line {n}: {e}: {line[:120]}")
                return None
            call_id = f"call_{len(calls)}"
            msg = {"role": "assistant", "content": "",
                   "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": {}}}]}
            messages += [msg, {"role": "tool", "tool_call_id": call_id, "name": name, "content": output}]
            calls.append((msg, args))
            if name == "ToolSearcher" and offer_retrieved:
                found = _retrieved_apis(output, notes)
                if found is None:
                    notes["toolsearcher_result_unparsed"] += 1
                for api in found or []:
                    if not isinstance(api.get("input_parameters") or {}, dict):
                        notes["toolsearcher_result_invalid_api"] += 1  # e.g. {'none'}: a set, not parameters
                        continue
                    if api["name"] not in apis:
                        apis[api["name"]] = api
                        tools.append(api_to_tool(api, f"{where} line {n}"))
                        notes["tools_from_toolsearcher_results"] += 1
        elif sep and speaker in _SPEAKERS:
            messages.append({"role": _SPEAKERS[speaker], "content": text})
        else:
            result.reject(file, index, "dialogue_line_unparsed", f"line {n}: no User:/AI:/API-Request: prefix: "
                                                                  f"{line[:120]!r}")
            return None
    for msg, args in calls:
        fn = msg["tool_calls"][0]["function"]
        fn["arguments"] = typed_arguments(args, apis.get(fn["name"]))
        if fn["name"] not in apis:
            notes["dialogue_call_tool_not_offered"] += 1

    try:
        name, args, unwrapped = parse_api_request(expected)
    except CallSyntaxError as e:
        result.reject(file, index, "gold_unparsed", f"{e}: {expected[:160]}")
        return None
    if unwrapped:
        notes["quoted_literal_unwrapped"] += 1
    if name not in apis:
        notes["gold_tool_not_offered"] += 1
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        notes["dialogue_ends_with_assistant_text"] += 1
    return {"id": f"{BENCHMARK}/{subset}/{index}", "benchmark": BENCHMARK, "subset": subset,
            "messages": messages, "tools": tools,
            "gold": [{"name": name, "arguments": typed_arguments(args, apis.get(name), notes)}]}


def load(root: Path, offer_retrieved: bool = True) -> SourceResult:
    """Convert every subset under `root` (the API-Bank raw folder); notes are keyed `<subset>/<counter>`."""
    result = SourceResult()
    for subset, (rel, layout) in SUBSETS.items():
        notes = Counter()
        file = Path(root) / rel
        if not file.is_file():
            raise InputError(f"{file}: API-Bank {subset} file not found (the raw folder's README names its origin)")
        records = read_json(file)
        if not isinstance(records, list):
            raise InputError(f"{file}: expected a JSON list of records, got {type(records).__name__}")
        for index, rec in enumerate(records):
            if not isinstance(rec, dict):
                result.reject(file, index, "not_an_object", f"got {type(rec).__name__}")
                continue
            request = convert_record(rec, file, index, subset, result, notes, offer_retrieved, layout)
            if request is not None:
                result.requests.append(request)
                notes["requests"] += 1
        result.notes.update({f"{subset}/{key}": n for key, n in notes.items()})
    return result
