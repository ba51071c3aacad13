"""Structured output at the gateway: response_format and /generate's grammars, checked (400s).

The gateway turns OpenAI's ``response_format`` into SGLang's sampling fields (a JSON object
is the schema ``{"type": "object"}``; a ``json_schema`` format its ``schema``) and checks
every grammar before it is routed: a schema keyword the grammar engine would not enforce, a
regex or EBNF that does not parse, answer 400 naming the problem, so a request that cannot
be served as asked is never served differently. The nodes compile the grammar against the
tokenizer (common/grammar/backend.py); that compile can still fail (400 from the node).
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

from bootstrap.errors import bad_request
from common.grammar.backend import clean_error
from common.grammar.schema_features import check_schema
from common.sampling_params import GRAMMAR_FIELDS

JSON_OBJECT_SCHEMA = '{"type": "object"}'


def response_format_grammar(fmt: Any) -> dict[str, str]:
    """The sampling fields for an OpenAI ``response_format`` (empty for text or none)."""
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request('response_format must be an object with a "type"', "response_format")
    kind = fmt["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                'response_format of type "json_schema" needs a "json_schema" object',
                "response_format",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema object",
                "response_format",
            )
        return {"json_schema": json.dumps(schema)}
    raise bad_request(
        f'response_format type {kind!r:.40} is not served; use "text", "json_object" or '
        '"json_schema"',
        "response_format",
    )


def generate_grammar(sampling_params: dict[str, Any]) -> dict[str, str]:
    """/generate's grammar fields as strings (a schema or structural tag may be an object)."""
    out: dict[str, str] = {}
    for name in GRAMMAR_FIELDS:
        value = sampling_params.get(name)
        if value is None:
            continue
        if name in ("json_schema", "structural_tag") and isinstance(value, (dict, bool)):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise bad_request(f"{name} must be a string", name)
        out[name] = value
    return out


def check_grammar(fields: dict[str, str], param: str | None = None) -> None:
    """400 unless the grammar fields hold at most one grammar the engine can enforce."""
    if len(fields) > 1:
        names = sorted(fields)
        raise bad_request(f"pass one grammar, got {', '.join(names)}", param or names[1])
    for kind, text in fields.items():
        where = param or kind
        try:
            if kind == "json_schema":
                check_schema(text)
            elif kind == "regex":
                xgr.Grammar.from_regex(text)
            elif kind == "ebnf":
                xgr.Grammar.from_ebnf(text)
            elif kind == "structural_tag":
                xgr.Grammar.from_structural_tag(text)
        except ValueError as exc:
            raise bad_request(f"{kind}: {exc}", where) from None
        except Exception as exc:  # noqa: BLE001 - xgrammar's parse errors (RuntimeError, ...)
            raise bad_request(f"invalid {kind}: {clean_error(exc)}", where) from None
