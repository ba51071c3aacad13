"""bench/routing_sim.py's simulated prefill node: the real radix cache over a page pool, a
FIFO queue served at the cost model's speed, and the KV events it would publish."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from routing_workloads import Cost, Request, _pages

from common.page_hash import HashArray
from common.radix_cache import RadixCache, TreeNode


class FreeList:
    """A node's page pool (the radix cache frees evicted pages into it)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages, self.free_pages = num_pages, set(range(num_pages))

    def allocate(self, num: int) -> list[int]:
        return [self.free_pages.pop() for _ in range(num)]  # KeyError: out of pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if p in self.free_pages:
                raise RuntimeError(f"page {p} freed twice")
            self.free_pages.add(p)


class EventSink:
    """The cache's CacheEvents: the net change since the last batch, as the publisher keeps it."""

    def __init__(self) -> None:
        self.net: dict[int, bool] = {}  # page hash -> stored (True) or removed (False)

    def stored(self, hashes: HashArray) -> None:
        self.net.update(dict.fromkeys(hashes.tolist(), True))

    def removed(self, hashes: HashArray) -> None:
        self.net.update(dict.fromkeys(hashes.tolist(), False))

    def offloaded(self, hashes: HashArray) -> None:
        raise RuntimeError("the simulated nodes have no host tier")

    loaded = offloaded

    def cleared(self) -> None:
        raise RuntimeError("the simulation never resets a cache")

    def take(self) -> tuple[HashArray, HashArray]:
        """The batch: (stored, removed), and a fresh start."""
        net, self.net = self.net, {}
        return tuple(
            np.array([h for h, s in net.items() if s is is_stored], dtype=np.uint64)
            for is_stored in (True, False)
        )  # type: ignore[return-value]


@dataclass
class Job:
    index: int
    request: Request
    num_tokens: int
    uncached_at_route: int  # what the gateway counts as pending (and the oracle as queued)
    tokens: bytes = b""
    pages: list[int] = field(default_factory=list)
    locked: TreeNode | None = None
    cached: int = 0
    start: float = 0.0
    end: float = 0.0


class SimNode:
    def __init__(self, node_id: str, pool_pages: int, page_size: int, cost: Cost) -> None:
        self.node_id, self.page_size, self.cost = node_id, page_size, cost
        self.allocator = FreeList(pool_pages)
        self.sink = EventSink()
        self.cache = RadixCache(page_size, self.allocator, events=self.sink)
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self.seq = 0
        self.busy_s = 0.0
        self.num_waiting_tokens = self.num_waiting_uncached = self.max_cached_pages = 0

    def enqueue(self, job: Job) -> None:
        self.waiting.append(job)
        self.num_waiting_tokens += job.num_tokens
        self.num_waiting_uncached += job.uncached_at_route

    def start_next(self, now: float) -> float | None:
        """When idle, admit the head of the queue (match, lock, allocate); returns its end."""
        if self.running is not None or not self.waiting:
            return None
        job = self.running = self.waiting.popleft()
        self.num_waiting_tokens -= job.num_tokens
        self.num_waiting_uncached -= job.uncached_at_route
        ps, n = self.page_size, job.num_tokens
        job.tokens = np.concatenate(job.request.parts).tobytes()
        match = self.cache.match_prefix(job.tokens)
        num_cached = min(len(match.page_ids), (n - 1) // ps)  # the last token is computed
        if num_cached:
            self.cache.inc_lock_ref(match.last_node)  # before evicting: the prefix stays
            job.locked = match.last_node
        need = _pages(n, ps) - num_cached
        if need > len(self.allocator.free_pages):
            self.cache.evict(need - len(self.allocator.free_pages))
        job.pages = match.page_ids[:num_cached] + self.allocator.allocate(need)
        job.cached, job.start = num_cached * ps, now
        service = self.cost.service_s(job.cached, n - job.cached)
        job.end, self.busy_s = now + service, self.busy_s + service
        return job.end

    def finish(self) -> Job:
        """The prefill is done: cache the prompt's pages, free duplicates and the partial page."""
        job, ps = self.running, self.page_size
        assert job is not None
        self.running = None
        already = self.cache.insert(job.tokens, job.pages) // ps
        self.allocator.free(
            job.pages[job.cached // ps : already] + job.pages[job.num_tokens // ps :]
        )
        if job.locked is not None:
            self.cache.dec_lock_ref(job.locked)
        self.max_cached_pages = max(self.max_cached_pages, self.cache.num_pages)
        job.tokens, job.pages, job.locked = b"", [], None
        return job

    def reported_tokens(self, node_load: str) -> int:
        """PrefillScheduler.queued_tokens: the one under way, and the waiting prompts less
        what the cache holds now ("prompt": whole, as before that was fixed)."""
        if node_load == "prompt":
            return self.num_waiting_tokens
        ps, job = self.page_size, self.running  # the one under way: all of it left
        running = job.num_tokens - job.cached if job is not None else 0
        return running + sum(
            j.num_tokens
            - ps
            * min(
                (j.num_tokens - 1) // ps,
                len(self.cache.match_prefix(np.concatenate(j.request.parts).tobytes()).page_ids),
            )
            for j in self.waiting
        )

    def exact_tokens(self, now: float) -> int:
        """The oracle's queue: the running prefill's remaining tokens, the waiting ones'."""
        left = 0.0
        if (job := self.running) is not None and job.end > job.start:
            left = (job.num_tokens - job.cached) * (job.end - now) / (job.end - job.start)
        return int(left) + self.num_waiting_uncached
