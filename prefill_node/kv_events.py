"""A prefill node's KV events: its radix cache's stored and evicted pages, published to gateways.

The cache tells the publisher each page it stores or evicts (by chained page hash,
common/page_hash.py); the loop calls ``flush`` once per step, which sends at most one
batch per ``interval_s`` with the net change since the last (a page stored then evicted
within one batch is not sent at all), numbered by ``seq``. Without changes a keepalive
goes every ``keepalive_s`` with the last seq and the node's queued tokens, so a
subscriber learns the load and notices a lost batch soon. A snapshot (every cached page)
goes when a gateway asks for one (KVSnapshotRequest on the request socket: it saw a gap,
a new instance, or it just joined) or after a cache reset.

Transport: one PUB socket bound by the node (a CURVE server, like every bound socket of
a cluster with a token: a subscriber without the cluster key never gets a byte), its
endpoint in RegisterNode.kv_events_endpoint. PUB drops batches for a subscriber whose
queue is full instead of blocking the loop; the seq gap makes it ask for a snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from common import messages as msg
from common import page_hash
from common.ipc import bind_pull, close_pull, count_refused
from common.page_hash import HashArray

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.02
DEFAULT_KEEPALIVE_S = 0.5
PUB_SNDHWM = 1000  # batches queued per subscriber before PUB drops (a gap, then a snapshot)
# A page's state in a batch: the index of its list (removed, stored, stored_host).
_REMOVED, _DEVICE, _HOST = 0, 1, 2
# Loading a page back as a fraction of computing it, until the node has measured it (or
# where it cannot: on CUDA both only queue work). A host-memory tier is far cheaper than
# computing on a CPU (0.2% measured: bench/kv_tiers.py).
DEFAULT_HOST_LOAD_COST = 0.1


class KVEventPublisher:
    """The cache's event sink (common.radix_node.CacheEvents) and the PUB socket."""

    def __init__(
        self,
        node_id: str,
        instance_id: str,
        num_pages: int,
        endpoint: str,
        *,
        ctx: zmq.Context | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id, self.instance_id = node_id, instance_id
        self.num_pages = num_pages
        self.interval_s, self.keepalive_s = interval_s, keepalive_s
        self.clock = clock
        self.seq = 0
        self.num_batches = self.num_snapshots = 0
        self._net: dict[int, int] = {}  # page hash -> _REMOVED, _DEVICE or _HOST
        # What loading a page back from the host tier costs here, as a fraction of
        # computing it (the loop keeps it current; prefill_node/load_back_cost.py).
        self.host_load_cost = DEFAULT_HOST_LOAD_COST
        self._is_snapshot_due = False
        self._last_batch = self._last_sent = -float("inf")
        self._sock, self.endpoint = bind_pull(ctx or zmq.Context.instance(), endpoint, zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, PUB_SNDHWM)

    # ---- the cache's events --------------------------------------------------------------

    def stored(self, hashes: HashArray) -> None:
        self._mark(hashes, _DEVICE)

    def removed(self, hashes: HashArray) -> None:
        self._mark(hashes, _REMOVED)

    def offloaded(self, hashes: HashArray) -> None:
        self._mark(hashes, _HOST)

    def loaded(self, hashes: HashArray) -> None:
        self._mark(hashes, _DEVICE)

    def _mark(self, hashes: HashArray, state: int) -> None:
        net = self._net
        for h in hashes.tolist():
            net[h] = state

    def cleared(self) -> None:
        self._net.clear()
        self._is_snapshot_due = True

    def request_snapshot(self) -> None:
        self._is_snapshot_due = True

    # ---- the loop ------------------------------------------------------------------------

    def flush(
        self,
        queued_tokens: Callable[[], int],
        snapshot: Callable[..., HashArray],
        *,
        force: bool = False,
    ) -> msg.KVEvents | None:
        """Send what is due now (``force``: any change now, whatever the interval);
        returns the message sent (None: nothing was due). ``snapshot()`` is every page on
        the device, ``snapshot(host=True)`` every page on the host tier alone."""
        now = self.clock()
        if self._is_snapshot_due:
            self._is_snapshot_due = False
            self._net.clear()  # the snapshot reads the cache as it is: these are in it
            self.seq += 1
            self.num_snapshots += 1
            device, host = snapshot(), snapshot(host=True)
            return self._send(
                now, page_hash.pack(device), b"", True, queued_tokens(), page_hash.pack(host)
            )
        if self._net and (force or now - self._last_batch >= self.interval_s):
            by_state: tuple[list[int], list[int], list[int]] = ([], [], [])
            for h, state in self._net.items():
                by_state[state].append(h)
            gone, on_device, on_host = map(page_hash.pack, by_state)
            self._net.clear()
            self.seq += 1
            self.num_batches += 1
            self._last_batch = now
            return self._send(now, on_device, gone, False, queued_tokens(), on_host)
        if now - self._last_sent >= self.keepalive_s:
            return self._send(now, b"", b"", False, queued_tokens())
        return None

    def _send(
        self,
        now: float,
        stored: bytes,
        removed: bytes,
        is_snapshot: bool,
        queued_tokens: int,
        stored_host: bytes = b"",
    ) -> msg.KVEvents:
        count_refused(self._sock, "kv_events")  # here, not on every loop step
        event = msg.KVEvents(
            node_id=self.node_id,
            instance_id=self.instance_id,
            seq=self.seq,
            stored=stored,
            removed=removed,
            is_snapshot=is_snapshot,
            queued_tokens=queued_tokens,
            num_pages=self.num_pages,
            stored_host=stored_host,
            host_load_cost=self.host_load_cost,
        )
        try:
            self._sock.send(msg.encode(event), zmq.NOBLOCK)
        except zmq.Again:  # PUB never blocks; kept for a socket option change
            logger.debug("kv events batch %d dropped", self.seq)
        self._last_sent = now
        return event

    def close(self) -> None:
        close_pull(self._sock)
