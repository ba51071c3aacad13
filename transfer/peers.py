"""A KVManager's peer table: handshake state, retry back-off per remote node (never a blacklist)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class PeerState(Enum):
    NEW = "new"  # nothing sent yet, or forgotten after a failure: handshake on next use
    CONNECTING = "connecting"  # PeerHello sent, waiting for the ack
    READY = "ready"  # handshake accepted; transfers may flow
    BACKOFF = "backoff"  # last handshake or write failed; retry after retry_at


@dataclass
class Peer:
    """One remote node as this node sees it, keyed by its control endpoint."""

    endpoint: str
    node_id: str | None = None
    instance_id: str = ""  # of the process we shook hands with; another one is a new peer
    agent: str | None = None  # the backend's name for it (writer side only)
    metadata: bytes = b""  # its backend metadata, kept so a writer can re-add it
    state: PeerState = PeerState.NEW
    hello_sent_at: float = 0.0
    retry_at: float = 0.0
    backoff_s: float = 0.0
    last_seen: float = 0.0
    last_error: str = ""

    def failed(self, now: float, error: str, base_s: float = 0.5, cap_s: float = 30.0) -> None:
        """Back off exponentially; the next use after retry_at tries again."""
        self.backoff_s = min(cap_s, max(base_s, self.backoff_s * 2))
        self.retry_at = now + self.backoff_s
        self.state = PeerState.BACKOFF
        self.last_error = error

    def ready(self, now: float) -> None:
        self.state = PeerState.READY
        self.backoff_s = 0.0
        self.last_seen = now
        self.last_error = ""

    def may_retry(self, now: float) -> bool:
        return self.state is PeerState.NEW or (
            self.state is PeerState.BACKOFF and now >= self.retry_at
        )
