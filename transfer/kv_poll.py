"""KVPoll: the state of one room's transfer, shared by KVSender and KVReceiver.

    Bootstrapping ──▶ WaitingForInput ──▶ Transferring ──▶ Success
          │                 │                  │
          └─────────────────┴──────────────────┴──────▶ Failed

States only move forward; Success and Failed are terminal; Failed wins over
anything that is not already terminal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    @property
    def is_terminal(self) -> bool:
        return self in (KVPoll.Success, KVPoll.Failed)


class FailureReason:
    """Failure reasons: the label values of pdserve_kv_transfer_failures_total."""

    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"
    WAITING_TIMEOUT = "waiting_timeout"
    TRANSFER_TIMEOUT = "transfer_timeout"
    LEASE_EXPIRED = "lease_expired"
    ABORTED = "aborted"
    PEER_ABORTED = "peer_aborted"
    PEER_UNREACHABLE = "peer_unreachable"
    PEER_RESTARTED = "peer_restarted"
    WRITE_ERROR = "write_error"
    INCOMPATIBLE = "incompatible"
    UNAUTHORIZED = "unauthorized"
    ROOM_ECHO_MISMATCH = "room_echo_mismatch"
    BAD_REQUEST = "bad_request"


@dataclass
class RoomState:
    """The state of one room with the time it entered that state and, if failed, why."""

    state: KVPoll = KVPoll.Bootstrapping
    since: float = 0.0
    created: float = 0.0
    reason: str | None = None
    detail: str = ""
    history: list[KVPoll] = field(default_factory=list)

    @property
    def failure_reason(self) -> str | None:
        """ "reason: detail" once Failed, else None."""
        if self.state is not KVPoll.Failed:
            return None
        return f"{self.reason}: {self.detail}" if self.detail else self.reason

    def advance(self, new: KVPoll, now: float) -> bool:
        """Move forward to `new`; returns whether the state changed."""
        if self.state.is_terminal or new <= self.state and new is not KVPoll.Failed:
            return False
        if new is KVPoll.Failed:
            return self.fail("", "", now)
        self.history.append(self.state)
        self.state, self.since = new, now
        return True

    def fail(self, reason: str, detail: str, now: float) -> bool:
        if self.state.is_terminal:
            return False
        self.history.append(self.state)
        self.state, self.since = KVPoll.Failed, now
        self.reason, self.detail = reason or FailureReason.ABORTED, detail
        return True
