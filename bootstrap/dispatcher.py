"""The gateway's zmq side: GenerateReq to both nodes of a pair; replies go by rid to asyncio queues.

One state machine, the life of a request at the gateway (one ``InflightReq`` each):

    DISPATCHED ──first TokenChunk──▶ STREAMING ──ReqFinished──▶ FINISHED
        │                               │        (or a stop string matched at the gateway)
        ├───────────────────────────────┴──ReqFailed / node lost──▶ FAILED
        └───────────────────────────────┴──client gone / timeout / shutdown──▶ ABORTED

Terminal states are never left. Entering one removes the request from the table and its
node counts; FAILED and ABORTED (and a gateway-side finish) send ``AbortReq(rid, room)`` to
both nodes so each frees what it holds. Messages for a rid no longer in the table are late
and dropped. A thread owns the reply PULL socket and hands batches to the event loop; the
PUSH sockets belong to the loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

import zmq

from common import messages as msg
from common.ipc import PushPool, bind_pull, close_pull, poll_any, recv_messages

logger = logging.getLogger(__name__)

POLL_MS = 100
# How often the loop reads the PUSH sockets' disconnect monitors: a node process that dies
# closes its connections at once, and its requests move on within this (not its lease).
DISCONNECT_POLL_S = 0.05
MAX_FRAMES_PER_BATCH = 4096
NODE_LOST_STATUS = 503


class ReqState(Enum):
    DISPATCHED = "dispatched"
    STREAMING = "streaming"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"


_REPLIES = (msg.TokenChunk, msg.PromptLogprobs)  # a request's output, not its end
_TERMINAL = frozenset({ReqState.FINISHED, ReqState.FAILED, ReqState.ABORTED})
_NEXT: dict[ReqState, frozenset[ReqState]] = {
    ReqState.DISPATCHED: frozenset({ReqState.STREAMING, *_TERMINAL}),
    ReqState.STREAMING: _TERMINAL,
}


@dataclass(eq=False)
class InflightReq:
    """One dispatched request: its room, its pair and the queue its replies arrive on."""

    rid: str
    room: int
    prefill_id: str
    decode_id: str
    prefill_endpoint: str
    decode_endpoint: str
    queue: asyncio.Queue[msg.Message] = field(default_factory=asyncio.Queue)
    state: ReqState = ReqState.DISPATCHED
    # Set when the gateway itself failed the request because a node of its pair was lost:
    # "decode_lost" or "prefill_lost" (the migration metric's reason).
    lost: str | None = None

    @property
    def is_done(self) -> bool:
        return self.state in _TERMINAL


class NodeQueueFull(Exception):
    """A node's request socket would not take the message (its send queue is full)."""


class Dispatcher:
    """Sends requests to node pairs and routes their replies; owns the in-flight table."""

    def __init__(self, gateway_id: str, bind_endpoint: str, advertise_host: str | None = None):
        self.gateway_id = gateway_id
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock, bound = bind_pull(self._ctx, bind_endpoint)
        port = bound.rsplit(":", 1)[1]
        host = advertise_host or bound.split("//", 1)[1].rsplit(":", 1)[0]
        self.reply_endpoint = f"tcp://{host}:{port}"
        self._push = PushPool(self._ctx, watch_disconnects=True)
        # Told the request endpoint of a node that closed its connection (the service marks
        # the node unreachable); the dispatcher has already failed the requests it held.
        self.on_disconnect: Callable[[str], None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._reqs: dict[str, InflightReq] = {}
        self._num_pending_prefill: Counter[str] = Counter()
        self._num_inflight: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._recv_loop, name="gateway-replies", daemon=True)

    # ---- life ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start routing replies into the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread.start()
        self._watch = asyncio.create_task(self._watch_disconnects(), name="node-disconnects")

    def close(self) -> None:
        """Abort everything in flight, stop the reply thread, close the sockets."""
        if self._watch is not None:
            self._watch.cancel()
        for req in list(self._reqs.values()):
            req.queue.put_nowait(msg.ReqFailed(rid=req.rid, status=503, error="gateway stopping"))
            self.end(req, ReqState.ABORTED, "gateway stopping")
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        close_pull(self._sock)
        self._push.close()

    # ---- counts for the router and admission -----------------------------------------------

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    @property
    def pending_prefill(self) -> Mapping[str, int]:
        """Per prefill node, the requests routed to it that have not produced a token yet;
        read in place (the router reads it per node)."""
        return self._num_pending_prefill

    def num_inflight(self, node_id: str) -> int:
        """Requests routed to decode node ``node_id`` that have not ended."""
        return self._num_inflight[node_id]

    # ---- transitions -----------------------------------------------------------------------

    def dispatch(
        self, gen: msg.GenerateReq, prefill_endpoint: str, decode_endpoint: str
    ) -> InflightReq:
        """Send ``gen`` to both nodes at once; raises NodeQueueFull (nothing stays in flight)."""
        if gen.rid in self._reqs:
            raise ValueError(f"request id {gen.rid} is already in flight")
        req = InflightReq(
            gen.rid,
            gen.room,
            gen.prefill_node_id,
            gen.decode_node_id,
            prefill_endpoint,
            decode_endpoint,
        )
        self._reqs[req.rid] = req
        self._num_pending_prefill[req.prefill_id] += 1
        self._num_inflight[req.decode_id] += 1
        # Decode first: its preallocation is what releases the prefill's bootstrap queue.
        if not self._push.send(decode_endpoint, gen) or not self._push.send(prefill_endpoint, gen):
            self.end(req, ReqState.ABORTED, "node request queue full")
            raise NodeQueueFull(
                f"a node of pair ({req.prefill_id}, {req.decode_id}) is not taking requests"
            )
        return req

    def end(
        self, req: InflightReq, state: ReqState, reason: str, *, abort_nodes: bool = True
    ) -> bool:
        """Move ``req`` to terminal ``state``; False if it had already ended.

        ``abort_nodes`` (ignored for FINISHED by ReqFinished) tells both nodes to free the room.
        """
        if not self._transition(req, state):
            return False
        if state is not ReqState.FINISHED or abort_nodes:
            abort = msg.AbortReq(node_id=self.gateway_id, room=req.room, rid=req.rid, reason=reason)
            self._push.send(req.decode_endpoint, abort)
            self._push.send(req.prefill_endpoint, abort)
        return True

    def fail_node(self, node_id: str, reason: str) -> None:
        """A node is lost: the requests that needed it fail now (both nodes are told to abort).

        A request streaming from its decode node has its KV there (the first token comes
        only after the transfer completed): losing its prefill node does not touch it.
        """
        hit = [
            r
            for r in self._reqs.values()
            if r.decode_id == node_id
            or (r.prefill_id == node_id and r.state is ReqState.DISPATCHED)
        ]
        self._fail_lost(hit, lambda r: r.decode_id == node_id, reason)

    def fail_endpoint(self, endpoint: str, reason: str) -> None:
        """A node closed its request connection (its process died or restarted): as
        fail_node, for the requests sent to ``endpoint``."""
        hit = [
            r
            for r in self._reqs.values()
            if r.decode_endpoint == endpoint
            or (r.prefill_endpoint == endpoint and r.state is ReqState.DISPATCHED)
        ]
        self._fail_lost(hit, lambda r: r.decode_endpoint == endpoint, reason)

    def _fail_lost(
        self, hit: list[InflightReq], is_decode: Callable[[InflightReq], bool], reason: str
    ) -> None:
        for req in hit:
            req.lost = "decode_lost" if is_decode(req) else "prefill_lost"
            failed = msg.ReqFailed(
                rid=req.rid, status=NODE_LOST_STATUS, error=reason, retryable=True
            )
            req.queue.put_nowait(failed)
            self.end(req, ReqState.FAILED, reason)

    async def _watch_disconnects(self) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            for endpoint in self._push.disconnected():
                logger.warning("the node at %s closed its connection", endpoint)
                self.fail_endpoint(endpoint, f"the node at {endpoint} closed its connection")
                if self.on_disconnect is not None:
                    self.on_disconnect(endpoint)

    def _transition(self, req: InflightReq, state: ReqState) -> bool:
        if req.is_done:
            return False
        if state not in _NEXT[req.state]:
            raise RuntimeError(
                f"request {req.rid}: {req.state.value} -> {state.value} is not allowed"
            )
        if req.state is ReqState.DISPATCHED:
            self._num_pending_prefill[req.prefill_id] -= 1
        if state in _TERMINAL:
            self._num_inflight[req.decode_id] -= 1
            del self._reqs[req.rid]
            for counts, node_id in (
                (self._num_pending_prefill, req.prefill_id),
                (self._num_inflight, req.decode_id),
            ):
                if counts[node_id] <= 0:
                    del counts[node_id]
        req.state = state
        return True

    # ---- replies ---------------------------------------------------------------------------

    def _on_messages(self, batch: list[msg.Message]) -> None:
        """Loop thread: route each reply to its request's queue and advance its state."""
        for m in batch:
            rid = getattr(m, "rid", None)
            req = self._reqs.get(rid) if isinstance(rid, str) else None
            if req is None:
                if not isinstance(m, (*_REPLIES, msg.ReqFinished, msg.ReqFailed)):
                    logger.debug("unexpected %s on the reply socket", type(m).__name__)
                continue  # late reply of an ended request
            if isinstance(m, msg.TokenChunk):
                if req.state is ReqState.DISPATCHED:
                    self._transition(req, ReqState.STREAMING)
            elif isinstance(m, msg.PromptLogprobs):
                pass  # before the first token: the state moves with that
            elif isinstance(m, msg.ReqFinished):
                self.end(req, ReqState.FINISHED, "finished", abort_nodes=False)
            elif isinstance(m, msg.ReqFailed):
                self.end(req, ReqState.FAILED, f"failed elsewhere: {m.error}")
            else:
                continue
            req.queue.put_nowait(m)

    def _recv_loop(self) -> None:
        """Reply thread: the only user of the PULL socket."""
        while not self._stop.is_set():
            if not poll_any([self._sock], POLL_MS):
                continue
            batch = recv_messages(
                self._sock, socket_name="gateway_replies", max_frames=MAX_FRAMES_PER_BATCH
            )
            if batch and self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._on_messages, batch)
                except RuntimeError:  # the loop is closed: we are shutting down
                    return
