"""The decode node's loop: receive, preallocate, collect transfers, decode one batch step, stream.

One step (`step()`), like nano-vllm's:
  1. drain GenerateReq / AbortReq from the request socket; a valid request gets a
     KVReceiver for its room (prefill node from the registry) and enters the prealloc queue;
  2. resume retracted requests first (KV back from host memory); only when none is left
     retracted, admit prealloc requests under the KV budget: allocate destination pages
     (after a cached prefix, with --disaggregation-decode-enable-radix-cache:
     decode_node/request_pages.py) and send them to the prefill node (send_metadata);
  3. poll the KVManager (handshakes, TransferDone, leases, timeouts);
  4. transfer queue: commit the first token of each finished room and stream it (a request
     with a grammar waits until its grammar, compiled off the loop since arrival, is ready;
     its matcher starts from the first token); failed rooms fail their request, their
     pages are freed once no write can land any more;
  5. waiting -> running up to max_running_requests; if the pool cannot hold the next
     token of every running request, retract (policy order) until the rest can run
     RETRACT_DECODE_STEPS more steps; launch one decode step for the whole batch, commit
     the last step's tokens (check stop conditions, stream TokenChunk / ReqFinished), then
     sample the launched step on the device. With overlap scheduling (the default) its
     tokens are committed in the next iteration, after the next step is launched: the
     host's work overlaps the device's (decode_node/running_batch.py);
     --disable-overlap-schedule commits them at once.
Replies to the gateways are held in an Outbox and leave as one ReplyBatch per gateway
before the step's forward and at its end, not one message per request and token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from common import messages as msg
from common import stages
from common.config import DecodeConfig
from common.grammar.backend import GrammarBackend, GrammarError
from common.ipc import PushPool
from common.model.runner import ModelRunner
from common.node.gateway_watch import GatewayWatch
from common.node.scheduling import RequestFailures
from common.stop import FinishReason
from common.tokenizer import Tokenizer
from decode_node.budget import build_budget, default_max_running_requests
from decode_node.grammar_gate import failed_grammars, poll_grammar
from decode_node.ingress import NodeLimits, Rejection, build_request, check_request
from decode_node.integrity import LATE_WRITE_ERROR, check_requests
from decode_node.outbox import Outbox
from decode_node.output import append_token, prompt_logprobs, req_finished, token_chunk
from decode_node.prealloc_queue import (
    BudgetReq,
    DecodeBudget,
    DecodePreallocQueue,
    resume_retracted,
)
from decode_node.preemption import choose_victims
from decode_node.req import DecodeReq, DecodeState
from decode_node.request_pages import RequestPages
from decode_node.retract import NewTokenRatio
from decode_node.retracted_queue import RetractedQueue, RetractionFailed
from decode_node.running_batch import RunningBatch
from decode_node.sample_groups import find_donor
from decode_node.stats import DecodeStats
from decode_node.transfer_queue import DecodeTransferQueue, ReleaseQueue
from transfer.kv_manager import KVManager

logger = logging.getLogger(__name__)

# The decode node's copy of the node table can lag the gateway's by a heartbeat: a request
# naming a prefill node not known here yet waits this long in the prealloc queue.
PREFILL_LOOKUP_TIMEOUT_S = 30.0
# How often the node table's prefill nodes are checked for a handshake to make.
PEER_WARM_INTERVAL_S = 1.0


class DecodeScheduler:
    def __init__(
        self,
        config: DecodeConfig,
        runner: ModelRunner,
        kv: KVManager,
        request_socket: zmq.Socket,
        tokenizer: Tokenizer,
        prefill_endpoint_for: Callable[[str], str | None],
        *,
        clock: Callable[[], float] = time.monotonic,
        prefill_lookup_timeout_s: float = PREFILL_LOOKUP_TIMEOUT_S,
        prefill_endpoints: Callable[[], list[str]] = list,
        grammar: GrammarBackend | None = None,
        shares_pool_with_prefill: bool = False,
    ) -> None:
        self.config = config
        # Colocated: the prefill half computes preallocated prompts in this same pool.
        self.shares_pool_with_prefill = shares_pool_with_prefill
        self.grammar = grammar  # None: structured output is off here (400 for a grammar)
        self.runner = runner
        self.kv = kv
        self.request_socket = request_socket
        self.tokenizer = tokenizer
        self.prefill_endpoint_for = prefill_endpoint_for
        self.clock = clock
        self.prefill_lookup_timeout_s = prefill_lookup_timeout_s
        # Known prefill nodes' control endpoints: handshakes made ahead of their first room.
        self.prefill_endpoints = prefill_endpoints
        self._peers_warmed_at = -float("inf")
        self.pool = runner.pool
        self.page_size = runner.page_size
        cache = config.disaggregation_decode_enable_radix_cache
        self.pages = RequestPages(  # colocated: the prefill half uses this pool, no sharing
            runner.pool.allocator, self.page_size, cache, not shares_pool_with_prefill, runner.pool
        )
        self.prefix_cache = self.pages.cache  # None: nothing shared (colocated)
        self.allocator = self.pages.allocator
        self.limits = NodeLimits(
            runner.context_length, runner.spec.vocab_size, self.page_size, self.allocator.num_pages
        )
        max_running = config.max_running_requests or default_max_running_requests(
            self.allocator.num_pages, self.page_size
        )
        # Request slots for everything holding KV (running, preallocated, retracted):
        # SGLang's req_to_token pool plus its pre-allocation slots.
        self.max_held_requests = 2 * max_running
        self.prealloc_queue = DecodePreallocQueue(
            enable_priority=config.enable_priority_scheduling,
            low_priority_values_first=config.schedule_low_priority_values_first,
        )
        self.transfer_queue = DecodeTransferQueue()
        self.waiting_queue: list[DecodeReq] = []
        self.release_queue = ReleaseQueue(self.allocator)
        self.overlap = not config.disable_overlap_schedule
        self.running = RunningBatch(
            runner,
            max_running,
            self.release_queue,
            retraction_policy=config.retraction_policy,
            enable_priority=config.enable_priority_scheduling,
            low_priority_values_first=config.schedule_low_priority_values_first,
        )
        self.retracted_queue = RetractedQueue(
            self.pool, self.allocator, self.pages.release, host_pool_size_gb=config.host_pool_size
        )
        self.reqs: dict[str, DecodeReq] = {}  # by rid, every live request this node holds
        self.new_token_ratio = NewTokenRatio(config.schedule_conservativeness)
        # the gateways' replies, one ReplyBatch per gateway at each flush (twice a step)
        self.push = Outbox(PushPool(zmq.Context.instance()))
        self.stats = DecodeStats(self)
        self.gateway_watch = GatewayWatch()
        self.failures = RequestFailures(
            self.reqs, self._end, self.push, self.stats, self.gateway_watch, notify_aborts=True
        )
        kv.on_late_write = self._on_late_write

    # ---- the loop -----------------------------------------------------------------------------

    def step(self) -> bool:
        """One iteration; returns whether a decode step ran (callers sleep briefly if not)."""
        try:
            return self._step()
        finally:
            self.push.flush()  # this step's tokens: one message per gateway

    def _step(self) -> bool:
        self.failures.drain(
            self.request_socket,
            "decode_requests",
            lambda g: self._add_request(g, time.time()),
            now=self.clock(),
        )
        self.failures.abort_orphans(self.clock())
        self._warm_peers()
        self._fail_bad_grammars()
        self._process_prealloc()
        self.kv.poll()
        self._process_transferred()
        self.release_queue.release_safe()
        ran = self._run_batch()
        if not self.reqs:
            self.new_token_ratio.on_idle()
        self.stats.update()
        return ran

    def _warm_peers(self) -> None:
        now = self.clock()
        if now - self._peers_warmed_at >= PEER_WARM_INTERVAL_S:
            self._peers_warmed_at = now
            for endpoint in self.prefill_endpoints():
                self.kv.connect_peer(endpoint)

    @property
    def max_running_requests(self) -> int:
        return self.running.max_running_requests

    def is_idle(self) -> bool:
        """No live request, no step in flight and no page waiting to be released: safe to
        stop."""
        return not self.reqs and not self.release_queue and not self.running.is_busy

    # ---- ingress -------------------------------------------------------------------------------

    def _add_request(self, g: msg.GenerateReq, received: float) -> None:
        limit = self.config.max_queued_requests
        checked = check_request(
            g,
            self.limits,
            is_duplicate=g.rid in self.reqs,
            is_room_in_use=g.room in self.kv.receivers
            or any(r.room == g.room for r in self.prealloc_queue.queue),
            has_grammar=self.grammar is not None,
            is_queue_full=limit is not None and len(self.prealloc_queue) >= limit,
        )
        if isinstance(checked, Rejection):
            failed = msg.ReqFailed(
                rid=g.rid, status=checked.status, error=checked.error, retryable=checked.retryable
            )
            self.push.send(g.reply_endpoint, failed)
            self.stats.finished("rejected")
            return
        req = build_request(
            g, checked, self.limits, self.tokenizer, self.runner.device, self.clock()
        )
        req.marks[stages.DECODE_RECEIVED] = received
        if self.grammar is not None and checked.grammar is not None:
            req.grammar_ticket = self.grammar.submit(*checked.grammar)
        self.reqs[g.rid] = req
        self.prealloc_queue.add(req)
        self._attach_receiver(req)

    def _attach_receiver(self, r: DecodeReq) -> None:
        """Give r its KVReceiver once its prefill node's control endpoint is known here."""
        endpoint = self.prefill_endpoint_for(r.generate.prefill_node_id)
        if endpoint is not None:
            r.receiver = self.kv.create_receiver(r.room, endpoint)
        elif self.clock() - r.arrival > self.prefill_lookup_timeout_s:
            self._fail(
                r, 503, f"unknown prefill node {r.generate.prefill_node_id!r}", retryable=True
            )

    def _fail_lost_prefill(self) -> None:
        """A request whose prefill node left the node table holds nothing and fails now,
        before it is given pages that no transfer would ever fill."""
        for r in list(self.prealloc_queue.queue):
            node = r.generate.prefill_node_id
            if r.receiver is not None and self.prefill_endpoint_for(node) is None:
                self._fail(r, 503, f"prefill node {node!r} is lost", retryable=True)

    # ---- prealloc and transfer -----------------------------------------------------------------

    def _budget(self) -> DecodeBudget:
        return build_budget(
            page_size=self.page_size,
            num_free_pages=self.allocator.num_free_pages,
            num_reserved_decode_tokens=self.config.num_reserved_decode_tokens,
            running=self.running.budget_reqs(),
            retracted=list(self.retracted_queue),
            in_transfer=self.transfer_queue.queue,
            num_waiting=len(self.waiting_queue),
            max_held_requests=self.max_held_requests,
            shares_pool_with_prefill=self.shares_pool_with_prefill,
        )

    def _process_prealloc(self) -> None:
        for r in [r for r in self.prealloc_queue.queue if r.receiver is None]:
            self._attach_receiver(r)
        self._fail_lost_prefill()
        for r in self.prealloc_queue.pop_failed():
            reason = r.receiver.failure_reason if r.receiver is not None else "no receiver"
            self._fail(
                r, 500, f"KV bootstrap with the prefill node failed: {reason}", retryable=True
            )
        if self.retracted_queue:
            self.waiting_queue += self.retracted_queue.resume(resume_retracted(self._budget()))
        if not self.retracted_queue:  # no new admission while a request waits in host memory
            waits = self.pages.waits_for(self.transfer_queue.queue, self.reqs.values())
            for r in self.prealloc_queue.pop_preallocated(self._budget(), waits):
                self._preallocate(r)
        if self.config.is_priority_preemption_on:
            self._preempt_for_priority()

    def _preallocate(self, r: DecodeReq) -> None:
        assert r.receiver is not None
        dst, held = self.pages.preallocate(r, find_donor(r, self.reqs.values()))
        r.advance(DecodeState.TRANSFER)
        r.receiver.send_metadata(dst, aux_slot=0, num_held_pages=held)
        r.marks[stages.DECODE_PREALLOCATED] = time.time()
        self.transfer_queue.add(r)

    def _preempt_for_priority(self) -> None:
        """Admit the most urgent ready prealloc request now if retracting running requests
        less urgent by the threshold makes room (decode_node/preemption.py)."""
        waits = self.pages.waits_for(self.transfer_queue.queue, self.reqs.values())
        head = self.prealloc_queue.most_urgent_ready(waits)
        if head is None or head.priority is None:
            return
        victims = self._priority_victims(head)
        if victims is not None and self.running.pending is not None:
            self._commit_results()  # every running token known before retracting any
            victims = self._priority_victims(head)
        if victims is None:
            return
        for r in victims:
            self._retract(r)
        self.stats.preempted(len(victims))
        self.prealloc_queue.remove(head)
        self._preallocate(head)

    def _priority_victims(self, head: DecodeReq) -> list[DecodeReq] | None:
        """The running requests to retract so that `head` runs now (preemption.py), or None."""
        assert head.priority is not None
        running = list(self.running)
        victims = choose_victims(
            BudgetReq(head.num_input_tokens, 0, head.max_new_tokens),
            head.priority,
            running,
            [r.priority for r in self.retracted_queue],
            self._budget(),
            self.config.priority_scheduling_preemption_threshold,
            self.config.schedule_low_priority_values_first,
        )
        return None if victims is None else [running[key] for key in victims]

    def _process_transferred(self) -> None:
        done, failed = self.transfer_queue.pop_transferred()
        for r in failed:
            reason = r.receiver.failure_reason if r.receiver is not None else "no receiver"
            error = f"KV transfer from the prefill node failed: {reason}"
            self._fail(r, 500, error, retryable=True)
        for r in done:
            ready = poll_grammar(self.grammar, r)
            if isinstance(ready, GrammarError):
                self._fail(r, ready.status, str(ready))
                continue
            if not ready:  # still compiling: back to wait with its KV in place
                self.transfer_queue.add(r)
                continue
            assert r.receiver is not None and r.receiver.aux is not None
            aux = r.receiver.aux
            r.receiver.clear()
            r.receiver = None
            self.pages.transferred(r)
            r.marks[stages.DECODE_TRANSFERRED] = time.time()
            self.stats.stages(stages.stage_seconds(r.marks, stages.DECODE_STAGES))
            r.marks.update(aux.marks)
            r.num_cached_tokens = aux.num_cached_tokens
            if (prompt := prompt_logprobs(r, aux)) is not None:
                self.push.send(r.generate.reply_endpoint, prompt)
            if r.max_new_tokens == 0:
                self._finish(r, FinishReason.length())
                continue
            try:
                finish = self._emit(
                    r, aux.first_token_id, aux.first_logprob, aux.top_logprobs, r.marks
                )
            except GrammarError as exc:
                self._fail(r, exc.status, str(exc))
                continue
            if finish is not None:
                self._finish(r, finish)
                continue
            r.advance(DecodeState.WAITING)
            self.waiting_queue.append(r)

    def _fail_bad_grammars(self) -> None:
        """A failed grammar fails its request before the KV arrives (the prefill's too)."""
        waiting_for_kv = [*self.prealloc_queue.queue, *self.transfer_queue.queue]
        for r, exc in failed_grammars(self.grammar, waiting_for_kv):
            self._fail(r, exc.status, str(exc))

    # ---- the running batch ---------------------------------------------------------------------

    def _run_batch(self) -> bool:
        """Launch the next decode step, commit the pending step's tokens, then sample the
        launched one on the device; returns whether a step ran or was committed."""
        # first tokens and refusals leave before the forward (on the CPU it blocks)
        self.push.flush()
        self.running.admit(self.waiting_queue)
        if self.running:
            self._ensure_step_memory()
        step = None
        if self.running:
            try:
                step = self.running.launch(self.allocator)
            except Exception as exc:  # noqa: BLE001 - the batch's requests fail, the node goes on
                self._fail_running("decoding it", exc)
        committed = self._commit_results()
        if step is None:
            return committed
        try:
            self.running.sample(step)
        except Exception as exc:  # noqa: BLE001 - the batch's requests fail, the node goes on
            self._fail_running("sampling its token", exc)
            return True
        if not self.overlap:
            self._commit_results()
        self.release_queue.release_safe()  # pages of requests that ended in this step
        return True

    def _commit_results(self) -> bool:
        """The pending step's tokens committed: stop checks, the gateway's messages, finished
        requests out (a row whose request ended meanwhile is skipped). False: none pending."""
        results = self.running.results()
        if results is None:
            return False
        batch, out = results
        for i, r in enumerate(batch):
            if r.state is not DecodeState.RUNNING:
                continue  # failed, aborted or finished since its token was drawn
            try:
                finish = self._emit(
                    r,
                    out.token_ids[i],
                    out.logprobs[i] if out.logprobs else None,
                    out.top_logprobs[i] if out.top_logprobs else None,
                )
                if finish is not None:
                    self.running.remove(r)
                    self._finish(r, finish)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                self.failures.isolate(r.rid, r.generate.reply_endpoint, "emitting its token", exc)
        self.stats.decode_step(self.clock(), len(batch))
        return True

    def _fail_running(self, doing: str, exc: Exception) -> None:
        for r in list(self.running):
            self.failures.isolate(r.rid, r.generate.reply_endpoint, doing, exc)

    def _ensure_step_memory(self) -> None:
        """Retract until the pool holds the next token of every running request."""
        victims, plan = self.running.plan_retraction(self.allocator.num_free_pages)
        if plan.can_run and not victims:
            self.new_token_ratio.on_decode_step()
            return
        if self.running.pending is not None:
            self._commit_results()  # every running token known before retracting any
            if not self.running:
                return
            victims, plan = self.running.plan_retraction(self.allocator.num_free_pages)
            if plan.can_run and not victims:
                self.new_token_ratio.on_decode_step()
                return
        for r in victims:
            self._retract(r)
        if plan.new_token_ratio is not None:
            self.new_token_ratio.on_retract(plan.new_token_ratio)
        if not plan.can_run:
            # One request left and no page for its next token.
            (last,) = self.running
            if self.stats.num_held_pages() > len(last.own_pages):
                self._retract(last)  # others hold pages and will free them: wait in host memory
            else:
                logger.warning("request %s fills the KV pool alone; ending it", last.rid)
                self.running.remove(last)
                self._finish(last, FinishReason.length())

    def _retract(self, r: DecodeReq) -> None:
        self.running.remove(r)
        try:
            self.retracted_queue.retract(r)
        except RetractionFailed as exc:  # out of host memory: this request alone fails
            logger.error("%s", exc)
            self._fail(r, 503, f"retraction failed: {exc.reason}", retryable=True)
            return
        self.stats.retracted(1)

    # ---- output --------------------------------------------------------------------------------

    def _emit(
        self,
        r: DecodeReq,
        token_id: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        marks: dict[str, float] | None = None,
    ) -> FinishReason | None:
        finish = append_token(r, token_id)
        now = self.clock()
        self.stats.token(None if r.last_token_at is None else now - r.last_token_at)
        r.last_token_at = now
        self.push.send(r.generate.reply_endpoint, token_chunk(r, token_id, logprob, top, marks))
        return finish

    def _finish(self, r: DecodeReq, finish: FinishReason) -> None:
        """r is out of every queue: it ends normally; free (or cache) its pages, report it."""
        r.advance(DecodeState.FINISHED)
        self.pages.finish(r)
        self.reqs.pop(r.rid, None)
        self.push.send(r.generate.reply_endpoint, req_finished(r, finish))
        self.stats.finished("finished")

    # ---- abort and failure ---------------------------------------------------------------------

    def _on_late_write(self, room: int, pages: list[int]) -> None:
        """A paused prefill node's write into `room` may have landed after its fence: any
        other request reading one of those pages fails (transfer/fence.py); a cached page
        hit drops the prefix cache (request_pages.py)."""
        hit, cached = self.pages.hit_by_late_write(self.reqs.values(), room, pages)
        for r in hit:
            logger.error("request %s: its KV pages may hold a late write of room %d", r.rid, room)
            self._fail(r, 500, LATE_WRITE_ERROR, retryable=True)
        self.pages.drop_cached(cached)

    def fail_all(self, status: int, error: str) -> None:
        """Fail every request this node holds (the drain timeout passed); the gateway hears."""
        self.failures.fail_all(status, error)

    def abort(self, rid: str | None, room: int | None, reason: str) -> None:
        """Abort a request by rid or room wherever it is; the gateway gets ReqFailed 499."""
        self.failures.abort(rid, room, reason)

    def _end(
        self,
        r: DecodeReq,
        status: int,
        error: str,
        *,
        notify: bool,
        peer_reason: str,
        retryable: bool = False,
    ) -> None:
        """How RequestFailures ends a request here: _fail (its receiver tells the prefill
        side `error`; `peer_reason` is the prefill side's word for its own sender)."""
        self._fail(r, status, error, notify, retryable=retryable)

    def _fail(
        self,
        r: DecodeReq,
        status: int,
        error: str,
        notify: bool = True,
        *,
        retryable: bool = False,
    ) -> None:
        """Free everything r holds in whichever state it is; tell the gateway if `notify`
        (``retryable``: the nodes' fault, the gateway may migrate the request)."""
        state = r.state
        if state is DecodeState.PREALLOC:
            self.prealloc_queue.remove(r)
        elif state is DecodeState.TRANSFER:
            self.transfer_queue.remove(r)
        elif state is DecodeState.WAITING:
            self.waiting_queue.remove(r)
        elif state is DecodeState.RUNNING:
            self.running.remove(r)
        elif state is DecodeState.RETRACTED:
            self.retracted_queue.remove(r)
        if r.receiver is not None:
            r.receiver.abort(error)
            # Pages a prefill node may still be writing wait until that cannot happen.
            self.pages.release_after_write(r, r.receiver, self.release_queue)
            r.receiver = None
        self.pages.release(r)
        r.advance(DecodeState.FAILED)
        self.reqs.pop(r.rid, None)
        if notify:
            failed = msg.ReqFailed(rid=r.rid, status=status, error=error, retryable=retryable)
            self.push.send(r.generate.reply_endpoint, failed)
        self.stats.finished("aborted" if status == 499 else "error")

    # ---- introspection -------------------------------------------------------------------------

    def load(self) -> dict[str, int | float]:  # a heartbeat's (DecodeStats.load)
        return self.stats.load(self.new_token_ratio.value)

    def check_integrity(self) -> None:
        """Every page is free or held exactly once; every request sits in its state's queue;
        every running request's slot holds its pages."""
        check_requests(self)
        self.running.check_integrity()

    def close(self) -> None:
        self.push.close()
