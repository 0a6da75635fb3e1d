"""ToolAlpaca converter: real eval records, OpenAPI -> JSON Schema rules, gold policy, errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from pipeline.io import InputError
from pipeline.schema import find_tool, schema_errors
from pipeline.sources import raw_data_root, toolalpaca
from pipeline.sources.toolalpaca import convert_schema, gold_from_steps

ROOT = raw_data_root() / "toolalpaca"
needs_data = pytest.mark.skipif(not (ROOT / "eval_real.json").is_file(),
                                reason=f"ToolAlpaca raw data not found at {ROOT}")


@pytest.fixture(scope="module")
def converted():
    return toolalpaca.load(ROOT)


@pytest.fixture(scope="module")
def by_id(converted):
    return {r["id"]: r for r in converted.requests}


def tool(request: dict, name: str) -> dict:
    return request["tools"][find_tool(request["tools"], name)]["function"]


# ---- real data ----

@needs_data
def test_counts_ids_and_single_user_turn(converted):
    subsets = Counter(r["subset"] for r in converted.requests)
    assert subsets == {"eval_simulated": 100, "eval_real": 114} and converted.rejects == []
    assert [r["id"] for r in converted.requests][:2] == ["toolalpaca/eval_simulated/0", "toolalpaca/eval_simulated/1"]
    assert converted.requests[100]["id"] == "toolalpaca/eval_real/0"
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" and "split" not in r
               for r in converted.requests)


@needs_data
def test_every_schema_is_valid_json_schema(converted):
    for r in converted.requests:
        for t in r["tools"]:
            assert schema_errors(t["function"]["parameters"]) == [], (r["id"], t["function"]["name"])


@needs_data
def test_enum_query_parameters_exactly(by_id):
    r = by_id["toolalpaca/eval_simulated/1"]
    assert r["messages"][0]["content"].startswith("I'm looking for an axolotl that is wild in color")
    assert [t["function"]["name"] for t in r["tools"]] == ["getRandomAxolotlImage", "searchAxolotlImages",
                                                           "getAxolotlFacts"]
    assert tool(r, "getRandomAxolotlImage")["parameters"] == {"type": "object", "properties": {},
                                                              "additionalProperties": False}
    assert tool(r, "searchAxolotlImages")["parameters"] == {"type": "object", "properties": {
        "color": {"type": "string", "enum": ["wild", "leucistic", "albino"],
                  "description": "The color of the axolotl (e.g., 'wild', 'leucistic', 'albino', etc.)"},
        "gender": {"type": "string", "enum": ["male", "female"],
                   "description": "The gender of the axolotl ('male', 'female')"},
        "size": {"type": "string", "enum": ["small", "medium", "large"],
                 "description": "The size of the axolotl ('small', 'medium', 'large')"},
        "page": {"type": "integer", "description": "The page number for pagination purposes"}},
        "additionalProperties": False}
    # "" means "not given" in the source; kept as written (the data stage counts it against the enum)
    assert r["gold"] == [{"name": "searchAxolotlImages",
                          "arguments": {"color": "wild", "gender": "", "size": "medium", "page": 1}}]


@needs_data
def test_nested_request_body_and_placeholder_kept_raw(by_id, converted):
    r = by_id["toolalpaca/eval_simulated/47"]
    assert tool(r, "createRole")["parameters"] == {"type": "object", "properties": {
        "accessToken": {"type": "string", "description": "The access token for the authenticated user."},
        "roleName": {"type": "string", "description": "The name of the new role."},
        "permissions": {"type": "array", "items": {"type": "object", "properties": {
            "permissionId": {"type": "string", "description": "The unique identifier for the permission."},
            "permissionName": {"type": "string", "description": "The name of the permission."}}},
            "description": "A list of permission objects to be associated with the new role."}},
        "required": ["accessToken", "roleName"], "additionalProperties": False}
    assert r["gold"][0]["arguments"]["permissions"][0] == {"permissionId": "edit_content",
                                                            "permissionName": "${string}"}
    assert converted.notes["eval_simulated/gold_placeholder_values"] == 1


@needs_data
def test_request_body_ref_is_inlined(by_id):
    r = by_id["toolalpaca/eval_simulated/86"]
    assert tool(r, "createDashboard")["parameters"]["properties"]["charts"] == {
        "type": "array", "items": {"type": "string"},
        "description": "A list of charts to be included in the dashboard initially"}
    assert "$ref" not in json.dumps(r["tools"])


@needs_data
def test_real_api_named_by_projection_with_path_parameters(by_id):
    r = by_id["toolalpaca/eval_real/4"]
    assert tool(r, "LongWeekendLongWeekend")["parameters"] == {"type": "object", "properties": {
        "year": {"type": "integer", "format": "int32"},
        "countryCode": {"type": "string", "description": "Two-character represented country code. For instance, CN "
                                                         "or cn represents China."}},
        "required": ["year", "countryCode"], "additionalProperties": False}
    assert r["gold"] == [{"name": "LongWeekendLongWeekend", "arguments": {"year": 2024, "countryCode": "US"}}]


@needs_data
def test_gold_policy_counters_match_requests(converted, by_id):
    notes = converted.notes
    assert notes["eval_simulated/action_input_not_json_all_steps"] == 32  # README: 32 simulated + 4 real
    assert notes["eval_real/action_input_not_json_all_steps"] == 4
    assert by_id["toolalpaca/eval_simulated/19"]["gold"] == []  # first step is getDetails (ask the user)
    assert by_id["toolalpaca/eval_real/107"]["gold"] == []  # '"symbols": "symbols": [...]' is not JSON
    for subset in ("eval_simulated", "eval_real"):
        reqs = [r for r in converted.requests if r["subset"] == subset]
        empty = sum(1 for r in reqs if not r["gold"])
        assert empty == notes[f"{subset}/gold_first_step_getDetails"] + notes[f"{subset}/gold_action_input_not_json"]
        unoffered = sum(1 for r in reqs if r["gold"] and find_tool(r["tools"], r["gold"][0]["name"]) is None)
        assert unoffered == notes[f"{subset}/gold_tool_not_offered"]
    assert by_id["toolalpaca/eval_real/31"]["gold"][0]["name"] == "vatsim_pilots_get"  # mis-nested, never offered


# ---- rules ----

def test_convert_schema_openapi_30_keywords():
    notes = Counter()
    ref = "#/components/schemas/"
    doc = {"components": {"schemas": {
        "Pet": {"type": "object", "properties": {"tag": {"$ref": ref + "Tag"}}},
        "Tag": {"type": "string", "nullable": True, "example": "cute", "xml": {}},
        "Loop": {"type": "object", "properties": {"next": {"$ref": ref + "Loop"}}}}}}
    assert convert_schema({"$ref": "#/components/schemas/Pet"}, doc, "w", notes) == {
        "type": "object", "properties": {"tag": {"type": ["string", "null"], "examples": ["cute"]}}}
    assert notes == {"schema_keyword_dropped:xml": 1}
    assert convert_schema({"type": "integer", "minimum": 0, "exclusiveMinimum": True}, doc, "w", notes) == {
        "type": "integer", "exclusiveMinimum": 0}
    with pytest.raises(InputError, match="recursive"):
        convert_schema({"$ref": "#/components/schemas/Loop"}, doc, "w", notes)
    with pytest.raises(InputError, match="does not resolve"):
        convert_schema({"$ref": "#/components/schemas/Nope"}, doc, "w", notes)


def test_gold_from_steps_rules():
    notes = Counter()
    names = {"search"}
    assert gold_from_steps([{"Action": "getDetails", "Action_Input": '{"Question": "which?"}'},
                            {"Action": "search", "Action_Input": '{"q": ${q from getDetails}}'}], names, notes) == []
    assert gold_from_steps([{"Action": "search", "Action_Input": '{"q": ${x}}'}], names, notes) == []
    assert gold_from_steps([{"Action": "search", "Action_Input": '{"q": "a, \\"b\\""}'}], names, notes) == [
        {"name": "search", "arguments": {"q": 'a, "b"'}}]
    assert notes == {"action_input_not_json_all_steps": 2, "gold_later_steps_dropped": 1,
                     "gold_first_step_getDetails": 1, "gold_action_input_not_json": 1,
                     "gold_action_input_not_json_with_placeholder": 1}


# ---- malformed input (a tiny raw folder built from a real-shaped API) ----

API = {"Name": "Pets", "Documentation": json.dumps({"openapi": "3.0.0", "paths": {"/pets/{id}": {"get": {
    "operationId": "getPet", "description": "Get a pet.",
    "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]}}}}),
       "Function_Projection": {"getPet": ["/pets/{id}", "get"]},
       "Instructions": ["Show pet 7.", "Show pet 8."],
       "Golden_Answers": [[{"Action": "getPet", "Action_Input": '{"id": "7"}'}]]}


def _write_root(tmp_path: Path, simulated: list) -> Path:
    (tmp_path / "eval_simulated.json").write_text(json.dumps(simulated))
    (tmp_path / "eval_real.json").write_text("[]")
    return tmp_path


def test_small_api_converts_and_unpaired_instruction_is_rejected(tmp_path):
    result = toolalpaca.load(_write_root(tmp_path, [API]))
    assert [r["gold"] for r in result.requests] == [[{"name": "getPet", "arguments": {"id": "7"}}]]
    assert result.requests[0]["tools"][0]["function"]["parameters"]["required"] == ["id"]
    assert [(r["record"], r["reason"]) for r in result.rejects] == [("API 0 'Pets' instruction 1", "no_golden_answer")]


def test_unknown_type_raises_naming_file_api_operation_and_type(tmp_path):
    bad = dict(API, Documentation=API["Documentation"].replace('"type": "string"', '"type": "file"'))
    with pytest.raises(InputError) as e:
        toolalpaca.load(_write_root(tmp_path, [bad]))
    msg = str(e.value)
    assert "eval_simulated.json (API 0 'Pets')" in msg and "getPet" in msg and "'file'" in msg


def test_malformed_documentation_raises(tmp_path):
    with pytest.raises(InputError, match="Documentation is not an OpenAPI JSON string"):
        toolalpaca.load(_write_root(tmp_path, [dict(API, Documentation="{oops")]))
