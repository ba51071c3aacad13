"""The writer's lease renewals: a thread that asks each receiver, every lease/3, to grant the rooms
we still write into, dated in a RenewalLog so each grant opens a fence by our own clock.

Renewals go from a thread of their own: a long model step (seconds of prefill on a CPU)
must not make a live writer look dead to its peers. A room is leased the moment its
TransferRequest is attached and unleased when it ends; the thread only sends what the
table says. The grants come back on the control socket and are applied by the loop.

Every peer we shook hands with gets a renewal each round, with no rooms if we hold none
of its rooms yet: a room whose TransferRequest still sits in our control socket (the loop
is inside a prefill step that outlasts the lease) is not ours to renew, but its receiver
must still hear that we are alive, or it fails the room although we will serve it
(kv_control._on_LeaseRenew). A peer that has not been touched by the loop for
`idle_s` (no handshake, room or grant) gets no more empty renewals.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from common import messages as msg
from common.ipc import PushPool
from transfer.fence import RenewalLog

logger = logging.getLogger(__name__)


class LeaseRenewer:
    def __init__(
        self,
        node_id: str,
        instance_id: str,
        lease_s: float,
        ctx: zmq.Context,
        clock: Callable[[], float],
        idle_s: float | None = None,
    ) -> None:
        self.node_id, self.instance_id = node_id, instance_id
        self.lease_s = lease_s
        self.idle_s = idle_s if idle_s is not None else 30 * lease_s
        self.clock = clock
        self._peers: dict[str, float] = {}  # endpoint -> when the loop last touched it
        self.log = RenewalLog(horizon_s=2 * lease_s)
        self._ctx = ctx
        self._leased: dict[int, str] = {}  # room -> endpoint of the receiver that grants it
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._loop_push = PushPool(ctx)  # the loop thread's sockets (renew_now)
        self._thread = threading.Thread(target=self._run, name=f"{node_id}-leases", daemon=True)
        self._thread.start()

    def lease(self, room: int, endpoint: str) -> None:
        with self._lock:
            self._leased[room] = endpoint
            self._peers[endpoint] = self.clock()

    def touch(self, endpoint: str) -> None:
        """Loop thread: `endpoint` is a live peer; keep telling it we are alive."""
        with self._lock:
            self._peers[endpoint] = self.clock()

    def forget(self, endpoint: str) -> None:
        with self._lock:
            self._peers.pop(endpoint, None)

    def unlease(self, room: int) -> None:
        with self._lock:
            self._leased.pop(room, None)

    def rooms(self) -> list[int]:
        with self._lock:
            return list(self._leased)

    def renew_now(self, endpoint: str, rooms: list[int]) -> None:
        """Loop thread: ask for a grant at once (a new room's first write waits for it)."""
        self._send(self._loop_push, endpoint, rooms)

    def _send(self, push: PushPool, endpoint: str, rooms: list[int]) -> None:
        seq = self.log.record(endpoint, self.clock())  # dated before it leaves
        try:
            push.send(
                endpoint,
                msg.LeaseRenew(
                    node_id=self.node_id, rooms=rooms, instance_id=self.instance_id, seq=seq
                ),
            )
        except zmq.ZMQError as exc:
            logger.warning("lease renewal to %s failed: %s", endpoint, exc)

    def due(self) -> dict[str, list[int]]:
        """The renewals of one round: each recently touched peer's leased rooms (maybe none)."""
        now = self.clock()
        with self._lock:
            for endpoint in [e for e, at in self._peers.items() if now - at > self.idle_s]:
                del self._peers[endpoint]
            by_peer: dict[str, list[int]] = {endpoint: [] for endpoint in self._peers}
            for room, endpoint in self._leased.items():
                by_peer.setdefault(endpoint, []).append(room)
        return by_peer

    def _run(self) -> None:
        push = PushPool(self._ctx)  # this thread's own sockets (zmq sockets are per thread)
        try:
            while not self._closed.wait(self.lease_s / 3):
                for endpoint, rooms in self.due().items():
                    self._send(push, endpoint, rooms)
        finally:
            push.close()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._loop_push.close()
