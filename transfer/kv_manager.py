"""KVManager: one per node; owns the transfer backend, the control socket, peers, rooms and timers.

A node's loop calls `poll()` every iteration: it drains control messages, collects
backend notifications, progresses writes, renews leases and enforces every timeout.
Control traffic (zmq PUSH/PULL, messages from common/messages.py):

  decode ──PeerHello──────▶ prefill     once per peer process: token, protocol, KV layout,
                                        backend metadata, instance id
  decode ◀─PeerHelloAck──── prefill     accepted, or refused with a reason
  decode ──TransferRequest─▶ prefill    per room: destination pages, aux slot
  decode ◀─PeerReset─────── prefill     "I do not know you" (it restarted): hello again, resend
  decode ◀─LeaseRenew────── prefill     every lease/3: rooms it still writes (its liveness)
  decode ──LeaseGrant─────▶ prefill     the answer: the pages stay theirs for a lease; the
                                        writer's fence (transfer/fence.py) opens from it
  decode ◀─TransferDone──── prefill     per room, as the last write's notification (or on this
                                        socket for backends that carry none)
  decode ──AbortReq───────▶ prefill     stop writing; prefill acks with TransferFailed
  decode ◀─TransferFailed── prefill     the room failed on the prefill side (or abort ack):
                                        nothing of it is in flight any more
  decode ◀─LateWrite─────── prefill     a write may have landed after its fence

Every message carries the sender's node id and instance id; a peer is trusted only as
the very process it shook hands with.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import zmq

from common import messages as msg
from common.ipc import PushPool, bind_pull, recv_messages
from common.kv_pool import KVPool
from transfer.backend import TransferBackend, XferState
from transfer.kv_control import ControlDispatcher
from transfer.kv_poll import FailureReason, KVPoll
from transfer.kv_receiver import KVReceiver
from transfer.kv_sender import KVSender
from transfer.leases import LeaseRenewer
from transfer.metrics import TransferMetrics
from transfer.peers import Peer, PeerState

logger = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL_S = 0.005


class KVManager:
    def __init__(self, node_id: str, role: str, backend: TransferBackend, pool: KVPool, *,
                 backend_kind: str = "nixl",
                 control_endpoint: str = "tcp://127.0.0.1:0", auth_token: str | None = None,
                 bootstrap_timeout_s: float = 300.0, waiting_timeout_s: float = 300.0,
                 lease_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 zmq_context: zmq.Context | None = None, instance_id: str | None = None) -> None:
        self.node_id, self.role = node_id, role
        self.instance_id = instance_id or uuid.uuid4().hex
        self.backend, self.pool = backend, pool
        self.backend_kind = backend_kind
        self.page_size = pool.page_size
        self.auth_token = auth_token
        self.bootstrap_timeout_s = bootstrap_timeout_s
        self.waiting_timeout_s = waiting_timeout_s
        self.lease_s = lease_s
        self.clock = clock
        self.metrics = TransferMetrics(role)
        self._ctx = zmq_context or zmq.Context.instance()
        self._sock, self.control_endpoint = bind_pull(self._ctx, control_endpoint)
        self._push = PushPool(self._ctx)
        backend.register_pool(pool)
        self.senders: dict[int, KVSender] = {}
        self.receivers: dict[int, KVReceiver] = {}
        self.peers: dict[str, Peer] = {}  # by control endpoint
        self.peer_by_node: dict[str, Peer] = {}
        # Prefill: TransferRequests / aborts that arrived before their sender exists.
        self.early_requests: dict[int, tuple[msg.TransferRequest, float]] = {}
        self.early_aborts: dict[int, float] = {}
        self._draining: list[KVSender] = []  # forgotten senders whose writes are in flight
        self._abort_acks: list[KVSender] = []  # aborted by the peer; ack once drained
        # Receiver side: called with (room, pages) when a writer reports a late write.
        self.on_late_write: Callable[[int, list[int]], None] = lambda room, pages: None
        self._leases = LeaseRenewer(node_id, self.instance_id, lease_s, self._ctx, clock)
        self.renewals = self._leases.log
        self._control = ControlDispatcher(self)
        self._next_housekeeping = 0.0
        self._is_closed = False

    # ---- rooms ------------------------------------------------------------------------------

    def create_sender(self, room: int, num_tokens: int) -> KVSender:
        now = self.clock()
        if room in self.senders:
            raise ValueError(f"room {room} already has a sender")
        sender = KVSender(self, room, num_tokens, now)
        self.senders[room] = sender
        if self.early_aborts.pop(room, None) is not None:
            sender.fail(FailureReason.PEER_ABORTED, "aborted by the decode node", now)
        elif room in self.early_requests:
            req, _ = self.early_requests.pop(room)
            self._control.attach_request(sender, req, now)
        return sender

    def create_receiver(self, room: int, peer_endpoint: str) -> KVReceiver:
        now = self.clock()
        if room in self.receivers:
            raise ValueError(f"room {room} already has a receiver")
        receiver = KVReceiver(self, room, peer_endpoint, now)
        self.receivers[room] = receiver
        peer = self.peers.setdefault(peer_endpoint, Peer(peer_endpoint))
        if peer.state is PeerState.READY:
            receiver.on_peer_ready(now)
        elif peer.may_retry(now):
            self._control.send_hello(peer, now)
        return receiver

    def remove_sender(self, sender: KVSender) -> None:
        if self.senders.get(sender.room) is sender:
            del self.senders[sender.room]
            self.unlease_room(sender.room)
        if sender.handles and sender not in self._draining:
            self._draining.append(sender)

    def remove_receiver(self, receiver: KVReceiver) -> None:
        if self.receivers.get(receiver.room) is receiver:
            del self.receivers[receiver.room]
            self.unlease_room(receiver.room)

    # ---- hooks used by senders and receivers ------------------------------------------------

    def observe_bootstrap(self, room: KVSender | KVReceiver) -> None:
        self.metrics.bootstrap(self.clock() - room.status.created)

    def observe_failure(self, room: KVSender | KVReceiver, reason: str) -> None:
        self.metrics.failure(reason)

    def observe_success(self, receiver: KVReceiver) -> None:
        start = receiver.metadata_sent_at or receiver.status.created
        nbytes = len(receiver.dst_pages) * self.pool.layout.bytes_per_page
        self.metrics.transferred(nbytes, self.clock() - start)

    def flush_writes(self, sender: KVSender) -> None:
        """Post the sender's computed pages, only while its fence is open (transfer/fence.py)."""
        if not sender.has_unposted_writes or sender.status.state is not KVPoll.Transferring:
            return
        now = self.clock()
        if not sender.fence.is_open(now):
            self._drain_control(now)  # grants may sit unread behind a long model step
            now = self.clock()
        if not sender.fence.is_open(now):
            if sender.fence.has_grant:
                self.metrics.fenced()
                self._fail_sender(sender, FailureReason.LEASE_EXPIRED,
                                  "the lease fence passed before the write (paused?)", now)
            return  # no grant yet: poll() posts once the first one arrives
        peer = self.peer_by_node.get(sender.peer_node or "")
        if peer is None or peer.agent is None or not self._ensure_agent(peer, now):
            self._fail_sender(sender, FailureReason.PEER_UNREACHABLE,
                              f"no transfer path to {sender.peer_node}", now)
            return
        pairs, sender.pending_pairs = sender.pending_pairs, []
        is_last = sender.is_last_sent
        notification = b""
        # The TransferDone rides on the last write when the backend carries notifications
        # and no earlier write is still in flight; otherwise _finish_notification sends it
        # once every write is done.
        if (is_last and self.backend.carries_notifications
                and not any(self._pending(h) for h in sender.handles)):
            notification = self._done_bytes(sender)
        if pairs or is_last:
            try:
                handle = self.backend.write(peer.agent, pairs, notification)
            except Exception as exc:  # noqa: BLE001 - any backend failure fails the room only
                self._write_failed(sender, peer, str(exc), now)
                return
            sender.handles.append(handle)
            sender.posted_dst_pages.append([d for _, d in pairs])
            sender.num_bytes += len(pairs) * self.pool.layout.bytes_per_page
            sender.is_notified = bool(notification)
            if pairs and not sender.fence.is_open(self.clock()):
                # Paused between the check and the end of the post: it may land late.
                self._report_late(sender, [d for _, d in pairs])
        sender.is_last_posted = is_last

    def _report_late(self, sender: KVSender, dst_pages: list[int]) -> None:
        peer = self.peer_by_node.get(sender.peer_node or "")
        logger.error("room %d: a write may land after its fence; telling %s", sender.room,
                     sender.peer_node)
        self.metrics.late_write()
        if peer is not None:
            self.send(peer.endpoint, msg.LateWrite(node_id=self.node_id,
                                                   instance_id=self.instance_id,
                                                   room=sender.room, dst_pages=dst_pages))

    def _fail_sender(self, sender: KVSender, reason: str, detail: str, now: float) -> None:
        if sender.fail(reason, detail, now):
            self.ack_abort_when_drained(sender)  # the explicit stop, once nothing is in flight

    def send_transfer_request(self, receiver: KVReceiver) -> None:
        self.send(receiver.peer_endpoint, msg.TransferRequest(
            room=receiver.room, node_id=self.node_id, dst_pages=receiver.dst_pages,
            aux_slot=receiver.aux_slot, lease_s=self.lease_s, instance_id=self.instance_id,
            control_endpoint=self.control_endpoint))

    def notify_peer_failed(self, sender: KVSender) -> None:
        peer = self.peer_by_node.get(sender.peer_node or "")
        if peer is not None:
            self.send(peer.endpoint, msg.TransferFailed(
                room=sender.room, node_id=self.node_id, reason=sender.failure_reason or "failed",
                instance_id=self.instance_id))

    def notify_peer_aborted(self, receiver: KVReceiver) -> None:
        peer = self.peers.get(receiver.peer_endpoint)
        if peer is not None and peer.state is PeerState.READY:
            self.send(peer.endpoint, msg.AbortReq(node_id=self.node_id, room=receiver.room,
                                                   rid=None, reason="aborted by the decode node",
                                                   instance_id=self.instance_id))

    # ---- the poll loop ----------------------------------------------------------------------

    def poll(self) -> None:
        now = self.clock()
        self._drain_control(now)
        for peer_agent, data in self.backend.get_notifications():
            self._control.handle_notification(peer_agent, data, now)
        for sender in [s for s in self.senders.values() if s.has_unposted_writes]:
            self.flush_writes(sender)
        self._progress_writes(now)
        # Timers are coarse (seconds): checking them every few ms keeps each poll, and
        # so the latency of noticing a completed transfer, short.
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + HOUSEKEEPING_INTERVAL_S
            self._check_timeouts(now)
            self._control.resend_hellos(now)
            self._prune_leases()
            self.metrics.rooms(self.senders.values(), self.receivers.values())

    def _drain_control(self, now: float) -> None:
        for message in recv_messages(self._sock, socket_name=self.metrics.socket,
                                     max_frames=1000):
            self._control.handle(message, now)

    def _progress_writes(self, now: float) -> None:
        for sender in list(self.senders.values()):
            if sender.status.state is not KVPoll.Transferring:
                continue
            if sender.has_unposted_writes:
                continue  # waiting for the first grant (flush_writes posts them)
            states = [self.backend.poll(h) for h in sender.handles]
            if XferState.PENDING in states and not sender.fence.is_open(now):
                # Still in flight past the fence: it lands after the receiver may reuse.
                late = [p for st, pages in zip(states, sender.posted_dst_pages)
                        if st is XferState.PENDING for p in pages]
                self._fail_sender(sender, FailureReason.LEASE_EXPIRED,
                                  "writes still in flight when the lease fence passed", now)
                if late:
                    self._report_late(sender, late)
                continue
            if XferState.ERROR in states:
                peer = self.peer_by_node.get(sender.peer_node or "")
                self._write_failed(sender, peer, "a write reported an error", now)
                continue
            if not sender.is_last_sent or XferState.PENDING in states:
                continue
            if not sender.is_notified:
                self._finish_notification(sender, now)
                continue
            self._release_handles(sender)
            if sender.status.advance(KVPoll.Success, now):
                self.metrics.transferred(sender.num_bytes, now - (sender.first_send_at or now))
        for sender in list(self._draining):
            if not any(self._pending(h) for h in sender.handles):
                self._release_handles(sender)
                self._draining.remove(sender)
        for sender in list(self._abort_acks):
            if not any(self._pending(h) for h in sender.handles):
                self._abort_acks.remove(sender)
                self.notify_peer_failed(sender)
        for sender in [s for s in self._abort_acks if s.fence.has_grant]:
            if not sender.fence.is_open(now) and not sender.is_late_reported:
                sender.is_late_reported = True
                pages = [p for h, pages in zip(sender.handles, sender.posted_dst_pages)
                         if self._pending(h) for p in pages]
                if pages:
                    self._report_late(sender, pages)

    def ack_abort_when_drained(self, sender: KVSender) -> None:
        if sender not in self._abort_acks:
            self._abort_acks.append(sender)

    def _finish_notification(self, sender: KVSender, now: float) -> None:
        """All data is in place: deliver TransferDone (as a notification, or on the socket)."""
        peer = self.peer_by_node.get(sender.peer_node or "")
        if peer is None or peer.agent is None:
            sender.fail(FailureReason.PEER_UNREACHABLE, "peer forgotten before completion", now)
            return
        data = self._done_bytes(sender)
        if self.backend.carries_notifications:
            try:
                sender.handles.append(self.backend.write(peer.agent, [], data))
            except Exception as exc:  # noqa: BLE001
                self._write_failed(sender, peer, str(exc), now)
                return
        else:
            self.send(peer.endpoint, msg.decode(data))
        sender.is_notified = True

    def _check_timeouts(self, now: float) -> None:
        for sender in list(self.senders.values()):
            state, age = sender.status.state, now - sender.status.since
            if state is KVPoll.Bootstrapping and age > self.bootstrap_timeout_s:
                sender.fail(FailureReason.BOOTSTRAP_TIMEOUT,
                            f"no TransferRequest from the decode node in {self.bootstrap_timeout_s:g} s",
                            now)
            elif state in (KVPoll.WaitingForInput, KVPoll.Transferring) and (
                    not sender.fence.is_open(now)
                    and (sender.fence.has_grant or now - sender.attached_at > self.lease_s)):
                sender.fail(FailureReason.LEASE_EXPIRED,
                            "the decode node stopped granting the room's lease", now)
            elif state is KVPoll.Transferring and age > self.waiting_timeout_s:
                sender.fail(FailureReason.TRANSFER_TIMEOUT, "writes did not complete", now)
            if sender.status.state is KVPoll.Failed and state is not KVPoll.Failed:
                self.notify_peer_failed(sender)
        for receiver in list(self.receivers.values()):
            state, age = receiver.status.state, now - receiver.status.since
            if state in (KVPoll.Bootstrapping, KVPoll.WaitingForInput) and (
                    now - receiver.status.created > self.bootstrap_timeout_s):
                receiver.fail(FailureReason.BOOTSTRAP_TIMEOUT,
                              f"not bootstrapped in {self.bootstrap_timeout_s:g} s", now)
            elif state is KVPoll.Transferring and now > receiver.lease_deadline:
                receiver.fail(FailureReason.LEASE_EXPIRED, "the prefill node stopped renewing", now)
            elif state is KVPoll.Transferring and age > self.waiting_timeout_s:
                receiver.fail(FailureReason.WAITING_TIMEOUT,
                              f"no KV in {self.waiting_timeout_s:g} s", now)
                self.notify_peer_aborted(receiver)
        for room, (req, at) in list(self.early_requests.items()):
            if now - at > self.bootstrap_timeout_s:  # the request for it never reached us
                del self.early_requests[room]
                peer = self.peer_by_node.get(req.node_id)
                if peer is not None:
                    self.send(peer.endpoint, msg.TransferFailed(
                        room=room, node_id=self.node_id, reason="prefill never got this request"))
        for room, at in list(self.early_aborts.items()):
            if now - at > self.bootstrap_timeout_s:
                del self.early_aborts[room]

    def _done_bytes(self, sender: KVSender) -> bytes:
        aux = sender.aux
        assert aux is not None
        return msg.encode(msg.TransferDone(
            room=sender.room, node_id=self.node_id, first_token_id=aux.first_token_id,
            first_logprob=aux.first_logprob, top_logprobs=[[t, lp] for t, lp in aux.top_logprobs],
            room_echo=aux.room_echo, num_pages=len(sender.dst_pages),
            instance_id=self.instance_id))

    def lease_room(self, room: int, endpoint: str) -> None:
        self._leases.lease(room, endpoint)

    def unlease_room(self, room: int) -> None:
        self._leases.unlease(room)

    def renew_now(self, endpoint: str, rooms: list[int]) -> None:
        self._leases.renew_now(endpoint, rooms)

    def _prune_leases(self) -> None:
        """Stop renewing rooms that ended (their peer may free its pages now)."""
        for room in self._leases.rooms():
            s = self.senders.get(room)
            if s is None or s.status.state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
                self.unlease_room(room)

    def _write_failed(self, sender: KVSender, peer: Peer | None, error: str, now: float) -> None:
        sender.fail(FailureReason.WRITE_ERROR, error, now)
        self.notify_peer_failed(sender)
        if peer is not None and peer.agent is not None:
            # Drop the backend's connection; it is re-made from the stored metadata later.
            try:
                self.backend.remove_peer(peer.agent)
            except Exception:  # noqa: BLE001
                logger.debug("remove_peer(%s) failed", peer.agent, exc_info=True)
            peer.failed(now, error)

    def _ensure_agent(self, peer: Peer, now: float) -> bool:
        """Writer side: re-add a peer dropped after a failure, once its back-off has passed."""
        if peer.state is PeerState.READY:
            return True
        if not peer.may_retry(now) or not peer.metadata:
            return False
        try:
            peer.agent = self.backend.add_peer(peer.metadata)
        except Exception as exc:  # noqa: BLE001
            peer.failed(now, str(exc))
            return False
        peer.ready(now)
        return True

    def _release_handles(self, sender: KVSender) -> None:
        for h in sender.handles:
            try:
                self.backend.release(h)
            except Exception:  # noqa: BLE001
                logger.debug("release failed for room %d", sender.room, exc_info=True)
        sender.handles.clear()
        sender.posted_dst_pages.clear()

    def _pending(self, handle: object) -> bool:
        return self.backend.poll(handle) is XferState.PENDING

    def send(self, endpoint: str, message: msg.Message) -> None:
        try:
            self._push.send(endpoint, message)
        except zmq.ZMQError as exc:
            logger.warning("control send to %s failed: %s", endpoint, exc)

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        self._leases.close()
        self._push.close()
        self._sock.close(linger=0)
        self.backend.close()
