"""The gateway receiving ReplyBatch frames: the dispatcher and a live gateway see the same
replies, in the same order, as when each came alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import openai
import zmq

from bootstrap.dispatcher import Dispatcher, ReqState
from common import messages as msg
from common.ipc import PushPool, bind_pull, close_pull, poll_any, recv_messages
from common.tokenizer import Tokenizer
from decode_node.outbox import Outbox
from tests.support import gateway as harness
from tests.support.gateway import REPLY_TEXT, Behaviour, Gateway, reply_ids, stream_tokens
from tests.support.generate_req import generate_req
from tests.support.ports import free_port

# The harness's fixtures, used here by name.
gateway_factory = harness.gateway_factory
tokenizer = harness.tokenizer


def _chunk(rid: str, token_id: int) -> msg.TokenChunk:
    return msg.TokenChunk(rid=rid, token_ids=[token_id], logprobs=None, top_logprobs=None)


REPLIES: list[msg.GatewayReply] = [
    msg.PromptLogprobs(rid="a", logprobs=[-1.0, -2.0], top_logprobs=[[], []]),
    _chunk("a", 11),
    _chunk("b", 21),
    _chunk("a", 12),
    msg.ReqFinished(
        rid="a",
        finish_reason="length",
        matched_stop=None,
        num_prompt_tokens=3,
        num_output_tokens=2,
        num_cached_tokens=0,
    ),
    _chunk("b", 22),
    msg.ReqFailed(rid="b", status=500, error="decode blew up"),
    _chunk("b", 23),  # late: b has ended, the dispatcher drops it
]


def _aborts(sock: zmq.Socket[Any]) -> list[msg.AbortReq]:
    got: list[msg.Message] = []
    while poll_any([sock], timeout_ms=200):
        got += recv_messages(sock, socket_name="fake_decode")
    return [m for m in got if isinstance(m, msg.AbortReq)]


def test_the_dispatcher_routes_a_batch_entry_by_entry() -> None:
    async def scenario() -> None:
        ctx: zmq.Context[Any] = zmq.Context.instance()
        dispatcher = Dispatcher("gw-1", f"tcp://127.0.0.1:{free_port()}")
        dispatcher.start()
        prefill, prefill_endpoint = bind_pull(ctx, f"tcp://127.0.0.1:{free_port()}")
        decode, decode_endpoint = bind_pull(ctx, f"tcp://127.0.0.1:{free_port()}")
        try:
            reqs = {
                rid: dispatcher.dispatch(
                    generate_req(rid=rid, room=room, reply_endpoint=dispatcher.reply_endpoint),
                    prefill_endpoint,
                    decode_endpoint,
                )
                for rid, room in (("a", 1), ("b", 2))
            }
            with Outbox(PushPool(ctx)) as outbox:
                for reply in REPLIES:
                    outbox.send(dispatcher.reply_endpoint, reply)
                outbox.flush()
                got = {
                    rid: [await asyncio.wait_for(req.queue.get(), 5.0) for _ in range(num)]
                    for (rid, req), num in zip(reqs.items(), (4, 3), strict=True)
                }
            assert got["a"] == [r for r in REPLIES if r.rid == "a"]
            assert got["b"] == [r for r in REPLIES if r.rid == "b"][:-1]
            assert reqs["a"].state is ReqState.FINISHED and reqs["b"].state is ReqState.FAILED
            assert dispatcher.num_requests == 0 and dispatcher.num_inflight("d") == 0
            # b's failure told its nodes to free it; a's finish told no one.
            assert [m.rid for m in _aborts(decode)] == ["b"]
            assert reqs["b"].queue.empty()
        finally:
            dispatcher.close()
            close_pull(prefill)
            close_pull(decode)

    asyncio.run(scenario())


def in_one_batch(behaviour: Behaviour) -> Behaviour:
    """``behaviour``'s replies to a request, sent together as one ReplyBatch."""

    def behave(gen: msg.GenerateReq, send: Callable[[msg.Message], None]) -> None:
        replies: list[msg.Message] = []
        behaviour(gen, replies.append)
        batch = [r for r in replies if isinstance(r, msg.GatewayReply)]
        assert len(batch) == len(replies)
        send(msg.ReplyBatch(messages=batch))

    return behave


def test_a_live_gateway_streams_a_batched_reply(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    gw = gateway_factory()
    gw.node("prefill")
    gw.node("decode", in_one_batch(stream_tokens(reply_ids(tokenizer), logprobs=True)))
    client = openai.OpenAI(base_url=gw.api_url + "/v1", api_key="x", max_retries=0, timeout=10)
    stream = client.completions.create(
        model="test-model", prompt="Hi", max_tokens=100, stream=True, logprobs=1, echo=False
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    out = client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "Hi!"}], max_tokens=100
    )
    assert out.choices[0].message.content == REPLY_TEXT
    assert out.usage is not None and out.usage.completion_tokens == len(reply_ids(tokenizer))
