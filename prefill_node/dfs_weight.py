"""SGLang's dfs-weight order over radix-tree nodes: heavier subtrees first, post-order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from common.radix_node import TreeNode


def dfs_weight_order(root: TreeNode, last_nodes: Sequence[TreeNode]) -> list[int]:
    """Indices of last_nodes in SGLang's dfs-weight order: DFS from the root visiting
    children with more requests in their subtree first (ties: insertion order), a node's
    own requests after its children's, in input order."""
    nodes = [root if n.is_evicted else n for n in last_nodes]  # stale: no match
    rank = dfs_node_ranks(root, Counter(nodes))
    keys = list(map(rank.__getitem__, nodes))
    return sorted(range(len(keys)), key=keys.__getitem__)  # stable: input order in a node


def dfs_node_ranks(root: TreeNode, counts: Mapping[TreeNode, int]) -> dict[TreeNode, int]:
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
    stack: list[tuple[TreeNode, bool]] = [(root, False)]
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
