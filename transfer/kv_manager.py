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
                                        nothing of it is in flight any more; also the answer
                                        to a TransferRequest for a room that failed and was
                                        cleared here before it came (``ended_rooms``)
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
from common.ipc import PushPool, bind_pull, close_pull, recv_messages
from common.kv_pool import KVPool
from transfer.backend import TransferBackend
from transfer.kv_control import ControlDispatcher
from transfer.kv_poll import FailureReason, KVPoll
from transfer.kv_receiver import KVReceiver
from transfer.kv_sender import KVSender
from transfer.kv_writer import KVWriter
from transfer.leases import LeaseRenewer
from transfer.metrics import TransferMetrics
from transfer.peers import Peer, PeerState

logger = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL_S = 0.005


class KVManager:
    def __init__(
        self,
        node_id: str,
        role: str,
        backend: TransferBackend,
        pool: KVPool,
        *,
        backend_kind: str = "nixl",
        control_endpoint: str = "tcp://127.0.0.1:0",
        auth_token: str | None = None,
        bootstrap_timeout_s: float = 300.0,
        waiting_timeout_s: float = 300.0,
        lease_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        zmq_context: zmq.Context | None = None,
        instance_id: str | None = None,
    ) -> None:
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
        # Prefill: rooms that failed and were cleared here before their TransferRequest came
        # (an abort, a grammar error): one that comes later hears TransferFailed at once,
        # not after the bootstrap timeout (its decode side holds pages until it hears).
        self.ended_rooms: dict[int, tuple[str, float]] = {}
        # Receiver side: called with (room, pages) when a writer reports a late write.
        self.on_late_write: Callable[[int, list[int]], None] = lambda room, pages: None
        self._leases = LeaseRenewer(node_id, self.instance_id, lease_s, self._ctx, clock)
        self.renewals = self._leases.log
        self._control = ControlDispatcher(self)
        self._writer = KVWriter(self)
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

    def connect_peer(self, peer_endpoint: str) -> None:
        """Shake hands with a peer before a room needs it, so a pair's first request does
        not wait for the handshake; a no-op while one is under way or done."""
        now = self.clock()
        peer = self.peers.setdefault(peer_endpoint, Peer(peer_endpoint))
        if peer.may_retry(now):
            self._control.send_hello(peer, now)

    def remove_sender(self, sender: KVSender) -> None:
        if self.senders.get(sender.room) is sender:
            del self.senders[sender.room]
            self.unlease_room(sender.room)
            if sender.status.state is KVPoll.Failed and sender.peer_node is None:
                reason = sender.failure_reason or "failed"
                self.ended_rooms[sender.room] = (reason, self.clock())
        self._writer.forget(sender)

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

    def send_transfer_request(self, receiver: KVReceiver) -> None:
        self.send(
            receiver.peer_endpoint,
            msg.TransferRequest(
                room=receiver.room,
                node_id=self.node_id,
                dst_pages=receiver.dst_pages,
                aux_slot=receiver.aux_slot,
                lease_s=self.lease_s,
                instance_id=self.instance_id,
                control_endpoint=self.control_endpoint,
                num_held_pages=receiver.num_held_pages,
            ),
        )

    def flush_writes(self, sender: KVSender) -> None:
        self._writer.flush(sender)

    def stop_when_drained(self, sender: KVSender) -> None:
        """TransferFailed to the receiver once none of the room's writes is in flight."""
        self._writer.stop_when_drained(sender)

    def notify_peer_aborted(self, receiver: KVReceiver) -> None:
        peer = self.peers.get(receiver.peer_endpoint)
        if peer is not None and peer.state is PeerState.READY:
            self.send(
                peer.endpoint,
                msg.AbortReq(
                    node_id=self.node_id,
                    room=receiver.room,
                    rid=None,
                    reason="aborted by the decode node",
                    instance_id=self.instance_id,
                ),
            )

    # ---- the poll loop ----------------------------------------------------------------------

    def poll(self) -> None:
        now = self.clock()
        self.drain_control(now)
        for peer_agent, data in self.backend.get_notifications():
            self._control.handle_notification(peer_agent, data, now)
        for sender in [s for s in self.senders.values() if s.has_unposted_writes]:
            self._writer.flush(sender)
        self._writer.progress(now)
        # Timers are coarse (seconds): checking them every few ms keeps each poll, and
        # so the latency of noticing a completed transfer, short.
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + HOUSEKEEPING_INTERVAL_S
            self._check_timeouts(now)
            self._control.resend_hellos(now)
            self._prune_leases()
            self.metrics.rooms(self.senders.values(), self.receivers.values())

    def drain_control(self, now: float) -> None:
        for message in recv_messages(self._sock, socket_name=self.metrics.socket, max_frames=1000):
            self._control.handle(message, now)

    def _check_timeouts(self, now: float) -> None:
        for sender in list(self.senders.values()):
            state, age = sender.status.state, now - sender.status.since
            if state is KVPoll.Bootstrapping and age > self.bootstrap_timeout_s:
                sender.fail(
                    FailureReason.BOOTSTRAP_TIMEOUT,
                    f"no TransferRequest from the decode node in {self.bootstrap_timeout_s:g} s",
                    now,
                )
            elif state in (KVPoll.WaitingForInput, KVPoll.Transferring) and (
                now - max(sender.fence.until, sender.attached_at) > self.lease_s
            ):
                # No grant for a whole lease past the fence (or since the request came).
                sender.fail(
                    FailureReason.LEASE_EXPIRED,
                    "the decode node stopped granting the room's lease",
                    now,
                )
            elif state is KVPoll.Transferring and age > self.waiting_timeout_s:
                sender.fail(FailureReason.TRANSFER_TIMEOUT, "writes did not complete", now)
            if sender.status.state is KVPoll.Failed and state is not KVPoll.Failed:
                self.stop_when_drained(sender)
        for receiver in list(self.receivers.values()):
            state, age = receiver.status.state, now - receiver.status.since
            if state in (KVPoll.Bootstrapping, KVPoll.WaitingForInput) and (
                now - receiver.status.created > self.bootstrap_timeout_s
            ):
                receiver.fail(
                    FailureReason.BOOTSTRAP_TIMEOUT,
                    f"not bootstrapped in {self.bootstrap_timeout_s:g} s",
                    now,
                )
            elif state is KVPoll.Transferring and now > receiver.lease_deadline:
                receiver.fail(FailureReason.LEASE_EXPIRED, "the prefill node stopped renewing", now)
            elif state is KVPoll.Transferring and age > self.waiting_timeout_s:
                receiver.fail(
                    FailureReason.WAITING_TIMEOUT, f"no KV in {self.waiting_timeout_s:g} s", now
                )
                self.notify_peer_aborted(receiver)
        for room, (req, at) in list(self.early_requests.items()):
            if now - at > self.bootstrap_timeout_s:  # the request for it never reached us
                del self.early_requests[room]
                peer = self.peer_by_node.get(req.node_id)
                if peer is not None:
                    self.send(
                        peer.endpoint,
                        msg.TransferFailed(
                            room=room,
                            node_id=self.node_id,
                            reason="prefill never got this request",
                            instance_id=self.instance_id,
                        ),
                    )
        for room, at in list(self.early_aborts.items()):
            if now - at > self.bootstrap_timeout_s:
                del self.early_aborts[room]
        for room, (_, at) in list(self.ended_rooms.items()):
            if now - at > self.bootstrap_timeout_s:  # a TransferRequest would be as late
                del self.ended_rooms[room]

    def lease_room(self, room: int, endpoint: str) -> None:
        self._leases.lease(room, endpoint)

    def unlease_room(self, room: int) -> None:
        self._leases.unlease(room)

    def renew_now(self, endpoint: str, rooms: list[int]) -> None:
        self._leases.renew_now(endpoint, rooms)

    def vouch_to(self, endpoint: str) -> None:
        """Tell `endpoint` we are alive every lease/3, rooms or not (transfer/leases.py)."""
        self._leases.touch(endpoint)

    def _prune_leases(self) -> None:
        """Stop renewing rooms that ended (their peer may free its pages now)."""
        for room in self._leases.rooms():
            s = self.senders.get(room)
            if s is None or s.status.state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
                self.unlease_room(room)

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
        close_pull(self._sock)
        self.backend.close()
