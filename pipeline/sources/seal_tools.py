"""Seal-Tools test sets -> canonical requests (subsets test_in_domain / test_out_domain, id "seal_tools/<subset>/<n>").

Files under the raw folder (README.md there): `test_<subset>.jsonl` ({"id", "query", "calling"}),
`dataset_for_finetune/test_<subset>.json` (the same examples in chat form; the human turn holds the example's
candidate tools as a Python literal `api_list = [...]`) and `tool.jsonl` (the full tool catalog).

Per example:
  - messages: the `query` as one user message;
  - tools: the example's `api_list` (5 candidates), matched by id. Its entries are complete tool docs, identical to
    the catalog's (checked: `api_list_entry_differs_from_catalog` / `api_list_entry_not_in_catalog` count exceptions);
  - gold: the `calling` list in order, {"name": api, "arguments": parameters}; `responses` (output names) dropped.
    A value "API_call_<k>" stands for the output of an earlier call: kept raw, counted (`api_call_ref_values`,
    `requests_with_api_call_refs`). A gold call naming a tool outside the candidate list is kept as it is and the
    request emitted (`gold_tool_not_offered`, and `gold_tool_not_in_catalog` when the catalog lacks it too): the
    data stage's gold validation reports it as an unknown tool.

Parameter dialect -> JSON Schema: str/int/float/bool -> string/integer/number/boolean, `required` kept, `default`
kept, `choices` -> `enum`, `examples` / `example` / `example_values` -> `examples` (a list; a single value becomes a
one-element list), `unit` kept as an annotation. Any other key is dropped and counted (`schema_key_dropped:<key>`);
a type outside TYPE_MAP raises InputError naming file, record and type.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from ..io import InputError, iter_jsonl, read_json, where
from . import SourceResult

BENCHMARK = "seal_tools"
SUBSETS = ("test_in_domain", "test_out_domain")
TYPE_MAP = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
EXAMPLE_KEYS = ("examples", "example", "example_values")
API_LIST = re.compile(r"api_list = (\[.*\])\ntask_instruction = ", re.S)
TASK = re.compile(r'task_instruction = "(.*)"\nOutput:\n?$', re.S)
CALL_REF = re.compile(r"API_call_\d+")


# ---------------------------------------------------------------- tools

def convert_param(spec: Any, file: Path, record: str, path: str, notes) -> dict:
    if not isinstance(spec, dict):
        raise InputError(f"{where(file, record=record)}: parameter {path} is {type(spec).__name__}; expected an object")
    seal_type = spec.get("type")
    if seal_type not in TYPE_MAP:
        raise InputError(f"{where(file, record=record)}: parameter {path} has unknown type {seal_type!r}; "
                         f"expected one of {sorted(TYPE_MAP)}")
    out: dict = {"type": TYPE_MAP[seal_type]}
    if "description" in spec:
        out["description"] = spec["description"]
    if "default" in spec:
        out["default"] = spec["default"]
    if "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list):
            raise InputError(f"{where(file, record=record)}: {path}.choices is {choices!r}; expected a list")
        out["enum"] = list(choices)
    examples = []
    for key in EXAMPLE_KEYS:
        if key in spec:
            v = spec[key]
            examples.extend(v if isinstance(v, list) else [v])
    if examples:
        out["examples"] = examples
    if "unit" in spec:
        out["unit"] = spec["unit"]
    for key in spec:
        if key not in ("type", "description", "default", "choices", "unit", *EXAMPLE_KEYS):
            notes[f"schema_key_dropped:{key}"] += 1
    return out


def convert_tool(entry: Any, file: Path, record: str, notes) -> dict:
    """A Seal-Tools tool doc (api_list entry or catalog line) -> OpenAI tool."""
    if (not isinstance(entry, dict) or not isinstance(entry.get("api_name"), str)
            or not isinstance(entry.get("parameters"), dict)):
        raise InputError(f"{where(file, record=record)}: tool entry {str(entry)[:80]!r}; expected an object with "
                         "a string 'api_name' and an object 'parameters'")
    name = entry["api_name"]
    props = {p: convert_param(s, file, record, f"{name}.{p}", notes) for p, s in entry["parameters"].items()}
    schema: dict = {"type": "object", "properties": props}
    required = entry.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise InputError(f"{where(file, record=record)}: {name}.required is {required!r}; expected a list of names")
    if required:
        schema["required"] = list(required)
    notes["required_not_in_properties"] += sum(r not in props for r in required)
    return {"type": "function", "function": {"name": name, "description": entry.get("api_description", ""),
                                             "parameters": schema}}


def parse_candidates(example: Any, file: Path, record: str) -> tuple[list[dict], str | None, str]:
    """(api_list, task_instruction or None, gpt answer text) from one dataset_for_finetune example."""
    conv = example.get("conversations") if isinstance(example, dict) else None
    if not isinstance(conv, list) or len(conv) < 2 or not all(isinstance(t, dict) for t in conv):
        raise InputError(f"{where(file, record=record)}: expected 'conversations' with a human and a gpt turn")
    human = conv[0].get("value", "")
    m = API_LIST.search(human) if isinstance(human, str) else None
    if m is None:
        raise InputError(f"{where(file, record=record)}: human turn has no 'api_list = [...]' before "
                         "'task_instruction = '")
    try:
        api_list = ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError) as e:
        raise InputError(f"{where(file, record=record)}: api_list is not a Python literal ({e})") from e
    if not isinstance(api_list, list):
        raise InputError(f"{where(file, record=record)}: api_list is {type(api_list).__name__}; expected a list")
    task = TASK.search(human[m.end() - len("task_instruction = "):])
    return api_list, (task.group(1) if task else None), conv[1].get("value", "")


# ---------------------------------------------------------------- gold

def count_refs(value: Any) -> int:
    """How many values inside `value` are exactly an earlier call's output name ("API_call_<k>")."""
    if isinstance(value, str):
        return 1 if CALL_REF.fullmatch(value) else 0
    if isinstance(value, dict):
        return sum(count_refs(v) for v in value.values())
    if isinstance(value, list):
        return sum(count_refs(v) for v in value)
    return 0


def convert_calling(calling: Any, file: Path, record: str) -> list[dict]:
    if not isinstance(calling, list) or not calling:
        raise InputError(f"{where(file, record=record)}: 'calling' is {str(calling)[:60]!r}; expected a non-empty list")
    gold = []
    for call in calling:
        if not isinstance(call, dict) or not isinstance(call.get("api"), str) or not isinstance(call.get("parameters"),
                                                                                                 dict):
            raise InputError(f"{where(file, record=record)}: call {str(call)[:80]!r}; expected "
                             "{api: string, parameters: object, responses: [...]}")
        gold.append({"name": call["api"], "arguments": call["parameters"]})
    return gold


# ---------------------------------------------------------------- records

def load_catalog(path: Path) -> dict[str, dict]:
    catalog = {}
    for lineno, row in iter_jsonl(path):
        name = row.get("api_name")
        if not isinstance(name, str) or name in catalog:
            raise InputError(f"{where(path, lineno)}: api_name {name!r}; expected a unique string")
        catalog[name] = row
    return catalog


def load_subset(result: SourceResult, root: Path, subset: str, catalog: dict[str, dict]) -> None:
    """Append one test set's requests and notes to `result`."""
    notes = result.notes
    jl_file = root / f"{subset}.jsonl"
    ft_file = root / "dataset_for_finetune" / f"{subset}.json"
    examples = read_json(ft_file)
    if not isinstance(examples, list):
        raise InputError(f"{ft_file}: expected a JSON list of examples, got {type(examples).__name__}")
    by_id: dict[str, tuple[int, dict]] = {}
    for i, ex in enumerate(examples):
        rid = ex.get("id") if isinstance(ex, dict) else None
        if not isinstance(rid, str) or rid in by_id:
            raise InputError(f"{where(ft_file, record=f'#{i}')}: id {rid!r}; expected a unique string id")
        by_id[rid] = (i, ex)
    prefix = f"{subset}-"
    for n, (lineno, row) in enumerate(iter_jsonl(jl_file)):
        rid = row.get("id")
        if not isinstance(rid, str) or not rid.startswith(prefix) or not isinstance(row.get("query"), str):
            raise InputError(f"{where(jl_file, lineno)}: expected {{id: '{prefix}<n>', query: string, calling: [...]}}")
        if rid not in by_id:
            result.reject(jl_file, rid, "no_candidate_list", f"{rid} is not in {ft_file}")
            continue
        index, example = by_id[rid]
        notes["finetune_order_differs"] += index != n
        api_list, task, answer = parse_candidates(example, ft_file, rid)
        notes["query_differs_from_finetune"] += task is not None and task != row["query"]
        for entry in api_list:
            name = entry.get("api_name") if isinstance(entry, dict) else None
            if name not in catalog:
                notes["api_list_entry_not_in_catalog"] += 1
            elif catalog[name] != entry:
                notes["api_list_entry_differs_from_catalog"] += 1
        tools = [convert_tool(entry, ft_file, rid, notes) for entry in api_list]
        gold = convert_calling(row.get("calling"), jl_file, rid)
        try:
            notes["finetune_gold_differs"] += ast.literal_eval(answer) != row["calling"]
        except (ValueError, SyntaxError):
            notes["finetune_gold_unparseable"] += 1
        offered = {t["function"]["name"] for t in tools}
        for call in gold:
            if call["name"] not in offered:
                notes["gold_tool_not_offered"] += 1
                notes["gold_tool_not_in_catalog"] += call["name"] not in catalog
        refs = sum(count_refs(c["arguments"]) for c in gold)
        notes["api_call_ref_values"] += refs
        notes["requests_with_api_call_refs"] += refs > 0
        notes["multi_call_requests"] += len(gold) > 1
        result.requests.append({
            "id": f"{BENCHMARK}/{subset}/{rid[len(prefix):]}",
            "benchmark": BENCHMARK,
            "subset": subset,
            "messages": [{"role": "user", "content": row["query"]}],
            "tools": tools,
            "gold": gold,
        })


def load(root: Path, subsets: tuple[str, ...] = SUBSETS) -> SourceResult:
    root = Path(root)
    result = SourceResult()
    catalog = load_catalog(root / "tool.jsonl")
    for subset in subsets:
        load_subset(result, root, subset, catalog)
    result.notes = +result.notes  # drop zero counters
    return result
