"""The scoring rules, once: strict JSON equality, BFCL acceptable values, slots and calls."""

from pipeline.scoring import (arguments_accepted, bfcl_string, call_accepted, call_equal, slot_match, value_accepted,
                              values_equal)
from pipeline.sidecar.rows import UNKNOWN


def test_values_equal_is_strict_json():
    assert values_equal(1, 1.0) and values_equal({"a": [1, {"b": None}]}, {"a": [1.0, {"b": None}]})
    assert not values_equal(True, 1) and not values_equal(0, False) and not values_equal("1", 1)
    assert not values_equal("Paris", "paris") and not values_equal([1, 2], [2, 1])
    assert not values_equal({"a": 1}, {"a": 1, "b": 2}) and not values_equal(None, "")
    assert not values_equal(UNKNOWN, None) and not values_equal(UNKNOWN, "x")


def test_bfcl_strings_drop_punctuation_and_case_everywhere():
    assert bfcl_string("New-York, U.S.") == "newyorkus" and bfcl_string("it's") == 'it"s'
    assert value_accepted("12 * 7 + 3", ["12*7+3"]) and value_accepted("NEW_YORK", ["new york"])
    assert value_accepted(["San Francisco", 2], [["san-francisco", 2]])  # inside lists
    assert value_accepted({"city": "SAN FRANCISCO"}, [{"city": ["san francisco"]}])  # inside objects
    assert not value_accepted("Paris", ["London"]) and not values_equal("12 * 7", "12*7")  # exact stays exact


def test_value_accepted_follows_bfcl_options():
    assert value_accepted(None, [0.01, ""]) and value_accepted(0.01, [0.01, ""]) and not value_accepted(0.1, [0.01, ""])
    assert not value_accepted(None, ["celsius"])  # omission only where "" (or null) is listed
    assert value_accepted(None, [None]) and value_accepted("", [""])  # a given "" compares like any string
    assert not value_accepted(UNKNOWN, ["", None]) and not value_accepted(True, [1]) and value_accepted(2, [2.0])
    nested = [{"city": ["Paris", "paris"], "unit": ["c", ""]}]  # an object option: {key: [options]}, key by key
    assert value_accepted({"city": "paris"}, nested) and value_accepted({"city": "Paris", "unit": "c"}, nested)
    assert not value_accepted({"city": "Paris", "unit": "k"}, nested)
    assert not value_accepted({"unit": "c"}, nested)  # city may not be omitted
    assert not value_accepted({"city": "Paris", "extra": 1}, nested)
    assert value_accepted([{"x": 2}, 3], [[{"x": [1, 2]}, 3]]) and not value_accepted([{"x": 4}, 3], [[{"x": [1, 2]}, 3]])
    assert value_accepted([1, 2], [[1, 2]]) and not value_accepted([1, 2], [[2, 1]])
    assert value_accepted("c", "c")  # a bare option is one option


def test_arguments_and_slots():
    accept = {"expression": ["12*7+3"], "precision": [0.01, ""]}
    assert arguments_accepted({"expression": "12 * 7 + 3"}, accept)
    assert not arguments_accepted({"precision": 0.01}, accept)  # expression may not be omitted
    assert not arguments_accepted({"expression": "12*7+3", "round": True}, accept)  # unknown argument
    assert slot_match(None, None) and slot_match(3.0, 3) and not slot_match(UNKNOWN, None)
    assert slot_match(None, 0.01, [0.01, ""]) and not slot_match(None, 0.01)


def test_calls_exact_and_acceptable():
    gold = [{"name": "calc", "arguments": {"expression": "12*7+3", "precision": 0.01}}]
    accept = [{"name": "calc", "arguments": {"expression": ["12*7+3"], "precision": [0.01, ""]}}]
    assert call_equal({"name": "calc", "arguments": {"precision": 0.01, "expression": "12*7+3"}}, gold)
    assert not call_equal({"name": "calc", "arguments": {"expression": "12*7+3"}}, gold)
    assert call_accepted({"name": "calc", "arguments": {"expression": "12 * 7 + 3"}}, gold, accept)
    assert not call_accepted({"name": "calc", "arguments": {"expression": "12 * 7 + 3"}}, gold)  # no options: exact
    assert not call_accepted({"name": "other", "arguments": {"expression": "12*7+3"}}, gold, accept)
