"""The writer's lease renewals: a thread that asks each receiver, every lease/3, to grant the rooms
we still write into, dated in a RenewalLog so each grant opens a fence by our own clock.

Renewals go from a thread of their own: a long model step (seconds of prefill on a CPU)
must not make a live writer look dead to its peers. A room is leased the moment its
TransferRequest is attached and unleased when it ends; the thread only sends what the
table says. The grants come back on the control socket and are applied by the loop.
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
    def __init__(self, node_id: str, instance_id: str, lease_s: float, ctx: zmq.Context,
                 clock: Callable[[], float]) -> None:
        self.node_id, self.instance_id = node_id, instance_id
        self.lease_s = lease_s
        self.clock = clock
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
            push.send(endpoint, msg.LeaseRenew(node_id=self.node_id, rooms=rooms,
                                               instance_id=self.instance_id, seq=seq))
        except zmq.ZMQError as exc:
            logger.warning("lease renewal to %s failed: %s", endpoint, exc)

    def _run(self) -> None:
        push = PushPool(self._ctx)  # this thread's own sockets (zmq sockets are per thread)
        try:
            while not self._closed.wait(self.lease_s / 3):
                with self._lock:
                    leased = list(self._leased.items())
                by_peer: dict[str, list[int]] = {}
                for room, endpoint in leased:
                    by_peer.setdefault(endpoint, []).append(room)
                for endpoint, rooms in by_peer.items():
                    self._send(push, endpoint, rooms)
        finally:
            push.close()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._loop_push.close()
