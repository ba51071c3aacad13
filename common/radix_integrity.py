"""The radix cache's invariants, checked by walking the whole tree (tests and idle loops)."""

from __future__ import annotations

from typing import Any

from common.token_keys import TOKEN_BYTES


def check_tree(tree: Any) -> None:
    """Raise AssertionError unless every invariant of ``tree`` (a RadixCache, not imported:
    it imports this module) holds: each node under its
    key, keys as long as their pages (device pages, or the host copy of a host-only node),
    no page held twice on a tier, locks no deeper than their parents, the device tier
    prefix-closed, and the page counts and leaf sets equal to what the walk finds."""
    pb = tree.page_size * TOKEN_BYTES
    seen_pages: set[int] = set()
    seen_host: set[int] = set()
    evictable = protected = 0
    leaves, host_leaves = set(), set()
    for node in tree._nodes():
        parent = node.parent
        _require(parent is not None and not node.is_evicted, f"{node} detached")
        assert parent is not None
        _require(parent.children.get(tree._child_key(node)) is node, f"{node} not under its key")
        is_namespace = node in tree._namespace_of
        pages = node.host_value if node.is_host_only else node.value
        _require(
            (len(node.key) > 0 or (is_namespace and parent is tree.root))
            and pages is not None
            and len(node.key) == len(pages) * pb,
            f"{node}: key length does not match its pages",
        )
        _require(node.lock_ref >= 0, f"{node} has a negative lock count")
        _require(
            parent is tree.root or parent.lock_ref >= node.lock_ref,
            f"{node} is locked more than its parent",
        )
        _require(
            not node.value or not parent.is_host_only,
            f"{node} is on the device below a host-only node",
        )
        _require(not node.is_host_only or node.lock_ref == 0, f"host-only {node} is locked")
        for p in node.value:
            _require(p not in seen_pages, f"page {p} held by two nodes")
            seen_pages.add(p)
        if node.host_value is not None:
            _require(
                len(node.host_value) * pb == len(node.key), f"{node}: host copy of another length"
            )
            for p in node.host_value:
                _require(p not in seen_host, f"host page {p} held by two nodes")
                seen_host.add(p)
        if node.is_host_only:
            if not node.children:
                host_leaves.add(node)
        elif node.lock_ref:
            protected += len(node.value)
        else:
            evictable += len(node.value)
            if tree._is_device_leaf(node):
                leaves.add(node)
    _require(
        evictable == tree.num_evictable_pages,
        f"evictable {tree.num_evictable_pages} pages, counted {evictable}",
    )
    _require(
        protected == tree.num_protected_pages,
        f"protected {tree.num_protected_pages} pages, counted {protected}",
    )
    _require(leaves == tree._evictable_leaves, "evictable leaf set out of date")
    _require(host_leaves == tree._host_leaves, "host leaf set out of date")
    _require(
        len(seen_host) == tree.num_host_pages,
        f"{tree.num_host_pages} host pages counted, {len(seen_host)} held",
    )
    _require(tree.version == tree._log_start + len(tree._log), "event log out of step")


def _require(is_ok: bool, message: str) -> None:
    if not is_ok:
        raise AssertionError(message)
