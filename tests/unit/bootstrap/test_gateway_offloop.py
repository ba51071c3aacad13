"""Tokenization off the event loop: huge prompts neither stall other streams nor cost leases."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx

from common.tokenizer import Tokenizer
from tests.support import gateway as harness
from tests.support.gateway import Gateway, reply_ids, stream_tokens

gateway_factory = harness.gateway_factory
tokenizer = harness.tokenizer

CHAT = "/v1/chat/completions"
NUM_STREAMS = 8
TOKENS_PER_STREAM = 50
TOKEN_DELAY_S = 0.05  # each stream lasts ~2.5 s, across the big requests below


def _stream_gaps(url: str, gaps: list[float], errors: list[str]) -> None:
    """One streamed chat; appends the longest wait between two of its chunks."""
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": TOKENS_PER_STREAM,
        "stream": True,
    }
    try:
        with httpx.Client(timeout=60) as c, c.stream("POST", url + CHAT, json=body) as r:
            assert r.status_code == 200, r.read()
            last, longest = time.monotonic(), 0.0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    longest, last = max(longest, now - last), now
            gaps.append(longest)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(repr(exc))


def test_huge_prompts_do_not_stall_streams_or_heartbeats(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    gw = gateway_factory(lease_s=1.5)  # a loop stalled for over a lease loses both nodes
    lost: list[str] = []
    gw.service.registry.add_lost_listener(lambda node_id, reason: lost.append(node_id))
    gw.node("prefill")
    for _ in range(NUM_STREAMS):  # a fake node answers one request at a time: one stream each
        gw.node("decode", stream_tokens(reply_ids(tokenizer) * 20, delay_s=TOKEN_DELAY_S))
    gaps: list[float] = []
    errors: list[str] = []
    streams = [
        threading.Thread(target=_stream_gaps, args=(gw.api_url, gaps, errors))
        for _ in range(NUM_STREAMS)
    ]
    for t in streams:
        t.start()
    time.sleep(0.5)  # the streams are under way, one per decode node (least loaded first)
    # Just under what the gateway refuses untokenized: tokenized in full, then too long for
    # the context. Then 3.5 MB, refused by its length alone (on the loop it took 2-3 s to
    # tokenize), and 5 MB, over the body limit.
    bound = 2 * tokenizer.max_token_chars * gw.service.context_length
    word = "hello world, this is the tide. "
    statuses = []
    with httpx.Client(timeout=120) as c:
        for chars in (int(0.9 * bound), 3_500_000, 5 << 20):
            content = word * (chars // len(word))
            r = c.post(gw.api_url + CHAT, json={"messages": [{"role": "user", "content": content}]})
            statuses.append((r.status_code, r.json()["error"]["code"]))
    for t in streams:
        t.join(60)
    assert errors == []
    assert [s for s, _ in statuses] == [400, 400, 413], statuses
    assert statuses[0][1] == statuses[1][1] == "context_length_exceeded", statuses
    assert len(gaps) == NUM_STREAMS and max(gaps) < 1.0, gaps
    assert lost == []


def test_the_length_bound_never_refuses_a_prompt_that_fits(tokenizer: Tokenizer) -> None:
    """Characters over twice the longest token never exceed the token count, for texts
    of long words, spaces, digits, multi-byte characters and special tokens."""
    texts = [
        "a" * 5000,
        " " * 5000,
        "1234567890" * 500,
        "é" * 3000,
        "🙂" * 2000,
        "<|im_start|>" * 300,
        "Tide pools form where the sea leaves water behind. " * 100,
    ]
    for text in texts:
        bound = len(text) // (2 * tokenizer.max_token_chars)
        assert bound <= len(tokenizer.encode(text)), text[:20]


def _content_events(url: str) -> tuple[str, int]:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "stream": True}
    text, events = "", 0
    with httpx.Client(timeout=30) as c, c.stream("POST", url + CHAT, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                piece = choices[0]["delta"].get("content") if choices else None
                if piece:
                    text, events = text + piece, events + 1
    return text, events


def test_tokens_stream_as_they_come_and_queued_ones_share_an_event(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    ids = reply_ids(tokenizer)[:12]
    spaced = gateway_factory()
    spaced.node("prefill")
    spaced.node("decode", stream_tokens(ids, delay_s=0.03))
    text, events = _content_events(spaced.api_url)
    assert text == tokenizer.decode(ids) and events >= len(ids) - 2  # one event per token
    burst = gateway_factory()
    burst.node("prefill")
    burst.node("decode", stream_tokens(ids))  # all at once: they wait in the queue together
    text, events = _content_events(burst.api_url)
    assert text == tokenizer.decode(ids) and 1 <= events < len(ids)
