"""BFCL v4 single-turn AST categories -> canonical requests (subset = category, id "bfcl/<category>/<n>").

Where a category comes from: `<root>/BFCL_v4_<cat>.json` + `<root>/possible_answer/BFCL_v4_<cat>.json` when the raw
folder has it, else the same two files inside the installed `bfcl-eval` package (`pip install --no-deps bfcl-eval`),
else one counted reject `category_missing` naming both places. Notes `<cat>:from_data_dir` / `<cat>:from_package`
count the records read from each place; `category_origins(root)` says the same without loading.

Files are JSON Lines despite the .json suffix. Messages are the first (only) turn of `question`, system roles kept.

Parameter dialect -> JSON Schema (TYPE_MAP). Python categories use dict/float/tuple/any; Java and JavaScript use their
language's names (String, long, HashMap, Array, Boolean, ...). Every name maps to the JSON type of the value the
possible answers hold for it (booleans, numbers, lists, objects), not to BFCL's prompt-time "everything is a string"
rendering. `any` (and an empty type) -> no type constraint. Nested `properties` / `items`, `enum`, `default`,
`required`, `format` and bounds are kept; BFCL's `optional` markers are dropped (counted), descriptions untouched.
An `enum` of scalars on an array (BFCL's way to list the allowed items) moves to `items` (`array_enum_moved_to_items`).
A type outside TYPE_MAP raises InputError naming file, record and type. Tool names are kept as given even where they
fall outside OpenAI's [a-zA-Z0-9_-] (counted: `tool_name_outside_openai_charset`).

Gold. `gold_accept` is BFCL's `ground_truth` as [{"name", "arguments": {arg: [acceptable values]}}], values raw ("" =
the argument may be omitted; a dict value whose entries are all lists is itself {key: [acceptable values]}).
`gold` is one canonical call per ground-truth call, argument by argument:
  - the first acceptable value that is neither "" nor null (dicts and dicts inside lists resolved the same way);
  - none such and "" acceptable -> the argument is omitted (`gold_arg_omitted`; ["", null] is counted there too,
    as passing null and leaving the argument out mean the same default);
  - only null acceptable -> null (`gold_arg_null`); an empty list -> omitted (`gold_arg_no_acceptable_value`).
Gold that then fails its schema is kept: the data stage validates and counts it.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

from ..io import InputError, iter_jsonl, where
from . import SourceResult

BENCHMARK = "bfcl"
CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple",
              "simple_java", "simple_javascript")
PACKAGE = "bfcl_eval"
INSTALL_HINT = "pip install --no-deps bfcl-eval"

# BFCL type name -> JSON Schema type; None = no type constraint. Python dialect, then Java, then JavaScript names
# (bfcl_eval/constants/type_mappings.py lists the same names; it renders `any` as string for prompting).
TYPE_MAP: dict[str, str | None] = {
    "string": "string", "integer": "integer", "number": "number", "float": "number", "boolean": "boolean",
    "bool": "boolean", "array": "array", "list": "array", "tuple": "array", "dict": "object", "object": "object",
    "any": None, "": None,
    "String": "string", "char": "string", "byte": "integer", "short": "integer", "long": "integer",
    "double": "number", "Array": "array", "ArrayList": "array", "Queue": "array", "Stack": "array", "Set": "array",
    "HashMap": "object", "Hashtable": "object", "Any": None,
    "Boolean": "boolean", "Bigint": "integer",
}
# JSON Schema keywords copied as they are (the structural ones, properties/items/required, are handled apart)
KEEP_KEYS = ("description", "enum", "default", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
             "minItems", "maxItems", "minLength", "maxLength", "pattern", "const", "examples", "title")
OPENAI_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


# ---------------------------------------------------------------- where the files are

def package_data_dir() -> Path | None:
    """`bfcl_eval/data` of the installed package, found without importing it; None when not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def category_files(root: Path, category: str) -> tuple[Path, Path, str] | None:
    """(question file, answer file, origin) for a category; origin is "data_dir" or "package"; None if neither."""
    name = f"BFCL_v4_{category}.json"
    places = [(Path(root), "data_dir")]
    pkg = package_data_dir()
    if pkg is not None:
        places.append((pkg, "package"))
    for base, origin in places:
        if (base / name).is_file() and (base / "possible_answer" / name).is_file():
            return base / name, base / "possible_answer" / name, origin
    return None


def category_origins(root: Path) -> dict[str, str]:
    """Category -> "data_dir" | "package" | "missing", for the data stage's report."""
    return {c: (f[2] if (f := category_files(root, c)) else "missing") for c in CATEGORIES}


# ---------------------------------------------------------------- schema

def convert_schema(node: Any, file: Path, record: str, path: str, notes) -> dict:
    """One BFCL parameter node -> JSON Schema, recursively through `properties` and `items`."""
    if not isinstance(node, dict):
        raise InputError(f"{where(file, record=record)}: parameter {path} is {type(node).__name__}; expected an object")
    bfcl_type = node.get("type", "")
    if not isinstance(bfcl_type, str) or bfcl_type not in TYPE_MAP:
        raise InputError(f"{where(file, record=record)}: parameter {path} has unknown type {bfcl_type!r}; "
                         f"expected one of {sorted(t for t in TYPE_MAP if t)}")
    out: dict = {}
    json_type = TYPE_MAP[bfcl_type]
    if json_type is not None:
        out["type"] = json_type
    else:
        notes["untyped_param" if bfcl_type.lower() == "any" else "empty_type_untyped_param"] += 1
    if bfcl_type == "Set":
        out["uniqueItems"] = True
    for key in KEEP_KEYS:
        if key in node:
            out[key] = node[key]
    if "properties" in node:
        props = node["properties"]
        if not isinstance(props, dict):
            raise InputError(f"{where(file, record=record)}: {path}.properties is {type(props).__name__}; "
                             "expected an object")
        out["properties"] = {k: convert_schema(v, file, record, f"{path}.{k}", notes) for k, v in props.items()}
    if "items" in node:
        out["items"] = convert_schema(node["items"], file, record, f"{path}[]", notes)
    if (json_type == "array" and isinstance(out.get("enum"), list) and isinstance(out.get("items"), dict)
            and "enum" not in out["items"] and not any(isinstance(v, (list, dict)) for v in out["enum"])):
        # BFCL writes the allowed ITEM values on the array itself; as JSON Schema no array could ever match
        out["items"]["enum"] = out.pop("enum")
        notes["array_enum_moved_to_items"] += 1
    if "required" in node:
        required = node["required"]
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise InputError(f"{where(file, record=record)}: {path}.required is {required!r}; expected a list of names")
        out["required"] = list(required)
        missing = [r for r in required if r not in out.get("properties", {})]
        notes["required_not_in_properties"] += len(missing)
    if "optional" in node:
        notes["optional_marker_dropped"] += 1
    for key in node:
        if key not in KEEP_KEYS and key not in ("type", "properties", "items", "required", "optional"):
            notes[f"schema_key_dropped:{key}"] += 1
    return out


def convert_function(fn: Any, file: Path, record: str, notes) -> dict:
    """A BFCL function doc -> OpenAI tool {"type": "function", "function": {name, description, parameters}}."""
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("parameters"), dict):
        raise InputError(f"{where(file, record=record)}: function entry {str(fn)[:80]!r}; expected an object with "
                         "a string 'name' and an object 'parameters'")
    name = fn["name"]
    params = fn["parameters"]
    if params.get("type") not in ("dict", "object"):
        raise InputError(f"{where(file, record=record)}: parameters of {name} have type {params.get('type')!r}; "
                         "expected 'dict'")
    schema = convert_schema(params, file, record, name, notes)
    schema.setdefault("properties", {})
    if not OPENAI_NAME.fullmatch(name):
        notes["tool_name_outside_openai_charset"] += 1
    return {"type": "function", "function": {"name": name, "description": fn.get("description", ""),
                                             "parameters": schema}}


# ---------------------------------------------------------------- gold

_OMIT = object()  # marker: the canonical call leaves this argument out


def _is_accept_dict(value: Any) -> bool:
    """BFCL writes dict answers as {key: [acceptable values]}; a dict with any non-list entry is a plain value."""
    return isinstance(value, dict) and all(isinstance(v, list) for v in value.values())


def canonical_value(value: Any, notes) -> Any:
    """A plain value from one acceptable answer: resolve per-key acceptable lists inside dicts (and lists of dicts)."""
    if isinstance(value, dict):
        if not _is_accept_dict(value):
            notes["gold_plain_dict"] += 1
            return value
        out = {}
        for k, accepted in value.items():
            v = pick(accepted, notes)
            if v is not _OMIT:
                out[k] = v
        return out
    if isinstance(value, list):
        return [canonical_value(v, notes) for v in value]
    return value


def pick(accepted: list, notes) -> Any:
    """The canonical value among BFCL's acceptable values (rule in the module docstring); _OMIT to leave it out."""
    for v in accepted:
        if v != "" and v is not None:
            return canonical_value(v, notes)
    if "" in accepted:
        notes["gold_arg_omitted"] += 1
        return _OMIT
    if accepted:  # only null
        notes["gold_arg_null"] += 1
        return None
    notes["gold_arg_no_acceptable_value"] += 1
    return _OMIT


def convert_ground_truth(ground_truth: Any, tools: list[dict], file: Path, record: str, notes):
    """BFCL ground_truth [{func: {arg: [acceptable]}}] -> (gold, gold_accept)."""
    if not isinstance(ground_truth, list):
        raise InputError(f"{where(file, record=record)}: ground_truth is {type(ground_truth).__name__}; expected a list")
    offered = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    gold, accept = [], []
    for call in ground_truth:
        if not isinstance(call, dict) or len(call) != 1:
            raise InputError(f"{where(file, record=record)}: ground-truth call {str(call)[:80]!r}; expected "
                             "{function name: {argument: [acceptable values]}}")
        (name, args), = call.items()
        if not isinstance(args, dict) or not all(isinstance(v, list) for v in args.values()):
            raise InputError(f"{where(file, record=record)}: ground-truth arguments of {name} must map each argument "
                             f"to a list of acceptable values, got {str(args)[:80]!r}")
        if name not in offered:
            notes["gold_call_tool_not_offered"] += 1
        props = offered.get(name, {}).get("properties", {})
        arguments = {}
        for arg, accepted in args.items():
            if name in offered and arg not in props:
                notes["gold_arg_not_in_schema"] += 1
            v = pick(accepted, notes)
            if v is not _OMIT:
                arguments[arg] = v
        gold.append({"name": name, "arguments": arguments})
        accept.append({"name": name, "arguments": args})
    return gold, accept


# ---------------------------------------------------------------- records

def local_id(category: str, source_id: Any, file: Path) -> str:
    prefix = f"{category}_"
    if not isinstance(source_id, str) or not source_id.startswith(prefix) or len(source_id) == len(prefix):
        raise InputError(f"{where(file, record=str(source_id))}: id {source_id!r}; expected '{prefix}<n>'")
    return source_id[len(prefix):]


def convert_messages(question: Any, file: Path, record: str) -> list[dict]:
    """The first turn of `question` as OpenAI chat messages (roles system/user/assistant kept as given)."""
    if not isinstance(question, list) or not question or not isinstance(question[0], list):
        raise InputError(f"{where(file, record=record)}: question {str(question)[:80]!r}; expected a list of turns, "
                         "each a list of {role, content}")
    messages = []
    for m in question[0]:
        if (not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant")
                or not isinstance(m.get("content"), str)):
            raise InputError(f"{where(file, record=record)}: message {str(m)[:80]!r}; expected "
                             "{role: system|user|assistant, content: string}")
        messages.append({"role": m["role"], "content": m["content"]})
    return messages


def load_category(result: SourceResult, root: Path, category: str) -> None:
    """Append one category's requests, rejects and notes to `result`."""
    files = category_files(root, category)
    if files is None:
        name = f"BFCL_v4_{category}.json"
        pkg = package_data_dir()
        result.reject(Path(root) / name, "*", "category_missing",
                      f"{name} (+ possible_answer/{name}) is neither in {root} nor in an installed {PACKAGE} package "
                      f"({pkg if pkg else 'not installed'}); install it with `{INSTALL_HINT}`")
        return
    q_file, a_file, origin = files
    answers: dict[str, Any] = {}
    for lineno, row in iter_jsonl(a_file):
        rid = row.get("id")
        if not isinstance(rid, str) or rid in answers:
            raise InputError(f"{where(a_file, lineno)}: id {rid!r}; expected a unique string id")
        answers[rid] = row.get("ground_truth")
    seen = set()
    n_read = 0
    for lineno, row in iter_jsonl(q_file):
        n_read += 1
        rid = row.get("id")
        local = local_id(category, rid, q_file)
        seen.add(rid)
        if rid not in answers:
            result.reject(q_file, rid, "no_answer", f"no ground truth for {rid} in {a_file}")
            continue
        question = row.get("question")
        if isinstance(question, list) and len(question) > 1:
            result.reject(q_file, rid, "multi_turn", f"{len(question)} turns; a single-turn category has one")
            continue
        functions = row.get("function")
        if not isinstance(functions, list) or not functions:
            raise InputError(f"{where(q_file, lineno, rid)}: 'function' is {str(functions)[:60]!r}; "
                             "expected a non-empty list of function docs")
        tools = [convert_function(fn, q_file, rid, result.notes) for fn in functions]
        gold, accept = convert_ground_truth(answers[rid], tools, a_file, rid, result.notes)
        result.requests.append({
            "id": f"{BENCHMARK}/{category}/{local}",
            "benchmark": BENCHMARK,
            "subset": category,
            "messages": convert_messages(question, q_file, rid),
            "tools": tools,
            "gold": gold,
            "gold_accept": accept,
        })
    result.notes["answer_without_question"] += len(set(answers) - seen)
    result.notes[f"{category}:from_{origin}"] += n_read


def load(root: Path, categories: tuple[str, ...] = CATEGORIES) -> SourceResult:
    result = SourceResult()
    for category in categories:
        load_category(result, Path(root), category)
    result.notes = +result.notes  # drop zero counters
    return result
