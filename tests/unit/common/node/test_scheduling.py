"""Both roles' early endings: abort, orphans, fail_all, isolate, drain.

All in common/node/scheduling.py.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import pytest
import zmq

from common import messages as msg
from common.ipc import bind_pull
from common.messages import encode
from common.node.gateway_watch import HEARD_GRACE_S, GatewayWatch
from common.node.scheduling import IllegalTransition, RequestFailures, check_transition

REPLY = "tcp://127.0.0.1:1"


@dataclass
class Req:
    rid: str
    room: int
    generate: msg.GenerateReq


def _generate(rid: str, gateway_id: str = "gw-a") -> msg.GenerateReq:
    return msg.GenerateReq(
        rid=rid,
        room=0,
        input_ids=[1, 2],
        sampling={},
        priority=None,
        routing_key=None,
        prefill_node_id="p",
        decode_node_id="d",
        reply_endpoint=REPLY,
        arrival_time=0.0,
        return_logprob=False,
        gateway_id=gateway_id,
    )


@dataclass
class Ended:
    """The role's `end`, recorded: what it was asked, and it takes the request out."""

    reqs: dict[str, Req]
    calls: list[tuple[str, int, str, bool, str]] = field(default_factory=list)
    retryable: list[str] = field(default_factory=list)  # rids ended as the nodes' fault
    fail_on: set[str] = field(default_factory=set)

    def __call__(
        self,
        r: Req,
        status: int,
        error: str,
        /,
        *,
        notify: bool,
        peer_reason: str,
        retryable: bool = False,
    ) -> None:
        if r.rid in self.fail_on:
            raise RuntimeError("end broke")
        self.calls.append((r.rid, status, error, notify, peer_reason))
        if retryable:
            self.retryable.append(r.rid)
        del self.reqs[r.rid]


class Push:
    def __init__(self) -> None:
        self.sent: list[tuple[str, msg.Message]] = []

    def send(self, endpoint: str, m: msg.Message) -> bool:
        self.sent.append((endpoint, m))
        return True


class Stats:
    def __init__(self) -> None:
        self.outcomes: list[str] = []

    def finished(self, outcome: str) -> None:
        self.outcomes.append(outcome)


def _failures(*rids: str, notify_aborts: bool = False, watch: GatewayWatch | None = None):
    reqs = {rid: Req(rid, room, _generate(rid, f"gw-{rid}")) for room, rid in enumerate(rids)}
    end, push, stats = Ended(reqs), Push(), Stats()
    failures = RequestFailures(
        reqs,
        end,
        push,
        stats,
        watch or GatewayWatch(),  # type: ignore[arg-type]
        notify_aborts=notify_aborts,
    )
    return failures, reqs, end, push, stats


def test_abort_by_rid_or_by_room_and_nothing_when_none_matches():
    failures, reqs, end, _, _ = _failures("a", "b", "c")
    failures.abort("b", None, "client left")
    failures.abort(None, 2, "client left")  # c's room
    failures.abort("zzz", 99, "nobody")
    assert list(reqs) == ["a"]
    assert end.calls == [
        ("b", 499, "aborted: client left", False, "aborted: client left"),
        ("c", 499, "aborted: client left", False, "aborted: client left"),
    ]


def test_aborts_tell_the_gateway_where_the_role_asks():
    failures, _, end, _, _ = _failures("a", notify_aborts=True)
    failures.abort("a", None, "x")
    assert end.calls[0][3] is True


def test_orphans_are_the_requests_of_a_gateway_that_is_gone_and_checked_at_intervals():
    watch = GatewayWatch(interval_s=1.0)
    watch.is_alive = lambda gateway_id, now: gateway_id != "gw-b"
    failures, reqs, end, _, _ = _failures("a", "b", watch=watch)
    failures.abort_orphans(10.0)
    assert list(reqs) == ["a"]
    assert end.calls == [("b", 499, "aborted: its gateway is gone", False, "its gateway is gone")]
    watch.is_alive = lambda gateway_id, now: False
    failures.abort_orphans(10.5)  # within the interval: not checked
    assert list(reqs) == ["a"]
    failures.abort_orphans(11.0)
    assert reqs == {}


def test_a_request_from_a_gateway_keeps_it_alive_for_the_grace_whatever_the_registry_says():
    """A gateway resumed from a pause past the lease sends requests before the node's
    registry link hears it again; before, those fresh requests were aborted as orphans."""
    watch = GatewayWatch(interval_s=0.0)
    watch.is_alive = lambda gateway_id, now: False  # the registry link has not heard it yet
    failures, reqs, end, _, _ = _failures("a", "b", watch=watch)
    watch.heard("gw-a", 10.0)
    failures.abort_orphans(10.0 + HEARD_GRACE_S)
    assert list(reqs) == ["a"]  # b's gateway sent nothing lately
    failures.abort_orphans(10.0 + HEARD_GRACE_S + 0.01)
    assert reqs == {} and [c[0] for c in end.calls] == ["b", "a"]


def test_fail_all_ends_every_request_and_tells_each_gateway():
    failures, reqs, end, _, _ = _failures("a", "b")
    failures.fail_all(503, "draining")
    assert reqs == {}
    assert [(c[0], c[1], c[3]) for c in end.calls] == [("a", 503, True), ("b", 503, True)]
    assert end.retryable == ["a", "b"]  # a draining node's requests may move to another pair


def test_isolate_fails_that_request_alone():
    failures, reqs, end, push, stats = _failures("a", "b")
    failures.isolate("a", REPLY, "sampling", ValueError("bad"))
    assert list(reqs) == ["b"]
    assert end.calls == [
        (
            "a",
            500,
            "internal error while sampling: ValueError",
            True,
            "internal error while sampling",
        )
    ]
    assert push.sent == [] and stats.outcomes == []  # `end` told the gateway


def test_isolate_forgets_a_request_it_cannot_end_and_still_answers_the_gateway():
    failures, reqs, end, push, stats = _failures("a", "b")
    end.fail_on.add("a")
    failures.isolate("a", REPLY, "sampling", ValueError("bad"))
    assert list(reqs) == ["b"]
    assert push.sent == [
        (
            REPLY,
            msg.ReqFailed(rid="a", status=500, error="internal error while sampling: ValueError"),
        )
    ]
    assert stats.outcomes == ["error"]


def test_isolate_of_a_request_not_yet_held_answers_the_gateway():
    failures, reqs, _, push, stats = _failures("a")
    failures.isolate("new", REPLY, "accepting it", KeyError("x"))
    assert list(reqs) == ["a"] and [m.rid for _, m in push.sent] == ["new"]
    assert stats.outcomes == ["error"]


def test_drain_adds_requests_aborts_and_passes_the_rest_on():
    ctx = zmq.Context.instance()
    pull, endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(endpoint)
    try:
        failures, reqs, end, sent, _ = _failures("old")
        added: list[str] = []
        others: list[msg.Message] = []

        def add(m: msg.GenerateReq) -> None:
            if m.rid == "broken":
                raise ValueError("cannot take it")
            added.append(m.rid)

        frames = [
            _generate("new"),
            _generate("broken"),
            msg.AbortReq(node_id="g", room=None, rid="old", reason="r"),
            msg.Heartbeat(node_id="x", load={}, auth_token=None),
        ]
        for m in frames:
            push.send(encode(m))

        def handled() -> int:
            return len(added) + len(others) + len(end.calls) + len(sent.sent)

        deadline = time.monotonic() + 10
        while handled() < len(frames) and time.monotonic() < deadline:
            pull.poll(50)
            failures.drain(pull, "requests", add, others.append, now=5.0)
        assert added == ["new"]
        assert [c[0] for c in end.calls] == ["old"] and "old" not in reqs
        assert [m.rid for _, m in sent.sent] == ["broken"]  # failed alone, 500
        assert [type(m) for m in others] == [msg.Heartbeat]
        # Each request is word from its gateway: it is not an orphan for a while.
        failures.gateway_watch.is_alive = lambda gateway_id, now: False
        assert failures.gateway_watch.orphans(["gw-a"], lambda g: g, 5.0 + 1.0) == []
    finally:
        push.close()
        pull.close()


class State(enum.Enum):
    A = enum.auto()
    B = enum.auto()
    DONE = enum.auto()


def test_check_transition_allows_only_the_table():
    table = {
        State.A: frozenset({State.B}),
        State.B: frozenset({State.DONE}),
        State.DONE: frozenset(),
    }
    check_transition(table, "r", State.A, State.B)
    with pytest.raises(IllegalTransition, match="request r: A -> DONE"):
        check_transition(table, "r", State.A, State.DONE)
    with pytest.raises(IllegalTransition):
        check_transition(table, "r", State.DONE, State.A)
