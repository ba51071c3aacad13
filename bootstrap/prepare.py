"""From a parsed body to a PreparedRequest: template, tokenize, check values and lengths (400s)."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any

from bootstrap.errors import bad_request
from bootstrap.generation import PreparedRequest
from bootstrap.openai_schema import (
    DEFAULT_MAX_N,
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from bootstrap.structured import check_grammar, generate_grammar, response_format_grammar
from bootstrap.tool_formats import (
    detect_format,
    messages_for_template,
    structural_tag,
    template_supports_tools,
    tool_functions,
)
from common.grammar.schema_features import check_schema
from common.sampler import sample_seed
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_GENERATE_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
_SAMPLING_FIELDS = frozenset(SamplingParams().to_wire())
# OpenAI-body fields passed on to SamplingParams as they are, when given.
_OPENAI_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_tokens",
)


def _check_served(values: dict[str, Any], max_n: int = 1) -> None:
    n = values.get("n")
    if n is not None and not (isinstance(n, int) and 1 <= n <= max_n):
        raise bad_request(f"n must be an integer in [1, {max_n}] (--max-n), got {n!r:.20}", "n")


def _sampling(params: dict[str, Any], vocab_size: int, *, is_openai: bool) -> SamplingParams:
    """SamplingParams from known keys (types and values checked); ValueError becomes 400."""
    try:
        sampling = SamplingParams.from_wire(params)
        sampling.validate(vocab_size)
    except ValueError as exc:
        text = str(exc)
        field = text.removeprefix("sampling params: ").split(" ", 1)[0].split("[", 1)[0]
        if is_openai and field == "max_new_tokens":
            field = "max_tokens"
        raise bad_request(text.removeprefix("sampling params: "), field or None) from None
    return sampling


def _check_lengths(num_prompt: int, max_new_tokens: int, context_length: int, param: str) -> None:
    if num_prompt == 0:
        raise bad_request("the prompt is empty", param)
    if num_prompt + max_new_tokens > context_length:
        raise bad_request(
            f"this model's maximum context length is {context_length} tokens; the prompt has "
            f"{num_prompt} tokens and {max_new_tokens} more were asked for",
            param,
            code="context_length_exceeded",
        )


# A normalizer may drop characters (control characters, say): the bound below leaves 2x.
_TEXT_BOUND_MARGIN = 2


def _check_text_fits(num_chars: int, tokenizer: Tokenizer, context_length: int, param: str) -> None:
    """A text that cannot fit the context is refused before it is tokenized: its tokens are
    at least its characters over the longest token's (Tokenizer.max_token_chars)."""
    at_least = num_chars // (_TEXT_BOUND_MARGIN * tokenizer.max_token_chars)
    if at_least >= context_length:
        raise bad_request(
            f"this model's maximum context length is {context_length} tokens; the prompt of "
            f"{num_chars} characters has at least {at_least} tokens",
            param,
            code="context_length_exceeded",
        )


def _message_chars(messages: list[Any]) -> int:
    """Characters of every string in the messages (contents, text parts, names)."""
    total, stack = 0, list(messages)
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _check_chat_served(body: ChatCompletionRequest) -> None:
    """Chat fields that would change the output and are not served are refused, not ignored."""
    if body.functions:
        raise bad_request("functions are not served; pass them as tools", "functions")
    if body.function_call is not None and body.function_call != "none":
        raise bad_request("function_call is not served; use tool_choice", "function_call")
    if body.modalities is not None and any(m != "text" for m in body.modalities):
        raise bad_request('modalities other than "text" are not served', "modalities")
    for name in ("audio", "prediction"):
        if getattr(body, name) is not None:
            raise bad_request(f"{name} is not served", name)


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for i, tid in enumerate(ids):
        if not 0 <= tid < vocab_size:
            raise bad_request(f"{param}[{i}] = {tid} is not a token id in [0, {vocab_size})", param)


def _max_tokens(value: int | None, default: int, param: str, least: int = 1) -> int:
    if value is None:
        return default
    if value < least:
        raise bad_request(f"{param} must be at least {least}, got {value}", param)
    return value


def _openai_sampling(
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    top_logprobs: int,
    tokenizer: Tokenizer,
    grammar: dict[str, str],
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "stop": stop,
        "stop_token_ids": body.stop_token_ids or [],
        "ignore_eos": body.ignore_eos,
        "seed": body.seed,
        **grammar,
    }
    for name in _OPENAI_SAMPLING:
        if getattr(body, name) is not None:
            params[name] = getattr(body, name)
    if isinstance(body, ChatCompletionRequest):
        params["logprobs"] = body.logprobs
    else:
        params["logprobs"] = body.logprobs is not None
    params["top_logprobs"] = top_logprobs
    params["logit_bias"] = _logit_bias(body.logit_bias)
    return _sampling(params, tokenizer.vocab_size, is_openai=True)


def _logit_bias(bias: dict[str, float] | None) -> list[list[int | float]]:
    """OpenAI's {"token id": bias} as the wire's [id, bias] pairs; a key that is not an
    integer is a 400 (ranges are checked with the other sampling parameters)."""
    pairs: list[list[int | float]] = []
    for key, value in (bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {key!r:.40}", "logit_bias"
            ) from None
        pairs.append([tid, value])
    return pairs


MAX_ROUTING_KEY_CHARS = 1024  # the body's routing_key has the same bound (openai_schema)


def _routing_key(body_key: str | None, header_key: str | None) -> str | None:
    if header_key is not None and len(header_key) > MAX_ROUTING_KEY_CHARS:
        raise bad_request(
            f"the x-routing-key header is over {MAX_ROUTING_KEY_CHARS} characters", "x-routing-key"
        )
    return body_key if body_key is not None else (header_key or None)


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions request: a text, token ids, or a list of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt")
    return list(prompt)


# Prompt logprobs travel in one message (TransferDone, then PromptLogprobs): at ~15 bytes
# an entry this keeps it near 30 MB, under common/ipc.py's 64 MiB frame.
MAX_PROMPT_LOGPROB_ENTRIES = 2_000_000


def _check_prompt_logprobs_fit(num_prompt: int, top: int) -> None:
    entries = num_prompt * (top + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise bad_request(
            f"echo with logprobs={top} over {num_prompt} prompt tokens is {entries} entries, "
            f"over {MAX_PROMPT_LOGPROB_ENTRIES:,}: ask for fewer logprobs or a shorter prompt",
            "logprobs",
        )


def best_of(body: CompletionRequest, max_n: int = DEFAULT_MAX_N) -> int:
    """Samples drawn per prompt: ``best_of`` (OpenAI's: at least ``n``; the ``n`` whose
    output has the highest logprob per token are returned), else ``n``. Above ``n`` they
    cannot stream: the ranking needs every sample whole."""
    n = body.n or 1
    if body.best_of is None:
        return n
    if not (n <= body.best_of <= max_n):
        raise bad_request(
            f"best_of must be an integer in [n={n}, {max_n}] (--max-n), got {body.best_of}",
            "best_of",
        )
    if body.stream and body.best_of > n:
        raise bad_request("best_of above n cannot be streamed", "best_of")
    return body.best_of


def prepare_completion(
    body: CompletionRequest,
    tokenizer: Tokenizer,
    context_length: int,
    header_key: str | None,
    max_n: int = DEFAULT_MAX_N,
) -> list[PreparedRequest]:
    """One prepared request per prompt, in order (``n`` samples of each: ``samples``)."""
    _check_served(body.model_dump(), max_n)
    if body.suffix:
        raise bad_request("suffix is not served", "suffix")
    draws = best_of(body, max_n)
    # 0 with echo: the prompt (and its logprobs) alone, as scoring harnesses ask
    max_tokens = _max_tokens(
        body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, "max_tokens", 0 if body.echo else 1
    )
    top = body.logprobs or 0
    grammar = response_format_grammar(body.response_format)
    check_grammar(grammar, "response_format")
    sampling = _openai_sampling(body, max_tokens, top, tokenizer, grammar)
    if draws > (body.n or 1):  # the nodes report each token's logprob: the ranking reads it
        sampling = replace(sampling, logprobs=True)
    prepared = []
    for prompt in _completion_prompts(body.prompt):
        if isinstance(prompt, str):
            _check_text_fits(len(prompt), tokenizer, context_length, "prompt")
            input_ids = tokenizer.encode(prompt)
        else:
            input_ids = list(prompt)
            _check_ids(input_ids, tokenizer.vocab_size, "prompt")
        _check_lengths(len(input_ids), max_tokens, context_length, "prompt")
        if body.echo and body.logprobs is not None:
            _check_prompt_logprobs_fit(len(input_ids), top)
        echo = ""
        if body.echo:
            echo = (
                prompt
                if isinstance(prompt, str)
                else tokenizer.decode(prompt, skip_special_tokens=False)
            )
        prepared.append(
            PreparedRequest(
                input_ids,
                sampling,
                body.priority,
                _routing_key(body.routing_key, header_key),
                body.cache_salt,
                echo=echo,
                echo_logprobs=bool(body.echo) and body.logprobs is not None,
                prompt_logprobs=bool(body.echo) and body.logprobs is not None,
            )
        )
    return prepared


def samples(prepared: PreparedRequest, n: int) -> list[PreparedRequest]:
    """``n`` samples of one prompt; each seeded sample draws from its own stream (sample 0
    from the request's seed, sample i from ``sample_seed(seed, i)``). Only sample 0 asks
    the nodes for the prompt's logprobs (echo): computing them reads no cache, and the
    others show its copy (bootstrap/choices.py). n > 1: they share a fresh sample group
    (GenerateReq.sample_group), so the nodes compute and move the prompt once."""
    if n > 1:
        prepared = replace(prepared, sample_group=uuid.uuid4().hex, num_group_samples=n)
    seed = prepared.sampling.seed
    follower = replace(prepared, prompt_logprobs=False)
    return [
        prepared
        if i == 0
        else follower
        if seed is None
        else replace(follower, sampling=replace(prepared.sampling, seed=sample_seed(seed, i)))
        for i in range(n)
    ]


def prepare_chat(
    body: ChatCompletionRequest,
    tokenizer: Tokenizer,
    context_length: int,
    header_key: str | None,
    max_n: int = DEFAULT_MAX_N,
) -> PreparedRequest:
    _check_served(body.model_dump(), max_n)
    _check_chat_served(body)
    if not body.messages:
        raise bad_request("messages must be a non-empty list", "messages")
    # OpenAI's newer name for the system role; chat templates know only "system".
    messages = [
        {**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
        for m in body.messages
    ]
    _check_text_fits(_message_chars(messages), tokenizer, context_length, "messages")
    tools = _chat_tools(body)
    template = tokenizer.hf_tokenizer.chat_template
    tool_format = detect_format(template if isinstance(template, str) else None)
    supports_tools = template_supports_tools(template if isinstance(template, str) else None)
    try:
        tool_grammar = (
            structural_tag(tools, body.tool_choice, body.parallel_tool_calls, tool_format)
            if tools
            else None
        )
    except ValueError as exc:
        raise bad_request(str(exc), "tool_choice") from None
    grammar = response_format_grammar(body.response_format)
    if tool_grammar is not None:
        if grammar:
            raise bad_request(
                'response_format cannot be combined with tools unless tool_choice is "none"',
                "response_format",
            )
        grammar = {"structural_tag": tool_grammar}
    check_grammar(grammar, "tools" if tool_grammar is not None else "response_format")
    try:
        rendered = messages_for_template(messages, tools, tool_format, supports_tools)
        input_ids = tokenizer.apply_chat_template(
            rendered, tools=tools if supports_tools and tools else None
        )
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    if not input_ids:
        raise bad_request("the messages render to an empty prompt", "messages")
    if len(input_ids) >= context_length:
        _check_lengths(len(input_ids), 1, context_length, "messages")
    asked = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = _max_tokens(asked, context_length - len(input_ids), param)
    _check_lengths(len(input_ids), max_tokens, context_length, "messages")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    sampling = _openai_sampling(body, max_tokens, body.top_logprobs or 0, tokenizer, grammar)
    return PreparedRequest(
        input_ids,
        sampling,
        body.priority,
        _routing_key(body.routing_key, header_key),
        body.cache_salt,
        tool_format=tool_format if tool_grammar is not None else None,
        tool_names=frozenset(f["name"] for f in tool_functions(tools or [])),
    )


def _chat_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools (None when there are none or tool_choice is "none"); each
    function's parameters schema is checked like a response_format's (400s)."""
    if not body.tools or body.tool_choice == "none":
        return None
    try:
        functions = tool_functions(body.tools)
    except ValueError as exc:
        raise bad_request(str(exc), "tools") from None
    for i, function in enumerate(functions):
        if function.get("parameters") is not None:
            try:
                check_schema(json.dumps(function["parameters"]))
            except ValueError as exc:
                raise bad_request(f"tools[{i}].function.parameters: {exc}", "tools") from None
    return list(body.tools)


def prepare_generate(
    body: GenerateRequest, tokenizer: Tokenizer, context_length: int, header_key: str | None
) -> PreparedRequest:
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("pass exactly one of text and input_ids", "text")
    _check_served(body.sampling_params)
    if body.text is not None:
        _check_text_fits(len(body.text), tokenizer, context_length, "text")
        input_ids = tokenizer.encode(body.text)
    else:
        input_ids = list(body.input_ids or [])
        _check_ids(input_ids, tokenizer.vocab_size, "input_ids")
    params = {k: v for k, v in body.sampling_params.items() if k in _SAMPLING_FIELDS}
    grammar = generate_grammar(params)
    check_grammar(grammar)
    params.update(grammar)
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    params.setdefault("max_new_tokens", DEFAULT_GENERATE_MAX_NEW_TOKENS)
    if "min_new_tokens" in body.sampling_params:  # SGLang's name for min_tokens
        params["min_tokens"] = body.sampling_params["min_new_tokens"]
    params["logprobs"] = body.return_logprob
    params["top_logprobs"] = body.top_logprobs_num
    sampling = _sampling(params, tokenizer.vocab_size, is_openai=False)
    if sampling.max_new_tokens < 1:
        raise bad_request("max_new_tokens must be at least 1", "max_new_tokens")
    _check_lengths(len(input_ids), sampling.max_new_tokens, context_length, "input_ids")
    return PreparedRequest(
        input_ids,
        sampling,
        body.priority,
        _routing_key(body.routing_key, header_key),
        body.cache_salt,
    )
