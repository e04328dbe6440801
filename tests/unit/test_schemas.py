"""The JSON Schema keywords the engines' grammar would drop are found where they constrain (llamamesh/schemas.py),
and only there: a property named like a keyword is data."""

from __future__ import annotations

from typing import Any

import pytest

from llamamesh.schemas import unenforced, unknown_type

INT = {"type": "integer"}
DEFS = {"$defs": {"x": {"type": "object", "properties": {"n": INT}}}}


@pytest.mark.parametrize(
    ("schema", "found"),
    [
        (
            {"type": "object", "properties": {"a": {"type": "array", "items": INT, "uniqueItems": True}}},
            "uniqueItems at properties.a",
        ),
        ({"type": "array", "items": INT, "contains": {"const": 7}}, "contains"),
        ({"type": "integer", "not": {"enum": [1]}}, "not"),
        ({"anyOf": [INT, {"type": "object", "patternProperties": {"^x": INT}}]}, "patternProperties at anyOf[1]"),
        ({"type": "object", "properties": {"a": INT}, "allOf": [{"required": ["a"]}]}, "allOf"),
        ({"allOf": [INT, {"minimum": 3}]}, "allOf"),
        ({"$ref": "http://example.com/s.json"}, "$ref to 'http://example.com/s.json'"),
        ({**DEFS, "$ref": "#/$defs/x", "required": ["n"]}, "required beside $ref"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "minLength/maxLength beside a pattern or format"),
        ({"type": "object", "properties": {"a": INT}, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        ({"type": "object", "$defs": {"d": {"type": "array", "uniqueItems": True}}}, "uniqueItems at $defs.d"),
    ],
)
def test_a_keyword_the_grammar_drops_is_found_where_it_is(schema: dict[str, Any], found: str) -> None:
    assert unenforced(schema).startswith(found)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"not": INT, "allOf": INT, "uniqueItems": {"type": "boolean"}}},
        {**DEFS, "type": "object", "properties": {"f": {"allOf": [{"$ref": "#/$defs/x"}], "description": "d"}}},
        {**DEFS, "type": "object", "properties": {"f": {"$ref": "#/$defs/x", "title": "F", "description": "d"}}},
        {"anyOf": [{"$ref": "#/$defs/x"}, {"type": "null"}], "default": None, **DEFS},
        {"type": "integer", "multipleOf": 5, "minimum": 0},
        {"type": ["integer", "null"], "multipleOf": 5},
        {"type": "string", "format": "date", "enum": ["2026-01-01"]},
        {"type": "array", "prefixItems": [INT], "minItems": 1, "maxItems": 3},
        True,
    ],
)
def test_what_the_grammar_enforces_passes(schema: Any) -> None:
    assert unenforced(schema) == "" and unknown_type(schema) == ""


def test_a_type_json_schema_does_not_have_is_named() -> None:
    assert unknown_type({"type": "object", "properties": {"x": {"type": ["integer", "foo"]}}}) == (
        "type 'foo' at properties.x is no JSON Schema type"
    )
    assert unknown_type({"type": {"bad": 1}}) == "type \"{'bad': 1}\" is no JSON Schema type"
    assert unknown_type({"type": [["string"]]}).startswith("type \"['string']\"")
