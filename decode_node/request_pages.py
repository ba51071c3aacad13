"""How a decode request's pages are taken and given back, with or without a prefix cache.

Without the cache every page a request holds is its own and goes back to the allocator.
With it (decode_node/prefix_cache.py) a request's pages start with a cached prefix it
locks: releasing gives that prefix back to the cache and frees only its own pages, and a
normal finish keeps its KV in the cache. The scheduler calls these and never touches the
cache itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from common.kv_pool import KVPool, PageAllocator, PageSource, pages_needed
from common.radix_node import TreeNode
from decode_node.integrity import hit_by_late_write
from decode_node.prefix_cache import CacheYieldingAllocator, DecodePrefixCache, first_page
from decode_node.req import DecodeReq
from decode_node.sample_groups import find_donor, is_group_mate
from decode_node.transfer_queue import ReleaseQueue
from transfer.kv_receiver import KVReceiver

# (request, requests admitted before it this round) -> whether it waits (prealloc_queue.py)
Waits = Callable[[DecodeReq, Sequence[DecodeReq]], bool]


class RequestPages:
    """``prefix_cache``: keep finished requests' KV (the flag); ``share``: without it,
    still share the prompts in use between requests (off only for a colocated node, whose
    pool the prefill half shares)."""

    def __init__(
        self,
        raw: PageAllocator,
        page_size: int,
        prefix_cache: bool,
        share: bool = True,
        pool: KVPool | None = None,
    ) -> None:
        """``pool``: where a sample copies its prompt's KV from another sample of it
        (decode_node/sample_groups.py); None: samples receive theirs."""
        self.page_size = page_size
        self.pool = pool
        self.cache: DecodePrefixCache | None = None
        self.allocator: PageSource = raw
        if prefix_cache or share:
            self.cache = DecodePrefixCache(raw, page_size, retain=prefix_cache)
            self.allocator = CacheYieldingAllocator(raw, self.cache)

    def preallocate(self, r: DecodeReq, donor: DecodeReq | None = None) -> tuple[list[int], int]:
        """Give r pages for its prompt: its cached prefix (locked first: allocating may
        evict) and own pages for the rest. Returns the transfer's destination pages and how
        many leading pages r holds already. ``donor``: a request holding the same prompt's KV
        (a sample of its group): the own pages get a copy of its pages, r holds them all."""
        if self.cache is not None:
            self.cache.match(r)
        total = pages_needed(r.num_input_tokens, self.page_size)
        own = self.allocator.allocate(total - r.num_prefix_pages)
        r.pages += own
        if donor is None or self.cache is None or self.pool is None:
            return own, r.num_prefix_pages
        source = donor.pages[r.num_prefix_pages : total]
        self.pool.copy_pages(source, own)
        r.copied_from = source
        self.cache.num_copied_tokens += r.num_input_tokens - r.num_prefix_pages * self.page_size
        return [], total

    def transferred(self, r: DecodeReq) -> None:
        """r's prompt KV arrived: with a cache, its whole pages become cached ones now."""
        if self.cache is not None:
            self.cache.cache_transferred(r)

    def waits_for(
        self, in_transfer: Sequence[DecodeReq], live: Iterable[DecodeReq] = ()
    ) -> Waits | None:
        """With a cache: whether a prealloc request waits for a request in transfer (or
        admitted before it this round) that brings its prompt; it then receives only what
        that one does not. ``live``: the node's requests (where a sample finds another of
        its group to copy from). None: none waits."""
        cache = self.cache
        if cache is None:
            return None
        by_first: dict[tuple[str | None, tuple[int, ...]], list[DecodeReq]] = {}
        for t in in_transfer:  # indexed once a round: a lookup per prealloc request
            by_first.setdefault(first_page(t, self.page_size), []).append(t)

        def waits(r: DecodeReq, admitted: Sequence[DecodeReq]) -> bool:
            same = by_first.get(first_page(r, self.page_size), [])
            if not same and not admitted:
                return False
            coming = [*same, *admitted]
            if r.generate.sample_group and any(is_group_mate(r, t) for t in coming):
                # It copies the prompt's KV from a sample of its group here: now if one
                # holds it, else once one that receives it has it (sample_groups.py).
                return find_donor(r, live) is None
            return cache.shares_transfer(r, coming)

        return waits

    def release(self, r: DecodeReq) -> None:
        """Free what r holds: its own pages; its cached prefix goes back to the cache."""
        if self.cache is not None:
            self.cache.unlock(r)
        if r.pages:
            self.allocator.free(r.pages)
        r.pages = []

    def release_after_write(
        self, r: DecodeReq, receiver: KVReceiver, release_queue: ReleaseQueue
    ) -> None:
        """r's room failed: its own pages wait in the release queue until no write can land
        in them; its prefix (never a destination) goes back to the cache at once."""
        if self.cache is not None:
            self.cache.unlock(r)
        release_queue.add(receiver, r.pages)
        r.pages = []

    def finish(self, r: DecodeReq) -> None:
        """r ended normally: its KV stays in the cache (if there is one), the rest is freed."""
        if self.cache is not None:
            self.cache.cache_finished(r)
        else:
            self.release(r)

    def hit_by_late_write(
        self, reqs: Iterable[DecodeReq], room: int, pages: list[int]
    ) -> tuple[list[DecodeReq], list[TreeNode]]:
        """The requests a late write into ``room``'s ``pages`` may have hit (reading one of
        them, or a cached prefix through a node holding one), and those cached nodes: the
        caller fails the requests, then drops the nodes (drop_cached)."""
        reqs = list(reqs)
        hit = hit_by_late_write(reqs, room, pages)
        if self.cache is None:
            return hit, []
        nodes = self.cache.poisoned(pages)
        if nodes:
            hit += [r for r in reqs if r not in hit and self.cache.reads_any(r, nodes)]
        return hit, nodes

    def drop_cached(self, nodes: Sequence[TreeNode]) -> None:
        if self.cache is not None and nodes:
            self.cache.discard(nodes)
