"""KVReceiver: the decode side of one room, from the handshake to the verified last page.

    Bootstrapping    created with the request; the handshake with the prefill node
         │             (PeerHello/Ack) is under way; bootstrap timeout -> Failed
    WaitingForInput  the peer accepted us; the prealloc queue may allocate pages and
         │             call send_metadata(); bootstrap timeout -> Failed
    Transferring     TransferRequest sent; pages arrive; each LeaseRenew of the prefill
         │             node is answered with a grant (transfer/fence.py); no renewal for
         │             a lease, or the waiting timeout -> Failed
    Success          TransferDone arrived after the data, its room echo verified
    Failed           any timeout, lease expiry, abort from either side, echo mismatch

Pages preallocated for the room may be freed only when `is_release_safe()`: after a
failure during Transferring the prefill node may still be writing into them, so we
wait for its explicit stop (TransferFailed) or for the room's fence: the last grant
plus a lease, after which no write of the prefill node can be posted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from transfer.fence import Fence, receiver_fence_end
from transfer.kv_poll import FailureReason, KVPoll, RoomState
from transfer.kv_sender import AuxData


class ReceiverHost(Protocol):
    """What a KVReceiver needs of its owner (the KVManager)."""

    lease_s: float
    clock: Callable[[], float]

    def send_transfer_request(self, receiver: KVReceiver) -> None: ...

    def notify_peer_aborted(self, receiver: KVReceiver) -> None: ...

    def observe_bootstrap(self, room: KVReceiver) -> None: ...

    def observe_success(self, receiver: KVReceiver) -> None: ...

    def observe_failure(self, room: KVReceiver, reason: str) -> None: ...

    def remove_receiver(self, receiver: KVReceiver) -> None: ...


class KVReceiver:
    def __init__(self, manager: ReceiverHost, room: int, peer_endpoint: str, now: float) -> None:
        self.manager = manager
        self.room = room
        self.peer_endpoint = peer_endpoint
        self.status = RoomState(KVPoll.Bootstrapping, since=now, created=now)
        self.dst_pages: list[int] = []
        self.num_held_pages = 0
        self.aux_slot = 0
        self.aux: AuxData | None = None
        self.lease_deadline = float("inf")  # the writer is presumed dead past this
        self.fence = Fence()  # our pages may be reused once the clock passes fence.until
        self.metadata_sent_at: float | None = None
        self.is_abort_acked = False
        self.failed_while_transferring = False
        # The prefill node forgot us (it restarted) before writing: handshake again, then
        # send the TransferRequest once more.
        self.needs_resend = False

    def poll(self) -> KVPoll:
        return self.status.state

    @property
    def failure_reason(self) -> str | None:
        return self.status.failure_reason

    def on_peer_ready(self, now: float) -> None:
        self.status.advance(KVPoll.WaitingForInput, now)
        self.manager.observe_bootstrap(self)

    def send_metadata(
        self, dst_pages: list[int], aux_slot: int = 0, num_held_pages: int = 0
    ) -> None:
        """Hand the prefill node our destination pages; the transfer starts on its side.
        ``num_held_pages``: leading pages of the room's KV we hold already (a prefix
        cache); ``dst_pages`` are for the pages after them."""
        if self.status.state is not KVPoll.WaitingForInput:
            raise RuntimeError(f"room {self.room}: send_metadata in state {self.status.state.name}")
        now = self.manager.clock()
        self.dst_pages, self.aux_slot = list(dst_pages), aux_slot
        self.num_held_pages = num_held_pages
        self.metadata_sent_at = now
        self.lease_deadline = now + self.manager.lease_s
        self.status.advance(KVPoll.Transferring, now)
        self.manager.send_transfer_request(self)

    def grant(self, now: float) -> bool:
        """The writer renewed: it is alive, and our pages stay this room's for a lease."""
        if self.status.state is not KVPoll.Transferring:
            return False
        self.lease_deadline = now + self.manager.lease_s
        self.fence.extend(receiver_fence_end(now, self.manager.lease_s))
        return True

    def writer_alive(self, now: float) -> None:
        """The writer renewed without naming this room: it has not read our request yet."""
        if self.status.state is KVPoll.Transferring and not self.fence.has_grant:
            self.lease_deadline = max(self.lease_deadline, now + self.manager.lease_s)

    def resend_request(self, now: float) -> None:
        """The handshake was made again: ask the (new) prefill process once more."""
        if self.status.state is not KVPoll.Transferring or not self.needs_resend:
            return
        self.needs_resend = False
        self.lease_deadline = now + self.manager.lease_s
        self.manager.send_transfer_request(self)

    def on_done(self, aux: AuxData, num_pages: int, now: float) -> None:
        if self.status.state is not KVPoll.Transferring:
            return
        if aux.room_echo != self.room:
            self.fail(
                FailureReason.ROOM_ECHO_MISMATCH,
                f"aux data names room {aux.room_echo}, expected {self.room}",
                now,
            )
            self.is_abort_acked = True  # the writer is done with this room
            return
        if num_pages != len(self.dst_pages):
            self.fail(
                FailureReason.BAD_REQUEST,
                f"{num_pages} pages written, {len(self.dst_pages)} expected",
                now,
            )
            self.is_abort_acked = True
            return
        self.aux = aux
        self.status.advance(KVPoll.Success, now)
        self.manager.observe_success(self)

    def abort(self, detail: str = "aborted by the decode node") -> None:
        """Fail the room here and tell the prefill node to stop writing into our pages."""
        if self.fail(FailureReason.ABORTED, detail, self.manager.clock()):
            self.manager.notify_peer_aborted(self)

    def fail(self, reason: str, detail: str, now: float) -> bool:
        was_transferring = self.status.state is KVPoll.Transferring
        changed = self.status.fail(reason, detail, now)
        if changed:
            self.failed_while_transferring = was_transferring
            self.manager.observe_failure(self, reason)
        return changed

    def is_release_safe(self) -> bool:
        """Whether no write into this room's destination pages can still land."""
        state = self.status.state
        if state is KVPoll.Success or (
            state is KVPoll.Failed and not self.failed_while_transferring
        ):
            return True
        if state is not KVPoll.Failed:
            return False
        if self.is_abort_acked:
            return True
        # No explicit stop: once the fence has passed the writer cannot post any more.
        return not self.fence.is_open(self.manager.clock())

    def clear(self) -> None:
        self.manager.remove_receiver(self)
