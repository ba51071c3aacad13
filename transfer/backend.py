"""TransferBackend: the one interface every KV page mover implements (NIXL, fake)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from common.kv_pool import KVPool


class XferState(Enum):
    PENDING = "pending"
    DONE = "done"
    ERROR = "error"


@dataclass(frozen=True)
class PageRun:
    """A run of consecutive pages: local pages [src, src+n) go to remote pages [dst, dst+n)."""

    src: int
    dst: int
    length: int


def page_runs(pairs: Sequence[tuple[int, int]]) -> list[PageRun]:
    """Merge (local page, remote page) pairs into runs where both sides are consecutive."""
    runs: list[PageRun] = []
    for src, dst in pairs:
        last = runs[-1] if runs else None
        if last is not None and src == last.src + last.length and dst == last.dst + last.length:
            runs[-1] = PageRun(last.src, last.dst, last.length + 1)
        else:
            runs.append(PageRun(src, dst, 1))
    return runs


class BackendError(RuntimeError):
    """A backend call failed (peer unreachable, bad metadata, transfer error)."""


class TransferBackend(ABC):
    """Moves whole KV pages from this node's pool into a peer's pool, one-sided.

    Lifecycle: construct with a node name, `register_pool` once, hand `local_metadata()`
    to peers over the control channel; a writer calls `add_peer(metadata)` for each
    peer it writes to, then `write(...)` and `poll(handle)` until DONE or ERROR, then
    `release(handle)`. A write may carry a notification (bytes) that the target
    receives through `get_notifications()` only after the written data is in place.
    All calls are made from one thread; nothing progresses unless someone calls
    `poll` or `get_notifications` (no background progress thread).
    """

    #: True when notifications travel with the data (the target sees them in
    #: get_notifications); False when the caller must send them another way.
    carries_notifications: bool = True

    @property
    @abstractmethod
    def name(self) -> str:
        """This node's agent name, unique among peers."""

    @abstractmethod
    def register_pool(self, pool: KVPool) -> None:
        """Register the pool's memory once and prepare its per-page descriptors."""

    @abstractmethod
    def local_metadata(self) -> bytes:
        """Opaque bytes a peer passes to `add_peer` to be able to write into this pool."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; return its agent name. Raises BackendError."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer (after it died or left); later writes to it fail."""

    @abstractmethod
    def write(
        self, peer: str, pairs: Sequence[tuple[int, int]], notification: bytes = b""
    ) -> object:
        """Start writing local pages into the peer's pages; returns a handle to poll.

        `pairs` are (local page, remote page); consecutive runs go as one descriptor.
        An empty `pairs` with a notification sends the notification alone.
        """

    @abstractmethod
    def poll(self, handle: object) -> XferState:
        """Progress the transfer and report its state."""

    @abstractmethod
    def release(self, handle: object) -> None:
        """Free a handle that is DONE or ERROR (or abandon a pending one)."""

    @abstractmethod
    def get_notifications(self) -> list[tuple[str, bytes]]:
        """Notifications that arrived since the last call, as (peer name, bytes)."""

    def close(self) -> None:
        """Release library resources; the backend is unusable afterwards."""
