"""API-Bank converter: real records from the shared data folder (test and training data), call parsing, typing,
rejects and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.io import InputError
from pipeline.schema import find_tool, schema_errors
from pipeline.sources import api_bank, raw_data_root
from pipeline.sources.api_bank import CallSyntaxError, parse_api_request, param_schema, type_value

ROOT = raw_data_root() / "api_bank"
needs_data = pytest.mark.skipif(not (ROOT / "test-data").is_dir(), reason=f"API-Bank raw data not found at {ROOT}")


@pytest.fixture(scope="module")
def converted():
    return api_bank.load(ROOT)


@pytest.fixture(scope="module")
def by_id(converted):
    return {r["id"]: r for r in converted.requests}


# ---- real data ----

@needs_data
def test_counts_and_ids(converted):
    subsets = [r["subset"] for r in converted.requests]
    assert subsets.count("level-1") == 399 and subsets.count("level-2") == 135
    assert all(r["file"].endswith("training-data/lv3-api-train.json") for r in converted.rejects)  # test data: none
    assert converted.notes["level-1/requests"] == 399 and converted.notes["level-2/requests"] == 135
    ids = [r["id"] for r in converted.requests]
    assert len(set(ids)) == len(ids) and ids[17] == "api_bank/level-1/17" and ids[399] == "api_bank/level-2/0"
    assert all("split" not in r and r["benchmark"] == "api_bank" for r in converted.requests)


@needs_data
def test_every_schema_is_valid_json_schema(converted):
    for r in converted.requests:
        for tool in r["tools"]:
            assert schema_errors(tool["function"]["parameters"]) == [], (r["id"], tool["function"]["name"])


@needs_data
def test_first_record_exactly(by_id):
    r = by_id["api_bank/level-1/0"]
    assert r["messages"] == [
        {"role": "system", "content": "The current year is 2023."},
        {"role": "user", "content": "Can you please modify my appointment scheduled for March 25th with Dr. Kim to "
                                    "March 26th with Dr. Lee?"},
        {"role": "assistant", "content": "Sure, I can help you with that. Please provide me with the appointment ID "
                                         "and the new appointment date and doctor's name."},
        {"role": "user", "content": "The appointment ID is 34567890 and the new date is March 26th with Dr. Lee."},
        {"role": "assistant", "content": "Alright. I'll modify your appointment now."},
    ]
    assert [t["function"]["name"] for t in r["tools"]] == ["QueryHealthData", "CancelRegistration",
                                                            "ModifyRegistration"]
    assert r["tools"][1]["function"] == {
        "name": "CancelRegistration",
        "description": "This API cancels the registration of a patient given appointment ID.",
        "parameters": {"type": "object", "properties": {"appointment_id": {"type": "string",
                                                                           "description": "The ID of appointment."}},
                       "additionalProperties": False}}
    assert r["gold"] == [{"name": "ModifyRegistration", "arguments": {
        "appointment_id": "34567890", "new_appointment_date": "2023-03-26", "new_appointment_doctor": "Dr. Lee"}}]


@needs_data
def test_dialogue_api_request_becomes_tool_call_and_result(by_id):
    msgs = by_id["api_bank/level-1/2"]["messages"]
    call, result = msgs[5], msgs[6]
    assert call == {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function",
                                                                        "function": {
        "name": "ModifyRegistration", "arguments": {"appointment_id": "34567890", "new_appointment_date": "2023-03-26",
                                                    "new_appointment_doctor": "Dr. Lee"}}}]}
    assert result == {"role": "tool", "tool_call_id": "call_0", "name": "ModifyRegistration", "content": "success"}


@needs_data
def test_int_and_bool_values_typed_by_declared_type(by_id):
    hotel = by_id["api_bank/level-1/258"]  # source: room_count='1', adult_count='2', child_count='1'
    params = hotel["tools"][find_tool(hotel["tools"], "BookHotel")]["function"]["parameters"]["properties"]
    assert params["room_count"] == {"type": "integer", "description": "The number of rooms to order."}
    assert hotel["gold"][0]["arguments"] == {"hotel_name": "Sheraton Hotel", "check_in_time": "2023-09-01",
                                             "check_out_time": "2023-09-05", "room_count": 1, "adult_count": 2,
                                             "child_count": 1}
    switch = by_id["api_bank/level-1/261"]  # source: on='False'; the source's gold names device_id, schema says name
    assert switch["tools"][0]["function"]["parameters"]["properties"]["on"]["type"] == "boolean"
    assert switch["gold"][0]["arguments"] == {"device_id": "123456", "time": "2022-03-01 22:00:00", "on": False}


@needs_data
def test_quoted_list_literals_become_lists(by_id):
    meeting = by_id["api_bank/level-1/19"]  # source: attendees='['John Smith', 'Jane Doe']'
    props = meeting["tools"][find_tool(meeting["tools"], "QueryMeeting")]["function"]["parameters"]["properties"]
    assert props["attendees"]["type"] == "array" and props["attendees"]["items"] == {"type": "string"}
    assert meeting["gold"][0]["arguments"]["attendees"] == ["John Smith", "Jane Doe"]
    health = by_id["api_bank/level-1/7"]
    assert health["gold"][0]["arguments"]["health_data"] == [{"name": "blood_pressure", "value": "120/80"},
                                                             {"name": "heart_rate", "value": "80"}]


@needs_data
def test_comma_inside_string_value(by_id):
    assert by_id["api_bank/level-1/374"]["gold"] == [
        {"name": "Translate", "arguments": {"src": "Hello, how are you?", "tgt_lang": "fr"}}]


@needs_data
def test_level2_offers_toolsearcher_then_retrieved_tools(by_id, converted):
    r = by_id["api_bank/level-2/1"]
    assert [t["function"]["name"] for t in r["tools"]] == ["ToolSearcher", "QueryHistoryToday"]
    assert r["gold"] == [{"name": "QueryHistoryToday", "arguments": {"date": "10-06"}}]
    assert by_id["api_bank/level-2/0"]["gold"][0]["name"] == "ToolSearcher"
    missing = [x["id"] for x in converted.requests
               if x["subset"] != "lv3-train" and find_tool(x["tools"], x["gold"][0]["name"]) is None]
    assert all(i.startswith("api_bank/level-2/") for i in missing)
    assert converted.notes["level-2/gold_tool_not_offered"] == len(missing) > 0


@needs_data
def test_level2_prompt_only_tools_when_asked():
    prompt_only = api_bank.load(ROOT, offer_retrieved=False)
    level2 = [r for r in prompt_only.requests if r["subset"] in ("level-2", "lv3-train")]
    assert len(level2) == 135 + 758
    assert all([t["function"]["name"] for t in r["tools"]] == ["ToolSearcher"] for r in level2)


# ---- real training data (training-data/lv3-api-train.json) ----

needs_train = pytest.mark.skipif(not (ROOT / "training-data" / "lv3-api-train.json").is_file(),
                                 reason=f"API-Bank training data not found at {ROOT / 'training-data'}")
TOOL_SEARCHER = {"name": "ToolSearcher", "description": "Searches for relevant tools in library based on the keywords.",
                 "parameters": {"type": "object", "properties": {"keywords": {
                     "type": "string", "description": "The keyword to search for."}}, "additionalProperties": False}}


@needs_train
def test_training_counts_rejects_and_notes(converted):
    train = [r for r in converted.requests if r["subset"] == "lv3-train"]
    assert len(train) == 758 and len(train) + len(converted.rejects) == 907
    assert {r["reason"] for r in converted.rejects} == {"gold_unparsed", "dialogue_call_unparsed"}
    assert sum(r["reason"] == "gold_unparsed" for r in converted.rejects) == 84
    # a bare-word value (`patient_name=John Smith`) is not a Python literal: the record is a counted reject
    bare = next(r for r in converted.rejects if r["record"] == "17")
    assert bare["reason"] == "gold_unparsed" and "patient_name=John Smith" in bare["detail"]
    assert sum(r["gold"][0]["name"] == "ToolSearcher" for r in train) == 430
    notes = converted.notes
    assert notes["lv3-train/requests"] == 758 and notes["lv3-train/no_current_year"] == 907
    assert notes["lv3-train/toolsearcher_result_bare_type_name"] == 42
    assert notes["lv3-train/toolsearcher_result_unparsed"] == 22
    assert notes["lv3-train/toolsearcher_result_invalid_api"] == 3
    assert notes["lv3-train/gold_tool_not_offered"] == 16
    assert all(r["id"] == f"api_bank/lv3-train/{r['id'].rsplit('/', 1)[1]}" and "split" not in r for r in train)


@needs_train
def test_training_record_exactly(by_id):
    r = by_id["api_bank/lv3-train/1"]
    assert r["messages"][0] == {"role": "user", "content": "Find a cardiologist in Los Angeles for a check-up "
                                                           "appointment.TIME: 2034-04-15 10:00:00"}  # no system turn
    assert r["messages"][1]["tool_calls"][0]["function"] == {
        "name": "ToolSearcher", "arguments": {"keywords": "healthcare provider appointment availability checker"}}
    assert r["messages"][2]["role"] == "tool" and r["messages"][2]["content"].startswith(
        "{'name': 'HealthcareProviderAppointmentChecker'")
    assert len(r["messages"]) == 3
    assert r["tools"][0]["function"] == TOOL_SEARCHER
    assert r["tools"][1]["function"] == {
        "name": "HealthcareProviderAppointmentChecker",
        "description": "API for checking the availability of appointments with healthcare providers.",
        "parameters": {"type": "object", "properties": {
            "specialty": {"type": "string", "description": "The specialty of the healthcare provider."},
            "location": {"type": "string", "description": "The city location."}}, "additionalProperties": False}}
    assert r["gold"] == [{"name": "HealthcareProviderAppointmentChecker",
                          "arguments": {"specialty": "cardiologist", "location": "Los Angeles"}}]
    assert by_id["api_bank/lv3-train/0"]["gold"] == [
        {"name": "ToolSearcher", "arguments": {"keywords": "healthcare provider appointment availability checker"}}]


@needs_train
def test_training_bare_type_names_and_datetime(by_id):
    rental = by_id["api_bank/lv3-train/196"]  # retrieved: 'duration': {'type': int, ...} (a bare name)
    props = rental["tools"][find_tool(rental["tools"], "GetEquipmentRentalFees")]["function"]["parameters"]
    assert props["properties"]["duration"]["type"] == "integer"
    assert rental["gold"][0]["arguments"] == {"equipment": "treadmill", "duration": 3, "location": "New York"}
    sched = by_id["api_bank/lv3-train/3"]  # 'appointment_datetime': {'type': 'datetime'}
    tool = sched["tools"][find_tool(sched["tools"], "HealthcareProviderAppointmentScheduler")]["function"]
    assert tool["parameters"]["properties"]["appointment_datetime"]["type"] == "string"
    assert sched["gold"][0]["arguments"]["appointment_datetime"] == "2034-04-18 14:30:00"


@needs_train
def test_training_invalid_retrieved_api_is_not_offered(by_id):
    r = by_id["api_bank/lv3-train/72"]  # ToolSearcher returned 'input_parameters': {'none'} (a set)
    assert find_tool(r["tools"], "AntibioticFormulations") is None
    assert r["gold"] == [{"name": "AntibioticFormulations", "arguments": {}}]  # kept; the data stage counts it


# ---- parsing and typing rules ----

def test_parse_api_request_handles_quotes_commas_and_lists():
    name, args, unwrapped = parse_api_request("""API-Request: [Send(text="it's 5, ok", to=['a, b', "c"], n=3)]""")
    assert (name, unwrapped) == ("Send", False)
    assert {k: v for k, (v, _) in args.items()} == {"text": "it's 5, ok", "to": ["a, b", "c"], "n": 3}
    name, args, unwrapped = parse_api_request("[M(a='x)', people='['A, B', 'C']', b='y')]")
    assert unwrapped and args["people"][0] == ["A, B", "C"] and args["a"][0] == "x)" and args["b"][0] == "y"
    assert args["people"][1] == "['A, B', 'C']"
    for bad in ["Send(text='x')", "[Send('x')]", "[Send(text=foo)]", "[Send(text='x'"]:
        with pytest.raises(CallSyntaxError):
            parse_api_request(bad)


def test_type_value_only_converts_exactly():
    assert type_value("12", "'12'", "int") == 12 and type_value("1.5", "", "int") == "1.5"
    assert type_value("True", "", "bool") is True and type_value("yes", "", "bool") == "yes"
    assert type_value("2.5", "", "float") == 2.5
    assert type_value("['a']", "", "list(str)") == ["a"] and type_value("a, b", "", "list") == "a, b"
    assert type_value(["a"], "['a']", "str") == "['a']"  # a str parameter keeps the quoted text verbatim
    assert type_value("x", "", None) == "x"


def test_param_schema_types():
    assert param_schema("list(int)", "f") == {"type": "array", "items": {"type": "integer"}}
    assert param_schema("list", "f") == {"type": "array"}
    with pytest.raises(InputError, match="tuple"):
        param_schema("tuple", "f")


# ---- malformed input (a tiny raw folder built from a real record) ----

def _write_root(tmp_path: Path, level1: list, level2: list | None = None, train: list | None = None) -> Path:
    (tmp_path / "test-data").mkdir()
    (tmp_path / "training-data").mkdir()
    (tmp_path / "test-data" / "level-1-api.json").write_text(json.dumps(level1))
    (tmp_path / "test-data" / "level-2-api.json").write_text(json.dumps(level2 or []))
    (tmp_path / "training-data" / "lv3-api-train.json").write_text(json.dumps(train or []))
    return tmp_path


RECORD = {
    "file": "x.jsonl", "id": 0,
    "instruction": "\nGenerate an API request.\nThe current year is 2023.\nAPI descriptions:\n"
                   '{"name": "Calc", "description": "Calculator.", "input_parameters": {"formula": {"type": "str", '
                   '"description": "The formula."}}, "output_parameters": {}}',
    "input": "User: What is 2+3?\nAI: Let me compute.\nGenerate API Request:\n",
    "expected_output": "API-Request: [Calc(formula='2+3')]",
}


def test_unknown_type_raises_naming_file_and_record(tmp_path):
    bad = dict(RECORD, instruction=RECORD["instruction"].replace('"type": "str"', '"type": "tuple(int)"'))
    root = _write_root(tmp_path, [RECORD, bad])
    with pytest.raises(InputError) as e:
        api_bank.load(root)
    assert "level-1-api.json (record 1)" in str(e.value) and "tuple(int)" in str(e.value)
    assert "Calc.formula" in str(e.value)


def test_malformed_records_are_counted_rejects(tmp_path):
    records = [RECORD,
               dict(RECORD, input="User: hi\nSomeone: hello\nGenerate API Request:\n"),
               dict(RECORD, expected_output="API-Request: Calc(formula='2+3'"),
               dict(RECORD, instruction=RECORD["instruction"] + "\n{not json"),
               "not a record"]
    result = api_bank.load(_write_root(tmp_path, records))
    assert [r["id"] for r in result.requests] == ["api_bank/level-1/0"]
    assert [(r["record"], r["reason"]) for r in result.rejects] == [
        ("1", "dialogue_line_unparsed"), ("2", "gold_unparsed"), ("3", "api_description_not_json"),
        ("4", "not_an_object")]
    assert all(r["file"].endswith("level-1-api.json") for r in result.rejects)
    assert "Someone: hello" in result.rejects[0]["detail"]


SEARCHER_LINE = ('{"apiCode": "ToolSearcher", "description": "Searches.", "parameters": {"keywords": {"type": "str", '
                 '"description": "Keywords."}}, "response": {}}')
TRAIN_RECORD = {
    "instruction": "\nGenerate an API request.\nThe current time is {{time}}.\nAPI descriptions:\n",
    "input": SEARCHER_LINE + "\nUser: Book a yoga class.TIME: 2034-01-01 09:00:00\n"
             "API-Request: [ToolSearcher(keywords='yoga')]->{'name': 'YogaBooker', 'description': 'Books.', "
             "'input_parameters': {'day': {'type': date, 'description': 'Day.'}, 'seats': {'type': 'int', "
             "'description': 'Seats.'}}, 'output_parameters': {}}\nGenerate API Request: ",
    "output": "API-Request: [YogaBooker(day='2034-01-02', seats='2')]",
}


def test_synthetic_training_record(tmp_path):
    result = api_bank.load(_write_root(tmp_path, [RECORD], train=[TRAIN_RECORD]))
    r = result.requests[-1]
    assert r["id"] == "api_bank/lv3-train/0" and r["subset"] == "lv3-train"
    assert r["messages"][0] == {"role": "user", "content": "Book a yoga class.TIME: 2034-01-01 09:00:00"}
    assert [t["function"]["name"] for t in r["tools"]] == ["ToolSearcher", "YogaBooker"]
    props = r["tools"][1]["function"]["parameters"]["properties"]
    assert props == {"day": {"type": "string", "description": "Day."},
                     "seats": {"type": "integer", "description": "Seats."}}
    assert r["gold"] == [{"name": "YogaBooker", "arguments": {"day": "2034-01-02", "seats": 2}}]
    assert result.notes["lv3-train/toolsearcher_result_bare_type_name"] == 1
    assert result.notes["lv3-train/no_current_year"] == 1 and result.rejects == []


def test_synthetic_training_edge_cases(tmp_path):
    unparsed_result = dict(TRAIN_RECORD, input=TRAIN_RECORD["input"].replace("'Books.'", "'Book's.'"))
    set_params = dict(TRAIN_RECORD, input=TRAIN_RECORD["input"].replace(
        "{'day': {'type': date, 'description': 'Day.'}, 'seats': {'type': 'int', 'description': 'Seats.'}}",
        "{'none'}"))
    records = [TRAIN_RECORD,
               unparsed_result,
               set_params,
               {k: v for k, v in TRAIN_RECORD.items() if k != "output"},
               dict(TRAIN_RECORD, input="User: hi\nGenerate API Request: "),
               dict(TRAIN_RECORD, output="API-Request: [YogaBooker(day=Monday)]")]
    result = api_bank.load(_write_root(tmp_path, [], train=records))
    assert [r["id"] for r in result.requests] == [f"api_bank/lv3-train/{i}" for i in range(3)]
    for r in result.requests[1:]:  # nothing retrieved: the gold names a tool that is not offered (kept, counted)
        assert [t["function"]["name"] for t in r["tools"]] == ["ToolSearcher"] and r["gold"][0]["name"] == "YogaBooker"
    assert result.notes["lv3-train/toolsearcher_result_unparsed"] == 1
    assert result.notes["lv3-train/toolsearcher_result_invalid_api"] == 1
    assert result.notes["lv3-train/gold_tool_not_offered"] == 2
    assert [(r["record"], r["reason"]) for r in result.rejects] == [
        ("3", "missing_field"), ("4", "no_api_descriptions"), ("5", "gold_unparsed")]
    assert all(r["file"].endswith("training-data/lv3-api-train.json") for r in result.rejects)


def test_unknown_type_in_retrieved_api_raises(tmp_path):
    bad = dict(TRAIN_RECORD, input=TRAIN_RECORD["input"].replace("'type': 'int'", "'type': 'Money'"))
    with pytest.raises(InputError) as e:
        api_bank.load(_write_root(tmp_path, [], train=[TRAIN_RECORD, bad]))
    assert "lv3-api-train.json (record 1) line 2" in str(e.value) and "YogaBooker.seats" in str(e.value)
    assert "'Money'" in str(e.value)


def test_missing_training_file_names_it(tmp_path):
    root = _write_root(tmp_path, [RECORD])
    (root / "training-data" / "lv3-api-train.json").unlink()
    with pytest.raises(InputError, match=r"lv3-api-train.json: API-Bank lv3-train file not found"):
        api_bank.load(root)
