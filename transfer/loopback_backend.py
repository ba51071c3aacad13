"""Loopback transfer backend: real page copies between pools of one process (unit tests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from transfer.backend import BackendError, XferState
from transfer.fake_backend import InProcessBackend

# Every open loopback backend of this process, by name: add_peer looks peers up here.
_REGISTRY: dict[str, LoopbackBackend] = {}


@dataclass(frozen=True)
class LoopbackXfer:
    """Handle returned by `LoopbackBackend.write`; the copy already happened (or failed)."""

    peer: str
    state: XferState


class LoopbackBackend(InProcessBackend):
    """Copies pages straight into the peer's pool and drops the notification in its inbox.

    A write to a peer that was removed or has closed completes as ERROR, like a write
    to a dead process; setting `fail_next_write` makes the next write ERROR (and
    deliver nothing) for failure tests.
    """

    carries_notifications = True

    def __init__(self, name: str) -> None:
        if name in _REGISTRY:
            raise BackendError(f"a loopback backend named {name!r} is already open")
        super().__init__(name)
        self._peers: dict[str, LoopbackBackend] = {}
        self._inbox: list[tuple[str, bytes]] = []
        self.fail_next_write = False
        _REGISTRY[name] = self

    def add_peer(self, metadata: bytes) -> str:
        name = self._peer_name(metadata)
        target = _REGISTRY.get(name)
        if target is None:
            raise BackendError(f"{self._name}: no open loopback backend named {name!r}")
        self._peers[name] = target
        return name

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def write(
        self, peer: str, pairs: Sequence[tuple[int, int]], notification: bytes = b""
    ) -> LoopbackXfer:
        if self._pool is None:
            raise BackendError(f"{self._name}: register_pool must come first")
        target = self._peers.get(peer)
        # A peer that closed (even if a new backend took its name) is gone, like a dead process.
        if self.fail_next_write or target is None or _REGISTRY.get(peer) is not target:
            self.fail_next_write = False
            return LoopbackXfer(peer, XferState.ERROR)
        if pairs:
            self._copy_pages(target, pairs)
        if notification:
            target._inbox.append((self._name, bytes(notification)))
        return LoopbackXfer(peer, XferState.DONE)

    def _copy_pages(self, target: LoopbackBackend, pairs: Sequence[tuple[int, int]]) -> None:
        assert self._pool is not None
        dst_pool = target._pool
        if dst_pool is None:
            raise BackendError(f"{self._name}: peer {target.name!r} has no pool")
        if dst_pool.layout.bytes_per_page != self._pool.layout.bytes_per_page:
            raise BackendError(f"{self._name}: peer {target.name!r} has a different page size")
        src = [s for s, _ in pairs]
        dst = [d for _, d in pairs]
        for pages, pool, side in ((src, self._pool, "local"), (dst, dst_pool, "peer")):
            if min(pages) < 0 or max(pages) >= pool.num_pages:
                raise BackendError(
                    f"page ids out of range for {side} pool of {pool.num_pages} pages"
                )
        src_idx = torch.tensor(src, dtype=torch.long, device=self._pool.device)
        dst_idx = torch.tensor(dst, dtype=torch.long, device=dst_pool.device)
        # Byte views, so pools of different dtypes but equal page bytes copy exactly.
        src_bytes = self._pool.buffer.flatten(1).view(torch.uint8)
        dst_bytes = dst_pool.buffer.flatten(1).view(torch.uint8)
        dst_bytes.index_copy_(0, dst_idx, src_bytes.index_select(0, src_idx).to(dst_pool.device))

    def poll(self, handle: object) -> XferState:
        if not isinstance(handle, LoopbackXfer):
            raise TypeError(f"not a loopback transfer handle: {handle!r}")
        return handle.state

    def release(self, handle: object) -> None:
        if not isinstance(handle, LoopbackXfer):
            raise TypeError(f"not a loopback transfer handle: {handle!r}")

    def get_notifications(self) -> list[tuple[str, bytes]]:
        arrived, self._inbox = self._inbox, []
        return arrived

    def close(self) -> None:
        if _REGISTRY.get(self._name) is self:
            del _REGISTRY[self._name]
        self._peers.clear()
