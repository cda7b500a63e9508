"""The schemas refused as unenforceable are exactly ones xgrammar would let break: for each rule, a string the
schema forbids (jsonschema says so) that xgrammar's grammar for it accepts. When xgrammar learns a keyword, its
case here fails and the rule can go. The schemas it does enforce pass through, and the refusal names the place."""

from __future__ import annotations

import json

import jsonschema
import pytest

from inferd.errors import InvalidRequestError
from inferd.structured.enforceable import unenforceable
from inferd.structured.spec import Constraint

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}

# (schema, JSON the schema forbids, where the refusal points)
REFUSED = [
    ({"not": {"type": "string"}}, '"x"', "/"),
    ({**OBJ_AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a":1}', "/"),
    ({**OBJ_AB, "dependentRequired": {"a": ["b"]}}, '{"a":1}', "/"),
    ({**OBJ_AB, "$schema": "http://json-schema.org/draft-07/schema#", "dependencies": {"a": ["b"]}}, '{"a":1}', "/"),
    ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, '"maybe"', "/"),
    ({"type": "number", "multipleOf": 0.5}, "0.3", "/"),
    ({"type": "integer", "multipleOf": 5, "minimum": 3}, "7", "/"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]", "/"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1,1]", "/"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcdef"', "/"),
    ({"type": "string", "format": "email", "maxLength": 5}, '"abcdef@x.com"', "/"),
    ({"properties": {"addr": {"format": "email"}}}, '{"addr":"x"}', "/properties/addr"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}, "properties": {"b": {}}}, '{"b":1}', "/"),
    ({**OBJ_AB, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "{}", "/"),
    ({"type": "object", "oneOf": [{"type": "string"}, {"type": "integer"}]}, "5", "/"),
    ({"$defs": {"s": {"type": "string", "minLength": 3, "oneOf": [{"pattern": "^a"}, {"pattern": "^b"}]}},
      "properties": {"s": {"$ref": "#/$defs/s"}}}, '{"s":"a"}', "/$defs/s"),
]  # fmt: skip

ENFORCED = [
    ({"type": "integer", "multipleOf": 5}, "7"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "[1,2,3]"),
    ({"type": "string", "format": "ipv4"}, '"abc"'),
    ({"type": "string", "minLength": 3}, '"a"'),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, '{"ax":"s"}'),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}]}, '{"a":"x"}'),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}], "title": "id"}, "[]"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}"),
]


def _grammar_accepts(schema: dict, text: str) -> bool:
    return _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True), text)


def _schema_accepts(schema: dict, text: str) -> bool:
    checker = jsonschema.FormatChecker(formats=["email", "ipv4"])
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=checker).is_valid(json.loads(text))


@pytest.mark.parametrize("schema, bad, where", REFUSED)
def test_each_refused_keyword_is_one_the_grammar_would_let_break(schema, bad, where):
    assert not _schema_accepts(schema, bad)
    assert _grammar_accepts(schema, bad), "xgrammar enforces this now: the rule can go"
    problems = unenforceable(schema)
    assert problems and problems[0].startswith(f"{where}: "), problems
    with pytest.raises(InvalidRequestError) as e:
        Constraint.json(schema, param="structured_outputs.json")
    assert e.value.param == "structured_outputs.json" and problems[0] in str(e.value)


@pytest.mark.parametrize("schema, bad", ENFORCED)
def test_schemas_the_grammar_enforces_pass(schema, bad):
    assert not _schema_accepts(schema, bad) and not _grammar_accepts(schema, bad)
    assert unenforceable(schema) == []
    Constraint.json(schema)


def test_formats_are_checked_only_where_they_constrain_a_string():
    # an undefined format is an annotation no validator checks; a format on an integer constrains nothing
    assert unenforceable({"type": "string", "format": "int32"}) == []
    assert unenforceable({"type": "integer", "format": "int64"}) == []
    assert unenforceable({"type": "string", "format": "regex"})  # defined by JSON Schema, not by the grammar
    assert unenforceable({"type": "array", "uniqueItems": False}) == []


def test_a_schema_with_many_problems_names_three_and_counts_the_rest():
    schema = {"properties": {f"p{i}": {"not": {}} for i in range(5)}}
    with pytest.raises(InvalidRequestError) as e:
        Constraint.json(schema)
    assert "/properties/p0: `not`" in str(e.value) and "(and 2 more)" in str(e.value)
