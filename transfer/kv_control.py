"""Control-message handling of a KVManager: handshake, requests, leases, aborts, completion."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from common import messages as msg
from common.kv_pool import KVLayout
from transfer.kv_poll import FailureReason, KVPoll
from transfer.kv_sender import AuxData, KVSender
from transfer.peers import Peer, PeerState

if TYPE_CHECKING:
    from transfer.kv_manager import KVManager

logger = logging.getLogger(__name__)

HELLO_RESEND_S = 2.0


def layout_mismatch(mine: KVLayout, theirs: dict) -> str | None:
    """One line naming every field where a peer's KV layout differs from ours, or None."""
    try:
        other = KVLayout.from_dict(theirs)
    except (KeyError, TypeError) as exc:
        return f"malformed KV layout ({exc})"
    diffs = [f"{name} {getattr(mine, name)} != {getattr(other, name)}"
             for name in KVLayout.__dataclass_fields__ if getattr(mine, name) != getattr(other, name)]
    return "incompatible KV pools: " + ", ".join(diffs) if diffs else None


class ControlDispatcher:
    """Applies one control message or notification to the manager's rooms and peers."""

    def __init__(self, manager: KVManager) -> None:
        self.m = manager

    def handle(self, message: object, now: float) -> None:
        handler = getattr(self, f"_on_{type(message).__name__}", None)
        if handler is None:
            self.m.metrics.dropped("unexpected_message")
            return
        handler(message, now)

    # ---- writer (prefill) side ---------------------------------------------------------------

    def _on_PeerHello(self, hello: msg.PeerHello, now: float) -> None:
        m = self.m
        reason, kind = self._refusal(hello)
        peer = m.peers.setdefault(hello.control_endpoint, Peer(hello.control_endpoint))
        if reason is None:
            try:
                if peer.agent is not None:
                    m.backend.remove_peer(peer.agent)
                peer.agent = m.backend.add_peer(hello.backend_metadata)
            except Exception as exc:  # noqa: BLE001 - a bad peer must not take the node down
                reason = f"cannot load the peer's transfer metadata: {exc}"
                kind = FailureReason.PEER_UNREACHABLE
        if reason is not None:
            logger.warning("refused peer %s at %s: %s", hello.node_id, hello.control_endpoint, reason)
            m.metrics.refused(kind)
            m.send(hello.control_endpoint, msg.PeerHelloAck(
                node_id=m.node_id, control_endpoint=m.control_endpoint, accepted=False,
                reason=reason))
            return
        peer.node_id, peer.metadata = hello.node_id, hello.backend_metadata
        peer.ready(now)
        m.peer_by_node[hello.node_id] = peer
        m.send(hello.control_endpoint, msg.PeerHelloAck(
            node_id=m.node_id, control_endpoint=m.control_endpoint, accepted=True, reason=""))

    def _refusal(self, hello: msg.PeerHello) -> tuple[str | None, str]:
        """Why a peer's hello is refused (and the failure kind), or (None, "")."""
        m = self.m
        if m.auth_token is not None and hello.auth_token != m.auth_token:
            return "bad or missing cluster token", FailureReason.UNAUTHORIZED
        if hello.protocol_version != msg.PROTOCOL_VERSION:
            return (f"protocol version {hello.protocol_version} != {msg.PROTOCOL_VERSION}",
                    FailureReason.INCOMPATIBLE)
        if hello.backend != m.backend_kind:
            return f"transfer backend {hello.backend} != {m.backend_kind}", FailureReason.INCOMPATIBLE
        mismatch = layout_mismatch(m.pool.layout, hello.kv_layout)
        return (mismatch, FailureReason.INCOMPATIBLE) if mismatch else (None, "")

    def _on_TransferRequest(self, req: msg.TransferRequest, now: float) -> None:
        m = self.m
        if req.node_id not in m.peer_by_node:
            m.metrics.dropped(FailureReason.UNAUTHORIZED)
            return
        sender = m.senders.get(req.room)
        if sender is None:
            m.early_requests[req.room] = (req, now)
            return
        self.attach_request(sender, req, now)

    def attach_request(self, sender: KVSender, req: msg.TransferRequest, now: float) -> None:
        sender.on_transfer_request(req.node_id, list(req.dst_pages), req.aux_slot,
                                   now + req.lease_s, now)
        if sender.status.state is KVPoll.Failed:
            self.m.notify_peer_failed(sender)
        elif sender.status.state is KVPoll.WaitingForInput:
            self.m.lease_room(sender.room, self.m.peer_by_node[req.node_id].endpoint)

    def _on_AbortReq(self, abort: msg.AbortReq, now: float) -> None:
        m = self.m
        if abort.node_id not in m.peer_by_node or abort.room is None:
            m.metrics.dropped(FailureReason.UNAUTHORIZED)
            return
        sender = m.senders.get(abort.room)
        if sender is None:
            m.early_requests.pop(abort.room, None)
            m.early_aborts[abort.room] = now
            return
        sender.fail(FailureReason.PEER_ABORTED, abort.reason, now)
        # Ack once nothing is in flight: the decode side may then reuse its pages.
        m.ack_abort_when_drained(sender)

    # ---- receiver (decode) side --------------------------------------------------------------

    def _on_PeerHelloAck(self, ack: msg.PeerHelloAck, now: float) -> None:
        m = self.m
        peer = m.peers.get(ack.control_endpoint)
        if peer is None:
            m.metrics.dropped("unexpected_message")
            return
        waiting = [r for r in m.receivers.values()
                   if r.peer_endpoint == peer.endpoint and r.status.state is KVPoll.Bootstrapping]
        if not ack.accepted:
            peer.failed(now, ack.reason)
            kind = (FailureReason.UNAUTHORIZED if "token" in ack.reason
                    else FailureReason.INCOMPATIBLE)
            for r in waiting:
                r.fail(kind, ack.reason, now)
            return
        peer.node_id = ack.node_id
        peer.ready(now)
        m.peer_by_node[ack.node_id] = peer
        for r in waiting:
            r.on_peer_ready(now)

    def _on_TransferDone(self, done: msg.TransferDone, now: float) -> None:
        receiver = self.m.receivers.get(done.room)
        peer = self.m.peer_by_node.get(done.node_id)
        if receiver is None or peer is None or peer.endpoint != receiver.peer_endpoint:
            self.m.metrics.dropped("unexpected_message")
            return
        aux = AuxData(first_token_id=done.first_token_id, room_echo=done.room_echo,
                      first_logprob=done.first_logprob,
                      top_logprobs=[(int(t), float(lp)) for t, lp in done.top_logprobs])
        receiver.on_done(aux, done.num_pages, now)

    def _on_TransferFailed(self, failed: msg.TransferFailed, now: float) -> None:
        receiver = self.m.receivers.get(failed.room)
        if receiver is None:
            return
        receiver.is_abort_acked = True  # the prefill side has stopped writing this room
        receiver.fail(FailureReason.PEER_ABORTED, failed.reason, now)

    # ---- both sides --------------------------------------------------------------------------

    def _on_LeaseRenew(self, renew: msg.LeaseRenew, now: float) -> None:
        m = self.m
        peer = m.peer_by_node.get(renew.node_id)
        if peer is None:
            m.metrics.dropped(FailureReason.UNAUTHORIZED)
            return
        peer.last_seen = now
        for room in renew.rooms:
            s = m.senders.get(room)
            if s is not None and s.peer_node == renew.node_id:
                s.lease_deadline = now + m.lease_s
            r = m.receivers.get(room)
            if r is not None and r.peer_endpoint == peer.endpoint:
                r.lease_deadline = now + m.lease_s

    def handle_notification(self, peer_agent: str, data: bytes, now: float) -> None:
        try:
            message = msg.decode(data)
        except msg.MalformedMessage:
            self.m.metrics.dropped("malformed_notification")
            return
        if isinstance(message, msg.TransferDone):
            self._on_TransferDone(message, now)
        else:
            self.m.metrics.dropped("unexpected_message")

    def send_hello(self, peer: Peer, now: float) -> None:
        m = self.m
        peer.state, peer.hello_sent_at = PeerState.CONNECTING, now
        m.send(peer.endpoint, msg.PeerHello(
            node_id=m.node_id, role=m.role, control_endpoint=m.control_endpoint,
            backend=m.backend_kind, backend_metadata=m.backend.local_metadata(),
            kv_layout=m.pool.layout.to_dict(), num_pages=m.pool.num_pages,
            protocol_version=msg.PROTOCOL_VERSION, auth_token=m.auth_token))

    def resend_hellos(self, now: float) -> None:
        """Re-send a lost or unanswered hello; the rooms' bootstrap timeout bounds the wait."""
        waiting = {r.peer_endpoint for r in self.m.receivers.values()
                   if r.status.state is KVPoll.Bootstrapping}
        for endpoint in waiting:
            peer = self.m.peers[endpoint]
            stale = peer.state is PeerState.CONNECTING and now - peer.hello_sent_at > HELLO_RESEND_S
            if stale or peer.may_retry(now):
                self.send_hello(peer, now)
