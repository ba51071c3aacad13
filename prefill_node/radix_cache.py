"""Radix tree over token ids at page granularity; its values are KV page ids (RadixAttention).

Keys are packed token ids (``prefill_node.request.token_key``): a node's key covers whole pages
and its value holds one page id per page_size tokens. Children are keyed by their first
page's bytes, so a lookup is one slice + dict get and a node comparison one memcmp.

Ownership (STYLE 6): the tree owns the pages of its nodes and is the only one to change
lock counts; pages leave it only through ``evict`` (or ``reset``), freed through the
allocator given at construction. Every structural change (child added, node split, node
evicted) bumps ``version`` and is logged, so a cached ``MatchResult`` can be revalidated
by looking at the changes since its version (``is_match_current``, ``PrefixMatcher``).

KV events (given ``events``): every page gets its chained hash (common/page_hash.py) when
it enters the tree, and ``events`` hears each page stored and evicted and each reset; a
split moves hashes, it neither stores nor removes a page. ``page_hashes()`` is the whole
set, for a snapshot.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from common import page_hash
from common.token_keys import TOKEN_BYTES, token_key
from prefill_node.radix_node import (
    EV_ADD,
    EV_EVICT,
    EV_SPLIT,
    CacheEvents,
    Event,
    MatchResult,
    PageFreer,
    StaleMatchError,
    TreeNode,
)

__all__ = ["CacheEvents", "MatchResult", "PageFreer", "RadixCache", "StaleMatchError", "TreeNode"]

_MAX_LOG = 1 << 16  # events kept for revalidating matches


class RadixCache:
    """Page-granular prefix cache. Sizes are in pages; the ``*_size()`` methods in tokens."""

    def __init__(
        self, page_size: int, allocator: PageFreer | None = None, events: CacheEvents | None = None
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        self._page_bytes = page_size * TOKEN_BYTES
        # A KVPool frees through its allocator; None: values are not real pages (tests, bench).
        self._allocator: PageFreer | None = getattr(allocator, "allocator", allocator)
        self.version = 0
        self.generation = 0
        self._log: list[Event] = []
        self._log_start = 0  # version of _log[0]
        self._serial = 0
        self._tick = 0
        self._events = events
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode(b"", [], None, self._next_serial())
        self.root.lock_ref = 1  # never evicted
        self.num_evictable_pages = 0
        self.num_protected_pages = 0
        self._evictable_leaves: set[TreeNode] = set()
        self._namespace_of: dict[TreeNode, bytes] = {}  # salt subtree roots (no pages)

    # --- sizes -----------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.num_evictable_pages + self.num_protected_pages

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (what evict can free)."""
        return self.num_evictable_pages * self.page_size

    def protected_size(self) -> int:
        """Tokens in nodes locked by running requests."""
        return self.num_protected_pages * self.page_size

    def total_size(self) -> int:
        return self.num_pages * self.page_size

    # --- match, insert -----------------------------------------------------------------------
    def _as_key(self, token_ids: Sequence[int] | bytes) -> bytes:
        if isinstance(token_ids, bytes):
            if len(token_ids) % TOKEN_BYTES:
                raise ValueError("a packed key must hold whole int32 token ids")
            return token_ids
        return token_key(token_ids)

    def match_prefix(
        self, token_ids: Sequence[int] | bytes, namespace: bytes | None = None
    ) -> MatchResult:
        """The longest cached prefix in whole pages, within ``namespace`` (a cache salt's
        ``salt_key``; None: the shared one). Pure: changes nothing (not even LRU)."""
        key = self._as_key(token_ids)
        pb = self._page_bytes
        end = len(key) - len(key) % pb
        node, pos, pages, is_partial = self.root, 0, [], False
        if namespace is not None:
            salted = self.root.children.get(namespace)
            if salted is None:  # nothing cached under this salt: creating it can extend
                extend = namespace if end else None
                return MatchResult([], 0, self.root, self.version, self.generation, extend, False)
            node = salted
        while pos < end:
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                break
            ck = child.key
            node = child
            if key.startswith(ck, pos):
                pages += child.value
                pos += len(ck)
                continue
            n = _common_pages(key, pos, end, ck, pb)
            pages += child.value[:n]
            pos += n * pb
            is_partial = True
            break
        extend_key = key[pos : pos + pb] if not is_partial and pos < end else None
        return MatchResult(
            pages, pos // TOKEN_BYTES, node, self.version, self.generation, extend_key, is_partial
        )

    def insert(
        self,
        token_ids: Sequence[int] | bytes,
        page_ids: Sequence[int],
        namespace: bytes | None = None,
    ) -> int:
        """Cache the whole pages of ``token_ids`` whose KV is in ``page_ids`` (one id per page,
        extra ids ignored); return how many leading tokens were cached already.

        Who frees what, with ``n = len(token_ids) // page_size`` and ``p = returned // page_size``:
        ``page_ids[p:n]`` now belong to the tree (freed by evict). ``page_ids[:p]`` stay the
        caller's: those that came from its own match (``req.prefix_indices``) are the tree's
        pages anyway, the others duplicate cached pages and the caller frees them, i.e. free
        ``page_ids[len(req.prefix_indices):p]``. ``page_ids[n:]`` (the page of a trailing
        partial page of tokens) stay the caller's to free.
        """
        key = self._as_key(token_ids)
        pb = self._page_bytes
        num_pages = len(key) // pb
        end = num_pages * pb
        if len(page_ids) < num_pages:
            raise ValueError(f"{num_pages} whole pages of tokens but {len(page_ids)} page ids")
        tick = self._next_tick()
        node, pos = self.root, 0
        if namespace is not None and end:
            node = self._namespace_node(namespace)
            node.last_access = tick
        while pos < end:
            first = key[pos : pos + pb]
            child = node.children.get(first)
            if child is None:
                self._add_leaf(node, first, key[pos:end], list(page_ids[pos // pb : num_pages]))
                node.children[first].last_access = tick
                return pos // TOKEN_BYTES
            ck = child.key
            child.last_access = tick
            if key.startswith(ck, pos):
                node = child
                pos += len(ck)
                continue
            n = _common_pages(key, pos, end, ck, pb)
            if pos + n * pb == end:
                break  # the whole key lies inside child: nothing to add
            node = self._split(child, n)
            pos += n * pb
        return end // TOKEN_BYTES

    def _namespace_node(self, namespace: bytes) -> TreeNode:
        """The root of a salt's subtree (a child of the root without pages), made on demand;
        it goes with its last child (evict)."""
        node = self.root.children.get(namespace)
        if node is None:
            node = TreeNode(b"", [], self.root, self._next_serial())
            self.root.children[namespace] = node
            self._namespace_of[node] = namespace
            self._evictable_leaves.add(node)
            self._log_event(EV_ADD, self.root, namespace)
        return node

    def _child_key(self, node: TreeNode) -> bytes:
        """The key node is filed under in its parent's children."""
        return self._namespace_of.get(node) or node.key[: self._page_bytes]

    def _add_leaf(self, parent: TreeNode, first: bytes, key: bytes, value: list[int]) -> None:
        leaf = TreeNode(key, value, parent, self._next_serial())
        if self._events is not None:
            leaf.hashes = page_hash.chain(key, self.page_size, self._tail_hash(parent))
            self._events.stored(leaf.hashes)
        if not parent.children and parent.lock_ref == 0:
            self._evictable_leaves.discard(parent)
        parent.children[first] = leaf
        self._evictable_leaves.add(leaf)
        self.num_evictable_pages += len(value)
        self._log_event(EV_ADD, parent, first)

    def _split(self, child: TreeNode, num_pages: int) -> TreeNode:
        """Cut child after num_pages pages; the new upper node takes its place (and serial)."""
        pb = self._page_bytes
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[: num_pages * pb], child.value[:num_pages], parent, child.serial)
        if child.hashes is not None:
            upper.hashes, child.hashes = child.hashes[:num_pages], child.hashes[num_pages:]
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        parent.children[child.key[:pb]] = upper  # same key: keeps its place among siblings
        child.serial = self._next_serial()
        child.key = child.key[num_pages * pb :]
        child.value = child.value[num_pages:]
        child.parent = upper
        upper.children[child.key[:pb]] = child
        depth, above = len(upper.key), parent.parent
        depth += len(parent.key)
        while above is not None:
            depth += len(above.key)
            above = above.parent
        self._log_event(EV_SPLIT, child, depth // TOKEN_BYTES)
        return upper

    # --- locks, eviction, LRU ----------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect node and its path to the root from eviction."""
        if node.is_evicted:
            raise StaleMatchError(f"{node} was evicted; match the request again")
        while node is not self.root:
            if node.lock_ref == 0:
                self.num_evictable_pages -= len(node.value)
                self.num_protected_pages += len(node.value)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one inc_lock_ref(node)."""
        if node is not self.root and node.lock_ref <= 0:
            raise ValueError(f"{node} is not locked")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_evictable_pages += len(node.value)
                self.num_protected_pages -= len(node.value)
                if not node.children:
                    self._evictable_leaves.add(node)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages pages (if there are) from unlocked leaves, least recently
        used first, whole nodes at a time; return the number of pages freed."""
        heap = [(n.last_access, n.serial, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            node = heapq.heappop(heap)[2]
            parent = node.parent
            assert parent is not None
            freed += node.value
            del parent.children[self._child_key(node)]
            self._namespace_of.pop(node, None)
            self._evictable_leaves.discard(node)
            self.num_evictable_pages -= len(node.value)
            node.is_evicted = True
            if self._events is not None and node.hashes is not None and len(node.hashes):
                self._events.removed(node.hashes)
            self._log_event(EV_EVICT, node, None)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                self._evictable_leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        if freed and self._allocator is not None:
            self._allocator.free(freed)
        return len(freed)

    def touch(self, target: TreeNode | Sequence[int] | bytes) -> None:
        """Mark a node's path (or a sequence's cached prefix) as just used."""
        node: TreeNode | None = target if isinstance(target, TreeNode) else None
        if node is None:
            node = self.match_prefix(target).last_node  # type: ignore[arg-type]
        tick = self._next_tick()
        while node is not None and not node.is_evicted:
            node.last_access = tick
            node = node.parent

    def touch_paths(self, last_nodes: Sequence[TreeNode], *, is_ordered: bool = True) -> None:
        """Touch many paths, the first most recently: LRU then evicts the paths of later
        nodes first (same result as touching them one by one in reverse order). With
        is_ordered False all paths get the same access time."""
        step = 1 if is_ordered else 0
        base = self._tick + len(last_nodes) * step
        self._tick = base + 1
        seen: set[TreeNode] = set()
        for i, node in enumerate(last_nodes):
            tick = base - i * step
            while node is not self.root and node not in seen and not node.is_evicted:
                seen.add(node)
                node.last_access = tick
                node = node.parent  # type: ignore[assignment]

    # --- dfs-weight ------------------------------------------------------------------------
    def dfs_weight_order(self, last_nodes: Sequence[TreeNode]) -> list[int]:
        """Indices of last_nodes in SGLang's dfs-weight order: DFS from the root visiting
        children with more requests in their subtree first (ties: insertion order), a node's
        own requests after its children's, in input order."""
        nodes = [self.root if n.is_evicted else n for n in last_nodes]  # stale: no match
        rank = self.dfs_node_ranks(Counter(nodes))
        keys = list(map(rank.__getitem__, nodes))
        return sorted(range(len(keys)), key=keys.__getitem__)  # stable: input order in a node

    def dfs_node_ranks(self, counts: Mapping[TreeNode, int]) -> dict[TreeNode, int]:
        """Post-order position, in dfs-weight order, of every node with a positive count
        (requests ending there) and of its ancestors. Cost: those nodes times depth."""
        weight: dict[TreeNode, int] = {}
        kids: dict[TreeNode, list[TreeNode]] = {}
        for node, count in counts.items():
            while node is not None:  # add count to the node and its ancestors
                if node in weight:
                    weight[node] += count
                else:
                    weight[node] = count
                    if node.parent is not None:
                        kids.setdefault(node.parent, []).append(node)
                node = node.parent  # type: ignore[assignment]
        rank: dict[TreeNode, int] = {}
        stack: list[tuple[TreeNode, bool]] = [(self.root, False)]
        while stack:
            node, is_visited = stack.pop()
            if is_visited:
                rank[node] = len(rank)
                continue
            stack.append((node, True))
            children = kids.get(node)
            if children:
                children.sort(key=lambda c: (-weight[c], c.serial))
                stack.extend((c, False) for c in reversed(children))
        return rank

    # --- versioning ------------------------------------------------------------------------
    def events_since(self, version: int) -> list[Event] | None:
        """Structural changes after ``version``; None when they are no longer logged."""
        if version == self.version:
            return []
        if version < self._log_start or version > self.version:
            return None
        return self._log[version - self._log_start :]

    def is_match_current(self, match: MatchResult) -> bool:
        """Whether ``match`` is still what match_prefix would return (same pages and node)."""
        if match.generation != self.generation:
            return False
        events = self.events_since(match.version)
        if events is None:
            return False
        node = match.last_node
        for kind, n, detail in events:
            if n is node and (
                kind == EV_EVICT
                or (kind == EV_SPLIT and match.is_partial and match.num_tokens <= detail)  # type: ignore[operator]
                or (kind == EV_ADD and detail == match.extend_key)
            ):
                return False
        return True

    def _log_event(self, kind: int, node: TreeNode, detail: bytes | int | None) -> None:
        self._log.append((kind, node, detail))
        self.version += 1
        if len(self._log) > 2 * _MAX_LOG:
            del self._log[:_MAX_LOG]
            self._log_start += _MAX_LOG

    def _next_serial(self) -> int:
        self._serial += 1
        return self._serial

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    # --- whole tree ------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every cached prefix, freeing its pages. Refused while any node is locked."""
        if self.num_protected_pages:
            raise RuntimeError(f"{self.num_protected_pages} cached pages are locked; unlock first")
        pages = [p for node in self._nodes() for p in node.value]
        if pages and self._allocator is not None:
            self._allocator.free(pages)
        for node in self._nodes():
            node.is_evicted = True
        self._init_tree()
        if self._events is not None:
            self._events.cleared()
        self.generation += 1
        self.version += 1
        self._log.clear()
        self._log_start = self.version

    def _tail_hash(self, node: TreeNode) -> int:
        """The chained hash a child of ``node`` continues from."""
        if node.hashes is not None and len(node.hashes):
            return int(node.hashes[-1])
        return page_hash.root_hash(self._namespace_of.get(node))

    def page_hashes(self) -> page_hash.HashArray:
        """The hash of every cached page (empty unless the cache publishes events)."""
        parts = [n.hashes for n in self._nodes() if n.hashes is not None]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)

    def _nodes(self) -> list[TreeNode]:
        """Every node but the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        """Raise AssertionError unless every invariant holds (tests and idle loops call it)."""
        pb, seen_pages = self._page_bytes, set()
        evictable = protected = 0
        leaves = set()
        for node in self._nodes():
            parent = node.parent
            _require(parent is not None and not node.is_evicted, f"{node} detached")
            assert parent is not None
            _require(
                parent.children.get(self._child_key(node)) is node, f"{node} not under its key"
            )
            is_namespace = node in self._namespace_of
            _require(
                (len(node.key) > 0 or (is_namespace and parent is self.root))
                and len(node.key) == len(node.value) * pb,
                f"{node}: key length does not match its pages",
            )
            _require(node.lock_ref >= 0, f"{node} has a negative lock count")
            _require(
                parent is self.root or parent.lock_ref >= node.lock_ref,
                f"{node} is locked more than its parent",
            )
            for p in node.value:
                _require(p not in seen_pages, f"page {p} held by two nodes")
                seen_pages.add(p)
            if node.lock_ref:
                protected += len(node.value)
            else:
                evictable += len(node.value)
                if not node.children:
                    leaves.add(node)
        _require(
            evictable == self.num_evictable_pages,
            f"evictable {self.num_evictable_pages} pages, counted {evictable}",
        )
        _require(
            protected == self.num_protected_pages,
            f"protected {self.num_protected_pages} pages, counted {protected}",
        )
        _require(leaves == self._evictable_leaves, "evictable leaf set out of date")
        _require(self.version == self._log_start + len(self._log), "event log out of step")


def _common_pages(key: bytes, pos: int, end: int, node_key: bytes, pb: int) -> int:
    """Whole pages node_key shares with key[pos:end], given that the first page matches."""
    lo, hi = 1, min(len(node_key), end - pos) // pb
    view = memoryview(node_key)  # slices without copies
    while lo < hi:  # largest n with key[pos:] starting with node_key[:n pages]
        mid = (lo + hi + 1) // 2
        if key.startswith(view[: mid * pb], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _require(is_ok: bool, message: str) -> None:
    if not is_ok:
        raise AssertionError(message)
