"""The radix cache as the prefill loop uses it.

Built from the config: none (--disable-radix-cache), device-only, or with the host tier
below it (--enable-hierarchical-cache, prefill_node/hiradix_cache.py). The loop asks it to
bring a request's host-tier prefix back to the device before admission (or to leave it
to be computed, when loading costs more here: prefill_node/load_back_cost.py) and to
cache a request's pages as soon as they are computed.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from common.config import PrefillConfig
from common.host_kv_pool import HostKVPool
from common.kv_pool import KVPool
from common.radix_cache import RadixCache
from common.radix_node import MatchResult
from prefill_node.hiradix_cache import HiRadixCache
from prefill_node.kv_events import KVEventPublisher
from prefill_node.load_back_cost import LoadBackCost
from prefill_node.req_state import PrefillReq
from prefill_node.request import Req

logger = logging.getLogger(__name__)


class CacheStats(Protocol):
    def evicted(self, num_pages: int) -> None: ...
    def host_loaded(self, num_tokens: int, seconds: float) -> None: ...
    def host_skipped(self, num_tokens: int) -> None: ...


class PrefillCache:
    def __init__(
        self,
        config: PrefillConfig,
        pool: KVPool,
        events: KVEventPublisher | None,
        stats: CacheStats,
    ) -> None:
        self.tree = build_tree(config, pool, events)
        self.events = events
        self.allocator = pool.allocator
        self.page_size = pool.page_size
        self.stats = stats
        # On CUDA the copies and the forward only queue work: their host times say nothing.
        self.is_timed = pool.device.type != "cuda"
        self.load_cost = LoadBackCost(self.page_size)

    def observe_compute(self, num_tokens: int, seconds: float) -> None:
        """A prefill of num_tokens took seconds (what a load is weighed against)."""
        if self.is_timed:
            self.load_cost.observe_compute(num_tokens, seconds)
            self._publish_cost()

    def load_back(self, req: Req, match: MatchResult, prefix: int) -> MatchResult:
        """The match to admit ``req`` with, its usable ``prefix`` going past the device
        part into the host tier: that part copied into device pages (evicting to make
        room), unless a page loads slower than it computes here. What gets no device
        pages, or left the host tier meanwhile, is computed instead."""
        tree = self.tree
        assert isinstance(tree, HiRadixCache)
        if not self.load_cost.is_worth_loading():
            self.stats.host_skipped(prefix - match.num_tokens)
            return match
        need = (prefix - match.num_tokens) // self.page_size
        # The device part (and no more: cut) stays while room is made.
        locked = tree.cut(match.last_node, match.num_tokens // self.page_size)
        tree.inc_lock_ref(locked)
        try:
            short = need - self.allocator.num_free_pages
            if short > 0:
                self.stats.evicted(tree.evict(short))
            pages = self.allocator.allocate(min(need, self.allocator.num_free_pages))
            start = time.perf_counter()
            loaded, unused = tree.load_back(req.key, req.namespace, pages)
            seconds = time.perf_counter() - start
        finally:
            tree.dec_lock_ref(locked)
        self.allocator.free(unused)
        num_loaded = len(pages) - len(unused)
        if not num_loaded:  # no device page to load into, or the host part left meanwhile
            return loaded
        self.stats.host_loaded(num_loaded * self.page_size, seconds)
        if self.is_timed:
            self.load_cost.observe_load(num_loaded, seconds)
            self._publish_cost()
        return loaded

    def _publish_cost(self) -> None:
        """The gateways price a host hit with what it costs here (the KV events carry it)."""
        ratio = self.load_cost.ratio
        if self.events is not None and ratio is not None:
            self.events.host_load_cost = ratio

    def cache_prefix(self, s: PrefillReq) -> None:
        """Put the whole pages computed so far into the radix cache right away (as SGLang's
        cache_unfinished_req does), so requests scheduled next round share them even while
        this one is still chunking or transferring; its lock moves to the new node."""
        if self.tree is None:
            return
        ps = self.page_size
        num_whole = s.num_computed // ps
        if num_whole <= s.num_prefix_pages:
            return
        key = s.req.origin_input_ids[: num_whole * ps]
        self.tree.insert(key, s.pages[:num_whole], s.req.namespace)
        match = self.tree.match_prefix(key, s.req.namespace)
        # Pages another request cached first are duplicates: ours may still be the source
        # of a write in flight, so they are freed only when the request ends.
        s.duplicate_pages += [
            own
            for own, cached in zip(
                s.pages[s.num_prefix_pages : num_whole], match.page_ids[s.num_prefix_pages :]
            )
            if own != cached
        ]
        locked = self.tree.cut(match.last_node, num_whole)  # not a longer node's tail
        self.tree.inc_lock_ref(locked)
        if s.locked_node is not None:
            self.tree.dec_lock_ref(s.locked_node)
        s.pages[:num_whole] = match.page_ids
        s.num_prefix_pages, s.locked_node = num_whole, locked

    def cached_prefix(self, req: Req) -> int:
        """The prefix of a request not admitted yet that its prefill would start from
        (either tier)."""
        if self.tree is None or not req.reads_cache:
            return 0
        match = req.match
        if match is None or match.version != self.tree.version:
            match = self.tree.match_prefix(req.key, req.namespace)  # pure: changes nothing
        usable = (req.num_input_tokens - 1) // self.page_size * self.page_size
        return min(match.total_tokens, usable)


def cache_pages(config: PrefillConfig, pool: KVPool) -> int:
    """Pages the node's cache can hold: the pool's, plus the host tier's."""
    if config.disable_radix_cache or not config.enable_hierarchical_cache:
        return pool.num_pages
    host = HostKVPool.num_pages_for(
        pool.layout, pool.num_pages, config.hicache_size, config.hicache_ratio
    )
    return pool.num_pages + host


def build_tree(
    config: PrefillConfig, pool: KVPool, events: KVEventPublisher | None
) -> RadixCache | None:
    """The prefill node's radix cache: none (--disable-radix-cache), device-only, or with a
    host tier below it (--enable-hierarchical-cache)."""
    if config.disable_radix_cache:
        return None
    if not config.enable_hierarchical_cache:
        return RadixCache(pool.page_size, pool.allocator, events=events)
    num_host = HostKVPool.num_pages_for(
        pool.layout, pool.num_pages, config.hicache_size, config.hicache_ratio
    )
    host = HostKVPool(pool, num_host)
    logger.info(
        "host tier: %d pages (%.2f GB), %s",
        num_host,
        host.nbytes / 2**30,
        config.hicache_write_policy,
    )
    return HiRadixCache(
        pool.page_size, pool.allocator, host, config.hicache_write_policy, events=events
    )
