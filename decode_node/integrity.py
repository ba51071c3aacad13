"""The decode scheduler's request check: each request in its state's queue, each page held once.

Between two steps every page is free or held exactly once (by a request, or by the release
queue until no write can land in it), every live request sits in exactly the queue its
state names (decode_node/req.py) with the pages that state allows, and a request that
follows a grammar and has committed tokens has a matcher that took every one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from common.kv_pool import PageSource, pages_needed
from decode_node.prefix_cache import DecodePrefixCache
from decode_node.req import DecodeReq, DecodeState


class HoldsRequests(Protocol):
    @property
    def queue(self) -> list[DecodeReq]: ...


class ReleasesPages(Protocol):
    def all_pages(self) -> list[int]: ...


class RetractedRequests(HoldsRequests, Protocol):
    def check_integrity(self) -> None: ...


class RunningRequests(Protocol):
    @property
    def reqs(self) -> list[DecodeReq]: ...
    @property
    def max_running_requests(self) -> int: ...


class DecodeQueues(Protocol):
    """What the check reads of the decode scheduler (which owns the queues)."""

    @property
    def reqs(self) -> Mapping[str, DecodeReq]: ...
    @property
    def allocator(self) -> PageSource: ...
    @property
    def release_queue(self) -> ReleasesPages: ...
    @property
    def prealloc_queue(self) -> HoldsRequests: ...
    @property
    def transfer_queue(self) -> HoldsRequests: ...
    @property
    def waiting_queue(self) -> list[DecodeReq]: ...
    @property
    def running(self) -> RunningRequests: ...
    @property
    def retracted_queue(self) -> RetractedRequests: ...
    @property
    def page_size(self) -> int: ...
    @property
    def prefix_cache(self) -> DecodePrefixCache | None: ...


LATE_WRITE_ERROR = (
    "KV integrity: a late write from a paused prefill node may have landed in this "
    "request's pages; retry"
)


def hit_by_late_write(reqs: Iterable[DecodeReq], room: int, pages: list[int]) -> list[DecodeReq]:
    """The requests other than ``room``'s holding one of ``pages``, where a write into
    ``room`` that landed after its fence may be: their KV may be wrong, so they fail (500)
    instead of streaming wrong tokens."""
    hit = set(pages)
    return [
        r
        for r in reqs
        if r.room != room and (hit.intersection(r.pages) or hit.intersection(r.copied_from))
    ]


def check_requests(s: DecodeQueues) -> None:
    """Raise AssertionError where pages, queues and request states disagree."""
    s.allocator.check_integrity()
    cache = s.prefix_cache
    held = [p for r in s.reqs.values() for p in r.own_pages] + s.release_queue.all_pages()
    cached = cache.cached_pages() if cache is not None else []
    if len(set(held + cached)) != len(held) + len(cached):
        raise AssertionError("a page is held twice")
    used = cache.raw.num_used_pages if cache is not None else s.allocator.num_used_pages
    if len(held) + len(cached) != used:
        raise AssertionError(f"{len(held)} pages held, {len(cached)} cached but {used} used")
    if cache is not None:
        cache.check_integrity()
    _check_prefixes(s.reqs.values(), set(cached))
    queues = {
        DecodeState.PREALLOC: s.prealloc_queue.queue,
        DecodeState.TRANSFER: s.transfer_queue.queue,
        DecodeState.WAITING: s.waiting_queue,
        DecodeState.RUNNING: s.running.reqs,
        DecodeState.RETRACTED: s.retracted_queue.queue,
    }
    if sum(len(q) for q in queues.values()) != len(s.reqs):
        raise AssertionError("queues and the request table disagree")
    for state, queue in queues.items():
        for r in queue:
            if r.state is not state or s.reqs.get(r.rid) is not r:
                raise AssertionError(
                    f"request {r.rid} in the {state.value} queue is {r.state.value}"
                )
            _check_pages(r, state, s.page_size)
            _check_grammar(r)
    s.retracted_queue.check_integrity()
    if len(s.running.reqs) > s.running.max_running_requests:
        raise AssertionError(f"{len(s.running.reqs)} running > {s.running.max_running_requests}")


def _check_prefixes(reqs: Iterable[DecodeReq], cached: set[int]) -> None:
    """A request's prefix pages are cached pages, kept by its lock."""
    for r in reqs:
        if not r.num_prefix_pages:
            if r.prefix_node is not None:
                raise AssertionError(f"request {r.rid} locks a prefix it does not read")
            continue
        node = r.prefix_node
        if node is None or node.is_evicted or node.lock_ref <= 0:
            raise AssertionError(f"request {r.rid} reads a cached prefix it has not locked")
        if not cached.issuperset(r.pages[: r.num_prefix_pages]):
            raise AssertionError(f"request {r.rid} reads prefix pages the cache does not hold")


def _check_pages(r: DecodeReq, state: DecodeState, page_size: int) -> None:
    need = {
        DecodeState.PREALLOC: 0,
        DecodeState.RETRACTED: 0,
        DecodeState.TRANSFER: pages_needed(r.num_input_tokens, page_size),
    }
    if state in need and len(r.pages) != need[state]:
        raise AssertionError(f"request {r.rid} ({state.value}) holds {len(r.pages)} pages")
    if len(r.pages) < need.get(state, pages_needed(r.kv_len, page_size)):
        raise AssertionError(f"request {r.rid} holds too few pages for its KV")


def _check_grammar(r: DecodeReq) -> None:
    if r.grammar_ticket is None or not r.output_ids:
        return
    num_output = r.num_resumed_tokens + len(r.output_ids)
    if r.grammar is None or r.grammar.num_accepted != num_output:
        taken = None if r.grammar is None else r.grammar.num_accepted
        raise AssertionError(
            f"request {r.rid}: its grammar took {taken} of its {num_output} tokens"
        )
