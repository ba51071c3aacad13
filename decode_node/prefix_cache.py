"""The decode node's prefix cache (``--disaggregation-decode-enable-radix-cache``).

A finished request's KV (prompt and output, whole pages) stays in a radix tree
(common/radix_cache.py, namespaced by cache salt as on prefill). A later request whose
prompt starts with a cached prefix (a chat's next turn) locks it and asks the prefill node
only for the pages after it (``TransferRequest.num_held_pages``): only its new KV moves.

A request's ``pages`` are its prefix pages (the tree's, ``num_prefix_pages`` of them)
followed by its own. Every page of the pool is in exactly one place: free, in the tree
(locked by the requests reading it, or evictable), owned by one request, or in the release
queue (a failed room's pages, until no write can land in them).

    preallocate   match the prompt, whole pages, at most up to the page before its last
                  token's (that page always moves, so the prefill node always writes);
                  lock the match; allocate own pages for the rest
    finish        insert prompt + output KV; own pages the tree took are its now, the
                  ones duplicating cached pages and a partial last page are freed; unlock
    fail/retract  free (or hand to the release queue) own pages; unlock. A retracted
                  request's KV goes to host memory whole and comes back in own pages.

The tree yields to admission: ``CacheYieldingAllocator`` counts unlocked cached pages as
free and evicts least recently used leaves when an allocation needs them, so every budget
and retraction rule of the loop reads the same numbers as without a cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from common.kv_pool import PageAllocator
from common.radix_cache import RadixCache, TreeNode
from common.radix_node import MatchResult
from common.token_keys import TOKEN_BYTES, salt_key, token_key
from decode_node.req import DecodeReq


class PageTree(RadixCache):
    """The radix tree with what the decode node asks of it by page (late writes)."""

    def lock_match(self, m: MatchResult) -> TreeNode:
        """Lock exactly the pages of ``m`` and return the node to unlock later (``cut``: a
        lock on the whole node a match ends inside would also protect its pages past the
        match, which the admission budget counted as free, and the allocation after it
        would come up short)."""
        node = self.cut(m.last_node, len(m.page_ids))
        self.inc_lock_ref(node)
        return node

    def device_pages(self) -> list[int]:
        """Every device page the tree holds."""
        return [p for node in self._nodes() for p in node.value]

    def nodes_holding(self, pages: Iterable[int]) -> list[TreeNode]:
        """The nodes whose device pages include one of ``pages``."""
        wanted = set(pages)
        return [n for n in self._nodes() if not wanted.isdisjoint(n.value)]

    def discard(self, nodes: Iterable[TreeNode]) -> int:
        """Take ``nodes`` and everything below them out of the tree, freeing their pages
        (pages that may hold a wrong write); none may be locked. Returns pages freed."""
        below: list[TreeNode] = []
        stack = list(nodes)
        while stack:
            node = stack.pop()
            if node.lock_ref:
                raise ValueError(f"{node} is locked; unlock it first")
            below.append(node)
            stack.extend(node.children.values())
        for node in below:  # the oldest of all: evict takes exactly these, leaves first
            node.last_access = -1
        return self.evict(sum(len(n.value) for n in below))


class DecodePrefixCache:
    """Finished requests' KV, matched by later prompts; the tree owns its pages.

    ``retain`` False (the flag off): only prompts in use are shared (the samples of one
    prompt, requests that arrive together on one prompt); a page no request reads leaves
    the tree at once, and a finished request's KV is not kept."""

    def __init__(self, allocator: PageAllocator, page_size: int, *, retain: bool = True) -> None:
        self.raw = allocator
        self.page_size = page_size
        self.retain = retain
        self.tree = PageTree(page_size, allocator)
        self.num_hit_pages = 0  # pages requests found here instead of receiving
        # prompt tokens samples copied from another sample of their prompt (sample_groups)
        self.num_copied_tokens = 0
        self.num_evicted_pages = 0

    def match(self, r: DecodeReq) -> None:
        """Give r its cached prefix: lock it and put its pages at the head of r.pages."""
        ps = self.page_size
        usable = (r.num_input_tokens - 1) // ps  # the last token's page always moves
        if usable <= 0:
            return
        tokens = r.origin_input_ids[: usable * ps]
        m = self.tree.match_prefix(tokens, salt_key(r.generate.cache_salt))
        if not m.page_ids:
            return
        r.prefix_node = self.tree.lock_match(m)
        self.tree.touch(r.prefix_node)
        r.num_prefix_pages = len(m.page_ids)
        r.pages = list(m.page_ids)
        self.num_hit_pages += len(m.page_ids)

    def cache_transferred(self, r: DecodeReq) -> None:
        """r's prompt KV has arrived: its whole pages go into the tree now (SGLang's
        cache_unfinished_req), and r reads them from there as its locked prefix. Requests of
        the same prompt that waited for this transfer (``shares_transfer``: the samples of
        an n > 1 request, a burst on one system prompt) then receive only their last page."""
        ps = self.page_size
        num_full = r.num_input_tokens // ps
        if num_full <= r.num_prefix_pages:
            return
        tokens = r.origin_input_ids[: num_full * ps]
        namespace = salt_key(r.generate.cache_salt)
        found = self.tree.insert(tokens, r.pages[:num_full], namespace) // ps
        m = self.tree.match_prefix(tokens, namespace)
        assert len(m.page_ids) == num_full, "the tree holds what was just inserted"
        # r's pages another request had cached first are duplicates: r reads the tree's.
        duplicates = r.pages[r.num_prefix_pages : max(found, r.num_prefix_pages)]
        node = self.tree.lock_match(m)
        if r.prefix_node is not None:
            self.tree.dec_lock_ref(r.prefix_node)
        self.raw.free(duplicates)
        r.pages = [*m.page_ids, *r.pages[num_full:]]
        r.prefix_node, r.num_prefix_pages = node, num_full

    def shares_transfer(self, r: DecodeReq, in_transfer: Iterable[DecodeReq]) -> bool:
        """Whether a request in transfer brings more of r's prompt than the tree holds now:
        r then waits for it (cache_transferred) instead of receiving those pages itself.
        Cheap when nothing in transfer starts like r (a first-page comparison each)."""
        ps = self.page_size
        usable = (r.num_input_tokens - 1) // ps
        if usable <= 0:
            return False
        first = first_page(r, ps)
        same = [t for t in in_transfer if first_page(t, ps) == first]
        if not same:
            return False
        key = token_key(r.origin_input_ids[: usable * ps])
        cached = len(self.tree.match_prefix(key, salt_key(r.generate.cache_salt)).page_ids)
        for t in same:
            other = token_key(t.origin_input_ids[: (t.num_input_tokens // ps) * ps])
            if common_pages(key, other, ps * TOKEN_BYTES) > cached:
                return True
        return False

    def evict(self, num_pages: int) -> None:
        """Free at least ``num_pages`` pages (least recently used leaves, unlocked)."""
        self.num_evicted_pages += self.tree.evict(num_pages)

    def unlock(self, r: DecodeReq) -> None:
        """Drop r's hold on its prefix (its pages stay the tree's); r.pages loses them."""
        if r.prefix_node is not None:
            self.tree.dec_lock_ref(r.prefix_node)
        r.prefix_node = None
        del r.pages[: r.num_prefix_pages]
        r.num_prefix_pages = 0
        self._drop_unread()

    def cache_finished(self, r: DecodeReq) -> None:
        """r finished normally: keep its KV's whole pages, free the rest, unlock (without
        ``retain``: free its own pages and unlock)."""
        if not self.retain:
            self.unlock(r)
            self.raw.free(r.pages)
            r.pages = []
            return
        kv_len = r.kv_len
        tokens = [*r.origin_input_ids, *r.output_ids][:kv_len]
        num_pages = kv_len // self.page_size
        pages = r.pages
        tokens = tokens[: num_pages * self.page_size]
        found = self.tree.insert(tokens, pages[:num_pages], salt_key(r.generate.cache_salt))
        found_pages = found // self.page_size
        # pages[:prefix] are the tree's; pages[prefix:found] duplicate cached pages;
        # pages[found:num_pages] are the tree's now; pages[num_pages:] hold a partial page.
        duplicates = pages[r.num_prefix_pages : max(found_pages, r.num_prefix_pages)]
        self.raw.free([*duplicates, *pages[num_pages:]])
        if r.prefix_node is not None:
            self.tree.dec_lock_ref(r.prefix_node)
        r.prefix_node = None
        r.num_prefix_pages = 0
        r.pages = []

    def _drop_unread(self) -> None:
        """Without ``retain``: free every cached page no request reads now."""
        if not self.retain and self.tree.num_evictable_pages:
            self.tree.evict(self.tree.num_evictable_pages)

    def poisoned(self, pages: Iterable[int]) -> list[TreeNode]:
        """The nodes holding one of ``pages``, where a late write may have landed."""
        return self.tree.nodes_holding(pages)

    @staticmethod
    def reads_any(r: DecodeReq, nodes: Sequence[TreeNode]) -> bool:
        """Whether r's locked prefix runs through one of ``nodes`` (or below one)."""
        node = r.prefix_node
        while node is not None:
            if any(node is n for n in nodes):
                return True
            node = node.parent
        return False

    def discard(self, nodes: Sequence[TreeNode]) -> None:
        """Drop ``nodes`` and what is below them (no request may read them any more)."""
        self.tree.discard(nodes)

    @property
    def num_pages(self) -> int:
        return self.tree.num_pages

    @property
    def num_evictable_pages(self) -> int:
        return self.tree.num_evictable_pages

    def cached_pages(self) -> list[int]:
        return self.tree.device_pages()

    def check_integrity(self) -> None:
        self.tree.check_integrity()


class CacheYieldingAllocator:
    """The pool's allocator as the decode loop sees it with a prefix cache: cached pages no
    request reads count as free and are evicted (least recently used) when needed."""

    def __init__(self, raw: PageAllocator, cache: DecodePrefixCache) -> None:
        self.raw = raw
        self.cache = cache

    @property
    def num_pages(self) -> int:
        return self.raw.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.raw.num_free_pages + self.cache.num_evictable_pages

    @property
    def num_used_pages(self) -> int:
        return self.raw.num_pages - self.num_free_pages

    def can_allocate(self, num: int) -> bool:
        return 0 <= num <= self.num_free_pages

    def allocate(self, num: int) -> list[int]:
        short = num - self.raw.num_free_pages
        if short > 0:
            self.cache.evict(short)
        return self.raw.allocate(num)

    def free(self, pages: Iterable[int]) -> None:
        self.raw.free(pages)

    def check_integrity(self) -> None:
        self.raw.check_integrity()


def common_pages(a: bytes, b: bytes, page_bytes: int) -> int:
    """Whole pages two packed token keys share from their start."""
    n = min(len(a), len(b)) // page_bytes
    lo, hi = 0, n
    while lo < hi:  # largest m with the first m pages equal
        mid = (lo + hi + 1) // 2
        if a[: mid * page_bytes] == b[: mid * page_bytes]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def first_page(r: DecodeReq, page_size: int) -> tuple[str | None, tuple[int, ...]]:
    """r's cache salt and the first page of its prompt (without building the whole prompt
    list): requests that can share cached pages have equal ones."""
    ids = itertools.chain(r.generate.input_ids, r.generate.output_ids)
    return r.generate.cache_salt, tuple(itertools.islice(ids, page_size))
