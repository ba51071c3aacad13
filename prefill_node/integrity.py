"""The prefill scheduler's request check.

It checks each request's state against the queue holding it, and each used page's owner.

Between two steps a request the node holds sits in exactly the place its state names
(req_state.py): the bootstrap queue, the grammar queue, the waiting queue, the chunked slot (the one
PREFILLING request a round leaves unfinished) or the inflight queue. A used page is
either the radix cache's or one request's own (own_pages, duplicate_pages), never both,
never two requests'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from common.kv_pool import PageAllocator, pages_needed
from prefill_node.req_state import PrefillReq, PrefillState
from prefill_node.request import Req


class HoldsRequests(Protocol):
    """A queue of PrefillReqs (prefill_node/queues.py)."""

    @property
    def queue(self) -> list[PrefillReq]: ...


class CachedPages(Protocol):
    @property
    def num_pages(self) -> int: ...


class PrefillQueues(Protocol):
    """What the check reads of the prefill scheduler (which owns the queues)."""

    @property
    def states(self) -> Mapping[str, PrefillReq]: ...
    @property
    def bootstrap_queue(self) -> HoldsRequests: ...
    @property
    def grammar_queue(self) -> HoldsRequests: ...
    @property
    def waiting_queue(self) -> list[Req]: ...
    @property
    def chunked(self) -> PrefillReq | None: ...
    @property
    def inflight_queue(self) -> HoldsRequests: ...
    @property
    def page_size(self) -> int: ...
    @property
    def allocator(self) -> PageAllocator: ...
    @property
    def tree(self) -> CachedPages | None: ...


def check_requests(s: PrefillQueues) -> None:
    """Raise AssertionError where a request's state and queue, or a page and its owner, disagree."""
    waiting = [s.states.get(req.rid) for req in s.waiting_queue]
    if any(r is None or r.req is not req for r, req in zip(waiting, s.waiting_queue)):
        raise AssertionError("the waiting queue holds a request the node does not")
    queues: dict[PrefillState, list[PrefillReq]] = {
        PrefillState.BOOTSTRAP: s.bootstrap_queue.queue,
        PrefillState.GRAMMAR: s.grammar_queue.queue,
        PrefillState.WAITING: [r for r in waiting if r is not None],
        PrefillState.PREFILLING: [s.chunked] if s.chunked is not None else [],
        PrefillState.TRANSFERRING: s.inflight_queue.queue,
    }
    if sum(len(q) for q in queues.values()) != len(s.states):
        raise AssertionError("queues and the request table disagree")
    for state, queue in queues.items():
        for r in queue:
            if r.state is not state or s.states.get(r.rid) is not r:
                raise AssertionError(
                    f"request {r.rid} in the {state.value} queue is {r.state.value}"
                )
            _check_pages(r, s.page_size)
    owned = [p for r in s.states.values() for p in r.own_pages + r.duplicate_pages]
    if len(set(owned)) != len(owned):
        raise AssertionError("a page is owned twice")
    cached = s.tree.num_pages if s.tree is not None else 0
    if len(owned) + cached != s.allocator.num_used_pages:
        raise AssertionError(
            f"{len(owned)} pages owned and {cached} cached but {s.allocator.num_used_pages} used"
        )


def _check_pages(r: PrefillReq, page_size: int) -> None:
    """What r holds fits its state: nothing before admission, pages of what it computed after."""
    if r.state in (PrefillState.BOOTSTRAP, PrefillState.GRAMMAR, PrefillState.WAITING):
        if r.pages or r.duplicate_pages or r.locked_node is not None:
            raise AssertionError(f"request {r.rid} ({r.state.value}) holds pages")
        return
    if r.is_group_sample:
        if r.pages or r.duplicate_pages or r.locked_node is not None:
            raise AssertionError(f"request {r.rid} (a group sample) holds pages")
    elif len(r.pages) != pages_needed(r.num_computed, page_size):
        raise AssertionError(
            f"request {r.rid} holds {len(r.pages)} pages for {r.num_computed} tokens"
        )
    if r.num_prefix_pages > len(r.pages):
        raise AssertionError(f"request {r.rid} has more prefix pages than pages")
    if r.state is PrefillState.TRANSFERRING and r.num_computed != r.req.num_input_tokens:
        raise AssertionError(
            f"request {r.rid} transfers {r.num_computed} of {r.req.num_input_tokens} tokens"
        )
