"""The writer side of a KVManager: posts fenced writes, follows them to completion, stops cleanly.

Every write is posted only while its room's fence is open (transfer/fence.py); while it
is closed the writes wait for a new grant, and the room fails after a lease without one. A room
that fails while writes are in flight is told to the receiver (TransferFailed, "the
explicit stop") only once none is pending, so the receiver never reuses pages a write
can still reach. A write that may complete after its fence is reported (LateWrite).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from common import messages as msg
from common.kv_pool import KVPool
from transfer.backend import TransferBackend, XferState
from transfer.kv_poll import FailureReason, KVPoll
from transfer.kv_sender import KVSender
from transfer.metrics import TransferMetrics
from transfer.peers import Peer, PeerState

logger = logging.getLogger(__name__)


class WriterHost(Protocol):
    """What the writer reads of the KVManager that owns it."""

    node_id: str
    instance_id: str
    backend: TransferBackend
    pool: KVPool
    metrics: TransferMetrics
    lease_s: float
    clock: Callable[[], float]
    senders: dict[int, KVSender]
    peer_by_node: dict[str, Peer]

    def send(self, endpoint: str, message: msg.Message) -> None: ...

    def drain_control(self, now: float) -> None: ...

    def renew_now(self, endpoint: str, rooms: list[int]) -> None: ...


class KVWriter:
    def __init__(self, host: WriterHost) -> None:
        self.m = host
        self.draining: list[KVSender] = []  # forgotten senders whose writes are in flight
        self.stopping: list[KVSender] = []  # failed senders: TransferFailed once drained

    def flush(self, sender: KVSender) -> None:
        """Post the sender's computed pages, only while its fence is open."""
        m = self.m
        if not sender.has_unposted_writes or sender.status.state is not KVPoll.Transferring:
            return
        now = m.clock()
        if not sender.fence.is_open(now):
            m.drain_control(now)  # grants may sit unread behind a long model step
            now = m.clock()
        peer = m.peer_by_node.get(sender.peer_node or "")
        if not sender.fence.is_open(now):
            # Not a byte goes out. A receiver that still holds the room grants it again
            # (the writes go then); one that let it go answers "released", and with no
            # grant for a lease the room fails (KVManager's timeouts).
            if sender.fence.has_grant and not sender.is_fence_held:
                sender.is_fence_held = True
                m.metrics.fenced()
            if peer is not None and now - sender.renew_asked_at > m.lease_s / 3:
                sender.renew_asked_at = now
                m.renew_now(peer.endpoint, [sender.room])
            return
        sender.is_fence_held = False
        if peer is None or peer.agent is None or not self._ensure_agent(peer, now):
            self.fail(
                sender,
                FailureReason.PEER_UNREACHABLE,
                f"no transfer path to {sender.peer_node}",
                now,
            )
            return
        # Only pages whose kernels have completed (on CUDA a forward returns with them
        # queued); the rest wait for KVManager.poll's next flush.
        pairs = sender.take_ready_pairs()
        is_last = sender.is_last_sent and not sender.pending_pairs and sender.ready.query()
        if not pairs and not is_last:
            return
        notification = b""
        # The TransferDone rides on the last write when the backend carries notifications
        # and no earlier write is still in flight; otherwise _finish_notification sends it
        # once every write is done.
        if (
            is_last
            and m.backend.carries_notifications
            and not any(self._pending(h) for h in sender.handles)
        ):
            notification = self._done_bytes(sender)
        if pairs or is_last:
            try:
                handle = m.backend.write(peer.agent, pairs, notification)
            except Exception as exc:  # noqa: BLE001 - any backend failure fails the room only
                self._write_failed(sender, peer, str(exc), now)
                return
            sender.handles.append(handle)
            sender.posted_dst_pages.append([d for _, d in pairs])
            sender.num_bytes += len(pairs) * m.pool.layout.bytes_per_page
            sender.is_notified = bool(notification)
            if pairs and not sender.fence.is_open(m.clock()):
                # Paused between the check and the end of the post: it may land late.
                self._report_late(sender, [d for _, d in pairs])
        sender.is_last_posted = is_last

    def fail(self, sender: KVSender, reason: str, detail: str, now: float) -> None:
        if sender.fail(reason, detail, now):
            self.stop_when_drained(sender)

    def stop_when_drained(self, sender: KVSender) -> None:
        """Tell the receiver the room is over (TransferFailed) once nothing is in flight."""
        if sender not in self.stopping:
            self.stopping.append(sender)

    def forget(self, sender: KVSender) -> None:
        """The scheduler is done with the room; its in-flight writes are still followed."""
        if sender.handles and sender not in self.draining:
            self.draining.append(sender)

    def progress(self, now: float) -> None:
        m = self.m
        for sender in list(m.senders.values()):
            if sender.status.state is not KVPoll.Transferring or sender.has_unposted_writes:
                continue
            states = [m.backend.poll(h) for h in sender.handles]
            if XferState.PENDING in states and not sender.fence.is_open(now):
                self.fail(
                    sender,
                    FailureReason.LEASE_EXPIRED,
                    "writes still in flight when the lease fence passed",
                    now,
                )
                continue  # reported as late below
            if XferState.ERROR in states:
                peer = m.peer_by_node.get(sender.peer_node or "")
                self._write_failed(sender, peer, "a write reported an error", now)
                continue
            if not sender.is_last_sent or XferState.PENDING in states:
                continue
            if not sender.is_notified:
                self._finish_notification(sender, now)
                continue
            self._release_handles(sender)
            if sender.status.advance(KVPoll.Success, now):
                m.metrics.transferred(sender.num_bytes, now - (sender.first_send_at or now))
        for sender in list(self.stopping):
            pending = [
                pages
                for h, pages in zip(sender.handles, sender.posted_dst_pages)
                if self._pending(h)
            ]
            if not pending:
                self.stopping.remove(sender)
                self.notify_failed(sender)
            elif not sender.fence.is_open(now) and not sender.is_late_reported:
                # Still in flight past the fence: it may land after the receiver reuses.
                sender.is_late_reported = True
                self._report_late(sender, [p for pages in pending for p in pages])
        for sender in list(self.draining):
            if not any(self._pending(h) for h in sender.handles):
                self._release_handles(sender)
                self.draining.remove(sender)

    def notify_failed(self, sender: KVSender) -> None:
        peer = self.m.peer_by_node.get(sender.peer_node or "")
        if peer is not None:
            self.m.send(
                peer.endpoint,
                msg.TransferFailed(
                    room=sender.room,
                    node_id=self.m.node_id,
                    reason=sender.failure_reason or "failed",
                    instance_id=self.m.instance_id,
                ),
            )

    def _report_late(self, sender: KVSender, dst_pages: list[int]) -> None:
        peer = self.m.peer_by_node.get(sender.peer_node or "")
        logger.error(
            "room %d: a write may land after its fence; telling %s", sender.room, sender.peer_node
        )
        self.m.metrics.late_write()
        if peer is not None:
            self.m.send(
                peer.endpoint,
                msg.LateWrite(
                    node_id=self.m.node_id,
                    instance_id=self.m.instance_id,
                    room=sender.room,
                    dst_pages=dst_pages,
                ),
            )

    def _finish_notification(self, sender: KVSender, now: float) -> None:
        """All data is in place: deliver TransferDone (as a notification, or on the socket)."""
        m = self.m
        peer = m.peer_by_node.get(sender.peer_node or "")
        if peer is None or peer.agent is None:
            self.fail(
                sender, FailureReason.PEER_UNREACHABLE, "peer forgotten before completion", now
            )
            return
        data = self._done_bytes(sender)
        if m.backend.carries_notifications:
            try:
                sender.handles.append(m.backend.write(peer.agent, [], data))
                sender.posted_dst_pages.append([])
            except Exception as exc:  # noqa: BLE001
                self._write_failed(sender, peer, str(exc), now)
                return
        else:
            m.send(peer.endpoint, msg.decode(data))
        sender.is_notified = True

    def _done_bytes(self, sender: KVSender) -> bytes:
        aux = sender.aux
        assert aux is not None
        return msg.encode(
            msg.TransferDone(
                room=sender.room,
                node_id=self.m.node_id,
                first_token_id=aux.first_token_id,
                first_logprob=aux.first_logprob,
                top_logprobs=[[t, lp] for t, lp in aux.top_logprobs],
                room_echo=aux.room_echo,
                num_pages=len(sender.dst_pages),
                instance_id=self.m.instance_id,
                marks=aux.marks or None,
                num_cached_tokens=aux.num_cached_tokens,
                prompt_logprobs=aux.prompt_logprobs,
                prompt_top_logprobs=aux.prompt_top_logprobs,
            )
        )

    def _write_failed(self, sender: KVSender, peer: Peer | None, error: str, now: float) -> None:
        self.fail(sender, FailureReason.WRITE_ERROR, error, now)
        if peer is not None and peer.agent is not None:
            # Drop the backend's connection; it is re-made from the stored metadata later.
            try:
                self.m.backend.remove_peer(peer.agent)
            except Exception:  # noqa: BLE001
                logger.debug("remove_peer(%s) failed", peer.agent, exc_info=True)
            peer.failed(now, error)

    def _ensure_agent(self, peer: Peer, now: float) -> bool:
        """Re-add a peer dropped after a failure, once its back-off has passed."""
        if peer.state is PeerState.READY:
            return True
        if not peer.may_retry(now) or not peer.metadata:
            return False
        try:
            peer.agent = self.m.backend.add_peer(peer.metadata)
        except Exception as exc:  # noqa: BLE001
            peer.failed(now, str(exc))
            return False
        peer.ready(now)
        return True

    def _release_handles(self, sender: KVSender) -> None:
        for h in sender.handles:
            try:
                self.m.backend.release(h)
            except Exception:  # noqa: BLE001
                logger.debug("release failed for room %d", sender.room, exc_info=True)
        sender.handles.clear()
        sender.posted_dst_pages.clear()

    def _pending(self, handle: object) -> bool:
        return self.m.backend.poll(handle) is XferState.PENDING
