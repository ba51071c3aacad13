"""Fake transfer backend: moves nothing and completes at once (scheduler tests, warmup)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgpack  # type: ignore[import-untyped]

from common.kv_pool import KVPool
from transfer.backend import BackendError, TransferBackend, XferState


@dataclass(frozen=True)
class FakeXfer:
    """Handle returned by `FakeBackend.write`: always DONE."""

    peer: str
    num_pages: int


class InProcessBackend(TransferBackend):
    """What the fake and loopback backends share: a name for metadata, one pool."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pool: KVPool | None = None

    @property
    def name(self) -> str:
        return self._name

    def register_pool(self, pool: KVPool) -> None:
        if self._pool is not None:
            raise BackendError(f"{self._name}: a pool is already registered")
        self._pool = pool

    def local_metadata(self) -> bytes:
        packed: bytes = msgpack.packb({"name": self._name})
        return packed

    def _peer_name(self, metadata: bytes) -> str:
        try:
            return str(msgpack.unpackb(metadata)["name"])
        except Exception as exc:
            raise BackendError(f"{self._name}: malformed peer metadata: {exc}") from exc


class FakeBackend(InProcessBackend):
    """Accepts every write to a known peer and reports it DONE without touching memory.

    Notifications are not delivered (`carries_notifications` is False): the caller
    sends completion over its control channel, as with SGLang's fake backend.
    """

    carries_notifications = False

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._peers: set[str] = set()
        self.num_writes = 0
        self.num_pages_written = 0

    def add_peer(self, metadata: bytes) -> str:
        name = self._peer_name(metadata)
        self._peers.add(name)
        return name

    def remove_peer(self, peer: str) -> None:
        self._peers.discard(peer)

    def write(
        self, peer: str, pairs: Sequence[tuple[int, int]], notification: bytes = b""
    ) -> FakeXfer:
        if peer not in self._peers:
            raise BackendError(f"{self._name}: unknown peer {peer!r}")
        self.num_writes += 1
        self.num_pages_written += len(pairs)
        return FakeXfer(peer, len(pairs))

    def poll(self, handle: object) -> XferState:
        if not isinstance(handle, FakeXfer):
            raise TypeError(f"not a fake transfer handle: {handle!r}")
        return XferState.DONE

    def release(self, handle: object) -> None:
        if not isinstance(handle, FakeXfer):
            raise TypeError(f"not a fake transfer handle: {handle!r}")

    def get_notifications(self) -> list[tuple[str, bytes]]:
        return []
