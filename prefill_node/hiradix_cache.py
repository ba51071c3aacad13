"""HiRadixCache: the radix cache with a host-memory tier below the device pool (SGLang's
HiCache, L1 + L2).

A node's device pages get a copy in host pages (``host_value``) when its write policy
says so; evicting the node from the device then keeps it in the tree, host-only, instead
of losing it. A match goes on through host-only nodes (``MatchResult.host_pages``), and
``load_back`` copies such a prefix into fresh device pages before a prefill starts from it.

Write policies (SGLang's names and meanings):
  write_through            a node is copied to the host as soon as it is cached;
  write_through_selective  once requests started from it ``SELECTIVE_HIT_THRESHOLD`` times;
  write_back               only when the device evicts it.
The host tier evicts least recently used host-only leaves to make room; a node with no
host copy leaves the tree when the device evicts it, with any host-only nodes below it.
Host hits count as cached everywhere a match is read (``MatchResult.total_tokens``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from enum import Enum

from common.radix_cache import RadixCache
from common.radix_node import CacheEvents, HostPages, MatchResult, PageFreer, TreeNode
from common.token_keys import TOKEN_BYTES


class WritePolicy(str, Enum):
    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


WRITE_POLICIES = tuple(p.value for p in WritePolicy)
SELECTIVE_HIT_THRESHOLD = 2  # SGLang's write_through_threshold for the selective policy


class HiRadixCache(RadixCache):
    def __init__(
        self,
        page_size: int,
        allocator: PageFreer | None,
        host: HostPages,
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        events: CacheEvents | None = None,
    ) -> None:
        self.host = host
        self.write_policy = WritePolicy(write_policy)
        self.num_host_evicted_pages = 0  # host copies dropped to make room (a counter)
        super().__init__(page_size, allocator, events)

    # --- the hooks of RadixCache ------------------------------------------------------------
    def _stored(self, node: TreeNode) -> None:
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            self._backup(node)

    def record_hit(self, node: TreeNode) -> None:
        is_selective = self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
        while node is not self.root and not node.is_evicted:
            node.hit_count += 1
            if is_selective and node.hit_count >= SELECTIVE_HIT_THRESHOLD:
                if node.value and node.host_value is None:
                    self._backup(node)
            node = node.parent  # type: ignore[assignment]

    def _offload(self, node: TreeNode) -> bool:
        if node.host_value is None and self.write_policy is WritePolicy.WRITE_BACK:
            self._backup(node)
        return node.host_value is not None

    def _drop_host_copy(self, node: TreeNode) -> None:
        if node.host_value is not None:
            self.host.allocator.free(node.host_value)
            self.num_host_pages -= len(node.host_value)
            node.host_value = None

    # --- the host tier ------------------------------------------------------------------------
    def _backup(self, node: TreeNode) -> bool:
        """Copy node's device pages to host pages (making room if needed); False when the
        host tier has no room for them."""
        num = len(node.value)
        allocator = self.host.allocator
        if num > allocator.num_free_pages:
            self.evict_host(num - allocator.num_free_pages, keep=node)
        if num > allocator.num_free_pages:
            return False
        pages = allocator.allocate(num)
        self.host.backup(node.value, pages)
        node.host_value = pages
        self.num_host_pages += num
        return True

    def evict_host(self, num_pages: int, keep: TreeNode | None = None) -> int:
        """Drop at least num_pages host pages (if there are) from host-only leaves, least
        recently used first, whole nodes at a time (never ``keep``'s subtree); return the
        number dropped. Host copies of nodes still on the device are not taken."""
        heap = [(n.last_access, n.serial, n) for n in self._host_leaves if n is not keep]
        heapq.heapify(heap)
        dropped = 0
        while dropped < num_pages and heap:
            node = heapq.heappop(heap)[2]
            if node not in self._host_leaves:
                continue
            parent = node.parent
            assert parent is not None and node.host_value is not None
            dropped += len(node.host_value)
            self._remove(node)
            if parent in self._host_leaves and parent is not keep:
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
            elif parent is not self.root and parent is not keep and self._is_device_leaf(parent):
                self._evictable_leaves.add(parent)  # a salt root whose last child left
        self.num_host_evicted_pages += dropped
        return dropped

    def load_back(
        self,
        token_ids: Sequence[int] | bytes,
        namespace: bytes | None,
        device_pages: list[int],
    ) -> tuple[MatchResult, list[int]]:
        """Copy the first ``len(device_pages)`` host pages of the sequence's match into
        ``device_pages`` (free pages the caller allocated), which then belong to the tree;
        return the new match and the device pages not needed (the match's host part was
        shorter, e.g. a host eviction made room since), which stay the caller's."""
        match = self.match_prefix(token_ids, namespace)
        num = min(len(device_pages), len(match.host_pages))
        key = self._as_key(token_ids)
        pb, pos = self._page_bytes, match.num_tokens * TOKEN_BYTES
        node, done = match.first_host, 0
        while done < num:
            assert node is not None and node.host_value is not None and node.is_host_only
            if done + len(node.host_value) > num:
                node = self.split(node, num - done)
            assert node.host_value is not None
            pages = device_pages[done : done + len(node.host_value)]
            self.host.load(node.host_value, pages)
            self._revive(node, pages)
            done += len(pages)
            pos += len(node.key)
            if done < num:
                node = node.children.get(key[pos : pos + pb])
        if num:
            match = self.match_prefix(token_ids, namespace)
        return match, device_pages[num:]

    def check_integrity(self) -> None:
        super().check_integrity()
        used = self.host.allocator.num_pages - self.host.allocator.num_free_pages
        if used != self.num_host_pages:
            raise AssertionError(f"{used} host pages allocated, {self.num_host_pages} held")
