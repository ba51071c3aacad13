"""Radix tree over token ids at page granularity; its values are KV page ids (RadixAttention).

Keys are packed token ids (``common.token_keys.token_key``): a node's key covers whole pages
and its value holds one page id per page_size tokens. Children are keyed by their first
page's bytes, so a lookup is one slice + dict get and a node comparison one memcmp.

Ownership (STYLE 6): the tree owns the pages of its nodes and is the only one to change
lock counts; pages leave it only through ``evict`` (or ``reset``), freed through the
allocator given at construction. Every structural change (child added, node split, node
evicted) bumps ``version`` and is logged, so a cached ``MatchResult`` can be revalidated
by looking at the changes since its version (``is_match_current``, ``PrefixMatcher``).

KV events (given ``events``): every page gets its chained hash (common/page_hash.py) when
it enters the tree, and ``events`` hears each page stored and evicted and each reset; a
split moves hashes, it neither stores nor removes a page; with a host tier, ``events`` also
hears each page kept on the host alone and each page loaded back. ``page_hashes()`` is the
whole set of a tier, for a snapshot.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from common import page_hash
from common.radix_integrity import check_tree
from common.radix_log import ChangeLog
from common.radix_node import (
    EV_ADD,
    EV_EVICT,
    EV_SPLIT,
    EV_TIER,
    CacheEvents,
    MatchResult,
    PageFreer,
    StaleMatchError,
    TreeNode,
)
from common.token_keys import TOKEN_BYTES, token_key

__all__ = ["CacheEvents", "MatchResult", "PageFreer", "RadixCache", "StaleMatchError", "TreeNode"]


class RadixCache(ChangeLog):
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
        self._init_log()
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
        self._host_leaves: set[TreeNode] = set()  # host-only nodes without children
        self.num_host_pages = 0  # host copies held (a host tier's)
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
        node, pos, is_partial = self.root, 0, False
        pages: list[int] = []
        host: list[int] = []
        if namespace is not None:
            salted = self.root.children.get(namespace)
            if salted is None:  # nothing cached under this salt: creating it can extend
                extend = namespace if end else None
                return MatchResult([], 0, self.root, self.version, self.generation, extend, False)
            node = salted
        # The device part ends where a host-only node starts (the device tier is
        # prefix-closed); the match goes on through host-only nodes into host_pages.
        found, device_node, device_pos = pages, node, 0
        first_host: TreeNode | None = None
        while pos < end:
            child = node.children.get(key[pos : pos + pb])
            if child is None:
                break
            if first_host is None and not child.value:
                device_node, device_pos, first_host, found = node, pos, child, host
            value = child.value or child.host_value
            assert value is not None
            ck = child.key
            node = child
            if key.startswith(ck, pos):
                found += value
                pos += len(ck)
                continue
            n = _common_pages(key, pos, end, ck, pb)
            found += value[:n]
            pos += n * pb
            is_partial = True
            break
        extend_key = key[pos : pos + pb] if not is_partial and pos < end else None
        if first_host is None:
            return MatchResult(
                pages,
                pos // TOKEN_BYTES,
                node,
                self.version,
                self.generation,
                extend_key,
                is_partial,
            )
        return MatchResult(
            pages,
            device_pos // TOKEN_BYTES,
            device_node,
            self.version,
            self.generation,
            extend_key,
            is_partial,
            host,
            (pos - device_pos) // TOKEN_BYTES,
            first_host,
            node,
        )

    def insert(
        self,
        token_ids: Sequence[int] | bytes,
        page_ids: Sequence[int],
        namespace: bytes | None = None,
    ) -> int:
        """Cache the whole pages of ``token_ids`` whose KV is in ``page_ids`` (one id per page,
        extra ids ignored); return how many leading tokens were cached already on the device
        (host-only nodes the key passes get the caller's pages from there on: ``_revive``).

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
        adopted = None  # where the caller's pages started to become the tree's
        while pos < end:
            first = key[pos : pos + pb]
            child = node.children.get(first)
            if child is None:
                self._add_leaf(node, first, key[pos:end], list(page_ids[pos // pb : num_pages]))
                node.children[first].last_access = tick
                return (pos if adopted is None else adopted) // TOKEN_BYTES
            ck = child.key
            child.last_access = tick
            if child.is_host_only:  # computed again by the caller: its pages come back
                adopted = pos if adopted is None else adopted
                if not key.startswith(ck, pos):
                    child = self.split(child, _common_pages(key, pos, end, ck, pb))
                    ck = child.key
                self._revive(child, list(page_ids[pos // pb : (pos + len(ck)) // pb]))
                node = child
                pos += len(ck)
                continue
            if key.startswith(ck, pos):
                node = child
                pos += len(ck)
                continue
            n = _common_pages(key, pos, end, ck, pb)
            if pos + n * pb == end:
                break  # the whole key lies inside child: nothing to add
            node = self.split(child, n)
            pos += n * pb
        return (end if adopted is None else adopted) // TOKEN_BYTES

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
        self._evictable_leaves.discard(parent)  # it has a device child now
        parent.children[first] = leaf
        self._evictable_leaves.add(leaf)
        self.num_evictable_pages += len(value)
        self._log_event(EV_ADD, parent, first)
        self._stored(leaf)

    def _revive(self, node: TreeNode, pages: list[int]) -> None:
        """A host-only node (its parent on the device) gets device pages again."""
        parent = node.parent
        assert (
            parent is not None
            and node.is_host_only
            and len(pages) * self._page_bytes == len(node.key)
        )
        node.value = pages
        self._host_leaves.discard(node)
        self._evictable_leaves.discard(parent)
        self.num_evictable_pages += len(pages)
        if self._is_device_leaf(node):
            self._evictable_leaves.add(node)
        self._tell("loaded", node)
        self._log_event(EV_TIER, node, None)

    # Hooks of the host tier (HiRadixCache); without one, nothing is copied or kept.
    def _stored(self, node: TreeNode) -> None:
        """node got new device pages (an insert)."""

    def record_hit(self, node: TreeNode) -> None:
        """A request starts from the prefix ending at node (its admission)."""

    def _offload(self, node: TreeNode) -> bool:
        """Whether an evicted device node keeps a host copy (then it stays, host-only)."""
        return False

    def cut(self, node: TreeNode, num_pages: int) -> TreeNode:
        """The node of node's path that ends ``num_pages`` pages deep, the one spanning that
        depth split there: what a lock on exactly those pages takes (SGLang's match splits
        where it ends; a lock on a longer node also holds pages the budget counts as free)."""
        depth = 0
        above: TreeNode | None = node
        while above is not None:
            depth, above = depth + above.num_pages, above.parent
        while node.num_pages and depth - node.num_pages >= num_pages:  # not past a salt root
            depth, node = depth - node.num_pages, node.parent  # type: ignore[assignment]
        if depth > num_pages > depth - node.num_pages:
            node = self.split(node, num_pages - (depth - node.num_pages))
        return node

    def split(self, child: TreeNode, num_pages: int) -> TreeNode:
        """Cut child after num_pages pages; the new upper node takes its place (and serial)."""
        pb = self._page_bytes
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[: num_pages * pb], child.value[:num_pages], parent, child.serial)
        if child.hashes is not None:
            upper.hashes, child.hashes = child.hashes[:num_pages], child.hashes[num_pages:]
        if child.host_value is not None:
            upper.host_value = child.host_value[:num_pages]
            child.host_value = child.host_value[num_pages:]
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hit_count = child.hit_count
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
                if self._is_device_leaf(node):
                    self._evictable_leaves.add(node)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_pages: int) -> int:
        """Free at least num_pages device pages (if there are) from unlocked device leaves,
        least recently used first, whole nodes at a time; return the number freed. A node
        with a host copy stays in the tree, host-only; one without leaves it (with any
        host-only nodes below it)."""
        heap = [(n.last_access, n.serial, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            node = heapq.heappop(heap)[2]
            if node not in self._evictable_leaves:
                continue  # a host eviction took it meanwhile (a salt root)
            parent = node.parent
            assert parent is not None
            freed += node.value
            is_kept = bool(node.value) and self._offload(node)  # may drop host leaves below
            self._evictable_leaves.discard(node)
            self.num_evictable_pages -= len(node.value)
            if is_kept:
                node.value = []
                if not node.children:
                    self._host_leaves.add(node)
                self._tell("offloaded", node)
                self._log_event(EV_TIER, node, None)
            else:
                self._remove(node)
            if parent is not self.root and self._is_device_leaf(parent):
                self._evictable_leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        if freed and self._allocator is not None:
            self._allocator.free(freed)
        return len(freed)

    def _is_device_leaf(self, node: TreeNode) -> bool:
        """Unlocked with no device child (a salt root: no child at all): evict may take it."""
        if node.lock_ref:
            return False
        if not node.value:
            return not node.children
        return not any(c.value for c in node.children.values())

    def _remove(self, node: TreeNode) -> None:
        """Take node and the host-only nodes below it out of the tree (its device pages are
        the caller's to free); their host copies are freed."""
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node)]
        if parent.is_host_only and not parent.children:
            self._host_leaves.add(parent)
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self._namespace_of.pop(n, None)
            self._host_leaves.discard(n)
            self._drop_host_copy(n)
            n.is_evicted = True
            self._tell("removed", n)
            self._log_event(EV_EVICT, n, None)

    def _tell(self, event: str, node: TreeNode) -> None:
        """Tell the events sink (``removed``, ``offloaded``, ``loaded``) node's pages."""
        if self._events is not None and node.hashes is not None and len(node.hashes):
            getattr(self._events, event)(node.hashes)

    def _drop_host_copy(self, node: TreeNode) -> None:
        """Free node's host pages (a host tier's; a plain tree has none)."""

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
            self._drop_host_copy(node)
            node.is_evicted = True
        self._init_tree()
        if self._events is not None:
            self._events.cleared()
        self._restart_log()

    def _tail_hash(self, node: TreeNode) -> int:
        """The chained hash a child of ``node`` continues from."""
        if node.hashes is not None and len(node.hashes):
            return int(node.hashes[-1])
        return page_hash.root_hash(self._namespace_of.get(node))

    def page_hashes(self, *, host: bool = False) -> page_hash.HashArray:
        """The hash of every page cached on the device (``host``: on the host tier alone);
        empty unless the cache publishes events."""
        parts = [n.hashes for n in self._nodes() if n.hashes is not None and n.is_host_only == host]
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
        check_tree(self)


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
