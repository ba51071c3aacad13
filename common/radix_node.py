"""The radix cache's data: nodes, match results and the structural events it logs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple, Protocol

from common.page_hash import HashArray

if TYPE_CHECKING:
    from common.kv_pool import PageAllocator

# Structural events: (kind, node, detail). EV_ADD: node got a child, detail is the child's
# first page. EV_SPLIT: node lost its first pages to a new parent, detail is the depth in
# tokens of the cut. EV_EVICT: node left the tree, detail None. EV_TIER: node moved between
# the device and the host tier (its device pages freed, or pages given back), detail None.
EV_ADD, EV_SPLIT, EV_EVICT, EV_TIER = 0, 1, 2, 3
Event = tuple[int, "TreeNode", bytes | int | None]


class PageFreer(Protocol):
    def free(self, pages: Iterable[int]) -> None: ...


class CacheEvents(Protocol):
    """Told what pages the cache gains and loses, by chained page hash (common/page_hash.py)."""

    def stored(self, hashes: HashArray) -> None: ...

    def removed(self, hashes: HashArray) -> None: ...

    def offloaded(self, hashes: HashArray) -> None: ...  # kept on the host tier alone

    def loaded(self, hashes: HashArray) -> None: ...  # back on the device from the host tier

    def cleared(self) -> None: ...


class HostPages(Protocol):
    """The host tier's page store (common/host_kv_pool.py): an allocator of host page ids
    and the copies between device and host pages."""

    @property
    def allocator(self) -> PageAllocator: ...

    def backup(self, device_pages: list[int], host_pages: list[int]) -> None: ...

    def load(self, host_pages: list[int], device_pages: list[int]) -> None: ...


class StaleMatchError(RuntimeError):
    """A match was used after the tree evicted part of it; match again."""


class TreeNode:
    """One edge of the tree: whole pages of tokens and their page ids.

    ``value`` holds the device pages; with a host tier (HiRadixCache) ``host_value`` holds
    a copy in host pages. A node whose device pages were evicted keeps only the copy
    (``value`` empty, ``is_host_only``); the device part of the tree is prefix-closed: a
    host-only node has only host-only nodes below it."""

    __slots__ = (
        "children",
        "hashes",
        "hit_count",
        "host_value",
        "is_evicted",
        "key",
        "last_access",
        "lock_ref",
        "parent",
        "serial",
        "value",
    )

    def __init__(self, key: bytes, value: list[int], parent: TreeNode | None, serial: int):
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        # Order of insertion among siblings (dfs-weight's tie-break, as dict order in SGLang).
        self.serial = serial
        self.is_evicted = False
        # The chained hash of each page (only when the cache publishes events).
        self.hashes: HashArray | None = None
        self.host_value: list[int] | None = None  # host pages holding a copy, or None
        self.hit_count = 0  # inserts that found this node (write_through_selective)

    @property
    def num_pages(self) -> int:
        """Pages of its tokens, on either tier (0: the root, a salt root)."""
        return len(self.value) if self.value else len(self.host_value or ())

    @property
    def is_host_only(self) -> bool:
        """Pages in the host tier only (salt roots and the root have no pages at all)."""
        return not self.value and bool(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(#{self.serial}, pages={len(self.value)}, lock={self.lock_ref})"


class MatchResult(NamedTuple):
    """The cached prefix of a token sequence. ``page_ids`` belong to the tree: lock
    ``last_node`` (``inc_lock_ref``) before using them and unlock when done."""

    page_ids: list[int]
    num_tokens: int  # on the device; a multiple of page_size
    last_node: TreeNode  # deepest node holding matched device pages (may end inside it)
    version: int  # tree version when matched
    generation: int  # tree generation (reset count) when matched
    # First page the match would continue with when it ended at the end of last_node and a
    # whole page of the sequence remains; None otherwise. An added child under this key
    # is the only insert that can lengthen the match.
    extend_key: bytes | None
    is_partial: bool  # ended inside its deepest node: a split of that node may change it
    # The match's continuation in host-only nodes (a host tier): their pages and tokens,
    # the first of those nodes (a child of last_node) and the deepest. extend_key and
    # is_partial then describe host_node.
    host_pages: tuple[int, ...] | list[int] = ()
    host_tokens: int = 0
    first_host: TreeNode | None = None
    host_node: TreeNode | None = None

    @property
    def end_node(self) -> TreeNode:
        """The deepest node of the match, on either tier."""
        return self.host_node if self.host_node is not None else self.last_node

    @property
    def total_tokens(self) -> int:
        """Tokens matched on both tiers (SGLang's num_matched_prefix_tokens counts both)."""
        return self.num_tokens + self.host_tokens
