"""The gateway's KV event subscriber: one thread, one SUB socket to all prefill nodes, the KV index.

    prefill ──KVEvents (PUB, CURVE)──▶ SUB thread ──apply──▶ KVIndex ◀──overlaps── router (loop)
       ▲                                   │
       └──KVSnapshotRequest (its request socket)── on a new node, a new instance or a gap

The loop thread tells the subscriber which prefill nodes are registered (``sync``, from
the service's timer, and ``drop`` when the registry loses one); the thread connects and
disconnects its socket to match, applies each batch to the index under a lock, and asks
a node for a snapshot when the index says it needs one (at most once per
``snapshot_retry_s``). A batch from a node id that is not registered, or from another
instance than the registered one, is dropped and counted: a restarted node's old
process, or a member of the cluster claiming another's id. Only cluster members reach
the socket at all (CURVE). The loop thread also says where each request went
(``note_dispatched``): its tokens count in the node's queue until the node's next report,
its prompt's pages as held there until the node's events store them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import zmq

from bootstrap import gateway_metrics as gm
from bootstrap.kv_index import KVIndex
from bootstrap.router import HostHits
from common import messages as msg
from common import metrics, page_hash
from common.ipc import PushPool, close_pull, connect_sub, poll_any, recv_messages

logger = logging.getLogger(__name__)

POLL_MS = 50
SNAPSHOT_RETRY_S = 1.0


@dataclass(frozen=True)
class PrefillSource:
    """A registered prefill node as the subscriber needs it."""

    node_id: str
    instance_id: str
    events_endpoint: str
    request_endpoint: str
    num_pages: int


class KVEventSubscriber:
    def __init__(
        self,
        gateway_id: str,
        *,
        ctx: zmq.Context | None = None,
        snapshot_retry_s: float = SNAPSHOT_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gateway_id = gateway_id
        self.index = KVIndex()
        self.snapshot_retry_s = snapshot_retry_s
        self.clock = clock
        self._ctx = ctx or zmq.Context.instance()
        self._lock = threading.Lock()  # guards index, _sources and _wanted
        self._sources: dict[str, PrefillSource] = {}  # what the loop says is registered
        self._connected: dict[str, str] = {}  # thread: node id -> endpoint its SUB dials
        self._asked_at: dict[str, float] = {}  # thread: node id -> last snapshot request
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)

    # ---- loop thread -----------------------------------------------------------------------

    def sync(self, sources: Iterable[PrefillSource]) -> None:
        """The prefill nodes registered now; nodes no longer among them leave the index."""
        wanted = {s.node_id: s for s in sources if s.events_endpoint}
        with self._lock:
            for node_id in [n for n in self._sources if n not in wanted]:
                self.index.drop_node(node_id)
            self._sources = wanted
            gm.KV_INDEX_PAGES.labels(**metrics.role_labels()).set(self.index.num_pages)

    def drop(self, node_id: str) -> None:
        """A node is lost: nothing it held may attract requests any more."""
        with self._lock:
            self._sources.pop(node_id, None)
            self.index.drop_node(node_id)

    def overlaps(self, hashes: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]:
        with self._lock:
            return self.index.overlaps(hashes, node_ids)

    def host_hits(self, hashes: Sequence[int], overlaps: Mapping[str, int]) -> HostHits | None:
        """Of the pages each node holds (``overlaps``), those on its host tier alone and
        what loading one costs there; None when no node holds any on a host tier."""
        with self._lock:
            pages = self.index.host_pages(hashes, overlaps)
            if not pages:
                return None
            return HostHits(pages, {n: self.index.host_load_cost(n) for n in pages})

    def queued_tokens(self) -> dict[str, int]:
        """Prefill tokens waiting on each node: its last report, plus what this gateway sent
        it since (the report does not have those yet); a node missing counts 0. One copy
        under the lock, kept up to date as reports and dispatches come (KVIndex.loads)."""
        with self._lock:
            return dict(self.index.loads)

    def note_dispatched(
        self, node_id: str, tokens: int, page_hashes: Sequence[int] = (), page_size: int = 0
    ) -> None:
        """Loop thread: a request expected to compute ``tokens`` went to ``node_id``; its
        prompt's ``page_hashes`` (of ``page_size`` tokens) count as held there until the
        node's events store them (KVIndex.expect: what keeps a busy prefix from being
        copied to node after node)."""
        with self._lock:
            self.index.sent(node_id, tokens)
            if page_hashes:
                self.index.expect(node_id, page_hashes, page_size)

    # ---- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        sock = connect_sub(self._ctx)
        push = PushPool(self._ctx)
        try:
            while not self._stop.is_set():
                self._reconnect(sock, push)
                if poll_any([sock], POLL_MS):
                    batch = recv_messages(sock, socket_name="kv_events", max_frames=1000)
                    self._apply(batch, push)
        finally:
            close_pull(sock)
            push.close()

    def _reconnect(self, sock: zmq.Socket, push: PushPool) -> None:
        with self._lock:
            sources = dict(self._sources)
        for node_id, endpoint in list(self._connected.items()):
            source = sources.get(node_id)
            if source is None or source.events_endpoint != endpoint:
                try:
                    sock.disconnect(endpoint)
                except zmq.ZMQError:
                    pass
                del self._connected[node_id]
                self._asked_at.pop(node_id, None)
        for node_id, source in sources.items():
            if node_id not in self._connected:
                sock.connect(source.events_endpoint)
                self._connected[node_id] = source.events_endpoint
                self._ask_snapshot(source, push)  # we just joined: what it holds is unknown

    def _apply(self, batch: list[msg.Message], push: PushPool) -> None:
        for m in batch:
            if not isinstance(m, msg.KVEvents):
                gm.KV_EVENTS.labels(**metrics.role_labels(outcome="dropped")).inc()
                continue
            with self._lock:
                source = self._sources.get(m.node_id)
                if source is None or source.instance_id != m.instance_id:
                    outcome, node = "dropped", None
                else:
                    try:
                        stored, removed = page_hash.unpack(m.stored), page_hash.unpack(m.removed)
                        stored_host = page_hash.unpack(m.stored_host)
                        is_valid = True
                    except ValueError:
                        is_valid = False
                    if not is_valid:
                        outcome, node = "dropped", None
                    else:
                        gaps = self.index.num_gaps
                        node = self.index.apply(
                            m.node_id,
                            m.instance_id,
                            m.seq,
                            stored=stored,
                            removed=removed,
                            is_snapshot=m.is_snapshot,
                            queued_tokens=max(0, m.queued_tokens),
                            max_pages=source.num_pages,
                            stored_host=stored_host,
                            host_load_cost=min(max(m.host_load_cost, 0.0), 1.0),
                        )
                        outcome = (
                            "snapshot"
                            if m.is_snapshot
                            else "gap"
                            if self.index.num_gaps > gaps
                            else "applied"
                        )
            gm.KV_EVENTS.labels(**metrics.role_labels(outcome=outcome)).inc()
            if node is not None and node.needs_snapshot and source is not None:
                self._ask_snapshot(source, push)

    def _ask_snapshot(self, source: PrefillSource, push: PushPool) -> None:
        now = self.clock()
        if now - self._asked_at.get(source.node_id, -float("inf")) < self.snapshot_retry_s:
            return
        self._asked_at[source.node_id] = now
        push.send(source.request_endpoint, msg.KVSnapshotRequest(gateway_id=self.gateway_id))
