"""Several choices in one response: a completions ``prompt`` that is a list (one request per
prompt, in order) and ``n`` > 1 (n samples of one prompt).

Each choice is its own Generation through the cluster, with its own format (what one
choice's chunks and response look like, with ``index`` 0); this module renumbers them and
merges them into one response: streamed, the chunks of all choices interleaved as they
come, each carrying its choice's ``index``, then one usage chunk when asked; not streamed,
one object with every choice in order. ``usage`` counts a prompt once however many
samples it has: ``prompt_tokens`` is the sum over distinct prompts, ``completion_tokens``
over choices. A choice that fails fails the response (its error event ends the stream,
the other choices are aborted on their nodes).

``best_of`` (completions, not streamed): each prompt's ``best_of`` samples run, and the
``keep`` (= n) whose output has the highest mean logprob per token are returned, best
first (ties: the earlier sample); ``usage`` counts every sample's tokens (they were all
generated). Their logprobs, which the ranking needs, are shown only when asked.

echo + logprobs with several samples of a prompt: only the first sample's request asks
the nodes for the prompt's logprobs (computing them reads no cache); the others show its
copy. Streamed, such a sample's chunks wait until the first one's prompt logprobs (or its
end) have come, so that its echo chunk goes first.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bootstrap.errors import APIError
from bootstrap.generation import Delta, Finish, Generation
from bootstrap.streaming import SSE_DONE, OutputFormat, collect, sse


@dataclass
class Choice:
    gen: Generation
    fmt: OutputFormat
    prompt: int  # which distinct prompt it samples (usage counts each prompt once)
    # echo + logprobs on a sample after the first: it shows the first sample's copy of the
    # prompt's logprobs (the nodes compute them once)
    borrows_prompt: bool = False


def merged_usage(choices: Sequence[Choice], finishes: Sequence[Finish]) -> dict[str, Any]:
    prompts: dict[int, Finish] = {}
    for c, f in zip(choices, finishes, strict=True):
        prompts.setdefault(c.prompt, f)
    prompt_tokens = sum(f.num_prompt_tokens for f in prompts.values())
    completion = sum(f.num_output_tokens for f in finishes)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {
            "cached_tokens": sum(f.num_cached_tokens for f in prompts.values())
        },
    }


def mean_logprob(fmt: OutputFormat) -> float:
    """The output's logprob per token (best_of's ranking); a token the node sent no
    logprob for counts as impossible, an empty output as 0."""
    values = [t.logprob for t in fmt.logprobs]
    if not values:
        return 0.0
    return sum(-math.inf if v is None else v for v in values) / len(values)


def _reindex(chunk: dict[str, Any], index: int) -> dict[str, Any]:
    for choice in chunk.get("choices", ()):
        choice["index"] = index
    return chunk


class Choices:
    """The choices of one response; quacks like a Generation where the gateway needs it."""

    def __init__(
        self,
        choices: Sequence[Choice],
        include_usage: bool,
        keep: int | None = None,
        show_logprobs: bool = True,
    ) -> None:
        self.choices = list(choices)
        self.include_usage = include_usage
        self.keep = keep  # best_of: the samples of each prompt returned
        self.show_logprobs = show_logprobs

    def abandon(self) -> None:
        for c in self.choices:
            c.gen.abandon()

    def first_bytes_sent(self) -> None:
        for c in self.choices:
            c.gen.first_bytes_sent()

    async def collect(self) -> dict[str, Any]:
        """The whole response; raises APIError (the others abandoned) if a choice fails."""
        finishes: list[Finish] = []
        parts: list[dict[str, Any]] = []
        try:
            for c in self.choices:  # they run concurrently on the nodes either way
                part = await collect(c.gen, c.fmt)
                parts.append(part)
                finishes.append(_finish_of(part))
        except APIError:
            self.abandon()
            raise
        for k, c in enumerate(self.choices):
            if c.borrows_prompt:
                c.fmt.prompt = self._lender(k).fmt.prompt
                parts[k] = c.fmt.response(finishes[k])
        body = dict(parts[0])
        returned = range(len(parts)) if self.keep is None else self._best(self.keep)
        body["choices"] = [_reindex(parts[j], i)["choices"][0] for i, j in enumerate(returned)]
        if not self.show_logprobs:
            for choice in body["choices"]:
                choice["logprobs"] = None
        body["usage"] = merged_usage(self.choices, finishes)
        return body

    def _lender(self, k: int) -> Choice:
        """The sample of choice k's prompt that asked for the prompt's logprobs."""
        prompt = self.choices[k].prompt
        return next(c for c in self.choices if c.prompt == prompt and not c.borrows_prompt)

    def _chunks(self, i: int, event: Delta | Finish, finishes: dict[int, Finish]) -> list[Any]:
        fmt = self.choices[i].fmt
        if isinstance(event, Finish):
            finishes[i] = event
        chunks = fmt.delta(event) if isinstance(event, Delta) else fmt.finish(event)
        return [_reindex(chunk, i) for chunk in chunks]

    def _release(
        self, i: int, held: dict[int, list[Delta | Finish]], finishes: dict[int, Finish]
    ) -> list[Any]:
        """Chunks of the samples that borrow choice i's prompt logprobs: each one's echo
        with them, then what it had sent meanwhile."""
        out: list[Any] = []
        lender = self.choices[i]
        for k in [k for k in held if self.choices[k].prompt == lender.prompt]:
            echo = Delta("", [], prompt=list(lender.fmt.prompt))
            out += self._chunks(k, echo, finishes)
            for event in held.pop(k):
                out += self._chunks(k, event, finishes)
        return out

    def _best(self, keep: int) -> list[int]:
        """Per prompt in order, its ``keep`` samples of the highest mean logprob per
        output token, best first."""
        by_prompt: dict[int, list[int]] = {}
        for j, c in enumerate(self.choices):
            by_prompt.setdefault(c.prompt, []).append(j)
        return [
            j
            for samples in by_prompt.values()
            for j in sorted(samples, key=lambda j: -mean_logprob(self.choices[j].fmt))[:keep]
        ]

    async def stream(
        self, on_first_bytes: Callable[[], None] | None = None
    ) -> AsyncIterator[bytes]:
        """SSE of every choice's chunks as they come, renumbered; then usage and [DONE]."""
        if on_first_bytes is not None:
            on_first_bytes()
        queue: asyncio.Queue[tuple[int, Delta | Finish | APIError]] = asyncio.Queue()

        async def pump(i: int, gen: Generation) -> None:
            try:
                async for event in gen.events():
                    await queue.put((i, event))
            except APIError as exc:
                await queue.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, c.gen)) for i, c in enumerate(self.choices)]
        finishes: dict[int, Finish] = {}
        # a borrowing sample's events until its prompt's logprobs have come
        held: dict[int, list[Delta | Finish]] = {
            i: [] for i, c in enumerate(self.choices) if c.borrows_prompt
        }
        try:
            for i, c in enumerate(self.choices):
                for chunk in c.fmt.start():
                    yield sse(_reindex(chunk, i))
            while len(finishes) < len(self.choices):
                i, event = await queue.get()
                if isinstance(event, APIError):
                    self.abandon()
                    yield sse(event.body())
                    break
                if i in held:
                    held[i].append(event)
                    continue
                chunks = self._chunks(i, event, finishes)
                if isinstance(event, Finish) or event.prompt is not None:
                    chunks += self._release(i, held, finishes)
                for chunk in chunks:
                    yield sse(chunk)
            else:
                if self.include_usage:
                    done = [finishes[i] for i in range(len(self.choices))]
                    usage = merged_usage(self.choices, done)
                    yield sse(self.choices[0].fmt.usage_chunk(usage))
        finally:
            if len(finishes) < len(self.choices):
                self.abandon()  # an error, or the client left: nothing of it goes on
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        yield SSE_DONE


def _finish_of(part: dict[str, Any]) -> Finish:
    """A choice's Finish again, from its response's usage (what merged_usage reads)."""
    u = part["usage"]
    return Finish(
        finish_reason=part["choices"][0].get("finish_reason") or "",
        matched_stop=None,
        num_prompt_tokens=u["prompt_tokens"],
        num_output_tokens=u["completion_tokens"],
        num_cached_tokens=u.get("prompt_tokens_details", {}).get("cached_tokens", 0),
    )
