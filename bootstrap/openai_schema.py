"""Request bodies of the public API (OpenAI's completions and chat, SGLang's /generate).

Strict types (a string is not a number, "yes" is not a boolean: 400), unknown fields ignored.
Values are checked later, in ``bootstrap.prepare``, where the tokenizer and context are known.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# What the nodes hold: integers travel as msgpack int64 (seeds as uint64) and become
# torch int64 tensors, so a larger value is a 400 here, not a crash there.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1


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

    model: str | None = None
    max_tokens: int | None = Field(
        default=None, le=INT64_MAX,
        description="unset: 16 (completions), the rest of the context (chat)"
    )
    temperature: float | None = Field(default=None, description="0: greedy; unset: 1")
    top_p: float | None = None
    top_k: int | None = Field(default=None, le=INT64_MAX, description="-1 or 0: disabled")
    min_p: float | None = None
    seed: int | None = Field(default=None, le=UINT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, description="only 1 is served")
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX,
                                 description="prefill scheduling priority")
    routing_key: str | None = Field(
        default=None, description="prefix-affinity key (also header x-routing-key)"
    )
    frequency_penalty: float | None = Field(default=None, description="only 0 is served")
    presence_penalty: float | None = Field(default=None, description="only 0 is served")
    repetition_penalty: float | None = Field(default=None, description="only 1 is served")
    logit_bias: dict[str, float] | None = Field(default=None, description="not served")
    user: str | None = None


class CompletionRequest(_OpenAISampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, description="top logprobs per token, 0-20")
    echo: bool = Field(default=False, description="not served")
    best_of: int | None = Field(default=None, description="only 1 is served")
    suffix: str | None = Field(default=None, description="not served")


class ChatCompletionRequest(_OpenAISampling):
    """POST /v1/chat/completions."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class GenerateRequest(_Body):
    """POST /generate, SGLang's native shape: text or input_ids plus sampling_params."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    priority: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    routing_key: str | None = None
