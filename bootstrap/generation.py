"""One admitted request's output as the client sees it: incremental text, stop strings, timing.

``Generation.events()`` turns the request's reply queue into ``Delta``s and one final
``Finish``; a failure (ReqFailed, node lost, timeout) raises ``APIError``, unless it is
the nodes' fault: then the request moves to another pair with its output so far, up to
``--migration-limit`` times (bootstrap/migration.py), and the events go on as if nothing
happened. Leaving the iteration early (client gone) aborts the request on both nodes.
Client-side latency metrics (TTFT, inter-token, end-to-end, migration gaps) and the
request outcome are recorded here.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from bootstrap import gateway_metrics as gm
from bootstrap.dispatcher import Dispatcher, InflightReq, ReqState
from bootstrap.errors import APIError
from bootstrap.gateway_metrics import count_request
from bootstrap.migration import (
    MIGRATION_RETRY_S,
    OutputSoFar,
    Redispatch,
    migration_reason,
)
from bootstrap.tool_formats import ToolFormat
from common import messages as msg
from common import metrics, stages
from common.sampling_params import SamplingParams
from common.stop import StopChecker
from common.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request ready to route: prompt ids, sampling and routing hints."""

    input_ids: list[int]
    sampling: SamplingParams
    priority: int | None = None
    routing_key: str | None = None
    cache_salt: str | None = None  # prefix-cache isolation (GenerateReq.cache_salt)
    # The prompt's chained page hashes (common/page_hash.py), for precise routing; None
    # when the router does not use them.
    page_hashes: list[int] | None = None
    # Chat with tools: how the model writes its calls (they are parsed out of the output
    # into tool_calls) and the functions it may call; None: no tool calls to look for.
    tool_format: ToolFormat | None = None
    tool_names: frozenset[str] = frozenset()
    # Completions with echo: the prompt's text, put before the output.
    echo: str = ""
    # Completions with echo and logprobs: the echo shows the prompt's logprobs, and (this
    # request, not the other samples of its prompt, which take its copy) the nodes compute
    # and send them.
    echo_logprobs: bool = False
    prompt_logprobs: bool = False
    # The samples of one prompt (GenerateReq.sample_group; "": none) and how many there are.
    sample_group: str = ""
    num_group_samples: int = 1


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's logprob and its alternatives, best first."""

    token_id: int
    logprob: float | None  # None: the node did not compute it (sent as NaN)
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """What one reply adds: new text (stop strings held back or cut) and the new token ids."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # The prompt's tokens and logprobs (the first has none), once, before any output.
    prompt: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Finish:
    """How the request ended and its usage counts."""

    finish_reason: str
    matched_stop: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _logprobs(chunk: msg.TokenChunk) -> list[TokenLogprob]:
    """The chunk's logprobs; malformed alternatives are skipped, NaN becomes None.

    JSON has no NaN.
    """
    if chunk.logprobs is None:
        return []
    return _token_logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)


def _prompt_logprobs(input_ids: list[int], m: msg.PromptLogprobs) -> list[TokenLogprob]:
    """Each prompt token with its logprob: none for the first (nothing precedes it), then
    the node's, one per following token (a short list leaves the rest None)."""
    logprobs = [*m.logprobs[: len(input_ids) - 1]]
    logprobs += [math.nan] * (len(input_ids) - 1 - len(logprobs))
    return [
        TokenLogprob(input_ids[0], None, []),
        *_token_logprobs(input_ids[1:], logprobs, m.top_logprobs),
    ]


def _token_logprobs(
    token_ids: list[int], logprobs: list[float], top_logprobs: list[list[Any]] | None
) -> list[TokenLogprob]:
    tops = [*(top_logprobs or [])]
    tops += [[] for _ in range(len(token_ids) - len(tops))]
    out = []
    for tid, lp, top in zip(token_ids, logprobs, tops, strict=False):
        pairs = [
            (p[0], float(p[1]))
            for p in top
            if isinstance(p, list)
            and len(p) == 2
            and isinstance(p[0], int)
            and isinstance(p[1], (int, float))
            and math.isfinite(p[1])
        ]
        out.append(TokenLogprob(tid, _finite(lp), pairs))
    return out


class Generation:
    """The gateway side of one dispatched request, from its first reply to its end."""

    def __init__(
        self,
        req: InflightReq,
        dispatcher: Dispatcher,
        tokenizer: Tokenizer,
        prepared: PreparedRequest,
        *,
        arrival: float,
        deadline: float,
        on_end: Callable[[], None],
        on_finished: Callable[[str, list[int]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        redispatch: Redispatch | None = None,
        migration_limit: int = 0,
        migration_timeout_s: float = 10.0,
        context_length: int = 1 << 62,
    ) -> None:
        self.req = req
        self.rid = req.rid
        self._dispatcher = dispatcher
        self._prepared = prepared
        self._detok = IncrementalDetokenizer(tokenizer, prepared.input_ids)
        self._stop = StopChecker(prepared.sampling, tokenizer.eos_token_ids)
        self._arrival = arrival
        self._deadline = deadline
        self._on_end = on_end
        # Told (decode node, output ids) when the node finished the request itself.
        self._on_finished = on_finished
        self._clock = clock
        self._last_token_at: float | None = None
        self._num_output_tokens = 0
        self._has_ended = False
        # Wall-clock marks (common/stages.py): the gateway's, then the nodes' with the first
        # token. A streamed request's stages are recorded at its first bytes, another's at
        # its first token (its response is sent whole at the end).
        self.marks: dict[str, float] = {}
        self.is_streamed = False
        self._carried: msg.Message | None = None  # taken off the queue behind coalesced chunks
        # Migration (bootstrap/migration.py): the output so far, how often it moved, and
        # where the stream's gap began while it moves.
        self._redispatch = redispatch
        self._migration_limit = migration_limit
        self._migration_timeout_s = migration_timeout_s
        self.num_migrations = 0
        self._output = OutputSoFar.start(
            prepared.sampling, tokenizer.eos_token_ids, len(prepared.input_ids), context_length
        )
        self._gap_from: float | None = None
        self._has_prompt_logprobs = False  # a migrated request's second copy is dropped

    async def events(self) -> AsyncIterator[Delta | Finish]:
        """Deltas as replies arrive, then one Finish; raises APIError when the request fails."""
        try:
            while True:
                m = await self._next_message()
                if isinstance(m, msg.TokenChunk):
                    delta, is_stopped = self._on_chunk(m)
                    # Chunks already queued behind it go out in the same event: one SSE
                    # write per batch of tokens instead of per token when the node runs
                    # ahead of the client (bench/gateway.py: the per-event cost dominates).
                    while not is_stopped and not self.req.queue.empty():
                        following = self.req.queue.get_nowait()
                        if not isinstance(following, msg.TokenChunk):
                            self._carried = following
                            break
                        more, is_stopped = self._on_chunk(following)
                        delta = Delta(
                            delta.text + more.text,
                            delta.token_ids + more.token_ids,
                            delta.logprobs + more.logprobs,
                        )
                    if delta.text or delta.token_ids:
                        yield delta
                    if is_stopped:  # a stop string matched here before the node saw it
                        self._dispatcher.end(self.req, ReqState.FINISHED, "stop string matched")
                        yield self._finish("stop", self._stop.matched_stop, None)
                        return
                elif isinstance(m, msg.PromptLogprobs):
                    if self._prepared.prompt_logprobs and not self._has_prompt_logprobs:
                        self._has_prompt_logprobs = True
                        prompt = _prompt_logprobs(self._prepared.input_ids, m)
                        yield Delta("", [], prompt=prompt)
                elif isinstance(m, msg.ReqFinished):
                    tail = self._stop.feed(self._detok.flush())[0] + self._stop.flush()
                    if tail:
                        yield Delta(tail, [])
                    yield self._finish(m.finish_reason, m.matched_stop, m)
                    return
                elif isinstance(m, msg.ReqFailed):
                    done = self._output.finished()
                    if done is not None:  # its pair failed after the last token: it is over
                        tail = self._stop.feed(self._detok.flush())[0] + self._stop.flush()
                        if tail:
                            yield Delta(tail, [])
                        yield self._finish(done.kind.value, done.matched, None)
                        return
                    reason = migration_reason(self.req, m)
                    if reason is not None and self.num_migrations < self._migration_limit:
                        await self._migrate(reason, m.error)
                        continue
                    self._end("error")
                    status = m.status if 400 <= m.status < 600 and m.status != 499 else 500
                    error = m.error
                    if reason is not None and self._redispatch is not None:
                        error += f" (after {self.num_migrations} migration(s), --migration-limit)"
                    raise APIError(status, error, code="request_failed")
        finally:
            self.abandon()

    def abandon(self) -> None:
        """The consumer left before the end (client gone): abort on both nodes. Idempotent."""
        if not self._has_ended:
            self._dispatcher.end(self.req, ReqState.ABORTED, "client disconnected")
            self._end("aborted")

    async def _migrate(self, reason: str, error: str) -> None:
        """Send the request, with its output so far, to another pair (not the failed one's
        nodes while others are there); waits up to --migration-timeout for a pair."""
        assert self._redispatch is not None
        old = self.req
        self.num_migrations += 1
        gm.MIGRATIONS.labels(**metrics.role_labels(reason=reason)).inc()
        if self._gap_from is None:
            self._gap_from = (
                self._last_token_at if self._last_token_at is not None else (self._arrival)
            )
        avoid = frozenset({old.prefill_id, old.decode_id})
        give_up = min(self._deadline, self._clock() + self._migration_timeout_s)
        while True:
            try:
                self.req = self._redispatch(list(self._output.token_ids), avoid)
                return
            except APIError as exc:
                if exc.status != 503 or self._clock() >= give_up:
                    self._end("error")
                    raise APIError(
                        503,
                        f"the request's node pair failed ({error}) and no other pair took "
                        f"it: {exc.message}",
                        code="migration_failed",
                    ) from None
            await asyncio.sleep(MIGRATION_RETRY_S)

    async def _next_message(self) -> msg.Message:
        if self._carried is not None:
            carried, self._carried = self._carried, None
            return carried
        timeout = self._deadline - self._clock()
        try:
            if timeout <= 0:
                raise TimeoutError
            return await asyncio.wait_for(self.req.queue.get(), timeout)
        except TimeoutError:
            self._dispatcher.end(self.req, ReqState.ABORTED, "request timeout")
            self._end("error")
            raise APIError(
                504, "the request timed out (--request-timeout)", code="timeout"
            ) from None

    def first_bytes_sent(self) -> None:
        """The response's first bytes go to the client now: the TTFT stages are complete."""
        self.marks[stages.FIRST_BYTE] = time.time()
        self._observe_ttft(stages.FIRST_BYTE)

    def _observe_ttft(self, last: str) -> None:
        """TTFT from the request's first byte in to ``last``, and the stages that make it up."""
        if stages.RECEIVED in self.marks:
            ttft = self.marks[last] - self.marks[stages.RECEIVED]
        else:  # no gateway marks (a Generation built outside the API)
            ttft = self._clock() - self._arrival
        metrics.TIME_TO_FIRST_TOKEN_SECONDS.labels(**metrics.role_labels()).observe(max(0.0, ttft))
        metrics.observe_stages(stages.stage_seconds(self.marks))

    def _on_chunk(self, chunk: msg.TokenChunk) -> tuple[Delta, bool]:
        now = self._clock()
        if self._last_token_at is None:
            self.marks.update(stages.forwarded(chunk.marks, stages.NODE_MARKS))
            self.marks[stages.FIRST_TOKEN] = time.time()
            if not self.is_streamed:  # answered whole at the end: TTFT is the first token's
                self._observe_ttft(stages.FIRST_TOKEN)
        else:
            metrics.INTER_TOKEN_LATENCY_SECONDS.labels(**metrics.role_labels()).observe(
                now - self._last_token_at
            )
        if self._gap_from is not None:  # the first token from the pair it migrated to
            gm.MIGRATION_GAP_SECONDS.labels(**metrics.role_labels()).observe(now - self._gap_from)
            self._gap_from = None
        self._last_token_at = now
        self._num_output_tokens += len(chunk.token_ids)
        self._output.add(chunk.token_ids)
        text, is_stopped = self._stop.feed(self._detok.add(chunk.token_ids))
        return Delta(text, list(chunk.token_ids), _logprobs(chunk)), is_stopped

    def _finish(
        self, reason: str, matched: int | str | None, done: msg.ReqFinished | None
    ) -> Finish:
        self._end("finished")
        if done is not None and self._on_finished is not None:
            self._on_finished(self.req.decode_id, list(self._output.token_ids))
        return Finish(
            finish_reason=reason,
            matched_stop=matched,
            num_prompt_tokens=len(self._prepared.input_ids),
            num_output_tokens=self._num_output_tokens if done is None else done.num_output_tokens,
            num_cached_tokens=0 if done is None else done.num_cached_tokens,
        )

    def _end(self, outcome: str) -> None:
        if self._has_ended:
            return
        self._has_ended = True
        if outcome == "finished":
            metrics.E2E_REQUEST_LATENCY_SECONDS.labels(**metrics.role_labels()).observe(
                self._clock() - self._arrival
            )
        count_request(outcome)
        self._on_end()
