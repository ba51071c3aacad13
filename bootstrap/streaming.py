"""Response shapes: OpenAI chat and completion objects and chunks, SGLang /generate, and SSE.

A format turns a Generation's Deltas and Finish into stream chunks (``start``, ``delta``,
``finish``) and, having seen them all, into the non-streaming ``response``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from bootstrap.errors import APIError
from bootstrap.generation import Delta, Finish, Generation, TokenLogprob
from bootstrap.tool_calls import ToolCall, ToolCallParser, parse_tool_calls
from bootstrap.tool_formats import ToolFormat
from common.tokenizer import Tokenizer

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def usage(finish: Finish) -> dict[str, Any]:
    return {
        "prompt_tokens": finish.num_prompt_tokens,
        "completion_tokens": finish.num_output_tokens,
        "total_tokens": finish.num_prompt_tokens + finish.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": finish.num_cached_tokens},
    }


class OutputFormat:
    """Accumulates the output; subclasses shape it for one API."""

    def __init__(self, rid: str, model: str, tokenizer: Tokenizer, *, include_usage: bool) -> None:
        self.rid = rid
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt: list[TokenLogprob] = []  # the prompt's logprobs (completions' echo)

    def add(self, delta: Delta) -> None:
        self.text_parts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.prompt is not None:
            self.prompt = delta.prompt

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def start(self) -> list[dict[str, Any]]:
        return []

    def delta(self, delta: Delta) -> list[dict[str, Any]]:
        raise NotImplementedError

    def finish(self, finish: Finish) -> list[dict[str, Any]]:
        raise NotImplementedError

    def response(self, finish: Finish) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The stream's last chunk when the client asked for usage: no choice, the usage."""
        raise NotImplementedError


def _tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {} if index is None else {"index": index}
    function = {"name": call.name, "arguments": call.arguments}
    return {**out, "id": call.id, "type": "function", "function": function}


class ChatFormat(OutputFormat):
    """Chat completions; with tools, calls are parsed out of the text into tool_calls (each
    streamed as one delta once it is complete, with its whole arguments)."""

    def __init__(
        self,
        *args: Any,
        tool_format: ToolFormat | None = None,
        tool_names: frozenset[str] = frozenset(),
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._tool_format = tool_format
        self._tool_names = set(tool_names)
        self._parser = ToolCallParser(tool_format, self._tool_names) if tool_format else None
        self._num_calls = 0

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{self.rid}",
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def _logprobs(self, items: list[TokenLogprob]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float | None) -> dict[str, Any]:
            token = self.token_text(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {
            "content": [
                {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                for t in items
            ]
        }

    def start(self) -> list[dict[str, Any]]:
        delta = {"role": "assistant", "content": ""}
        return [self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})]

    def delta(self, delta: Delta) -> list[dict[str, Any]]:
        self.add(delta)
        logprobs = self._logprobs(delta.logprobs) if delta.logprobs else None
        text, calls = (delta.text, []) if self._parser is None else self._parser.feed(delta.text)
        chunks = self._calls_chunks(calls)
        if text or logprobs is not None:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": logprobs}
            chunks.insert(0, self._chunk({**choice, "finish_reason": None}))
        return chunks

    def _calls_chunks(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        chunks = []
        for call in calls:
            delta = {"tool_calls": [_tool_call(call, self._num_calls)]}
            self._num_calls += 1
            chunks.append(
                self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})
            )
        return chunks

    def _finish_reason(self, finish: Finish, num_calls: int) -> str:
        """OpenAI's "tool_calls" when the model stopped after calling tools."""
        return (
            "tool_calls" if num_calls and finish.finish_reason == "stop" else finish.finish_reason
        )

    def finish(self, finish: Finish) -> list[dict[str, Any]]:
        chunks: list[dict[str, Any]] = []
        if self._parser is not None:
            text, calls = self._parser.finish()
            if text:
                delta = {"content": text}
                chunks.append(
                    self._chunk(
                        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
                    )
                )
            chunks += self._calls_chunks(calls)
        reason = self._finish_reason(finish, self._num_calls)
        chunks.append(
            self._chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason})
        )
        if self.include_usage:
            chunks.append(self.usage_chunk(usage(finish)))
        return chunks

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._chunk({}), "choices": [], "usage": usage}

    def response(self, finish: Finish) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        calls: list[ToolCall] = []
        if self._tool_format is not None:
            text, calls = parse_tool_calls(self.text, self._tool_format, self._tool_names)
            message = {"role": "assistant", "content": text or (None if calls else "")}
            if calls:
                message["tool_calls"] = [_tool_call(call) for call in calls]
        return {
            "id": f"chatcmpl-{self.rid}",
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": self._logprobs(self.logprobs) if self.logprobs else None,
                    "finish_reason": self._finish_reason(finish, len(calls)),
                }
            ],
            "usage": usage(finish),
        }


class CompletionFormat(OutputFormat):
    """Completions; with ``echo`` (the prompt's text) the output starts with the prompt:
    streamed, as the first chunk. With ``echo_logprobs`` that chunk waits for the prompt's
    logprobs and carries them; the output's text offsets go on from the prompt's text."""

    def __init__(
        self, *args: Any, echo: str = "", echo_logprobs: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo
        self.echo_logprobs = echo_logprobs

    def start(self) -> list[dict[str, Any]]:
        return [self._chunk(self.echo, None, None)] if self.echo and not self.echo_logprobs else []

    def _chunk(self, text: str, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        return {
            "id": f"cmpl-{self.rid}",
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
            ],
        }

    def _logprobs(
        self, items: list[TokenLogprob], offset: int, is_prompt: bool = False
    ) -> dict[str, Any]:
        """OpenAI's legacy logprobs object; a prompt's first token has no alternatives."""
        tokens = [self.token_text(t.token_id) for t in items]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        tops: list[dict[str, float] | None] = [
            {self.token_text(i): lp for i, lp in t.top} for t in items
        ]
        if is_prompt and tops:
            tops[0] = None
        return {
            "tokens": tokens,
            "token_logprobs": [t.logprob for t in items],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def delta(self, delta: Delta) -> list[dict[str, Any]]:
        offset = len(self.echo) + len(self.text)
        self.add(delta)
        if delta.prompt is not None:  # the echo, with the prompt's logprobs
            return [self._chunk(self.echo, self._logprobs(delta.prompt, 0, True), None)]
        logprobs = self._logprobs(delta.logprobs, offset) if delta.logprobs else None
        if not delta.text and logprobs is None:
            return []
        return [self._chunk(delta.text, logprobs, None)]

    def finish(self, finish: Finish) -> list[dict[str, Any]]:
        chunks = [self._chunk("", None, finish.finish_reason)]
        if self.include_usage:
            chunks.append(self.usage_chunk(usage(finish)))
        return chunks

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._chunk("", None, None), "choices": [], "usage": usage}

    def response(self, finish: Finish) -> dict[str, Any]:
        logprobs = None
        if self.prompt or self.logprobs:
            prompt = self._logprobs(self.prompt, 0, True)
            output = self._logprobs(self.logprobs, len(self.echo))
            logprobs = {k: prompt[k] + output[k] for k in prompt}
        chunk = self._chunk(self.echo + self.text, logprobs, finish.finish_reason)
        return {**chunk, "usage": usage(finish)}


class GenerateFormat(OutputFormat):
    """SGLang's /generate: cumulative text and output_ids with a meta_info block."""

    def __init__(self, *args: Any, arrival: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arrival = arrival

    def _obj(self, finish: Finish | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": None
            if finish is None
            else {"type": finish.finish_reason, "matched": finish.matched_stop},
            "prompt_tokens": None if finish is None else finish.num_prompt_tokens,
            "completion_tokens": len(self.token_ids),
            "cached_tokens": 0 if finish is None else finish.num_cached_tokens,
            "e2e_latency": time.monotonic() - self.arrival,
        }
        if self.logprobs:
            meta["output_token_logprobs"] = [[t.logprob, t.token_id, None] for t in self.logprobs]
            meta["output_top_logprobs"] = [
                [[lp, i, None] for i, lp in t.top] for t in self.logprobs
            ]
        return {"text": self.text, "output_ids": list(self.token_ids), "meta_info": meta}

    def delta(self, delta: Delta) -> list[dict[str, Any]]:
        self.add(delta)
        return [self._obj(None)]

    def finish(self, finish: Finish) -> list[dict[str, Any]]:
        return [self._obj(finish)]

    def response(self, finish: Finish) -> dict[str, Any]:
        return self._obj(finish)


async def collect(gen: Generation, fmt: OutputFormat) -> dict[str, Any]:
    """The non-streaming response; raises APIError when the request fails."""
    async for event in gen.events():
        if isinstance(event, Delta):
            fmt.add(event)
        else:
            return fmt.response(event)
    raise APIError(500, "the request ended without a result")


async def sse_stream(
    first: Delta | Finish,
    rest: AsyncIterator[Delta | Finish],
    fmt: OutputFormat,
    on_first_bytes: Callable[[], None] | None = None,
) -> AsyncIterator[bytes]:
    """SSE bytes from the first event on; a failure becomes an error event, then [DONE].

    ``on_first_bytes`` is called as the first bytes are handed to the server."""
    if on_first_bytes is not None:
        on_first_bytes()
    for chunk in fmt.start():
        yield sse(chunk)
    try:
        event: Delta | Finish | None = first
        while event is not None:
            chunks = fmt.delta(event) if isinstance(event, Delta) else fmt.finish(event)
            for chunk in chunks:
                yield sse(chunk)
            if isinstance(event, Finish):
                break
            event = await anext(rest, None)
    except APIError as exc:
        yield sse(exc.body())
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE
