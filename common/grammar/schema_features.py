"""JSON-schema keywords xgrammar enforces, and a check naming the ones it would not.

xgrammar's converter (Grammar.from_json_schema, strict_mode=True) raises on some bad schemas
but silently drops many keywords, so a request's schema is walked first and one that would
not be enforced is answered with a 400 naming it. Measured on xgrammar 0.2.9 by converting a
schema per keyword and matching strings that violate it (test_schema_features.py re-checks):

    keyword                                 xgrammar 0.2.9
    type (each type, type lists)            enforced
    properties, minProperties, maxProperties    enforced
    required                                enforced for names in "properties", else ignored
    additionalProperties, unevaluatedProperties (bool, schema)   enforced; absent: false
    patternProperties, propertyNames        enforced (a pattern must match the whole key)
    items (bool, schema), prefixItems, unevaluatedItems   enforced; absent items: none extra
    items as an array (draft 7 tuple)       raises
    minItems, maxItems                      enforced
    enum, const                             enforced (objects, arrays: compact form only);
                                            keywords beside them ignored
    anyOf; allOf of one member              enforced; keywords beside them ignored
    oneOf                                   enforced if members provably disjoint, else anyOf
    allOf of several members                ignored (any value)
    $ref "#", "#/..." ($defs, definitions)  enforced; keywords beside it ignored
    $ref to other URIs, "#anchor"           ignored (any value); unresolved "#/..." raises
    pattern                                 enforced, anchored (must match the whole string)
    minLength, maxLength                    enforced
    format on a string type                 enforced: date, date-time, duration, email,
        hostname, ipv4, ipv6, json-pointer, relative-json-pointer, time, uri, uri-reference,
        uri-template, uuid; ignored: idn-email, idn-hostname, iri, iri-reference, regex, others
    minimum, maximum, exclusiveMinimum/Maximum   enforced (integer bounds must be whole)
    multipleOf                              integer: enforced; number: ignored
    string/number/array/object keywords     ignored when nothing sets the type ("type",
                                            "properties", "items", "additionalProperties", ...)
    uniqueItems, contains, min/maxContains  ignored ("uniqueItems": false is a no-op)
    not, if, then, else, dependencies       ignored
    dependentRequired, dependentSchemas     ignored
    additionalItems                         ignored
    contentEncoding, contentMediaType       ignored
    $dynamicRef, $recursiveRef              ignored
    false as a schema, "enum": []           raises
    title, description, default, examples, $schema, $id, $anchor, $comment, deprecated,
    readOnly, writeOnly, discriminator, vendor keys (x-...)     annotations: allowed

Keywords for a type the schema cannot have (e.g. "minimum" on "type": "string") constrain
nothing in JSON Schema either, so they are allowed.
"""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from typing import Any

import xgrammar as xgr

MAX_DEPTH = 64  # subschema nesting; xgrammar's conversion time grows ~cubically with it
_STEPS = 100_000  # subschema visits the oneOf-disjointness proofs of one schema may take

# fmt: off
_NEVER = frozenset({
    "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
    "dependentRequired", "dependentSchemas", "dependencies", "additionalItems",
    "contentEncoding", "contentMediaType", "contentSchema", "$dynamicRef", "$recursiveRef",
})
_NUMERIC = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_BY_TYPE: dict[str, frozenset[str]] = {
    "string": frozenset({"pattern", "minLength", "maxLength", "format"}),
    "integer": _NUMERIC,
    "number": _NUMERIC,
    "array": frozenset({"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems"}),
    "object": frozenset({
        "properties", "required", "additionalProperties", "unevaluatedProperties",
        "patternProperties", "propertyNames", "minProperties", "maxProperties",
    }),
}
_DISPATCH = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")  # xgrammar's precedence
_VALIDATION = frozenset({"type", *_DISPATCH}).union(*_BY_TYPE.values())
_FORMATS = frozenset({
    "date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "json-pointer",
    "relative-json-pointer", "time", "uri", "uri-reference", "uri-template", "uuid",
})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_SCHEMA_ONE = (
    "additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems",
    "additionalItems", "contains", "not", "if", "then", "else", "contentSchema",
)
# fmt: on
_ALL_KINDS = frozenset({"null", "boolean", "integer", "fraction", "string", "array", "object"})
_LOG_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ")


def unsupported_feature(schema: object) -> str | None:
    """Names the first keyword xgrammar would not enforce, and where; None when there is none."""
    return _walk(schema, "#", _Proofs(schema), None, 0)


def check_schema(schema_text: str) -> dict[str, Any]:
    """The parsed schema (`true` gives {}); ValueError saying why xgrammar cannot enforce it."""
    try:
        schema = json.loads(schema_text, parse_float=_finite, parse_constant=_finite)
    except RecursionError:
        raise ValueError("json_schema is nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be an object or a boolean, not {type(schema).__name__}")
    problem = unsupported_feature(schema)
    if problem is not None:
        raise ValueError(problem)
    try:
        xgr.Grammar.from_json_schema(schema_text, strict_mode=True)
    except RuntimeError as exc:
        message = _LOG_PREFIX.sub("", str(exc)).strip()
        if "type mismatch" in message:  # picojson's, on e.g. "pattern": 5
            message = "a keyword's value has the wrong type"
        raise ValueError(message or "xgrammar cannot convert this json_schema") from None
    return schema if isinstance(schema, dict) else {}  # `false` raised above


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _msg(key: str, path: str, why: str = "") -> str:
    return f'"{key}" at {path} is not supported{why}'


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _head(node: object) -> str | None:
    """The keyword xgrammar reads `node` by when it has one; it drops the others beside it."""
    return next((k for k in _DISPATCH if k in node), None) if isinstance(node, dict) else None


def _walk(node: object, path: str, proofs: _Proofs, default: str | None, depth: int) -> str | None:
    if not isinstance(node, dict):
        return None  # true/false, or something xgrammar itself rejects
    if depth > MAX_DEPTH:
        return f"subschemas nested more than {MAX_DEPTH} deep (at {path}) are not supported"
    problem = _check(node, path, proofs, default)
    for key, value in node.items():
        where = f"{path}/{_escape(key)}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            subs = [(f"{where}/{_escape(k)}", v) for k, v in value.items()]
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            subs = [(f"{where}/{i}", v) for i, v in enumerate(value)]
        else:
            subs = [(where, value)] if key in _SCHEMA_ONE else []
        for sub_path, sub in subs:
            if problem is not None:
                return problem
            sub_default = "string" if key == "propertyNames" else None
            problem = _walk(sub, sub_path, proofs, sub_default, depth + 1)
    return problem


def _types(node: dict[str, Any], default: str | None) -> frozenset[str] | None:
    """The types xgrammar reads `node` as when it has no _DISPATCH keyword; None: any value."""
    declared = node.get("type", default)
    if isinstance(declared, str):
        return frozenset({declared})
    if isinstance(declared, list):
        return frozenset(t for t in declared if isinstance(t, str))
    if declared is not None:
        return frozenset()  # xgrammar raises on it
    if any(k in node for k in ("properties", "additionalProperties", "unevaluatedProperties")):
        return frozenset({"object"})
    if any(k in node for k in ("items", "prefixItems", "unevaluatedItems")):
        return frozenset({"array"})
    return None


def _check(node: dict[str, Any], path: str, proofs: _Proofs, default: str | None) -> str | None:
    """What xgrammar would not enforce among `node`'s own keywords (not its subschemas')."""
    for key, value in node.items():
        if key in _NEVER and not (key == "uniqueItems" and value is False):
            return _msg(key, path)
    head = _head(node)
    if head is not None:
        extra = [k for k in node if k in _VALIDATION and k != head]
        if head in ("const", "enum") and "type" in extra and _values_fit_type(node):
            extra.remove("type")
        value = node[head]
        if extra:
            unfit = extra[0] == "type" and head in ("const", "enum")
            fit = " (which does not allow all its values)" if unfit else ""
            return _msg(extra[0], path, f' next to "{head}"{fit}')
        if head == "$ref" and isinstance(value, str) and value != "#" and value[:2] != "#/":
            return f'"$ref": {json.dumps(value)} at {path} is not supported (only "#/..." refs)'
        if head == "allOf" and isinstance(value, list) and len(value) > 1:
            return _msg("allOf", path, " with more than one member")
        if head == "oneOf" and isinstance(value, list) and not proofs.disjoint(value):
            return _msg("oneOf", path, ' with members that may overlap (use "anyOf")')
        return None
    types = _types(node, default)
    if types is None:
        extra_key = next((k for k in node if k in _VALIDATION), None)
        return None if extra_key is None else _msg(extra_key, path, ' without a "type"')
    if "multipleOf" in node and "number" in types:
        return _msg("multipleOf", path, ' for "type": "number" (only for "integer")')
    fmt = node.get("format")
    if "format" in node and "string" in types and not (isinstance(fmt, str) and fmt in _FORMATS):
        return f'"format": {json.dumps(fmt)} at {path} is not supported'
    required, props = node.get("required"), node.get("properties")
    if "object" in types and isinstance(required, list):
        for name in required:
            if isinstance(name, str) and not (isinstance(props, dict) and name in props):
                return _msg("required", path, f' for {json.dumps(name)}, not in "properties"')
    return None


def _kind(value: object) -> str:
    if isinstance(value, float):
        return "integer" if value.is_integer() else "fraction"
    kinds = {bool: "boolean", int: "integer", str: "string", list: "array", dict: "object"}
    return "null" if value is None else kinds.get(type(value), "object")


def _values_fit_type(node: dict[str, Any]) -> bool:
    types = _types(node, None) or frozenset()
    values = [node["const"]] if "const" in node else node.get("enum")
    return isinstance(values, list) and all(
        _kind(v) in types or (_kind(v) in ("integer", "fraction") and "number" in types)
        for v in values
    )


def _canon(value: object) -> object:
    """A hashable form of a JSON value, equal when JSON Schema calls the values equal."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return ("n", Fraction(value) if math.isfinite(value) else value)
    if isinstance(value, list):
        return ("l", tuple(_canon(v) for v in value))
    if isinstance(value, dict):
        return ("d", frozenset((k, _canon(v)) for k, v in value.items()))
    return (type(value).__name__, value)


def _apart(a: set[object] | None, b: set[object] | None) -> bool:
    return a is not None and b is not None and not a & b


class _Proofs:
    """Proves oneOf members disjoint, so xgrammar's anyOf fallback for them is exact: by the
    kinds of value they allow, by const/enum values, or by a required const/enum property."""

    def __init__(self, root: object) -> None:
        self.root, self.steps = root, _STEPS

    def disjoint(self, members: list[object]) -> bool:
        for i, a in enumerate(members):
            for b in members[i + 1 :]:
                self.steps -= 1
                if self.steps < 0 or not self._pair(self.deref(a), self.deref(b)):
                    return False
        return True

    def _pair(self, a: object, b: object) -> bool:
        if not self.kinds(a, 0) & self.kinds(b, 0) or _apart(self.values(a), self.values(b)):
            return True
        objects = [n for n in (a, b) if isinstance(n, dict) and _head(n) is None]
        if len(objects) < 2 or any(_types(n, None) != {"object"} for n in objects):
            return False
        (pa, ra), (pb, rb) = [(n.get("properties"), n.get("required")) for n in objects]
        if not (isinstance(pa, dict) and isinstance(pb, dict)):
            return False
        shared = [n for n in ra or () if isinstance(n, str) and n in pa and n in (rb or ())]
        return any(_apart(self.values(pa[n]), self.values(pb.get(n))) for n in shared)

    def deref(self, node: object) -> object:
        """`node` past its local $refs and one-member allOfs; None when not resolvable."""
        for _ in range(64):
            self.steps -= 1
            if isinstance(node, dict) and _head(node) == "$ref":
                node = self.pointer(node["$ref"])
            elif isinstance(node, dict) and _head(node) == "allOf" and len(node["allOf"]) == 1:
                node = node["allOf"][0] if isinstance(node["allOf"], list) else None
            else:
                return node
        return None

    def pointer(self, ref: object) -> object:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return None
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def kinds(self, node: object, depth: int) -> frozenset[str]:
        """An over-estimate of the kinds of JSON value xgrammar lets `node` match."""
        node = self.deref(node)
        if not isinstance(node, dict) or self.steps < 0 or depth > MAX_DEPTH:
            return frozenset() if node is False else _ALL_KINDS
        head = _head(node)
        value = node.get(head) if head else None
        if head in ("const", "enum"):
            values = [value] if head == "const" else value
            return frozenset(map(_kind, values)) if isinstance(values, list) else _ALL_KINDS
        if head in ("anyOf", "oneOf") and isinstance(value, list):
            return frozenset().union(*(self.kinds(m, depth + 1) for m in value))
        types = _types(node, None) if head is None else None
        if types is None:
            return _ALL_KINDS
        number = {"integer": ("integer",), "number": ("integer", "fraction")}
        return frozenset(k for t in types for k in number.get(t, (t,)))

    def values(self, node: object) -> set[object] | None:
        """The values `node` allows when it is a const or an enum, else None."""
        node = self.deref(node)
        head = _head(node)
        if isinstance(node, dict) and head == "const":
            return {_canon(node["const"])}
        if isinstance(node, dict) and head == "enum" and isinstance(node["enum"], list):
            return {_canon(v) for v in node["enum"]}
        return None
