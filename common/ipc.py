"""zmq helpers used by every node: PULL binding, a pool of PUSH sockets, draining and polling.

Every socket made here carries the process's socket security (``common.socket_auth``):
with a cluster token, PULL sockets are CURVE servers and PUSH sockets CURVE clients, so
no socket can be added without authentication. Sockets are not thread safe: each
helper's sockets belong to the thread that uses them.
"""

import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any, Self

import zmq
from prometheus_client import Counter

from common import metrics, socket_auth
from common.messages import MalformedMessage, Message, encode, unpack

logger = logging.getLogger(__name__)

MALFORMED_LOG_INTERVAL_S = 10.0
DEFAULT_SNDHWM = 10_000
# The largest frame a PULL socket takes: a GenerateReq of a 1M-token prompt is ~5 MB. A peer
# sending more is disconnected by libzmq before the frame is buffered whole.
MAX_FRAME_BYTES = 64 << 20

Socket = zmq.Socket[Any]
Context = zmq.Context[Any]

# Each bound socket's handshake-failure monitor (CURVE only), drained by recv_messages.
_monitors: "weakref.WeakKeyDictionary[Socket, Socket]" = weakref.WeakKeyDictionary()


def bind_pull(ctx: Context, endpoint: str, kind: int = zmq.PULL) -> tuple[Socket, str]:
    """Bind a PULL socket (or a PUB: ``kind``); ``tcp://host:0`` or ``tcp://host:*`` picks
    a free port. Returns the socket and the endpoint it actually bound (with the real port).
    """
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    monitor = socket_auth.current().secure_server(sock)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        close_pull(sock)
        raise
    if monitor is not None:
        _monitors[sock] = monitor
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect_sub(ctx: Context) -> Socket:
    """A SUB socket taking every message, a CURVE client like every PUSH; connect it to
    PUB endpoints (``bind_pull(..., zmq.PUB)``) with ``connect``."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    socket_auth.current().secure_client(sock)
    return sock


def count_refused(sock: Socket, socket_name: str) -> None:
    """Count the failed handshakes of a bound socket that never receives (a PUB)."""
    monitor = _monitors.get(sock)
    if monitor is not None:
        socket_auth.count_failed_handshakes(monitor, socket_name)


def close_pull(sock: Socket) -> None:
    """Close a socket from ``bind_pull`` and its handshake monitor."""
    monitor = _monitors.pop(sock, None)
    if monitor is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(linger=0)
    sock.close(linger=0)


class PushPool:
    """One cached PUSH socket per remote endpoint; ``close`` never blocks (LINGER 0)."""

    def __init__(
        self, ctx: Context, *, sndhwm: int = DEFAULT_SNDHWM, watch_disconnects: bool = False
    ) -> None:
        self._ctx = ctx
        self._sndhwm = sndhwm
        self._sockets: dict[str, Socket] = {}
        # watch_disconnects: a monitor per socket reports its peer closing the connection
        # (the peer process died or restarted: the kernel closes its sockets at once).
        self._watch = watch_disconnects
        self._monitors: dict[str, Socket] = {}

    @property
    def num_sockets(self) -> int:
        """How many endpoints currently have a connected socket."""
        return len(self._sockets)

    def socket(self, endpoint: str) -> Socket:
        """The PUSH socket connected to ``endpoint``, created on first use."""
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.setsockopt(zmq.LINGER, 0)
            socket_auth.current().secure_client(sock)
            if self._watch:
                self._monitors[endpoint] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
        return sock

    def disconnected(self) -> list[str]:
        """Endpoints whose peer closed the connection since the last call (never blocks;
        empty unless the pool watches disconnects). zmq reconnects by itself meanwhile."""
        gone = []
        for endpoint, monitor in self._monitors.items():
            is_gone = False
            while True:
                try:
                    monitor.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                is_gone = True  # the monitor reports nothing but disconnects
            if is_gone:
                gone.append(endpoint)
        return gone

    def send(self, endpoint: str, msg: Message) -> bool:
        """Queue ``msg`` for ``endpoint`` without blocking; False when its queue is full."""
        return self.send_encoded(endpoint, encode(msg))

    def send_encoded(self, endpoint: str, data: bytes) -> bool:
        """As ``send``, for a message already encoded (``encode``)."""
        try:
            self.socket(endpoint).send(data, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def discard(self, endpoint: str) -> None:
        """Close the socket of a peer that is gone; unsent messages to it are dropped."""
        sock = self._sockets.pop(endpoint, None)
        monitor = self._monitors.pop(endpoint, None)
        if sock is not None and monitor is not None:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(linger=0)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        """Close every socket at once, dropping anything still unsent."""
        for endpoint in list(self._sockets):
            self.discard(endpoint)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _DropLog:
    """Logs a dropped message at most once per interval per socket, with a count of the rest."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._last_logged: dict[str, float] = {}
        self._num_suppressed: dict[str, int] = {}

    def note(self, socket_name: str, reason: str) -> None:
        now = time.monotonic()
        last = self._last_logged.get(socket_name)
        if last is not None and now - last < self._interval_s:
            self._num_suppressed[socket_name] = self._num_suppressed.get(socket_name, 0) + 1
            return
        num_suppressed = self._num_suppressed.pop(socket_name, 0)
        self._last_logged[socket_name] = now
        logger.warning(
            "dropped malformed message on socket %s: %s (%d more dropped since last report)",
            socket_name,
            reason,
            num_suppressed,
        )


_drop_log = _DropLog(MALFORMED_LOG_INTERVAL_S)


def recv_messages(
    sock: Socket,
    counter: Counter | None = None,
    socket_name: str = "unnamed",
    *,
    max_frames: int | None = None,
) -> list[Message]:
    """Drain ``sock`` without blocking and return its valid messages in arrival order.

    A ReplyBatch comes out as its entries, in order, as if each had come alone.
    Malformed frames (and multi-frame messages), and malformed entries of a ReplyBatch one
    by one, are dropped, logged at most once per MALFORMED_LOG_INTERVAL_S per
    ``socket_name``, and counted in ``counter`` (labels ``role`` and ``socket``; default
    ``pdserve_malformed_messages_total``).
    ``max_frames`` bounds one drain (in frames) so a flood cannot starve the caller's loop.
    Peers refused at the CURVE handshake are counted here too (their frames never arrive).
    """
    monitor = _monitors.get(sock)
    if monitor is not None:
        socket_auth.count_failed_handshakes(monitor, socket_name)
    if counter is None:
        counter = metrics.MALFORMED_MESSAGES
    messages: list[Message] = []
    num_frames = 0
    while max_frames is None or num_frames < max_frames:
        # Checking EVENTS first is cheaper than a NOBLOCK recv that raises Again,
        # and the empty case is what a busy loop sees almost every time.
        if not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
            break
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        num_frames += 1
        try:
            if len(frames) != 1:
                raise MalformedMessage(f"expected 1 frame, got {len(frames)}")
            unpacked = unpack(frames[0])
        except MalformedMessage as exc:
            counter.labels(role=metrics.ROLE, socket=socket_name).inc()
            _drop_log.note(socket_name, str(exc))
            continue
        messages += unpacked.messages
        for reason in unpacked.dropped:
            counter.labels(role=metrics.ROLE, socket=socket_name).inc()
            _drop_log.note(socket_name, reason)
    return messages


def poll_any(sockets: Sequence[Socket], timeout_ms: int | None) -> list[Socket]:
    """Wait up to ``timeout_ms`` (None: forever) for input; the readable sockets, in given order."""
    poller = zmq.Poller()
    for sock in sockets:
        poller.register(sock, zmq.POLLIN)
    ready = dict(poller.poll(timeout_ms))
    return [sock for sock in sockets if ready.get(sock, 0) & zmq.POLLIN]
