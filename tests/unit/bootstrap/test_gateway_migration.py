"""Mid-stream migration at the gateway, against fake nodes: when a request's pair fails on
the nodes' side, the gateway resends prompt + output so far to another pair and the
client's stream goes on; a failure that is the request's own still reaches the client."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from bootstrap import gateway_metrics as gm
from common import messages as msg
from common import metrics
from common.node.registry_client import wait_until
from common.tokenizer import Tokenizer
from tests.support import gateway as harness
from tests.support.gateway import Gateway, Send, reply_ids, silent

gateway_factory = harness.gateway_factory
tokenizer = harness.tokenizer

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def continuing(ids: list[int], *, fail_at: int | None = None, retryable: bool = True) -> Any:
    """A decode node that writes ``ids`` from the request's output_ids on (as a real node
    would go on after a migration), failing after position ``fail_at`` if given."""

    def behave(gen: msg.GenerateReq, send: Send) -> None:
        start = len(gen.output_ids)
        assert gen.output_ids == ids[:start], "a migrated request carries its output so far"
        limit = int(gen.sampling["max_new_tokens"])
        for pos in range(start, min(len(ids), limit)):
            if fail_at is not None and pos == fail_at:
                send(msg.ReqFailed(gen.rid, 500, "KV transfer failed: peer gone", retryable))
                return
            chunk = msg.TokenChunk(
                rid=gen.rid, token_ids=[ids[pos]], logprobs=None, top_logprobs=None
            )
            send(chunk)
        num = min(len(ids), limit)
        send(msg.ReqFinished(gen.rid, "length" if num == limit else "stop", None, 3, num, 0))

    return behave


def stream_chat(gw: Gateway, **body: Any) -> tuple[str, list[dict[str, Any]]]:
    """The streamed text and every parsed event."""
    events = []
    with httpx.stream(
        "POST",
        gw.api_url + CHAT,
        json={"messages": MESSAGES, "stream": True, **body},
        timeout=20,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")
    )
    return text, events


def migrations(reason: str) -> float:
    return gm.MIGRATIONS.labels(**metrics.role_labels(reason=reason))._value.get()


def by_load(gw: Gateway, role: str, fail: Any, ok: Any) -> None:
    """Two nodes of ``role``: the router's first choice (equal loads: the first id) fails,
    the other works; they are gw.nodes[-2] and gw.nodes[-1]."""
    gw.node(role, fail)
    gw.node(role, ok)


@pytest.mark.parametrize("stream", [True, False])
def test_a_failed_decode_node_hands_the_stream_to_another_pair(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer, stream: bool
) -> None:
    ids = reply_ids(tokenizer)
    gw = gateway_factory()
    gw.node("prefill")
    by_load(gw, "decode", continuing(ids, fail_at=4), continuing(ids))
    before = migrations("node_failure")
    body = {"max_tokens": len(ids), "stream_options": {"include_usage": True}}
    if stream:
        text, events = stream_chat(gw, **body)
        assert not any("error" in e for e in events), events
        usage = events[-1]["usage"]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    else:
        r = httpx.post(gw.api_url + CHAT, json={"messages": MESSAGES, **body}, timeout=20)
        assert r.status_code == 200, r.text
        text, usage = r.json()["choices"][0]["message"]["content"], r.json()["usage"]
    assert text == tokenizer.decode(ids)  # no token lost, none twice
    assert usage["completion_tokens"] == len(ids)
    assert migrations("node_failure") == before + 1
    failed, survivor = gw.nodes[1], gw.nodes[2]
    (first,) = failed.generates()
    (second,) = survivor.wait_generates(1)
    assert first.output_ids == [] and second.output_ids == ids[:4]
    assert second.input_ids == first.input_ids and second.room != first.room
    assert second.rid != first.rid  # late replies of the failed attempt are dropped
    assert failed.aborts(), "the failed pair is told to free the room"


def test_a_failure_that_is_the_requests_own_is_not_migrated(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    ids = reply_ids(tokenizer)
    gw = gateway_factory()
    gw.node("prefill")
    by_load(gw, "decode", continuing(ids, fail_at=2, retryable=False), continuing(ids))
    text, events = stream_chat(gw)
    assert "peer gone" in events[-1]["error"]["message"]
    assert text == tokenizer.decode(ids[:2])
    assert gw.nodes[2].generates() == []


def test_migrations_stop_at_the_limit(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    ids = reply_ids(tokenizer)
    gw = gateway_factory(migration_limit=2)
    gw.node("prefill")

    def fail_next(gen: msg.GenerateReq, send: Send) -> None:  # one more token, then fails
        pos = len(gen.output_ids)
        send(msg.TokenChunk(rid=gen.rid, token_ids=[ids[pos]], logprobs=None, top_logprobs=None))
        send(msg.ReqFailed(gen.rid, 503, f"failed at {pos + 1}", True))

    gw.node("decode", fail_next)
    text, events = stream_chat(gw)
    error = events[-1]["error"]["message"]
    assert "after 2 migration(s)" in error and "failed at 3" in error
    assert text == tokenizer.decode(ids[:3])  # each attempt added one token, in order
    assert [len(g.output_ids) for g in gw.nodes[1].generates()] == [0, 1, 2]


def test_a_lost_decode_node_migrates_its_streams(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    ids = reply_ids(tokenizer)
    gw = gateway_factory(lease_s=0.6)
    gw.node("prefill")

    def two_then_hang(gen: msg.GenerateReq, send: Send) -> None:
        for tid in ids[:2]:
            send(msg.TokenChunk(rid=gen.rid, token_ids=[tid], logprobs=None, top_logprobs=None))
        gw.nodes[1].registry.stop(deregister=False)  # then the node goes silent

    by_load(gw, "decode", two_then_hang, continuing(ids))
    before = migrations("decode_lost")
    t0 = time.monotonic()
    text, events = stream_chat(gw, max_tokens=len(ids))
    assert time.monotonic() - t0 < 5
    assert not any("error" in e for e in events), events
    assert text == tokenizer.decode(ids)
    assert migrations("decode_lost") == before + 1
    assert gw.nodes[2].wait_generates(1)[0].output_ids == ids[:2]


def test_with_no_pair_left_the_client_gets_an_error_within_the_migration_timeout(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    ids = reply_ids(tokenizer)
    gw = gateway_factory(lease_s=0.6, migration_timeout_s=1.5)
    gw.node("prefill")

    def one_then_hang(gen: msg.GenerateReq, send: Send) -> None:
        send(msg.TokenChunk(rid=gen.rid, token_ids=[ids[0]], logprobs=None, top_logprobs=None))
        gw.nodes[1].registry.stop(deregister=False)

    gw.node("decode", one_then_hang)
    t0 = time.monotonic()
    text, events = stream_chat(gw)
    took = time.monotonic() - t0
    assert 1.5 <= took < 6, took  # the lease (0.6 s), then --migration-timeout
    error = events[-1]["error"]
    assert error["code"] == "migration_failed" and "no decode node" in error["message"]
    assert text == tokenizer.decode(ids[:1])


def test_a_client_that_leaves_while_its_request_migrates_is_never_dispatched_again(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    """The abort storm's migrating stage: the request waits for a pair (none is live), its
    client goes away, then a decode node registers. Nothing is sent to that node and the
    gateway holds the request no more."""
    ids = reply_ids(tokenizer)
    gw = gateway_factory(migration_timeout_s=10.0)
    gw.node("prefill")

    def two_then_leave_and_fail(gen: msg.GenerateReq, send: Send) -> None:
        for tid in ids[:2]:
            send(msg.TokenChunk(rid=gen.rid, token_ids=[tid], logprobs=None, top_logprobs=None))
        gw.nodes[1].registry.stop(deregister=True)  # no decode node is left to move to
        send(msg.ReqFailed(gen.rid, 503, "node draining", True))

    gw.node("decode", two_then_leave_and_fail)
    with httpx.stream(
        "POST", gw.api_url + CHAT, json={"messages": MESSAGES, "stream": True}, timeout=20
    ) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 3:  # the role chunk and 2 tokens: the node has failed by now
                break
    assert wait_until(lambda: gw.call(lambda: gw.service.num_active) == 0, 5.0)
    late = gw.node("decode", continuing(ids))
    time.sleep(1.0)  # MIGRATION_RETRY_S is 0.25: a retry would have dispatched by now
    assert late.generates() == []


def test_a_pair_that_fails_after_the_last_token_is_not_asked_to_go_on(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    """The decode node sent the eos token, then failed before ReqFinished: the request is
    complete, so it finishes at the gateway instead of continuing past its end."""
    ids = reply_ids(tokenizer)[:3] + [min(tokenizer.eos_token_ids)]
    gw = gateway_factory()
    gw.node("prefill")

    def eos_then_fail(gen: msg.GenerateReq, send: Send) -> None:
        for tid in ids:
            send(msg.TokenChunk(rid=gen.rid, token_ids=[tid], logprobs=None, top_logprobs=None))
        send(msg.ReqFailed(gen.rid, 503, "node draining", True))

    by_load(gw, "decode", eos_then_fail, silent)
    text, events = stream_chat(gw)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert text == tokenizer.decode(ids[:3])
    assert gw.nodes[2].generates() == []


def test_a_node_that_closes_its_connection_moves_its_streams_at_once(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    """A decode process that dies closes its sockets: the gateway moves its streams then,
    not when its lease (10 s here) runs out, and routes nothing more to it."""
    import threading

    ids = reply_ids(tokenizer)
    gw = gateway_factory(lease_s=10.0)
    gw.node("prefill")
    sent_two = threading.Event()

    def two_then_die(gen: msg.GenerateReq, send: Send) -> None:
        for tid in ids[:2]:
            send(msg.TokenChunk(rid=gen.rid, token_ids=[tid], logprobs=None, top_logprobs=None))
        sent_two.set()

    by_load(gw, "decode", two_then_die, continuing(ids))
    before = gm.NODE_DISCONNECTS.labels(**metrics.role_labels())._value.get()
    result: dict[str, Any] = {}

    def client() -> None:
        result["out"] = stream_chat(gw, max_tokens=len(ids))

    thread = threading.Thread(target=client)
    thread.start()
    assert sent_two.wait(10)
    t0 = time.monotonic()
    gw.nodes[1].stop()  # its request socket closes, as a killed process's would
    thread.join(10)
    assert time.monotonic() - t0 < 3  # well inside the 10 s lease
    text, events = result["out"]
    assert not any("error" in e for e in events), events
    assert text == tokenizer.decode(ids)
    assert gm.NODE_DISCONNECTS.labels(**metrics.role_labels())._value.get() == before + 1
    dead = next(v for v in gw.service.registry.views("decode") if v.node_id == "decode-1")
    assert not dead.is_reachable and not dead.is_healthy  # still leased, never routed to
    for _ in range(3):  # new requests go to the live node only
        assert stream_chat(gw, max_tokens=3)[0] == tokenizer.decode(ids[:3])
    assert len(gw.nodes[1].generates()) == 1


def _scoring(ids: list[int], fail_at: int | None, asked: list[bool]) -> Any:
    """A decode node for echo + logprobs: the prompt's logprobs when asked (recorded in
    ``asked``), then ``ids`` from output_ids on with logprob -0.5, failing at ``fail_at``."""

    def behave(gen: msg.GenerateReq, send: Send) -> None:
        asked.append(gen.return_prompt_logprobs)
        if fail_at == 0:  # before anything reached the gateway
            send(msg.ReqFailed(gen.rid, 500, "KV transfer failed: peer gone", True))
            return
        if gen.return_prompt_logprobs:
            send(harness.fake_prompt_logprobs(gen))
        limit = int(gen.sampling["max_new_tokens"])
        for pos in range(len(gen.output_ids), min(len(ids), limit)):
            if fail_at is not None and pos == fail_at:
                send(msg.ReqFailed(gen.rid, 500, "KV transfer failed: peer gone", True))
                return
            send(msg.TokenChunk(gen.rid, [ids[pos]], [-0.5], [[[ids[pos], -0.5]]]))
        send(msg.ReqFinished(gen.rid, "length", None, 3, min(len(ids), limit), 0))

    return behave


@pytest.mark.parametrize("fail_at", [0, 3])
def test_a_migrated_echo_request_gets_the_prompts_logprobs_once(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer, fail_at: int
) -> None:
    """Failing before anything came, the next pair is asked for the prompt's logprobs
    again; failing after output was streamed, it is not (they came before it)."""
    ids = reply_ids(tokenizer)
    gw = gateway_factory()
    gw.node("prefill")
    first, second = [], []
    by_load(gw, "decode", _scoring(ids, fail_at, first), _scoring(ids, None, second))
    prompt = "Score me, then go on."
    r = httpx.post(
        gw.api_url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 6, "echo": True, "logprobs": 1},
        timeout=20,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == prompt + tokenizer.decode(ids[:6])
    n = len(tokenizer.encode(prompt))
    logprobs = choice["logprobs"]["token_logprobs"]
    assert logprobs == [None] + [-(i + 1) / 10 for i in range(n - 1)] + [-0.5] * 6
    assert first == [True] and second == [fail_at == 0]
