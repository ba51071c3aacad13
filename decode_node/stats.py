"""Decode node metrics: queue lengths, KV pages used/held, retractions, ITL, decode throughput."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sized
from typing import Final, Protocol

from prometheus_client import Counter, Gauge

from common import metrics
from common.kv_pool import PageSource
from decode_node.prefix_cache import DecodePrefixCache
from decode_node.transfer_queue import ReleaseQueue

ROLE: Final = "decode"
THROUGHPUT_WINDOW_S: Final = 5.0

# Not in common/metrics.py yet (owned by the lead); same registry and role label.
DECODE_TOKENS: Final = Counter(
    "pdserve_decode_tokens_total",
    "Output tokens produced by decode steps.",
    ("role",),
    registry=metrics.REGISTRY,
)
DECODE_THROUGHPUT: Final = Gauge(
    "pdserve_decode_throughput_tokens_per_second",
    f"Decode tokens per second over the last {THROUGHPUT_WINDOW_S:g} s.",
    ("role",),
    registry=metrics.REGISTRY,
)

QUEUES: Final = ("prealloc", "transfer", "waiting", "running", "retracted")


class HasPages(Protocol):
    @property
    def own_pages(self) -> Sized: ...


class DecodeView(Protocol):
    """What the stats read of the decode scheduler (which owns them)."""

    @property
    def prealloc_queue(self) -> Sized: ...

    @property
    def transfer_queue(self) -> Sized: ...

    @property
    def waiting_queue(self) -> Sized: ...

    @property
    def running(self) -> Sized: ...

    @property
    def retracted_queue(self) -> Sized: ...

    @property
    def allocator(self) -> PageSource: ...

    @property
    def reqs(self) -> Mapping[str, HasPages]: ...

    @property
    def release_queue(self) -> ReleaseQueue: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    @property
    def prefix_cache(self) -> DecodePrefixCache | None: ...


class DecodeStats:
    def __init__(self, scheduler: DecodeView) -> None:
        self.s = scheduler
        self._queues = {q: metrics.QUEUE_REQUESTS.labels(role=ROLE, queue=q) for q in QUEUES}
        self._used = metrics.KV_PAGES_USED.labels(role=ROLE)
        self._held = metrics.KV_PAGES_HELD.labels(role=ROLE)
        metrics.KV_PAGES_TOTAL.labels(role=ROLE).set(scheduler.allocator.num_pages)
        self._retractions = metrics.RETRACTIONS.labels(role=ROLE)
        self._preemptions = metrics.PREEMPTIONS.labels(role=ROLE)
        self._itl = metrics.INTER_TOKEN_LATENCY_SECONDS.labels(role=ROLE)
        self._tokens = DECODE_TOKENS.labels(role=ROLE)
        self._throughput = DECODE_THROUGHPUT.labels(role=ROLE)
        self._window: deque[tuple[float, int]] = deque()
        self._window_tokens = 0
        self.num_retractions = 0
        self.num_preemptions = 0
        self.num_decode_tokens = 0
        self._cache_hit_tokens = 0
        self._cache_evicted = 0
        self._copied_tokens = 0

    def update(self) -> None:
        s = self.s
        lengths = {
            "prealloc": len(s.prealloc_queue),
            "transfer": len(s.transfer_queue),
            "waiting": len(s.waiting_queue),
            "running": len(s.running),
            "retracted": len(s.retracted_queue),
        }
        for q, n in lengths.items():
            self._queues[q].set(n)
        self._held.set(self.num_held_pages())
        if s.prefix_cache is not None:  # used pages count cached ones, as on prefill
            self._used.set(s.prefix_cache.raw.num_used_pages)
            self._update_cache(s.prefix_cache)
        else:
            self._used.set(s.allocator.num_used_pages)
        self._expire(s.clock())
        self._throughput.set(self.tokens_per_s(s.clock()))

    def _update_cache(self, cache: DecodePrefixCache) -> None:
        metrics.PREFIX_CACHE_PAGES.labels(role=ROLE).set(cache.num_pages)
        hits = cache.num_hit_pages * cache.page_size
        if hits > self._cache_hit_tokens:
            metrics.PREFIX_CACHE_HIT_TOKENS.labels(role=ROLE).inc(hits - self._cache_hit_tokens)
            self._cache_hit_tokens = hits
        if cache.num_copied_tokens > self._copied_tokens:
            copied = cache.num_copied_tokens - self._copied_tokens
            metrics.GROUP_SAMPLE_TOKENS.labels(role=ROLE).inc(copied)
            self._copied_tokens = cache.num_copied_tokens
        if cache.num_evicted_pages > self._cache_evicted:
            evicted = cache.num_evicted_pages - self._cache_evicted
            metrics.PREFIX_CACHE_EVICTED_PAGES.labels(role=ROLE).inc(evicted)
            self._cache_evicted = cache.num_evicted_pages

    def load(self, new_token_ratio: float) -> dict[str, int | float]:
        """What a heartbeat reports (the router reads free_pages for least-load choice)."""
        s = self.s
        return {
            "free_pages": s.allocator.num_free_pages,
            "kv_pages_held": self.num_held_pages(),
            "running": len(s.running),
            "waiting": len(s.waiting_queue),
            "prealloc": len(s.prealloc_queue),
            "transfer": len(s.transfer_queue),
            "retracted": len(s.retracted_queue),
            "new_token_ratio": new_token_ratio,
        }

    def num_held_pages(self) -> int:
        """Device pages held by live requests and by failed rooms not yet safe to free."""
        s = self.s
        return sum(len(r.own_pages) for r in s.reqs.values()) + s.release_queue.num_pages

    def retracted(self, num: int) -> None:
        self.num_retractions += num
        self._retractions.inc(num)

    def preempted(self, num: int) -> None:
        """``num`` running requests were retracted for a more urgent one (after retracted())."""
        self.num_preemptions += num
        self._preemptions.inc(num)

    def stages(self, seconds: dict[str, float]) -> None:
        metrics.observe_stages(seconds)

    def token(self, gap_s: float | None) -> None:
        """One output token sent; `gap_s` is the time since the request's previous token."""
        if gap_s is not None:
            self._itl.observe(gap_s)

    def decode_step(self, now: float, num_tokens: int) -> None:
        self.num_decode_tokens += num_tokens
        self._tokens.inc(num_tokens)
        self._window.append((now, num_tokens))
        self._window_tokens += num_tokens
        self._expire(now)

    def tokens_per_s(self, now: float) -> float:
        if len(self._window) < 2:
            return 0.0
        span = now - self._window[0][0]
        return (self._window_tokens - self._window[0][1]) / span if span > 0 else 0.0

    def _expire(self, now: float) -> None:
        while self._window and now - self._window[0][0] > THROUGHPUT_WINDOW_S:
            self._window_tokens -= self._window.popleft()[1]

    def finished(self, outcome: str) -> None:
        metrics.REQUESTS.labels(role=ROLE, outcome=outcome).inc()
