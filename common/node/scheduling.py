"""What both node roles' schedulers do alike.

They drain the request socket, move a request's state, end a request early.

A role's scheduler composes one ``RequestFailures`` over its table of live requests
(rid -> request) and gives it the one role-specific step, ``end``: take the request out
of the queue its state names, free what it holds, tell its transfer peer and (when
asked) the gateway. The four early endings are then the same on both roles:

    abort(rid, room)      AbortReq from the gateway (499)
    abort_orphans(now)    the request's gateway is gone (499)
    fail_all(status)      the drain timeout passed
    isolate(rid, exc)     an exception while handling one request (500): it fails,
                          nothing else does; if even that fails, it is forgotten
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Generic, Protocol, TypeVar

from common import messages as msg
from common.ipc import Socket, recv_messages
from common.node.gateway_watch import GatewayWatch

logger = logging.getLogger(__name__)

MAX_FRAMES_PER_STEP = 512  # request-socket frames one step drains at most

S = TypeVar("S", bound=Enum)


class IllegalTransition(RuntimeError):
    """A state change a request's lifecycle does not allow (a scheduler bug)."""


def check_transition(transitions: Mapping[S, frozenset[S]], rid: str, old: S, new: S) -> None:
    """Raise IllegalTransition unless `transitions` allows request `rid` to go `old` -> `new`."""
    if new not in transitions[old]:
        raise IllegalTransition(f"request {rid}: {old.name} -> {new.name}")


class HeldRequest(Protocol):
    """What the shared code reads of a role's request."""

    @property
    def rid(self) -> str: ...
    @property
    def room(self) -> int: ...
    @property
    def generate(self) -> msg.GenerateReq: ...


R = TypeVar("R", bound=HeldRequest)
R_contra = TypeVar("R_contra", bound=HeldRequest, contravariant=True)


class EndRequest(Protocol[R_contra]):
    """The role's own ending: out of its state's queue, pages freed, the peer told
    `peer_reason`, the gateway told ReqFailed(status, error, retryable) if `notify`."""

    def __call__(
        self,
        r: R_contra,
        status: int,
        error: str,
        /,
        *,
        notify: bool,
        peer_reason: str,
        retryable: bool = False,
    ) -> None: ...


class CountsOutcomes(Protocol):
    def finished(self, outcome: str) -> None: ...


class SendsMessages(Protocol):
    """Where the gateway's messages go: a PushPool, or one that batches (decode_node/outbox.py)."""

    def send(self, endpoint: str, message: msg.Message, /) -> bool: ...


class RequestFailures(Generic[R]):
    """Ends a role's requests that cannot go on (see the module docstring)."""

    def __init__(
        self,
        reqs: dict[str, R],
        end: EndRequest[R],
        push: SendsMessages,
        stats: CountsOutcomes,
        gateway_watch: GatewayWatch,
        *,
        notify_aborts: bool,
    ) -> None:
        self.reqs = reqs  # the scheduler's own table: the same dict, never a copy
        self.end = end
        self.push = push
        self.stats = stats
        self.gateway_watch = gateway_watch
        # Whether an abort (AbortReq, lost gateway) also sends the gateway a ReqFailed 499.
        self.notify_aborts = notify_aborts

    def abort(self, rid: str | None, room: int | None, reason: str) -> None:
        """Abort a request by rid or room wherever it is (nothing if none matches)."""
        r = self.reqs.get(rid or "") or next(
            (x for x in self.reqs.values() if room is not None and x.room == room), None
        )
        if r is not None:
            error = f"aborted: {reason}"
            self.end(r, 499, error, notify=self.notify_aborts, peer_reason=error)

    def abort_orphans(self, now: float) -> None:
        """Requests whose gateway is gone (killed, or restarted as another instance) end here."""
        for r in self.gateway_watch.orphans(
            self.reqs.values(), lambda x: x.generate.gateway_id, now
        ):
            self.end(
                r,
                499,
                "aborted: its gateway is gone",
                notify=self.notify_aborts,
                peer_reason="its gateway is gone",
            )

    def fail_all(self, status: int, error: str) -> None:
        """Fail every request the node holds (the drain timeout passed); the gateway hears,
        and may migrate them (the node is going, not the requests' fault)."""
        for r in list(self.reqs.values()):
            self.end(r, status, error, notify=True, peer_reason=error, retryable=True)

    def isolate(self, rid: str, reply_endpoint: str, doing: str, exc: Exception) -> None:
        """An exception while handling one request: that request fails (500), nothing else."""
        logger.exception("request %s: %s while %s; failing it", rid, type(exc).__name__, doing)
        error = f"internal error while {doing}: {type(exc).__name__}"
        r = self.reqs.get(rid)
        if r is not None:
            try:
                self.end(r, 500, error, notify=True, peer_reason=f"internal error while {doing}")
                return
            except Exception:  # its state is beyond repair: forget it
                logger.exception("request %s: could not fail it cleanly", rid)
                self.reqs.pop(rid, None)
        self.push.send(reply_endpoint, msg.ReqFailed(rid=rid, status=500, error=error))
        self.stats.finished("error")

    def drain(
        self,
        socket: Socket,
        socket_name: str,
        add: Callable[[msg.GenerateReq], None],
        other: Callable[[msg.Message], None] | None = None,
        *,
        now: float,
    ) -> None:
        """Receive what the request socket holds: each GenerateReq goes to `add` (an
        exception fails that request alone; its gateway counts as heard at `now`), each
        AbortReq to abort, the rest to `other`."""
        for m in recv_messages(socket, socket_name=socket_name, max_frames=MAX_FRAMES_PER_STEP):
            if isinstance(m, msg.GenerateReq):
                self.gateway_watch.heard(m.gateway_id, now)
                try:
                    add(m)
                except Exception as exc:  # noqa: BLE001 - one request never stops the node
                    self.isolate(m.rid, m.reply_endpoint, "accepting it", exc)
            elif isinstance(m, msg.AbortReq):
                self.abort(m.rid, m.room, m.reason)
            elif other is not None:
                other(m)
