"""The radix cache's data: nodes, match results and the structural events it logs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Protocol

from common.page_hash import HashArray

# Structural events: (kind, node, detail). EV_ADD: node got a child, detail is the child's
# first page. EV_SPLIT: node lost its first pages to a new parent, detail is the depth in
# tokens of the cut. EV_EVICT: node left the tree, detail None.
EV_ADD, EV_SPLIT, EV_EVICT = 0, 1, 2
Event = tuple[int, "TreeNode", bytes | int | None]


class PageFreer(Protocol):
    def free(self, pages: Iterable[int]) -> None: ...


class CacheEvents(Protocol):
    """Told what pages the cache gains and loses, by chained page hash (common/page_hash.py)."""

    def stored(self, hashes: HashArray) -> None: ...

    def removed(self, hashes: HashArray) -> None: ...

    def cleared(self) -> None: ...


class StaleMatchError(RuntimeError):
    """A match was used after the tree evicted part of it; match again."""


class TreeNode:
    """One edge of the tree: whole pages of tokens and their page ids."""

    __slots__ = (
        "children",
        "hashes",
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

    def __repr__(self) -> str:
        return f"TreeNode(#{self.serial}, pages={len(self.value)}, lock={self.lock_ref})"


class MatchResult(NamedTuple):
    """The cached prefix of a token sequence. ``page_ids`` belong to the tree: lock
    ``last_node`` (``inc_lock_ref``) before using them and unlock when done."""

    page_ids: list[int]
    num_tokens: int  # a multiple of page_size
    last_node: TreeNode  # deepest node holding matched pages (the match may end inside it)
    version: int  # tree version when matched
    generation: int  # tree generation (reset count) when matched
    # First page the match would continue with when it ended at the end of last_node and a
    # whole page of the sequence remains; None otherwise. An added child under this key
    # is the only insert that can lengthen the match.
    extend_key: bytes | None
    is_partial: bool  # ended inside last_node: a split of last_node may change it
