"""Every zmq socket of a cluster authenticated and encrypted with CURVE keys derived from its token.

Why CURVE and not an HMAC per message: CurveZMQ authenticates the peer once per
connection and then encrypts each frame under short-term session keys with a
nonce, so replays, reordering and injection into a connection are refused by
libzmq itself, traffic (prompts, generated tokens) is private on the wire, and no
replay window or clock has to be kept here. What it costs per message, against
open sockets side by side, is what bench/socket_auth.py prints.

Every process that holds the token derives the same key pair (a secret from
HMAC-SHA256(token, label)): each PULL socket is a CURVE server with it, each PUSH
socket a CURVE client with it, and a ZAP handler on the context admits only that
public key. A peer without the token cannot finish the handshake, so nothing it
sends is ever delivered; each failed handshake is counted in
``pdserve_unauthenticated_connections_total{socket,reason}`` (reason
``no_curve``: a plaintext or otherwise mismatched peer; ``wrong_key``: a CURVE
peer with another key; ``protocol``: a handshake that failed otherwise).

Without a token (a node run by hand, standalone) sockets stay open, as before;
``pdserve launch`` always runs its cluster with a token.
"""

from __future__ import annotations

import hmac
import logging
import threading
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth.thread
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from common import metrics

KEY_LABEL = b"pdserve zmq curve v1"
ZAP_DOMAIN = "pdserve"
_FAILURE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

Socket = zmq.Socket[Any]
Context = zmq.Context[Any]


@dataclass(frozen=True)
class ClusterKeys:
    """The CURVE key pair every member of one cluster derives from its token (z85 text)."""

    public: bytes
    secret: bytes

    @staticmethod
    def from_token(token: str) -> ClusterKeys:
        secret = z85.encode(hmac.digest(token.encode(), KEY_LABEL, "sha256"))
        return ClusterKeys(zmq.curve_public(secret), secret)


class _AdmitClusterKey:
    """ZAP credentials check: only the cluster's own public key may connect."""

    def __init__(self, public: bytes) -> None:
        self._public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self._public)


class SocketSecurity:
    """Applies the cluster keys to sockets; one per process (see ``configure``)."""

    def __init__(self, keys: ClusterKeys | None) -> None:
        self.keys = keys
        self._lock = threading.Lock()
        self._authenticators: dict[int, zmq.auth.thread.ThreadAuthenticator] = {}

    @property
    def is_enabled(self) -> bool:
        return self.keys is not None

    def secure_server(self, sock: Socket) -> Socket | None:
        """Make a not yet bound socket a CURVE server; returns its failure monitor (or None)."""
        if self.keys is None:
            return None
        self._ensure_authenticator(sock.context)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        monitor: Socket = sock.get_monitor_socket(_FAILURE_EVENTS)
        return monitor

    def secure_client(self, sock: Socket) -> None:
        """Make a not yet connected socket a CURVE client of cluster servers."""
        if self.keys is None:
            return
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.keys.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)

    def _ensure_authenticator(self, ctx: Context) -> None:
        assert self.keys is not None
        with self._lock:
            if id(ctx) in self._authenticators:
                return
            auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=_quiet_logger())
            auth.start()
            auth.configure_curve_callback(ZAP_DOMAIN, _AdmitClusterKey(self.keys.public))
            self._authenticators[id(ctx)] = auth

    def stop(self) -> None:
        """Stop the ZAP handlers (before terminating their contexts)."""
        with self._lock:
            for auth in self._authenticators.values():
                auth.stop()
            self._authenticators.clear()


def count_failed_handshakes(monitor: Socket | None, socket_name: str) -> int:
    """Drain a server socket's monitor without blocking; count each failed handshake."""
    if monitor is None:
        return 0
    num_failed = 0
    while int(monitor.get(zmq.EVENTS)) & zmq.POLLIN:
        try:
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break
        reason = _failure_reason(int(event["event"]), int(event["value"]))
        metrics.UNAUTHENTICATED_CONNECTIONS.labels(
            role=metrics.ROLE, socket=socket_name, reason=reason
        ).inc()
        num_failed += 1
    return num_failed


def _failure_reason(event: int, value: int) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "wrong_key"
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "no_curve"
    return "protocol"


def _quiet_logger() -> logging.Logger:
    log = logging.getLogger("pdserve.zap")
    log.setLevel(logging.WARNING)  # pyzmq logs every handshake at DEBUG/INFO
    return log


_security = SocketSecurity(None)


def configure(token: str | None) -> SocketSecurity:
    """Set this process's socket security from the cluster token (None: open sockets).

    Call once at start-up, before any socket is made; ``common.ipc`` applies it to every
    socket it creates, so a socket added later cannot forget it.
    """
    global _security
    _security.stop()
    _security = SocketSecurity(ClusterKeys.from_token(token) if token else None)
    return _security


def current() -> SocketSecurity:
    """The process's socket security (open until ``configure`` is called with a token)."""
    return _security
