"""Control-message handling of a KVManager: handshake, requests, leases, aborts, completion.

Every peer is known by its node id and its instance id (new at each start of its
process). A message from a known node id with another instance id comes from a process
that restarted: what we held with the old one is failed and the handshake is made anew.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from common import messages as msg
from common import stages
from common.kv_pool import KVLayout, KVPool
from transfer.backend import TransferBackend
from transfer.fence import RenewalLog, writer_fence_end
from transfer.kv_poll import FailureReason, KVPoll
from transfer.kv_receiver import KVReceiver
from transfer.kv_sender import AuxData, KVSender
from transfer.metrics import TransferMetrics
from transfer.peers import Peer, PeerState

logger = logging.getLogger(__name__)

HELLO_RESEND_S = 2.0


class ControlHost(Protocol):
    """The KVManager state the dispatcher reads and changes (it owns none of it)."""

    node_id: str
    instance_id: str
    role: str
    control_endpoint: str
    backend: TransferBackend
    backend_kind: str
    pool: KVPool
    auth_token: str | None
    lease_s: float
    metrics: TransferMetrics
    peers: dict[str, Peer]
    peer_by_node: dict[str, Peer]
    senders: dict[int, KVSender]
    receivers: dict[int, KVReceiver]
    early_requests: dict[int, tuple[msg.TransferRequest, float]]
    early_aborts: dict[int, float]
    ended_rooms: dict[int, tuple[str, float]]
    renewals: RenewalLog
    on_late_write: Callable[[int, list[int]], None]

    def send(self, endpoint: str, message: msg.Message) -> None: ...

    def stop_when_drained(self, sender: KVSender) -> None: ...

    def lease_room(self, room: int, endpoint: str) -> None: ...

    def renew_now(self, endpoint: str, rooms: list[int]) -> None: ...

    def vouch_to(self, endpoint: str) -> None: ...


def layout_mismatch(mine: KVLayout, theirs: dict) -> str | None:
    """One line naming every field where a peer's KV layout differs from ours, or None."""
    try:
        other = KVLayout.from_dict(theirs)
    except (KeyError, TypeError) as exc:
        return f"malformed KV layout ({exc})"
    diffs = [
        f"{name} {getattr(mine, name)} != {getattr(other, name)}"
        for name in KVLayout.__dataclass_fields__
        if getattr(mine, name) != getattr(other, name)
    ]
    return "incompatible KV pools: " + ", ".join(diffs) if diffs else None


class ControlDispatcher:
    """Applies one control message or notification to the host's rooms and peers."""

    def __init__(self, host: ControlHost) -> None:
        self.m = host

    def handle(self, message: object, now: float) -> None:
        handler = getattr(self, f"_on_{type(message).__name__}", None)
        if handler is None:
            self.m.metrics.dropped("unexpected_message")
            return
        handler(message, now)

    def _known(self, node_id: str, instance_id: str) -> Peer | None:
        """The peer that sent a message, if we shook hands with that very process."""
        peer = self.m.peer_by_node.get(node_id)
        if peer is None or peer.state is not PeerState.READY or peer.instance_id != instance_id:
            return None
        return peer

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
            logger.warning(
                "refused peer %s at %s: %s", hello.node_id, hello.control_endpoint, reason
            )
            m.metrics.refused(kind)
            m.send(
                hello.control_endpoint,
                msg.PeerHelloAck(
                    node_id=m.node_id,
                    control_endpoint=m.control_endpoint,
                    accepted=False,
                    reason=reason,
                    instance_id=m.instance_id,
                ),
            )
            return
        old = m.peer_by_node.get(hello.node_id)
        if old is not None and old.instance_id and old.instance_id != hello.instance_id:
            # The decode process restarted: the pages we were writing belong to a dead process.
            for s in [s for s in m.senders.values() if s.peer_node == hello.node_id]:
                if s.fail(
                    FailureReason.PEER_RESTARTED, f"decode node {hello.node_id} restarted", now
                ):
                    m.metrics.dropped("peer_restarted")
        peer.node_id, peer.metadata = hello.node_id, hello.backend_metadata
        peer.instance_id = hello.instance_id
        peer.ready(now)
        m.peer_by_node[hello.node_id] = peer
        m.vouch_to(peer.endpoint)
        m.send(
            hello.control_endpoint,
            msg.PeerHelloAck(
                node_id=m.node_id,
                control_endpoint=m.control_endpoint,
                accepted=True,
                reason="",
                instance_id=m.instance_id,
            ),
        )

    def _refusal(self, hello: msg.PeerHello) -> tuple[str | None, str]:
        """Why a peer's hello is refused (and the failure kind), or (None, "")."""
        m = self.m
        if m.auth_token is not None and hello.auth_token != m.auth_token:
            return "bad or missing cluster token", FailureReason.UNAUTHORIZED
        if hello.protocol_version != msg.PROTOCOL_VERSION:
            return (
                f"protocol version {hello.protocol_version} != {msg.PROTOCOL_VERSION}",
                FailureReason.INCOMPATIBLE,
            )
        if hello.backend != m.backend_kind:
            return (
                f"transfer backend {hello.backend} != {m.backend_kind}",
                FailureReason.INCOMPATIBLE,
            )
        mismatch = layout_mismatch(m.pool.layout, hello.kv_layout)
        return (mismatch, FailureReason.INCOMPATIBLE) if mismatch else (None, "")

    def _on_TransferRequest(self, req: msg.TransferRequest, now: float) -> None:
        m = self.m
        peer = self._known(req.node_id, req.instance_id)
        if peer is None:
            # Most often we restarted and the decode node still trusts our old process:
            # tell it to shake hands again (it resends the request afterwards).
            m.metrics.dropped("unknown_peer")
            if req.control_endpoint:
                m.send(
                    req.control_endpoint,
                    msg.PeerReset(
                        node_id=m.node_id,
                        instance_id=m.instance_id,
                        control_endpoint=m.control_endpoint,
                        rooms=[req.room],
                    ),
                )
            return
        sender = m.senders.get(req.room)
        ended = m.ended_rooms.pop(req.room, None) if sender is None else None
        if ended is not None:  # failed here before this came: the decode side lets go now
            m.send(
                peer.endpoint,
                msg.TransferFailed(
                    room=req.room, node_id=m.node_id, reason=ended[0], instance_id=m.instance_id
                ),
            )
        elif sender is None:
            m.early_requests[req.room] = (req, now)
        else:
            self.attach_request(sender, req, now)

    def attach_request(self, sender: KVSender, req: msg.TransferRequest, now: float) -> None:
        sender.on_transfer_request(
            req.node_id, list(req.dst_pages), req.aux_slot, now, req.num_held_pages
        )
        if sender.status.state is KVPoll.Failed:
            self.m.stop_when_drained(sender)
        elif sender.status.state is KVPoll.WaitingForInput:
            endpoint = self.m.peer_by_node[req.node_id].endpoint
            self.m.lease_room(sender.room, endpoint)
            self.m.renew_now(endpoint, [sender.room])  # the first grant, before the first write

    def _on_AbortReq(self, abort: msg.AbortReq, now: float) -> None:
        m = self.m
        if self._known(abort.node_id, abort.instance_id) is None or abort.room is None:
            m.metrics.dropped(FailureReason.UNAUTHORIZED)
            return
        sender = m.senders.get(abort.room)
        if sender is None:
            m.early_requests.pop(abort.room, None)
            m.early_aborts[abort.room] = now
            return
        sender.fail(FailureReason.PEER_ABORTED, abort.reason, now)
        # Ack once nothing is in flight: the decode side may then reuse its pages.
        m.stop_when_drained(sender)

    def _on_LeaseGrant(self, grant: msg.LeaseGrant, now: float) -> None:
        m = self.m
        peer = self._known(grant.node_id, grant.instance_id)
        sent_at = m.renewals.take(grant.seq, peer.endpoint) if peer is not None else None
        if peer is None or sent_at is None:
            m.metrics.dropped("unexpected_grant")
            return
        peer.last_seen = now
        m.vouch_to(peer.endpoint)
        lease_s = min(grant.lease_s, m.lease_s)
        for room in grant.granted:
            s = m.senders.get(room)
            if s is not None and s.peer_node == grant.node_id:
                s.fence.extend(writer_fence_end(sent_at, lease_s))
        for room in grant.released:
            s = m.senders.get(room)
            # A room whose last write is out is finishing (the decode side may already
            # have it); any other released room is no longer wanted.
            if s is not None and s.peer_node == grant.node_id and not s.is_last_posted:
                if s.fail(FailureReason.PEER_ABORTED, "the decode node released the room", now):
                    m.stop_when_drained(s)

    # ---- receiver (decode) side --------------------------------------------------------------

    def _on_PeerHelloAck(self, ack: msg.PeerHelloAck, now: float) -> None:
        m = self.m
        peer = m.peers.get(ack.control_endpoint)
        if peer is None:
            m.metrics.dropped("unexpected_message")
            return
        mine = [r for r in m.receivers.values() if r.peer_endpoint == peer.endpoint]
        waiting = [r for r in mine if r.status.state is KVPoll.Bootstrapping]
        if not ack.accepted:
            peer.failed(now, ack.reason)
            kind = (
                FailureReason.UNAUTHORIZED if "token" in ack.reason else FailureReason.INCOMPATIBLE
            )
            for r in waiting + [r for r in mine if r.needs_resend]:
                r.fail(kind, ack.reason, now)
            return
        if peer.instance_id and peer.instance_id != ack.instance_id:
            self._peer_restarted(peer, now)
        peer.node_id, peer.instance_id = ack.node_id, ack.instance_id
        peer.ready(now)
        m.peer_by_node[ack.node_id] = peer
        for r in waiting:
            r.on_peer_ready(now)
        for r in mine:
            r.resend_request(now)

    def _peer_restarted(self, peer: Peer, now: float) -> None:
        """The prefill process behind `peer` is a new one: rooms the old one was writing fail."""
        for r in list(self.m.receivers.values()):
            if (
                r.peer_endpoint == peer.endpoint
                and r.status.state is KVPoll.Transferring
                and r.fence.has_grant
            ):
                r.fail(FailureReason.PEER_RESTARTED, "the prefill node restarted mid-transfer", now)

    def _on_PeerReset(self, reset: msg.PeerReset, now: float) -> None:
        m = self.m
        peer = m.peers.get(reset.control_endpoint)
        if peer is None:
            m.metrics.dropped("unexpected_message")
            return
        if peer.instance_id != reset.instance_id:
            self._peer_restarted(peer, now)
        for room in reset.rooms:
            r = m.receivers.get(room)
            if (
                r is not None
                and r.peer_endpoint == peer.endpoint
                and r.status.state is KVPoll.Transferring
                and not r.fence.has_grant
            ):
                r.needs_resend = True
        if peer.state is not PeerState.CONNECTING:
            self.send_hello(peer, now)

    def _on_TransferDone(self, done: msg.TransferDone, now: float) -> None:
        receiver = self.m.receivers.get(done.room)
        peer = self._known(done.node_id, done.instance_id)
        if receiver is None or peer is None or peer.endpoint != receiver.peer_endpoint:
            self.m.metrics.dropped("unexpected_message")
            return
        aux = AuxData(
            first_token_id=done.first_token_id,
            room_echo=done.room_echo,
            first_logprob=done.first_logprob,
            top_logprobs=[(int(t), float(lp)) for t, lp in done.top_logprobs],
            marks=stages.forwarded(done.marks, stages.PREFILL_MARKS),
            num_cached_tokens=max(0, done.num_cached_tokens),
            prompt_logprobs=done.prompt_logprobs,
            prompt_top_logprobs=done.prompt_top_logprobs,
        )
        receiver.on_done(aux, done.num_pages, now)

    def _on_TransferFailed(self, failed: msg.TransferFailed, now: float) -> None:
        receiver = self.m.receivers.get(failed.room)
        peer = self._known(failed.node_id, failed.instance_id)
        if receiver is None or peer is None or peer.endpoint != receiver.peer_endpoint:
            self.m.metrics.dropped("unexpected_message")
            return
        receiver.is_abort_acked = True  # the prefill side has stopped writing this room
        receiver.fail(FailureReason.PEER_ABORTED, failed.reason, now)

    def _on_LeaseRenew(self, renew: msg.LeaseRenew, now: float) -> None:
        m = self.m
        peer = self._known(renew.node_id, renew.instance_id)
        if peer is None:
            m.metrics.dropped(FailureReason.UNAUTHORIZED)
            return
        peer.last_seen = now
        granted, released = [], []
        for room in renew.rooms:
            r = m.receivers.get(room)
            if r is not None and r.peer_endpoint == peer.endpoint and r.grant(now):
                granted.append(room)
            else:
                released.append(room)
        # Rooms the writer has not taken up yet (their TransferRequest waits behind its
        # model step): it is alive, so they wait too. Their pages are safe meanwhile: no
        # write can come before the room's first grant.
        for r in m.receivers.values():
            if r.peer_endpoint == peer.endpoint and not r.fence.has_grant:
                r.writer_alive(now)
        m.send(
            peer.endpoint,
            msg.LeaseGrant(
                node_id=m.node_id,
                instance_id=m.instance_id,
                seq=renew.seq,
                lease_s=m.lease_s,
                granted=granted,
                released=released,
            ),
        )

    def _on_LateWrite(self, late: msg.LateWrite, now: float) -> None:
        if self._known(late.node_id, late.instance_id) is None:
            self.m.metrics.dropped(FailureReason.UNAUTHORIZED)
            return
        logger.error(
            "room %d: a write of %s may have landed after its fence (pages %s)",
            late.room,
            late.node_id,
            late.dst_pages[:16],
        )
        self.m.metrics.late_write()
        self.m.on_late_write(late.room, list(late.dst_pages))

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
        m.send(
            peer.endpoint,
            msg.PeerHello(
                node_id=m.node_id,
                role=m.role,
                control_endpoint=m.control_endpoint,
                backend=m.backend_kind,
                backend_metadata=m.backend.local_metadata(),
                kv_layout=m.pool.layout.to_dict(),
                num_pages=m.pool.num_pages,
                protocol_version=msg.PROTOCOL_VERSION,
                auth_token=m.auth_token,
                instance_id=m.instance_id,
            ),
        )

    def resend_hellos(self, now: float) -> None:
        """Re-send a lost or unanswered hello; the rooms' bootstrap timeout bounds the wait."""
        waiting = {
            r.peer_endpoint
            for r in self.m.receivers.values()
            if r.status.state is KVPoll.Bootstrapping or r.needs_resend
        }
        for endpoint in waiting:
            peer = self.m.peers[endpoint]
            stale = peer.state is PeerState.CONNECTING and now - peer.hello_sent_at > HELLO_RESEND_S
            if stale or peer.may_retry(now):
                self.send_hello(peer, now)
