"""Which decode node holds a conversation: the gateway's record of finished sequences.

A decode node with a prefix cache keeps a finished request's KV: the whole pages of its
prompt and output but the last token. The gateway saw both, so it records the chained
hash (common/page_hash.py) of that sequence's last whole page against the node. A later
prompt that starts with the sequence (a chat's next turn: prompt, answer, new message)
has that same hash at that page, so the longest recorded prefix of a prompt names the node
that served it, whatever the prompt's first tokens share with other conversations.

The record is this gateway replica's own and bounded (least recently used goes first); a
turn through another replica, or one whose record is gone, falls back to the ring of
decode nodes by affinity key (bootstrap/router.py). A stale record (the node restarted or
evicted the KV) costs nothing but the hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence

from common import page_hash

DEFAULT_CAPACITY = 65_536


def cached_sequence_hash(
    input_ids: Sequence[int], output_ids: Sequence[int], page_size: int, cache_salt: str | None
) -> int | None:
    """The hash of the last whole page a decode node caches of a finished request (its KV
    covers every token but the last); None when that is not one page."""
    num_pages = (len(input_ids) + len(output_ids) - 1) // page_size
    if num_pages <= 0:
        return None
    tokens = [*input_ids, *output_ids][: num_pages * page_size]
    return int(page_hash.prompt_hashes(tokens, page_size, cache_salt)[-1])


class DecodeSessions:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._node_of: OrderedDict[int, str] = OrderedDict()

    def record(self, sequence_hash: int, node_id: str) -> None:
        """``node_id`` caches the sequence whose last whole page hashes ``sequence_hash``."""
        self._node_of[sequence_hash] = node_id
        self._node_of.move_to_end(sequence_hash)
        while len(self._node_of) > self.capacity:
            self._node_of.popitem(last=False)

    def find(self, prompt_hashes: Sequence[int], nodes: Container[str]) -> str | None:
        """The node among ``nodes`` holding the longest recorded prefix of a prompt (its
        page hashes); None if no prefix is recorded on any of them."""
        for h in reversed(prompt_hashes):
            node_id = self._node_of.get(h)
            if node_id is not None and node_id in nodes:
                self._node_of.move_to_end(h)
                return node_id
        return None

    def __len__(self) -> int:
        return len(self._node_of)
