"""Tests for schema_features: which JSON-schema keywords xgrammar enforces, and the check.

The "enforced" and "ignored" cases also run xgrammar itself on strings that violate the
keyword, so the table in schema_features' docstring fails here when xgrammar changes.
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from common.grammar.schema_features import MAX_DEPTH, check_schema, unsupported_feature


def _accepts(schema: object, text: str) -> bool:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True)
    return _is_grammar_accept_string(grammar, text)


def _obj(**props: object) -> dict[str, object]:
    return {"type": "object", "properties": props, "required": list(props)}


INT = {"type": "integer"}
STR = {"type": "string"}

# (schema, strings it must accept, strings that violate a keyword it must reject)
ENFORCED: dict[str, tuple[object, list[str], list[str]]] = {
    "type string": (STR, ['"a"'], ["1", "null"]),
    "type integer": (INT, ["-3"], ["1.5", '"1"']),
    "type number": ({"type": "number"}, ["1.5", "2"], ['"a"']),
    "type boolean": ({"type": "boolean"}, ["true"], ["1"]),
    "type null": ({"type": "null"}, ["null"], ["0"]),
    "type object": ({"type": "object"}, ['{"a": [1]}'], ["[]"]),
    "type array": ({"type": "array"}, ['[1, "a"]'], ["{}"]),
    "type list": ({"type": ["string", "null"]}, ['"a"', "null"], ["1"]),
    "properties": (_obj(a=INT), ['{"a": 1}'], ['{"a": "x"}']),
    "required": ({**_obj(a=INT, b=INT), "required": ["a"]}, ['{"a": 1}'], ['{"b": 1}']),
    "additionalProperties false": (
        {**_obj(a=INT), "additionalProperties": False},
        ['{"a": 1}'],
        ['{"a": 1, "b": 2}'],
    ),
    "additionalProperties schema": (
        {"type": "object", "additionalProperties": INT},
        ['{"x": 1}'],
        ['{"x": "s"}'],
    ),
    "unevaluatedProperties": (
        {"type": "object", "unevaluatedProperties": INT},
        ['{"x": 1}'],
        ['{"x": "s"}'],
    ),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^x_[a-z]+$": INT}},
        ['{"x_a": 1}'],
        ['{"x_a": "s"}', '{"y": 1}'],
    ),
    "propertyNames": (
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": INT},
        ['{"ab": 1}'],
        ['{"A1": 1}'],
    ),
    "minProperties": (
        {"type": "object", "additionalProperties": INT, "minProperties": 2},
        ['{"a": 1, "b": 2}'],
        ['{"a": 1}'],
    ),
    "maxProperties": (
        {"type": "object", "additionalProperties": INT, "maxProperties": 1},
        ['{"a": 1}'],
        ['{"a": 1, "b": 2}'],
    ),
    "items": ({"type": "array", "items": INT}, ["[1, 2]"], ['["a"]']),
    "items false": ({"type": "array", "items": False}, ["[]"], ["[1]"]),
    "prefixItems": (
        {"type": "array", "prefixItems": [INT, STR], "items": False},
        ['[1, "a"]'],
        ['["a", 1]', '[1, "a", 2]'],
    ),
    "unevaluatedItems": (
        {"type": "array", "prefixItems": [STR], "unevaluatedItems": INT},
        ['["a", 1]'],
        ['["a", "b"]'],
    ),
    "minItems": ({"type": "array", "items": INT, "minItems": 2}, ["[1, 2]"], ["[1]"]),
    "maxItems": ({"type": "array", "items": INT, "maxItems": 1}, ["[1]"], ["[1, 2]"]),
    "uniqueItems false": ({"type": "array", "items": INT, "uniqueItems": False}, ["[1, 1]"], []),
    "enum": ({"enum": ["a", 1, None]}, ['"a"', "1", "null"], ['"b"', "2"]),
    "enum with type": ({"type": "string", "enum": ["a", "b"]}, ['"a"'], ['"c"']),
    # a const or enum object or array is matched in its compact form only
    "const": ({"const": {"a": [1]}}, ['{"a":[1]}'], ['{"a":[2]}', '{"a": [1]}']),
    "const with type": ({"type": "integer", "const": 3}, ["3"], ["4"]),
    "anyOf": ({"anyOf": [STR, INT]}, ['"a"', "1"], ["null"]),
    "oneOf disjoint": ({"oneOf": [STR, INT]}, ['"a"', "1"], ["null", "1.5"]),
    "allOf one member": ({"allOf": [{"type": "integer", "minimum": 5}]}, ["6"], ["4"]),
    "$ref $defs": (
        {"$defs": {"x": INT}, **_obj(a={"$ref": "#/$defs/x"})},
        ['{"a": 1}'],
        ['{"a": "s"}'],
    ),
    "$ref definitions": (
        {"definitions": {"x": INT}, **_obj(a={"$ref": "#/definitions/x"})},
        ['{"a": 1}'],
        ['{"a": "s"}'],
    ),
    "$ref recursive": (
        {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"}}}},
        ['{"c": [{"c": []}]}'],
        ['{"c": [1]}'],
    ),
    "pattern": ({"type": "string", "pattern": "^[0-9]+$"}, ['"12"'], ['"1a"']),
    "minLength": ({"type": "string", "minLength": 2}, ['"ab"'], ['"a"']),
    "maxLength": ({"type": "string", "maxLength": 2}, ['"ab"'], ['"abc"']),
    "integer minimum": ({"type": "integer", "minimum": 3}, ["3"], ["2"]),
    "integer maximum": ({"type": "integer", "maximum": 3}, ["3"], ["4"]),
    "integer exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, ["4"], ["3"]),
    "integer exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 3}, ["2"], ["3"]),
    "integer multipleOf": ({"type": "integer", "multipleOf": 3}, ["6", "0"], ["4"]),
    "number minimum": ({"type": "number", "minimum": 1.5}, ["1.5", "2"], ["1.4"]),
    "number maximum": ({"type": "number", "maximum": 2.5}, ["2.5"], ["2.6"]),
    "number exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, ["0.1"], ["0"]),
    "number exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 1}, ["0.9"], ["1"]),
    "minimum on a type list": (
        {"type": ["integer", "string"], "minimum": 3, "pattern": "^a$"},
        ["4", '"a"'],
        ["1", '"b"'],
    ),
}
FORMATS: dict[str, tuple[list[str], list[str]]] = {
    "email": (["a.b+c@example.org"], ["nope"]),
    "date": (["2024-02-29"], ["2024-13-01", "x"]),
    "time": (["12:30:00Z", "12:30:00+01:00"], ["12:30"]),
    "date-time": (["2024-01-31T12:30:00Z"], ["2024-01-31"]),
    "duration": (["P1D", "PT1H"], ["1D"]),
    "uri": (["http://example.com/a"], ["not a uri"]),
    "uri-reference": (["/a/b", "#frag"], ["a b"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123"]),
    "ipv4": (["1.2.3.4"], ["256.1.1.1", "1.2.3"]),
    "ipv6": (["::1", "2001:db8::1"], ["1.2.3.4"]),
    "hostname": (["example.com"], ["a b", "a_b"]),
    "json-pointer": (["/a~0b/c~1", ""], ["a"]),
    "relative-json-pointer": (["0/a"], ["a"]),
    "uri-template": (["http://x/{a}"], ["{"]),
}
for _name, (_good, _bad) in FORMATS.items():
    ENFORCED[f"format {_name}"] = (
        {"type": "string", "format": _name},
        [json.dumps(s) for s in _good],
        [json.dumps(s) for s in _bad],
    )

# (schema, the message, a string xgrammar accepts although it violates the schema)
IGNORED: dict[str, tuple[object, str, str | None]] = {
    "not": ({"type": "integer", "not": {"const": 3}}, '"not" at # is not supported', "3"),
    "if/then/else": (
        {"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}},
        '"if" at # is not supported',
        "7",
    ),
    "then": ({"then": INT}, '"then" at # is not supported', None),
    "else": ({"else": INT}, '"else" at # is not supported', None),
    "uniqueItems": (
        {"type": "array", "items": INT, "uniqueItems": True},
        '"uniqueItems" at # is not supported',
        "[1, 1]",
    ),
    "contains": (
        {"type": "array", "items": INT, "contains": STR},
        '"contains" at # is not supported',
        "[1]",
    ),
    "minContains": (
        {"type": "array", "minContains": 1},
        '"minContains" at # is not supported',
        None,
    ),
    "maxContains": (
        {"type": "array", "maxContains": 1},
        '"maxContains" at # is not supported',
        None,
    ),
    "dependentRequired": (
        {**_obj(a=INT, b=INT), "required": [], "dependentRequired": {"a": ["b"]}},
        '"dependentRequired" at # is not supported',
        '{"a": 1}',
    ),
    "dependentSchemas": (
        {**_obj(a=INT, b=INT), "required": [], "dependentSchemas": {"a": {"required": ["b"]}}},
        '"dependentSchemas" at # is not supported',
        '{"a": 1}',
    ),
    "dependencies": (
        {**_obj(a=INT, b=INT), "required": [], "dependencies": {"a": ["b"]}},
        '"dependencies" at # is not supported',
        '{"a": 1}',
    ),
    "additionalItems": (
        {"type": "array", "prefixItems": [STR], "additionalItems": INT},
        '"additionalItems" at # is not supported',
        None,
    ),
    "contentEncoding": (
        {"type": "string", "contentEncoding": "base64"},
        '"contentEncoding" at # is not supported',
        '"!!!"',
    ),
    "contentMediaType": (
        {"type": "string", "contentMediaType": "application/json"},
        '"contentMediaType" at # is not supported',
        '"{"',
    ),
    "$dynamicRef": ({"$dynamicRef": "#meta"}, '"$dynamicRef" at # is not supported', None),
    "allOf of two": (
        {"allOf": [INT, {"minimum": 5}]},
        '"allOf" at # is not supported with more than one member',
        '"a"',
    ),
    "oneOf overlapping": (
        {"oneOf": [INT, {"type": "number"}]},
        '"oneOf" at # is not supported with members that may overlap (use "anyOf")',
        "1",
    ),
    "oneOf objects": (
        {"oneOf": [{"type": "object", "properties": {"x": INT}}, {"type": "object"}]},
        '"oneOf" at # is not supported with members that may overlap (use "anyOf")',
        "{}",
    ),
    "remote $ref": (
        _obj(a={"$ref": "http://example.com/a.json"}),
        '"$ref": "http://example.com/a.json" at #/properties/a is not supported'
        ' (only "#/..." refs)',
        '{"a": "anything"}',
    ),
    "anchor $ref": (
        {"$defs": {"x": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"},
        '"$ref": "#x" at # is not supported (only "#/..." refs)',
        '"s"',
    ),
    "keyword next to $ref": (
        {"$defs": {"x": INT}, "$ref": "#/$defs/x", "minimum": 5},
        '"minimum" at # is not supported next to "$ref"',
        "3",
    ),
    "keyword next to anyOf": (
        {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]},
        '"type" at # is not supported next to "anyOf"',
        None,
    ),
    "keyword next to oneOf": (
        {"oneOf": [STR, INT], "maxLength": 2},
        '"maxLength" at # is not supported next to "oneOf"',
        '"abc"',
    ),
    "anyOf next to oneOf": (
        {"anyOf": [INT, STR], "oneOf": [INT]},
        '"oneOf" at # is not supported next to "anyOf"',
        '"a"',
    ),
    "keyword next to enum": (
        {"enum": ["a", "bbb"], "minLength": 2},
        '"minLength" at # is not supported next to "enum"',
        '"a"',
    ),
    "type not fitting enum": (
        {"type": "string", "enum": ["a", 1]},
        '"type" at # is not supported next to "enum" (which does not allow all its values)',
        "1",
    ),
    "type not fitting const": (
        {"type": "integer", "const": "a"},
        '"type" at # is not supported next to "const" (which does not allow all its values)',
        '"a"',
    ),
    "required not in properties": (
        {"type": "object", "properties": {"b": INT}, "required": ["a"]},
        '"required" at # is not supported for "a", not in "properties"',
        '{"b": 1}',
    ),
    "required without properties": (
        {"type": "object", "required": ["a"], "additionalProperties": True},
        '"required" at # is not supported for "a", not in "properties"',
        "{}",
    ),
    "pattern without type": (
        {"pattern": "^a$"},
        '"pattern" at # is not supported without a "type"',
        "1",
    ),
    "minimum without type": (
        {"minimum": 3},
        '"minimum" at # is not supported without a "type"',
        "1",
    ),
    "minItems without type": (
        {"minItems": 2},
        '"minItems" at # is not supported without a "type"',
        "[]",
    ),
    "format without type": (
        {"format": "email"},
        '"format" at # is not supported without a "type"',
        '"x"',
    ),
    "number multipleOf": (
        {"type": "number", "multipleOf": 0.5},
        '"multipleOf" at # is not supported for "type": "number" (only for "integer")',
        "1.3",
    ),
}
for _name in ["idn-email", "idn-hostname", "iri", "iri-reference", "regex", "int32", "password"]:
    IGNORED[f"format {_name}"] = (
        {"type": "string", "format": _name},
        f'"format": "{_name}" at # is not supported',
        None,
    )
IGNORED["format idn-email"] = (*IGNORED["format idn-email"][:2], '"nope"')
IGNORED["format regex"] = (*IGNORED["format regex"][:2], '"("')


@pytest.mark.parametrize("name", sorted(ENFORCED))
def test_enforced_keywords_pass_and_xgrammar_rejects_violations(name: str) -> None:
    schema, good, bad = ENFORCED[name]
    assert unsupported_feature(schema) is None
    assert check_schema(json.dumps(schema)) == schema
    for text in good:
        assert _accepts(schema, text), text
    for text in bad:
        assert not _accepts(schema, text), text


@pytest.mark.parametrize("name", sorted(IGNORED))
def test_ignored_keywords_are_named_with_their_path(name: str) -> None:
    schema, message, slips_through = IGNORED[name]
    assert unsupported_feature(schema) == message
    with pytest.raises(ValueError) as err:
        check_schema(json.dumps(schema))
    assert str(err.value) == message
    if slips_through is not None:  # xgrammar really lets a violating value through
        assert _accepts(schema, slips_through)


def test_annotations_vendor_keys_and_boolean_schemas_are_allowed() -> None:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://example.com/p",
        "$comment": "c",
        "title": "P",
        "description": "d",
        "type": "object",
        "properties": {
            "a": {"type": "integer", "default": 1, "examples": [1], "deprecated": True},
            "b": {"type": "string", "readOnly": True, "writeOnly": False, "x-foo": {"not": 1}},
            "c": True,
            "d": {"type": "string", "minimum": 3, "minItems": 1},  # not for strings: no-ops
        },
        "x-vendor": {"if": {}},
        "nullable": True,
    }
    assert unsupported_feature(schema) is None
    assert unsupported_feature(True) is None
    assert unsupported_feature(False) is None
    assert unsupported_feature({}) is None


def test_nested_positions_are_walked_with_json_pointer_paths() -> None:
    not_ = {"not": STR}
    cases = [
        (_obj(a={"anyOf": [STR, not_]}), "#/properties/a/anyOf/1"),
        ({"type": "array", "items": not_}, "#/items"),
        ({"type": "array", "prefixItems": [INT, not_]}, "#/prefixItems/1"),
        ({"type": "object", "additionalProperties": not_}, "#/additionalProperties"),
        ({"type": "object", "unevaluatedProperties": not_}, "#/unevaluatedProperties"),
        ({"type": "object", "patternProperties": {"^a$": not_}}, "#/patternProperties/^a$"),
        ({"$defs": {"x": not_}, "type": "integer"}, "#/$defs/x"),
        ({"definitions": {"x": {"oneOf": [not_]}}}, "#/definitions/x/oneOf/0"),
        ({"allOf": [{"allOf": [not_]}]}, "#/allOf/0/allOf/0"),
        (_obj(**{"a/b~c": {"type": "array", "items": not_}}), "#/properties/a~1b~0c/items"),
    ]
    for schema, path in cases:
        assert unsupported_feature(schema) == f'"not" at {path} is not supported'
    odd = {"type": "string", "format": ["email"]}
    assert unsupported_feature(odd) == '"format": ["email"] at # is not supported'
    fmt = _obj(e={"type": "string", "format": "idn-email"})
    assert unsupported_feature(fmt) == '"format": "idn-email" at #/properties/e is not supported'
    # propertyNames' subschema is read as a string
    assert unsupported_feature({"type": "object", "propertyNames": {"maxLength": 3}}) is None
    # the first offender in document order
    two = _obj(a={"type": "array", "uniqueItems": True}, b=not_)
    assert unsupported_feature(two) == '"uniqueItems" at #/properties/a is not supported'


def test_oneof_with_provably_disjoint_members_passes() -> None:
    defs = {
        "Cat": {**_obj(k={"const": "cat", "type": "string"}, m=INT), "title": "Cat"},
        "Dog": {**_obj(k={"enum": ["dog", "wolf"]}, b=STR), "title": "Dog"},
    }
    tagged = {
        "$defs": defs,
        "oneOf": [{"$ref": "#/$defs/Cat"}, {"allOf": [{"$ref": "#/$defs/Dog"}]}],
        "discriminator": {"propertyName": "k"},
    }
    assert unsupported_feature(tagged) is None
    assert _accepts(tagged, '{"k": "cat", "m": 1}')
    assert not _accepts(tagged, '{"k": "cat", "b": "x"}')
    assert unsupported_feature({"oneOf": [{"const": 1}, {"enum": [2, "1"]}]}) is None
    assert unsupported_feature({"oneOf": [{"anyOf": [STR, INT]}, {"type": "null"}]}) is None
    overlap = [{"const": 1}, {"enum": [1.0]}]  # 1 == 1.0 in JSON Schema
    assert unsupported_feature({"oneOf": overlap}) is not None
    same_tag = {"$defs": {**defs, "Dog": _obj(k={"const": "cat"})}, "oneOf": tagged["oneOf"]}
    assert unsupported_feature(same_tag) is not None
    # references that loop or do not resolve are not proofs, and do not hang
    loop = {"$defs": {"x": {"anyOf": [{"$ref": "#/$defs/x"}, INT]}}}
    assert unsupported_feature({**loop, "oneOf": [{"$ref": "#/$defs/x"}, STR]}) is not None
    assert unsupported_feature({"oneOf": [{"$ref": "#/$defs/nope"}, STR]}) is not None


def test_check_schema_errors_are_value_errors_with_readable_messages() -> None:
    with pytest.raises(ValueError, match="^json_schema is not valid JSON: "):
        check_schema('{"type": ')
    with pytest.raises(ValueError, match="^json_schema is not valid JSON: .*NaN"):
        check_schema('{"const": NaN}')
    with pytest.raises(ValueError, match="must be an object or a boolean, not list"):
        check_schema("[1]")
    with pytest.raises(ValueError, match="must be an object or a boolean, not str"):
        check_schema('"x"')
    xgrammar_errors = {
        '{"type": "strin"}': 'Unsupported type "strin"',
        '{"$ref": "#/$defs/nope"}': "Cannot find field '$defs' in #/$defs/nope",
        '{"type": "integer", "minimum": 1.5}': "Integer constraint must be a whole number",
        '{"type": "string", "pattern": "("}': "Regex parsing error at position 2: "
        "The parenthesis is not closed.",
        '{"type": "string", "pattern": 5}': "a keyword's value has the wrong type",
        '{"type": "array", "items": [{"type": "string"}]}': "items must be a boolean or an object",
        '{"enum": []}': "enum array must not be empty",
        "false": "Schema 'false' cannot accept any value",
    }
    for text, message in xgrammar_errors.items():
        with pytest.raises(ValueError) as err:
            check_schema(text)
        assert str(err.value) == message, text
    assert check_schema("true") == {}
    assert check_schema('{"type": "object"}') == {"type": "object"}


def test_too_deep_schemas_are_refused_before_xgrammar() -> None:
    def nested(depth: int) -> dict[str, object]:
        schema: dict[str, object] = {"type": "integer"}
        for _ in range(depth):
            schema = {"type": "array", "items": schema}
        return schema

    assert check_schema(json.dumps(nested(MAX_DEPTH))) == nested(MAX_DEPTH)
    with pytest.raises(ValueError, match=f"nested more than {MAX_DEPTH} deep"):
        check_schema(json.dumps(nested(MAX_DEPTH + 1)))
    with pytest.raises(ValueError, match="nested too deeply"):
        check_schema("[" * 100_000 + "]" * 100_000)
