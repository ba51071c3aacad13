"""The prefill node's loop: receive, bootstrap, schedule, run one chunk batch, send KV, finish.

One step (`step()`), like nano-vllm's:
  1. drain GenerateReq / AbortReq from the request socket into the bootstrap queue;
  2. poll the KVManager (handshakes, TransferRequests, writes, leases, timeouts);
  3. move bootstrapped requests to the waiting queue, through the grammar queue while
     their grammar compiles off the loop;
  4. calc_priority + PrefillAdder pick this round's chunks (the chunked request first);
  5. one model extend for the batch; each request's new whole pages go to its KVSender;
     a request's last chunk samples its one token (under its grammar, if any) and sends
     the rest plus the aux data;
  6. inflight requests whose transfer succeeded put their pages in the radix cache and
     unlock it (the prefix stays cached); failed ones free what they hold.
Each request's state (prefill_node/req_state.py) names the one place holding it, and moves
at every queue change; aborts, failures and isolated exceptions go through
common/node/scheduling.py, as on the decode node.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import zmq

from common import messages as msg
from common import stages
from common.config import PrefillConfig
from common.grammar.backend import GrammarBackend, GrammarError
from common.ipc import PushPool
from common.kv_pool import pages_needed
from common.model.runner import ModelRunner
from common.node.gateway_watch import GatewayWatch
from common.node.scheduling import RequestFailures
from common.radix_cache import RadixCache
from common.sampler import Sampler
from common.token_keys import TOKEN_BYTES
from common.work_done import COMPLETED, WorkDone
from prefill_node import prompt_logprobs
from prefill_node.cache_aware_orders import usable_prefix_len
from prefill_node.first_token import first_token_aux, sample_first_token
from prefill_node.integrity import check_requests
from prefill_node.kv_events import KVEventPublisher
from prefill_node.prefill_adder import AddReqResult, PrefillAdder, PrefillChunk
from prefill_node.prefill_cache import PrefillCache
from prefill_node.queues import BootstrapQueue, GrammarQueue, InflightQueue, poll_grammar
from prefill_node.req_state import PrefillReq, PrefillState
from prefill_node.request import Req
from prefill_node.request_check import NodeLimits, Rejection, check_request
from prefill_node.sample_groups import SampleGroups
from prefill_node.schedule_policy import SchedulePolicy
from prefill_node.stats import PrefillStats
from transfer.kv_manager import KVManager

logger = logging.getLogger(__name__)

QUEUED_TOKENS_TTL_S = 0.05  # how stale the queued tokens in the KV events may be


class PrefillScheduler:
    def __init__(
        self,
        config: PrefillConfig,
        runner: ModelRunner,
        kv: KVManager,
        request_socket: zmq.Socket,
        *,
        clock: Callable[[], float] = time.monotonic,
        events: KVEventPublisher | None = None,
        grammar: GrammarBackend | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        """`eos_token_ids`: what min_tokens holds back on the first token (the tokenizer's)."""
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.grammar = grammar  # None: structured output is off here (400 for a grammar)
        self.runner = runner
        self.kv = kv
        self.allocator = runner.pool.allocator
        self.page_size = runner.page_size
        self.events = None if config.disable_radix_cache else events
        self.stats = PrefillStats(self)
        self.cache = PrefillCache(config, runner.pool, self.events, self.stats)
        self.groups = SampleGroups()  # the last logits of prompts with samples to come
        self.policy = SchedulePolicy.from_config(config, self.tree)
        self.limits = NodeLimits(
            runner.context_length,
            runner.pool.num_pages,
            self.page_size,
            runner.spec.vocab_size,
        )
        self.request_socket = request_socket
        self.push = PushPool(zmq.Context.instance())
        self.clock = clock
        self.sampler = Sampler()
        self.bootstrap_queue = BootstrapQueue()
        self.grammar_queue = GrammarQueue()
        self.waiting_queue: list[Req] = []
        self.inflight_queue = InflightQueue()
        self.states: dict[str, PrefillReq] = {}  # by rid, every request this node holds
        self.chunked: PrefillReq | None = None  # the one PREFILLING request between rounds
        self.processed_tokens = 0  # HRRN's clock: tokens prefilled so far
        self.gateway_watch = GatewayWatch()
        # A prefill abort tells the decode side (through the sender), not the gateway.
        self.failures = RequestFailures(
            self.states, self._end, self.push, self.stats, self.gateway_watch, notify_aborts=False
        )
        self._queued, self._queued_at = 0, -float("inf")  # queued_tokens' last answer

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> bool:
        """One iteration; returns whether any model work ran (callers sleep briefly if not)."""
        self.failures.drain(
            self.request_socket,
            "prefill_requests",
            lambda g: self._add_request(g, time.time()),
            self._on_message,
            now=self.clock(),
        )
        self.kv.poll()
        self.failures.abort_orphans(self.clock())
        ready, failed = self.bootstrap_queue.pop_bootstrapped()
        now = time.time()
        for s in ready:
            s.marks[stages.PREFILL_BOOTSTRAPPED] = now
            outcome = poll_grammar(s, self.grammar)
            if isinstance(outcome, GrammarError):
                self._fail(s, outcome.status, str(outcome))
            elif outcome:
                self._enter_waiting(s)
            else:
                s.advance(PrefillState.GRAMMAR)
                self.grammar_queue.add(s)
        for s in failed:
            self._fail(s, 500, f"KV bootstrap failed: {s.sender.failure_reason}", retryable=True)
        if self.grammar is not None and self.grammar_queue:
            compiled, bad = self.grammar_queue.pop_ready(self.grammar)
            for s in compiled:
                self._enter_waiting(s)
            for s, exc in bad:
                self._fail(s, exc.status, str(exc))
        chunks = self._schedule()
        if chunks:
            if self.events is not None and self.tree is not None:
                # What admission evicted goes out before the model runs (a long prefill
                # step must not leave the gateway routing hits to pages gone meanwhile).
                self.events.flush(self.queued_tokens, self.tree.page_hashes, force=True)
            self._run(chunks)
        self._process_inflight()
        self.stats.update()
        if self.events is not None and self.tree is not None:
            self.events.flush(self.queued_tokens, self.tree.page_hashes)
        return bool(chunks)

    def _enter_waiting(self, s: PrefillReq) -> None:
        s.advance(PrefillState.WAITING)
        logits = self.groups.take(s, self.clock())
        if logits is not None:  # another sample of its prompt was computed: nothing to do
            s.advance(PrefillState.PREFILLING)
            s.num_computed = s.num_cached_tokens = s.req.num_input_tokens
            s.is_group_sample = True
            self.stats.group_sample_tokens(s.num_computed)
            try:
                self._send_last(s, logits, COMPLETED)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                self.failures.isolate(s.rid, s.generate.reply_endpoint, "sampling it", exc)
            return
        s.req.enter_waiting_queue(self.clock(), self.processed_tokens)
        self.waiting_queue.append(s.req)

    @property
    def tree(self) -> RadixCache | None:
        """The radix cache (None: --disable-radix-cache)."""
        return self.cache.tree

    def _on_message(self, m: msg.Message) -> None:
        if isinstance(m, msg.KVSnapshotRequest) and self.events is not None:
            self.events.request_snapshot()

    def queued_tokens(self) -> int:
        """Prompt tokens this node has still to compute (the precise router's load): a
        request not started yet counts its prompt less the prefix the cache holds now (none
        when a sample of its group computed it), one under way what it has left.
        Recomputed at most every QUEUED_TOKENS_TTL_S."""
        now = self.clock()
        if now - self._queued_at >= QUEUED_TOKENS_TTL_S or now < self._queued_at:
            total = 0
            for s in self.states.values():
                left = s.req.num_input_tokens - s.num_computed
                if left > 0 and s.num_computed == 0 and not s.pages:
                    left -= s.req.num_input_tokens if self.groups.covers(s) else 0
                    left -= self.cache.cached_prefix(s.req)
                total += max(0, left)
            self._queued, self._queued_at = total, now
        return self._queued

    # ---- ingress -------------------------------------------------------------------------------

    def _add_request(self, g: msg.GenerateReq, received: float) -> None:
        checked = check_request(
            g,
            self.config,
            self.limits,
            is_duplicate=g.rid in self.states,
            is_queue_full=self._is_queue_full(),
            has_grammar=self.grammar is not None,
        )
        if isinstance(checked, Rejection):
            failed = msg.ReqFailed(
                rid=g.rid, status=checked.status, error=checked.error, retryable=checked.retryable
            )
            self.push.send(g.reply_endpoint, failed)
            self.stats.finished("rejected")
            return
        sampling = checked
        ids = [*g.input_ids, *g.output_ids]
        # A prefill node computes exactly one token: no decode room to reserve.
        req = Req(
            rid=g.rid,
            room=g.room,
            origin_input_ids=ids,
            max_new_tokens=1,
            priority=g.priority,
            routing_key=g.routing_key,
            arrival_time=g.arrival_time,
            cache_salt=g.cache_salt,
            reads_cache=not g.return_prompt_logprobs,
        )
        s = PrefillReq(
            req,
            g,
            sampling,
            self.kv.create_sender(g.room, len(ids)),
            marks={stages.PREFILL_RECEIVED: received},
        )
        if self.grammar is not None and sampling.grammar is not None:
            s.grammar_ticket = self.grammar.submit(*sampling.grammar)
        self.states[g.rid] = s
        self.bootstrap_queue.add(s)
        self.stats.prompt_tokens(len(ids))

    def _is_queue_full(self) -> bool:
        """--max-queued-requests: requests waiting here (for their decode node's pages, or
        to be scheduled) are at the limit; a new one is refused with 503 (SGLang's meaning)."""
        limit = self.config.max_queued_requests
        num_queued = len(self.bootstrap_queue) + len(self.grammar_queue) + len(self.waiting_queue)
        return limit is not None and num_queued >= limit

    # ---- scheduling ----------------------------------------------------------------------------

    def _schedule(self) -> list[PrefillChunk]:
        if not self.waiting_queue and self.chunked is None:
            return []
        self.policy.calc_priority(self.waiting_queue, None, self.processed_tokens)
        adder = PrefillAdder(
            self.page_size,
            self.allocator.num_free_pages * self.page_size,
            self.tree,
            max_prefill_tokens=self.config.max_prefill_tokens,
            chunked_prefill_size=self.config.effective_chunked_prefill_size,
            prefill_max_requests=self.config.prefill_max_requests,
        )
        limit = None
        if self.chunked is not None:
            s = self.chunked
            if adder.rem_chunk_tokens is not None:
                limit = self.policy.shortest_prefill_chunk_limit(
                    s.req.num_input_tokens - s.num_computed,
                    self.waiting_queue,
                    adder.rem_chunk_tokens,
                    self.page_size,
                )
            still_chunked = adder.add_chunked_req(s.req, s.num_computed, limit)
            self.chunked = s if still_chunked is not None else None
            # shortest-prefill-first capped the chunk to leave room for shorter requests:
            # admit them now, whole (a second unfinished chunked request is not allowed).
            adder.can_start_chunk = self.chunked is None
        if self.chunked is None or limit is not None:
            for req in list(self.waiting_queue):
                if self._is_running_full(adder):
                    break
                match = self.policy.match_prefix_for_req(req)
                prefix = usable_prefix_len(req, self.page_size) if match is not None else 0
                if self._waits_for_batch_mate(req, prefix, adder.can_run_list):
                    continue
                if match is not None and prefix > match.num_tokens:  # a host-tier part
                    match = self.cache.load_back(req, match, prefix)
                    adder.free_tokens = self.allocator.num_free_pages * self.page_size
                    prefix = min(prefix, match.num_tokens)
                node = match.last_node if match is not None and prefix > 0 else None
                result = adder.add_one_req(req, prefix, node)
                if adder.can_run_list and adder.can_run_list[-1].req is req:
                    pages = (
                        match.page_ids[: prefix // self.page_size]
                        if (match is not None and node is not None)
                        else []
                    )
                    self._admit(req, pages, adder.can_run_list[-1])
                if result is not AddReqResult.CONTINUE:
                    break
            if adder.new_chunked_req is not None:
                self.chunked = self.states[adder.new_chunked_req.rid]
        return [c for c in adder.can_run_list if self._allocate(c)]

    def _is_running_full(self, adder: PrefillAdder) -> bool:
        """--max-running-requests: requests being prefilled this round or transferring
        their KV are at the limit; the rest wait in the queue."""
        limit = self.config.max_running_requests
        return limit is not None and len(self.inflight_queue) + len(adder.can_run_list) >= limit

    def _waits_for_batch_mate(self, req: Req, prefix: int, chunks: list[PrefillChunk]) -> bool:
        """Whether a request already in this round's batch computes the next page of `req`'s
        prompt (a shared prefix the cache lacks, e.g. a group leader's last chunk): then
        `req` waits one round and reads that page from the cache instead of computing it
        again. In-batch dedup only sees the waiting queue; this covers the running batch."""
        num_bytes = (prefix + self.page_size) * TOKEN_BYTES
        if not req.reads_cache or len(req.key) < num_bytes + TOKEN_BYTES:
            return False
        head = req.key[:num_bytes]
        return any(
            c.end >= prefix + self.page_size
            and c.req.key[:num_bytes] == head
            and c.req.namespace == req.namespace
            for c in chunks
        )

    def _admit(self, req: Req, prefix_pages: list[int], chunk: PrefillChunk) -> None:
        self.waiting_queue.remove(req)
        s = self.states[req.rid]
        s.advance(PrefillState.PREFILLING)
        s.pages, s.num_prefix_pages = list(prefix_pages), len(prefix_pages)
        s.num_computed = s.num_cached_tokens = chunk.start
        s.locked_node = chunk.locked_node
        if chunk.locked_node is not None and self.tree is not None:
            self.tree.record_hit(chunk.locked_node)
        # A chunk deferred for pages and admitted again keeps its first mark.
        s.marks.setdefault(stages.PREFILL_SCHEDULED, time.time())
        self.stats.cache_hit_tokens(chunk.start)

    def _allocate(self, chunk: PrefillChunk) -> bool:
        s = self.states[chunk.req.rid]
        need = pages_needed(chunk.end, self.page_size) - len(s.pages)
        if need > self.allocator.num_free_pages and self.tree is not None:
            self.stats.evicted(self.tree.evict(need - self.allocator.num_free_pages))
        if not self.allocator.can_allocate(need):
            # The adder counted evictable pages a concurrent lock now protects: retry later.
            logger.warning("room %d: %d pages short; deferring its chunk", s.req.room, need)
            self._release(s)
            if self.chunked is s:
                self.chunked = None
            s.num_computed = 0
            s.advance(PrefillState.WAITING)
            self.waiting_queue.append(s.req)
            return False
        s.pages += self.allocator.allocate(need)
        return True

    # ---- model run and KV sending -----------------------------------------------------------

    def _run(self, chunks: list[PrefillChunk]) -> None:
        reqs = [self.states[c.req.rid] for c in chunks]
        start = time.perf_counter()
        extends = list(map(prompt_logprobs.extend_request, chunks, reqs))
        try:
            out = self.runner.extend(extends)
        except Exception as exc:  # noqa: BLE001 - the batch's requests fail, the node goes on
            for s in reqs:
                self.failures.isolate(s.rid, s.generate.reply_endpoint, "prefilling it", exc)
            return
        num_tokens = sum(c.extend_len for c in chunks)
        self.cache.observe_compute(num_tokens, time.perf_counter() - start)
        self.processed_tokens += num_tokens
        self.stats.prefill_tokens(num_tokens)
        for i, (c, s) in enumerate(zip(chunks, reqs)):
            try:
                if out.target_logprobs:
                    prompt_logprobs.collect(
                        s, extends[i], out.target_logprobs[i], out.top_logprobs[i]
                    )
                self._finish_chunk(c, s, out.logits[i : i + 1], out.done)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                self.failures.isolate(s.rid, s.generate.reply_endpoint, "finishing its chunk", exc)

    def _finish_chunk(
        self, c: PrefillChunk, s: PrefillReq, logits: torch.Tensor, done: WorkDone
    ) -> None:
        """Cache and send what chunk `c` computed; its last chunk samples the first token.
        `done` marks the end of the forward that wrote the chunk's KV: the sender posts no
        write before it has completed (on CUDA the forward only queued its kernels)."""
        s.num_computed = c.end
        self.cache.cache_prefix(s)
        if not c.is_last:
            s.sender.send(s.pages, c.end, ready=done)
            return
        self.groups.keep(s, logits, self.clock())
        self._send_last(s, logits, done)

    def _send_last(self, s: PrefillReq, logits: torch.Tensor, done: WorkDone) -> None:
        """Sample s's first token from ``logits`` and send it with the pages left."""
        sample = sample_first_token(
            self.sampler, s, logits, self.runner.spec.vocab_size, self.eos_token_ids
        )
        s.marks[stages.PREFILL_COMPUTED] = time.time()
        self.stats.stages(stages.stage_seconds(s.marks, stages.PREFILL_STAGES))
        s.sender.send(s.pages, s.num_computed, first_token_aux(s, sample), ready=done)
        s.advance(PrefillState.TRANSFERRING)
        self.inflight_queue.add(s)

    def _process_inflight(self) -> None:
        done, failed = self.inflight_queue.pop_done()
        for s in done:
            self._cache_and_release(s)
            self.stats.finished("finished")
        for s in failed:
            self._fail(s, 500, f"KV transfer failed: {s.sender.failure_reason}", retryable=True)

    def _cache_and_release(self, s: PrefillReq) -> None:
        """The transfer is done: unlock the prompt's cached pages (they stay cached)."""
        s.advance(PrefillState.FINISHED)
        self._release(s)
        self._forget(s)

    # ---- abort and failure ------------------------------------------------------------------

    def fail_all(self, status: int, error: str) -> None:
        """Fail every request this node holds (the drain timeout passed); the gateway hears."""
        self.failures.fail_all(status, error)

    def abort(self, rid: str | None, room: int | None, reason: str) -> None:
        """Abort a request by rid or room wherever it is; its decode side hears, not the gateway."""
        self.failures.abort(rid, room, reason)

    def _end(
        self,
        s: PrefillReq,
        status: int,
        error: str,
        *,
        notify: bool,
        peer_reason: str,
        retryable: bool = False,
    ) -> None:
        """How RequestFailures ends a request here: its decode side first, then _fail."""
        s.sender.abort(peer_reason)
        self._fail(s, status, error, notify, retryable=retryable)

    def _fail(
        self,
        s: PrefillReq,
        status: int,
        error: str,
        notify: bool = True,
        *,
        retryable: bool = False,
    ) -> None:
        """Take s out of the queue its state names, free what it holds, tell the gateway
        (``retryable``: the nodes' fault, the gateway may migrate the request)."""
        # The decode side hears too (a no-op when the room already failed): it frees its
        # pages on that ack instead of waiting out the lease (a grammar that fails here).
        s.sender.abort(error)
        if s.state is PrefillState.BOOTSTRAP:
            self.bootstrap_queue.remove(s)  # a failed handshake has left it already
        elif s.state is PrefillState.GRAMMAR:
            self.grammar_queue.remove(s)
        elif s.state is PrefillState.WAITING:
            self.waiting_queue.remove(s.req)
        elif s.state is PrefillState.PREFILLING:
            if self.chunked is s:  # otherwise it is in this round's batch: no queue holds it
                self.chunked = None
        elif s.state is PrefillState.TRANSFERRING:
            self.inflight_queue.remove(s)  # a failed transfer has left it already
        s.advance(PrefillState.FAILED)
        self._release(s)
        self._forget(s)
        if notify:
            failed = msg.ReqFailed(rid=s.rid, status=status, error=error, retryable=retryable)
            self.push.send(s.generate.reply_endpoint, failed)
        self.stats.finished("aborted" if status == 499 else "error")

    def _release(self, s: PrefillReq) -> None:
        """Free the request's own pages and unlock its cached prefix."""
        if s.own_pages or s.duplicate_pages:
            self.allocator.free(s.own_pages + s.duplicate_pages)
        if s.locked_node is not None and self.tree is not None:
            self.tree.dec_lock_ref(s.locked_node)
        s.pages, s.num_prefix_pages, s.locked_node, s.duplicate_pages = [], 0, None, []

    def _forget(self, s: PrefillReq) -> None:
        self.states.pop(s.req.rid, None)
        s.sender.clear()

    def check_integrity(self) -> None:
        """Each request sits in its state's queue; each used page is cached or one request's own."""
        self.allocator.check_integrity()
        if self.tree is not None:
            self.tree.check_integrity()
        check_requests(self)
