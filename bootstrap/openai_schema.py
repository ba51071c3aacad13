"""Request bodies of the public API (OpenAI's completions and chat, SGLang's /generate).

Strict types (a string is not a number, "yes" is not a boolean: 400), unknown fields ignored.
Values are checked later, in ``bootstrap.prepare``, where the tokenizer and context are known;
the ranges and enums that check enforces are written into the OpenAPI schema here
(``json_schema_extra``), so a client or a schema-driven fuzzer knows what is served.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.sampling_params import (
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)

DEFAULT_MAX_N = 16  # --max-n: samples one request may ask for (n)
MAX_PROMPTS = 64  # prompts in one completions request (each is its own request)

# What the nodes hold: integers travel as msgpack int64 (seeds as uint64) and become
# torch int64 tensors, so a larger value is a 400 here, not a crash there.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1
# common.tokenizer.CHAT_ROLES, plus OpenAI's "developer" (served as "system").
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
# A "tool" message answers a call: it names the call's id (common.tokenizer checks it).
_MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "anyOf": [
            {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": [r for r in CHAT_ROLES if r != "tool"]},
                    "content": _CONTENT,
                    "name": {"type": "string"},
                },
            },
            {
                "type": "object",
                "required": ["role", "content", "tool_call_id"],
                "properties": {
                    "role": {"enum": ["tool"]},
                    "content": _CONTENT,
                    "tool_call_id": {"type": "string"},
                },
            },
        ]
    },
}
_STOP_TEXT = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
_MAX_STOPS = MAX_STOP_STRINGS
_MAX_STOP_IDS = MAX_STOP_TOKEN_IDS
_TOKEN_ID = {"type": "integer", "minimum": 0, "description": "below the vocabulary size"}
_GRAMMAR_TEXT = {"type": "string", "minLength": 1, "maxLength": MAX_GRAMMAR_CHARS}
_RESPONSE_FORMAT = {
    "anyOf": [
        {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}},
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"enum": ["json_schema"]},
                "json_schema": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "description": {"type": "string"},
                        "schema": {"type": "object"},
                        "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
                    },
                },
            },
        },
        {"type": "null"},
    ]
}
_FUNCTION = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
        "description": {"type": "string"},
        "parameters": {"type": "object"},
        "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    },
}
_TOOLS = {
    "anyOf": [
        {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "function"],
                "properties": {"type": {"enum": ["function"]}, "function": _FUNCTION},
            },
        },
        {"type": "null"},
    ]
}
_TOOL_CHOICE = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"enum": ["function"]},
                "function": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}},
                },
            },
        },
        {"type": "null"},
    ]
}


def _served(**schema: Any) -> Any:
    """JSON-schema keywords for what ``bootstrap.prepare`` accepts (it gives the 400s)."""
    return schema


def _find_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string in `value` holding a lone surrogate (U+D800-U+DFFF).

    JSON may escape one ("\\ud800"); it is no text (it has no UTF-8 encoding), so the
    tokenizer and the router could not take it.
    """
    if isinstance(value, str):
        return path if any(0xD800 <= ord(c) <= 0xDFFF for c in value) else None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and _find_surrogate(key) is not None:
            return f"{path}.{key!r}" if path else repr(key)
        found = _find_surrogate(item, f"{path}[{key!r}]" if path else str(key))
        if found is not None:
            return found
    return None


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @field_validator("*", mode="before")
    @classmethod
    def _text_is_text(cls, value: Any) -> Any:
        where = _find_surrogate(value)
        if where is not None:
            at = f" (at {where})" if where else ""
            raise ValueError(f"contains a lone surrogate{at}: not valid Unicode text")
        return value


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    """Fields completions and chat share."""

    # Echoed in every chunk of the answer: a long one would multiply the response size.
    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = Field(
        default=None,
        le=INT64_MAX,
        json_schema_extra=_served(minimum=1),
        description="unset: 16 (completions), the rest of the context (chat); prompt + "
        "max_tokens must fit the context length",
    )
    temperature: float | None = Field(
        default=None, json_schema_extra=_served(minimum=0), description="0: greedy; unset: 1"
    )
    top_p: float | None = Field(
        default=None, json_schema_extra=_served(exclusiveMinimum=0, maximum=1)
    )
    top_k: int | None = Field(
        default=None,
        le=INT64_MAX,
        json_schema_extra=_served(minimum=-1),
        description="-1 or 0: disabled",
    )
    min_p: float | None = Field(default=None, json_schema_extra=_served(minimum=0, maximum=1))
    seed: int | None = Field(default=None, ge=0, le=UINT64_MAX)
    stop: str | list[str] | None = Field(
        default=None,
        json_schema_extra=_served(
            anyOf=[
                _STOP_TEXT,
                {"type": "array", "items": _STOP_TEXT, "maxItems": _MAX_STOPS},
                {"type": "null"},
            ]
        ),
    )
    stop_token_ids: list[int] | None = Field(
        default=None,
        json_schema_extra=_served(
            anyOf=[
                {"type": "array", "items": _TOKEN_ID, "maxItems": _MAX_STOP_IDS},
                {"type": "null"},
            ]
        ),
    )
    ignore_eos: bool = False
    n: int = Field(
        default=1,
        json_schema_extra=_served(minimum=1, maximum=DEFAULT_MAX_N),
        description="samples of the prompt, each its own choice (at most --max-n)",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int | None = Field(
        default=None, ge=INT64_MIN, le=INT64_MAX, description="prefill scheduling priority"
    )
    routing_key: str | None = Field(
        default=None, max_length=1024, description="prefix-affinity key (also header x-routing-key)"
    )
    cache_salt: str | None = Field(
        default=None,
        max_length=1024,
        description="prefix-cache isolation: requests share cached KV only with the same salt",
    )
    frequency_penalty: float | None = Field(
        default=None,
        json_schema_extra=_served(minimum=-2, maximum=2),
        description="OpenAI's: logit -= penalty x times the token was output so far",
    )
    presence_penalty: float | None = Field(
        default=None,
        json_schema_extra=_served(minimum=-2, maximum=2),
        description="OpenAI's: logit -= penalty once the token was output",
    )
    repetition_penalty: float | None = Field(
        default=None,
        json_schema_extra=_served(exclusiveMinimum=0),
        description="SGLang's and vLLM's: a token of the prompt or output so far has its logit "
        "divided by it where positive, multiplied where not; 1: off",
    )
    min_tokens: int | None = Field(
        default=None,
        json_schema_extra=_served(minimum=0),
        description="vLLM's: EOS and stop_token_ids are held back until this many tokens are "
        "out (at most max_tokens)",
    )
    logit_bias: dict[str, float] | None = Field(
        default=None,
        json_schema_extra=_served(maxProperties=MAX_LOGIT_BIAS),
        description="token id (as a string) -> bias in [-100, 100], added to its logit",
    )
    user: str | None = None
    response_format: Any = Field(
        default=None,
        json_schema_extra=_served(**_RESPONSE_FORMAT),
        description='structured output: {"type": "json_object"} or {"type": "json_schema", '
        '"json_schema": {"name": ..., "schema": {...}}}; the output is constrained to it '
        "(a schema keyword that cannot be enforced is a 400 naming it)",
    )


class CompletionRequest(_OpenAISampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        json_schema_extra=_served(
            anyOf=[
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "minItems": 1,
                    "maxItems": MAX_PROMPTS,
                },
                {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                {
                    "type": "array",
                    "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                    "minItems": 1,
                    "maxItems": MAX_PROMPTS,
                },
            ]
        ),
        description="a prompt (text or token ids) or a list of them: one choice per prompt "
        "(times n), each its own request, in order",
    )
    logprobs: int | None = Field(
        default=None,
        json_schema_extra=_served(minimum=0, maximum=MAX_TOP_LOGPROBS),
        description="top logprobs per token, 0-20",
    )
    echo: bool = Field(
        default=False,
        description="the prompt's text before the output; with logprobs, the prompt's tokens "
        "and logprobs too (the prefill node computes the whole prompt, cached or not)",
    )
    best_of: int | None = Field(
        default=None,
        json_schema_extra=_served(minimum=1, maximum=DEFAULT_MAX_N),
        description="samples drawn per prompt, at least n: the n of the highest logprob per "
        "token are returned (above n: not streamed)",
    )
    suffix: str | None = Field(
        default=None, json_schema_extra=_served(enum=["", None]), description="not served"
    )


class ChatCompletionRequest(_OpenAISampling):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]] = Field(json_schema_extra=_served(**_MESSAGES))
    max_completion_tokens: int | None = Field(
        default=None, le=INT64_MAX, json_schema_extra=_served(minimum=1)
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(
        default=None,
        json_schema_extra=_served(minimum=0, maximum=MAX_TOP_LOGPROBS),
        description="needs logprobs: true",
    )
    tools: list[Any] | None = Field(
        default=None,
        json_schema_extra=_served(**_TOOLS),
        description="function tools; calls come back in message.tool_calls",
    )
    tool_choice: Any = Field(
        default=None,
        json_schema_extra=_served(**_TOOL_CHOICE),
        description='"auto" (default with tools), "none", "required" or a named function; '
        "required and named choices are enforced by a grammar",
    )
    parallel_tool_calls: bool = True
    # Fields that would change the output but are not served: a 400 names them, rather
    # than a silently different answer.
    functions: list[Any] | None = Field(
        default=None,
        json_schema_extra=_served(anyOf=[{"type": "array", "maxItems": 0}, {"type": "null"}]),
        description="not served (no function calling)",
    )
    function_call: Any = Field(
        default=None,
        json_schema_extra=_served(enum=["none", None]),
        description='not served: omit it or pass "none"',
    )
    modalities: list[Any] | None = Field(
        default=None,
        json_schema_extra=_served(
            anyOf=[{"type": "array", "items": {"enum": ["text"]}}, {"type": "null"}]
        ),
        description='only ["text"] is served',
    )
    audio: Any = Field(
        default=None, json_schema_extra=_served(type="null"), description="not served"
    )
    prediction: Any = Field(
        default=None, json_schema_extra=_served(type="null"), description="not served"
    )


class GenerateRequest(_Body):
    """POST /generate, SGLang's native shape: text or input_ids plus sampling_params."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {
                    "required": ["text"],
                    "properties": {
                        "text": {"type": "string", "minLength": 1},
                        "input_ids": {"type": "null"},
                    },
                },
                {
                    "required": ["input_ids"],
                    "properties": {"input_ids": {"type": "array"}, "text": {"type": "null"}},
                },
            ]
        }
    )

    text: str | None = Field(default=None, description="exactly one of text and input_ids")
    input_ids: list[int] | None = Field(
        default=None,
        json_schema_extra=_served(
            anyOf=[{"type": "array", "items": _TOKEN_ID, "minItems": 1}, {"type": "null"}]
        ),
    )
    sampling_params: dict[str, Any] = Field(
        default_factory=dict,
        json_schema_extra=_served(
            properties={
                "max_new_tokens": {"type": "integer", "minimum": 1, "maximum": INT64_MAX},
                "temperature": {"type": "number", "minimum": 0},
                "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "top_k": {"type": "integer", "minimum": -1, "maximum": INT64_MAX},
                "min_p": {"type": "number", "minimum": 0, "maximum": 1},
                "seed": {
                    "anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": UINT64_MAX},
                        {"type": "null"},
                    ]
                },
                "stop": {
                    "anyOf": [
                        _STOP_TEXT,
                        {"type": "array", "items": _STOP_TEXT, "maxItems": _MAX_STOPS},
                    ]
                },
                "stop_token_ids": {"type": "array", "items": _TOKEN_ID, "maxItems": _MAX_STOP_IDS},
                "ignore_eos": {"type": "boolean"},
                "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
                "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
                "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
                "min_new_tokens": {"type": "integer", "minimum": 0},
                "json_schema": {"anyOf": [_GRAMMAR_TEXT, {"type": "object"}]},
                "regex": _GRAMMAR_TEXT,
                "ebnf": _GRAMMAR_TEXT,
                "structural_tag": {"anyOf": [_GRAMMAR_TEXT, {"type": "object"}]},
            }
        ),
        description="SGLang's sampling parameters; unknown keys are ignored; at most one of "
        "json_schema, regex, ebnf and structural_tag constrains the output",
    )
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(
        default=0, json_schema_extra=_served(minimum=0, maximum=MAX_TOP_LOGPROBS)
    )
    priority: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    routing_key: str | None = Field(default=None, max_length=1024)
    cache_salt: str | None = Field(
        default=None,
        max_length=1024,
        description="prefix-cache isolation: requests share cached KV only with the same salt",
    )
