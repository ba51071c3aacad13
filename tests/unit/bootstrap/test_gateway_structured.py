"""Structured output and tools at the gateway (fake nodes): what the nodes are asked for,
the 400s for grammars that cannot be enforced, and tool calls parsed out of the output."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import openai
import pytest

from common.tokenizer import Tokenizer
from tests.support import gateway as harness
from tests.support.gateway import Gateway, stream_tokens

gateway_factory = harness.gateway_factory
tokenizer = harness.tokenizer
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _sampling_of(gw: Gateway, body: dict, route: str = "/v1/chat/completions") -> dict:
    gw.node("prefill")
    decode = gw.node("decode", stream_tokens([]))
    r = httpx.post(gw.api_url + route, json={"max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return decode.wait_generates(1)[0].sampling


def test_response_formats_become_json_schemas_for_the_nodes(
    gateway_factory: Callable[..., Gateway],
) -> None:
    sampling = _sampling_of(
        gateway_factory(), {"messages": MESSAGES, "response_format": {"type": "json_object"}}
    )
    assert json.loads(sampling["json_schema"]) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    sampling = _sampling_of(
        gateway_factory(), {"prompt": "Hi", "response_format": fmt}, "/v1/completions"
    )
    assert json.loads(sampling["json_schema"]) == schema
    assert sampling["regex"] is None and sampling["structural_tag"] is None


def test_generate_passes_its_grammars_and_accepts_a_schema_object(
    gateway_factory: Callable[..., Gateway],
) -> None:
    schema = {"type": "array", "items": {"type": "integer"}}
    body = {"text": "x", "sampling_params": {"json_schema": schema}}
    sampling = _sampling_of(gateway_factory(), body, "/generate")
    assert json.loads(sampling["json_schema"]) == schema
    body = {"text": "x", "sampling_params": {"ebnf": 'root ::= "a"'}}
    assert _sampling_of(gateway_factory(), body, "/generate")["ebnf"] == 'root ::= "a"'


@pytest.mark.parametrize(
    ("route", "body", "param", "words"),
    [
        (
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"if": {"type": "string"}}},
                },
            },
            "response_format",
            ['"if"'],
        ),
        ("/generate", {"text": "x", "sampling_params": {"regex": "(a"}}, "regex", ["regex"]),
        ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= b"}}, "ebnf", ["ebnf"]),
        (
            "/generate",
            {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
            "regex",
            ["one grammar"],
        ),
        (
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
            ["nope"],
        ),
        (
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "tools": [TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            ["tools"],
        ),
        (
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"not": {"type": "null"}}},
                    }
                ],
            },
            "tools",
            ['"not"', "tools[0]"],
        ),
    ],
)
def test_grammars_that_cannot_be_enforced_are_400s_and_reach_no_node(
    gateway_factory: Callable[..., Gateway], route: str, body: dict, param: str, words: list[str]
) -> None:
    gw = gateway_factory()
    gw.node("prefill")
    decode = gw.node("decode", stream_tokens([]))
    r = httpx.post(gw.api_url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error
    assert decode.generates() == []


def test_required_tools_are_a_structural_tag_and_none_drops_the_tools(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    body = {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "required"}
    sampling = _sampling_of(gateway_factory(), body)
    assert "get_weather" in sampling["structural_tag"]
    sampling = _sampling_of(gateway_factory(), {**body, "tool_choice": "none"})
    assert sampling["structural_tag"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_in_the_output_comes_back_as_tool_calls(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer, stream: bool
) -> None:
    gw = gateway_factory()
    gw.node("prefill")
    text = 'Sure.<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    ids = tokenizer.encode(text) + sorted(tokenizer.eos_token_ids)[:1]
    gw.node("decode", stream_tokens(ids))
    cl = openai.OpenAI(base_url=gw.api_url + "/v1", api_key="none", max_retries=0)
    kwargs = {"model": "default", "messages": MESSAGES, "tools": [TOOL], "max_tokens": 200}
    if not stream:
        choice = cl.chat.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        return
    content, names, arguments, reasons = "", [], "", []
    for chunk in cl.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            names.append(c.function.name)
            arguments += c.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert content == "Sure." and names == ["get_weather"]
    assert json.loads(arguments) == {"city": "Paris"} and reasons[-1] == "tool_calls"
