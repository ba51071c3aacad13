"""Transfer metrics of one KVManager: bytes, latency, bootstrap latency, speed, failures, rooms."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from common import metrics
from transfer.kv_poll import KVPoll, RoomState


class HasRoomState(Protocol):
    """A KVSender or KVReceiver, as far as the room gauge is concerned."""

    status: RoomState


class TransferMetrics:
    """Records into the shared pdserve_* metrics with this manager's role label."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.socket = f"{role}_kv_control"
        self.num_dropped: Counter[str] = Counter()
        self.num_failures: Counter[str] = Counter()
        self.num_fenced = 0
        self.num_late_writes = 0

    def bootstrap(self, seconds: float) -> None:
        metrics.KV_BOOTSTRAP_SECONDS.labels(role=self.role).observe(seconds)

    def transferred(self, num_bytes: int, seconds: float) -> None:
        metrics.KV_TRANSFER_BYTES.labels(role=self.role).inc(num_bytes)
        metrics.KV_TRANSFER_SECONDS.labels(role=self.role).observe(seconds)
        if seconds > 0:
            metrics.KV_TRANSFER_SPEED_GBPS.labels(role=self.role).set(num_bytes / seconds / 1e9)

    def failure(self, reason: str) -> None:
        self.num_failures[reason] += 1
        metrics.KV_TRANSFER_FAILURES.labels(role=self.role, reason=reason).inc()

    def refused(self, reason: str) -> None:
        """A peer's handshake was refused (bad token, incompatible pool)."""
        self.failure(reason)

    def dropped(self, kind: str) -> None:
        """A well-formed control message not acceptable here (unknown peer, no such room).

        Exported as pdserve_rejected_messages_total{socket, reason}; malformed frames are
        counted by common.ipc in pdserve_malformed_messages_total.
        """
        self.num_dropped[kind] += 1
        metrics.REJECTED_MESSAGES.labels(role=self.role, socket=self.socket, reason=kind).inc()

    def fenced(self) -> None:
        """A write was not posted: its room's fence had passed."""
        self.num_fenced += 1
        metrics.KV_FENCED_WRITES.labels(role=self.role).inc()

    def late_write(self) -> None:
        """A write may have landed after its room's fence (the writer says so)."""
        self.num_late_writes += 1
        metrics.KV_LATE_WRITES.labels(role=self.role).inc()

    def rooms(self, senders: Iterable[HasRoomState], receivers: Iterable[HasRoomState]) -> None:
        counts = Counter(r.status.state for r in (*senders, *receivers))
        for state in KVPoll:
            metrics.KV_TRANSFER_ROOMS.labels(role=self.role, state=state.name).set(counts[state])
