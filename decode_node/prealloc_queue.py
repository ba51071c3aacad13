"""Decode prealloc queue: requests wait for their handshake and for SGLang's KV budget.

The budget (tokens; pages are counted as whole pages):

  allocatable = free - max(reserved * active, need_for_single_req) - retracted_need
    active              running + transfer + waiting requests
    need_for_single_req max over running of min(max_new, CLIP) + input - retractable
    retractable         sum of input + output over the running batch
    retracted_need      sum of input + output + reserved over retracted requests

A request is admitted only if both fit in allocatable: ceil_page(input) + reserved, and
input + min(max_new, CLIP) - retractable (so it can finish alone by retracting the rest).
Each admission takes ceil_page(input) + reserved off allocatable.

A colocated node's decode half shares its pool with the prefill half, which computes every
preallocated prompt in that same pool before handing it over: there the budget also keeps
ceil_page(input) free for each request in transfer and charges each admission its input
twice. (Without it the decode half preallocated 23 of 24 pages for 11 prompts the prefill
half then had no page to compute: nothing moved until the requests timed out.)

The first ready request that does not fit stops the scan (head-of-line blocking, on
purpose); requests still handshaking are skipped. Liveness: when nothing at all holds
pages, the head may enter as soon as it could finish alone, even if the reserved headroom
is larger than the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.kv_pool import pages_needed
from decode_node.req import DecodeReq
from transfer.kv_poll import KVPoll

CLIP_MAX_NEW_TOKENS = 4096


@dataclass(frozen=True)
class BudgetReq:
    """What the budget needs to know of one request."""

    num_input_tokens: int
    num_output_tokens: int
    max_new_tokens: int
    is_ready: bool = True  # prealloc only: the receiver is WaitingForInput


@dataclass(frozen=True)
class DecodeBudget:
    """A snapshot of the decode node's memory and queues, for one admission round."""

    page_size: int
    num_free_pages: int
    num_reserved_decode_tokens: int
    num_active_reqs: int  # running + transfer + waiting
    running: Sequence[BudgetReq] = ()
    retracted: Sequence[BudgetReq] = ()
    num_free_slots: int | None = None  # request slots left; None: unlimited
    # Colocated: prompt tokens the prefill half still computes in this pool (requests in
    # transfer), and whether an admission's prompt is computed here too.
    num_prefill_tokens: int = 0
    shares_pool_with_prefill: bool = False

    def ceil_page(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.page_size) * self.page_size

    @property
    def free_tokens(self) -> int:
        return self.num_free_pages * self.page_size

    @property
    def retractable_tokens(self) -> int:
        return sum(r.num_input_tokens + r.num_output_tokens for r in self.running)

    @property
    def is_idle(self) -> bool:
        return self.num_active_reqs == 0 and not self.retracted

    def single_req_need(self, r: BudgetReq) -> int:
        """Tokens r needs to finish alone, beyond what retracting the running batch frees."""
        return (
            r.num_input_tokens
            + min(r.max_new_tokens, CLIP_MAX_NEW_TOKENS)
            - self.retractable_tokens
        )

    def allocatable_tokens(
        self, *, count_retracted: bool = True, use_single_need: bool = True
    ) -> int:
        single = 0
        if use_single_need and self.running:
            single = max(self.single_req_need(r) for r in self.running)
        reserve = max(self.num_reserved_decode_tokens * self.num_active_reqs, single)
        retracted = 0
        if count_retracted:
            retracted = sum(
                r.num_input_tokens + r.num_output_tokens + self.num_reserved_decode_tokens
                for r in self.retracted
            )
        return self.free_tokens - reserve - retracted - self.num_prefill_tokens

    def admission_tokens(self, r: BudgetReq) -> int:
        """What admitting r takes off allocatable: its pages and reserve, and in a shared
        pool the pages the prefill half computes its prompt into."""
        pages = self.ceil_page(r.num_input_tokens)
        if self.shares_pool_with_prefill:
            pages *= 2
        return pages + self.num_reserved_decode_tokens


def admit_preallocated(candidates: Sequence[BudgetReq], budget: DecodeBudget) -> list[int]:
    """Indices (in order) of the candidates to preallocate now; candidates come sorted."""
    allocatable = budget.allocatable_tokens()
    slots = budget.num_free_slots
    admitted: list[int] = []
    for i, r in enumerate(candidates):
        if not r.is_ready:
            continue
        if slots is not None and len(admitted) >= slots:
            break
        required = budget.admission_tokens(r)
        fits = required <= allocatable and budget.single_req_need(r) <= allocatable
        if not fits and budget.is_idle and not admitted:
            # Nothing holds a page: the head runs if it can finish with the whole pool.
            single = r.num_input_tokens + min(r.max_new_tokens, CLIP_MAX_NEW_TOKENS)
            fits = budget.ceil_page(single) <= budget.free_tokens
        if not fits:
            break
        admitted.append(i)
        allocatable -= required
    return admitted


def resume_retracted(budget: DecodeBudget) -> int:
    """How many retracted requests (from the head, in order) to bring back now."""
    allocatable = budget.allocatable_tokens(count_retracted=False, use_single_need=False)
    slots = budget.num_free_slots
    num = 0
    for r in budget.retracted:
        if slots is not None and num >= slots:
            break
        required = (
            budget.ceil_page(r.num_input_tokens + r.num_output_tokens)
            + budget.num_reserved_decode_tokens
        )
        fits = required <= allocatable
        if not fits and budget.num_active_reqs == 0 and num == 0:
            # Nothing else holds a page: the head comes back if its next step fits.
            fits = budget.ceil_page(r.num_input_tokens + r.num_output_tokens) <= budget.free_tokens
        if not fits:
            break
        num += 1
        allocatable -= required
    return num


def priority_order_key(priority: int | None, low_values_first: bool) -> tuple[int, int]:
    """Ascending sort key: most urgent first; requests without a priority after all others."""
    if priority is None:
        return (1, 0)
    return (0, priority if low_values_first else -priority)


class DecodePreallocQueue:
    """Requests whose destination pages are not allocated yet, in arrival order."""

    def __init__(
        self, *, enable_priority: bool = False, low_priority_values_first: bool = False
    ) -> None:
        self.queue: list[DecodeReq] = []
        self.enable_priority = enable_priority
        self.low_priority_values_first = low_priority_values_first

    def add(self, req: DecodeReq) -> None:
        self.queue.append(req)

    def remove(self, req: DecodeReq) -> bool:
        if req in self.queue:
            self.queue.remove(req)
            return True
        return False

    def most_urgent_ready(
        self, waits: Callable[[DecodeReq, Sequence[DecodeReq]], bool] | None = None
    ) -> DecodeReq | None:
        """The first request in priority order (FIFO among equals) whose receiver waits
        for its pages and that ``waits`` does not hold back (as in pop_preallocated: its
        prompt's KV is arriving for another request); None if there is none."""
        ready = [
            r
            for r in self.queue
            if r.receiver is not None
            and r.receiver.poll() is KVPoll.WaitingForInput
            and (waits is None or not waits(r, ()))
        ]
        if not ready:
            return None
        low = self.low_priority_values_first
        return min(ready, key=lambda r: priority_order_key(r.priority, low))

    def pop_failed(self) -> list[DecodeReq]:
        """Requests whose handshake failed (bootstrap timeout, refused peer)."""
        failed = [
            r for r in self.queue if r.receiver is not None and r.receiver.poll() is KVPoll.Failed
        ]
        for r in failed:
            self.queue.remove(r)
        return failed

    def pop_preallocated(
        self,
        budget: DecodeBudget,
        waits: Callable[[DecodeReq, Sequence[DecodeReq]], bool] | None = None,
    ) -> list[DecodeReq]:
        """Requests the budget admits this round, removed from the queue in admission order.
        A request for which ``waits(r, admitted before it)`` says so stays, skipped like one
        still handshaking (its prompt is arriving for another request:
        decode_node/prefix_cache.py).

        The caller allocates their pages and calls send_metadata in this order.
        """
        if self.enable_priority:
            low = self.low_priority_values_first
            self.queue.sort(key=lambda r: priority_order_key(r.priority, low))  # stable: FIFO ties
        candidates = [
            BudgetReq(
                r.num_input_tokens,
                0,
                r.max_new_tokens,
                is_ready=r.receiver is not None
                and r.receiver.poll() is KVPoll.WaitingForInput
                and (waits is None or not waits(r, ())),
            )
            for r in self.queue
        ]
        chosen: list[DecodeReq] = []
        for i in admit_preallocated(candidates, budget):
            r = self.queue[i]
            if waits is None or not waits(r, chosen):
                chosen.append(r)
        for r in chosen:
            self.queue.remove(r)
        return chosen

    def __len__(self) -> int:
        return len(self.queue)
