"""Prefill node metrics: queue lengths, KV pages used/held, token counters, request outcomes."""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import Protocol

from common import metrics
from common.kv_pool import PageAllocator
from common.radix_cache import RadixCache
from prefill_node.hiradix_cache import HiRadixCache


class HasPages(Protocol):
    @property
    def pages(self) -> Sized: ...


class PrefillView(Protocol):
    """What the stats read of the prefill scheduler (which owns them)."""

    @property
    def bootstrap_queue(self) -> Sized: ...

    @property
    def grammar_queue(self) -> Sized: ...

    @property
    def waiting_queue(self) -> Sized: ...

    @property
    def inflight_queue(self) -> Sized: ...

    @property
    def allocator(self) -> PageAllocator: ...

    @property
    def states(self) -> Mapping[str, HasPages]: ...

    @property
    def tree(self) -> RadixCache | None: ...


class PrefillStats:
    def __init__(self, scheduler: PrefillView) -> None:
        self.s = scheduler
        role = "prefill"
        self._queues = {
            q: metrics.QUEUE_REQUESTS.labels(role=role, queue=q)
            for q in ("bootstrap", "grammar", "waiting", "inflight")
        }
        self._used = metrics.KV_PAGES_USED.labels(role=role)
        self._held = metrics.KV_PAGES_HELD.labels(role=role)
        metrics.KV_PAGES_TOTAL.labels(role=role).set(scheduler.allocator.num_pages)
        self._prompt = metrics.PROMPT_TOKENS.labels(role=role)
        self._prefill = metrics.PREFILL_TOKENS.labels(role=role)
        self._hits = metrics.PREFIX_CACHE_HIT_TOKENS.labels(role=role)
        self.role = role
        self._host_evicted = 0  # the tree's count when last reported

    def update(self) -> None:
        s = self.s
        self._queues["bootstrap"].set(len(s.bootstrap_queue))
        self._queues["grammar"].set(len(s.grammar_queue))
        self._queues["waiting"].set(len(s.waiting_queue))
        self._queues["inflight"].set(len(s.inflight_queue))
        self._used.set(s.allocator.num_used_pages)
        self._held.set(self.num_held_pages())
        tree = s.tree
        if isinstance(tree, HiRadixCache):
            metrics.HOST_CACHE_PAGES.labels(role=self.role).set(tree.num_host_pages)
            total = tree.host.allocator.num_pages
            metrics.HOST_CACHE_PAGES_TOTAL.labels(role=self.role).set(total)
            if tree.num_host_evicted_pages > self._host_evicted:
                dropped = tree.num_host_evicted_pages - self._host_evicted
                metrics.HOST_CACHE_EVICTED_PAGES.labels(role=self.role).inc(dropped)
                self._host_evicted = tree.num_host_evicted_pages

    def num_held_pages(self) -> int:
        """Pages live requests hold: their own plus the cached prefixes they lock."""
        return sum(len(st.pages) for st in self.s.states.values())

    def prompt_tokens(self, n: int) -> None:
        self._prompt.inc(n)

    def prefill_tokens(self, n: int) -> None:
        self._prefill.inc(n)

    def cache_hit_tokens(self, n: int) -> None:
        if n:
            self._hits.inc(n)

    def group_sample_tokens(self, n: int) -> None:
        """A sample of an n > 1 request took its prompt from another sample of it."""
        metrics.GROUP_SAMPLE_TOKENS.labels(role=self.role).inc(n)

    def host_loaded(self, num_tokens: int, seconds: float) -> None:
        """A request's host-tier prefix was copied back to the device."""
        metrics.HOST_CACHE_HIT_TOKENS.labels(role=self.role).inc(num_tokens)
        metrics.HOST_CACHE_LOAD_SECONDS.labels(role=self.role).observe(seconds)

    def host_skipped(self, num_tokens: int) -> None:
        """A host-tier hit computed instead: loading it costs more here."""
        metrics.HOST_CACHE_SKIPPED_TOKENS.labels(role=self.role).inc(num_tokens)

    def evicted(self, num_pages: int) -> None:
        if num_pages:
            metrics.PREFIX_CACHE_EVICTED_PAGES.labels(role=self.role).inc(num_pages)

    def stages(self, seconds: dict[str, float]) -> None:
        metrics.observe_stages(seconds)

    def finished(self, outcome: str) -> None:
        metrics.REQUESTS.labels(role=self.role, outcome=outcome).inc()
