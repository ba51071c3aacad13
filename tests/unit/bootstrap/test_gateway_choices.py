"""n > 1 and batched completions prompts at the gateway (fake nodes, the official client):
one request per choice, choices numbered in order, usage counting a prompt once."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import openai
import pytest

from common import messages as msg
from common.sampler import sample_seed
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from tests.support import gateway as harness
from tests.support.gateway import Gateway, reply_ids, stream_tokens

gateway_factory = harness.gateway_factory
tokenizer = harness.tokenizer


@pytest.fixture
def gw(gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer) -> Gateway:
    gw = gateway_factory()
    gw.node("prefill")
    gw.node("decode", stream_tokens(reply_ids(tokenizer), delay_s=0.002))
    return gw


def client(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.api_url + "/v1", api_key="x", max_retries=0, timeout=10)


def test_chat_n_samples_one_prompt_each_with_its_own_seed(gw: Gateway) -> None:
    out = client(gw).chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=5,
        n=3,
        seed=11,
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    gens = gw.nodes[1].wait_generates(3)
    assert len({g.rid for g in gens}) == 3 and len({g.input_ids[0] for g in gens}) == 1
    assert len({(g.prefill_node_id, g.decode_node_id) for g in gens}) == 1  # one pair
    seeds = sorted(SamplingParams.from_wire(g.sampling).seed for g in gens)
    assert seeds == sorted(sample_seed(11, i) for i in range(3)) and seeds.count(11) == 1
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(gens[0].input_ids)  # the prompt once
    assert out.usage.completion_tokens == 15
    # One sample group, so the nodes compute and move the prompt once.
    assert len({g.sample_group for g in gens}) == 1 and gens[0].sample_group
    assert all(g.num_group_samples == 3 for g in gens)


def test_the_precise_router_counts_a_groups_prompt_once_in_its_prefill_nodes_queue(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    """The later samples of a group compute nothing (the first computes the prompt for
    them): the gateway counts them as 1 token each in the node's queue, not the prompt."""
    gw = gateway_factory(prefill_router="precise")
    prefill = gw.node("prefill")
    gw.node("decode", stream_tokens(reply_ids(tokenizer), delay_s=0.002))
    sent: list[int] = []
    subscriber = gw.service.kv_events
    assert subscriber is not None
    note = subscriber.note_dispatched

    def spy(node_id: str, tokens: int, *rest: Any) -> None:
        sent.append(tokens)
        note(node_id, tokens, *rest)

    subscriber.note_dispatched = spy  # type: ignore[method-assign]
    client(gw).completions.create(model="test-model", prompt="Shared " * 20, max_tokens=2, n=4)
    gens = prefill.wait_generates(4)
    assert sorted(sent) == [1, 1, 1, len(gens[0].input_ids)]


def test_each_prompt_of_a_batch_has_its_own_sample_group_and_a_lone_sample_none(
    gw: Gateway,
) -> None:
    client(gw).completions.create(model="test-model", prompt=["One", "Two"], max_tokens=2, n=2)
    gens = gw.nodes[1].wait_generates(4)
    groups = Counter(g.sample_group for g in gens)
    assert len(groups) == 2 and all(v == 2 for v in groups.values()) and "" not in groups
    client(gw).completions.create(model="test-model", prompt="Alone", max_tokens=2)
    lone = gw.nodes[1].wait_generates(5)[-1]
    assert lone.sample_group == "" and lone.num_group_samples == 1


def test_a_batch_of_prompts_streams_every_choice_with_its_index(
    gw: Gateway, tokenizer: Tokenizer
) -> None:
    prompts = ["One", "Two words", "Three small words"]
    stream = client(gw).completions.create(
        model="test-model",
        prompt=prompts,
        max_tokens=4,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    finished: Counter[int] = Counter()
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finished[c.index] += 1
    expected = tokenizer.decode(reply_ids(tokenizer)[:4])
    assert texts == {i: expected for i in range(6)}
    assert finished == {i: 1 for i in range(6)}
    assert usage is not None
    assert usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert usage.completion_tokens == 24
    gens = gw.nodes[1].wait_generates(6)
    assert Counter(tokenizer.decode(g.input_ids) for g in gens) == {p: 2 for p in prompts}


def test_a_batch_of_token_id_prompts_answers_in_order(gw: Gateway, tokenizer: Tokenizer) -> None:
    out = client(gw).completions.create(
        model="test-model", prompt=[[1, 2, 3], [4, 5], [6]], max_tokens=2
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage is not None and out.usage.prompt_tokens == 6


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": ["x"] * 65}, "prompt"),
    ],
)
def test_too_many_choices_are_refused(gw: Gateway, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client(gw).completions.create(model="test-model", max_tokens=2, **body)
    assert err.value.body["param"] == param  # type: ignore[index]


def test_the_samples_of_one_prompt_go_to_one_pair_among_several(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    """Least-load routing would spread 4 concurrent requests over 2 decode nodes; the
    samples of one prompt are pinned to the pair of the first, which computes and moves
    the prompt once."""
    gw = gateway_factory()
    gw.node("prefill")
    decodes = [gw.node("decode", stream_tokens(reply_ids(tokenizer), delay_s=0.01)) for _ in "ab"]
    out = client(gw).completions.create(model="test-model", prompt="Shared", max_tokens=3, n=4)
    assert len(out.choices) == 4
    counts = sorted(len(d.generates()) for d in decodes)
    assert counts == [0, 4]


def test_echo_puts_the_prompt_before_the_output_streamed_and_not(
    gw: Gateway, tokenizer: Tokenizer
) -> None:
    expected = tokenizer.decode(reply_ids(tokenizer)[:3])
    out = client(gw).completions.create(
        model="test-model", prompt="Echo me:", max_tokens=3, echo=True
    )
    assert out.choices[0].text == "Echo me:" + expected
    stream = client(gw).completions.create(
        model="test-model", prompt=["A", "B"], max_tokens=3, echo=True, stream=True
    )
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: "A" + expected, 1: "B" + expected}
    ids = tokenizer.encode("Token ids")
    out = client(gw).completions.create(model="test-model", prompt=ids, max_tokens=3, echo=True)
    assert out.choices[0].text == "Token ids" + expected


def _prompt_logprobs_expected(tokenizer: Tokenizer, prompt: str) -> dict[str, Any]:
    """What tests/support/gateway.py's fake prompt logprobs make of ``prompt``'s tokens."""
    ids = tokenizer.encode(prompt)
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return {
        "tokens": tokens,
        "token_logprobs": [None] + [-(i + 1) / 10 for i in range(len(ids) - 1)],
        "top_logprobs": [None] + [{t: -(i + 1) / 10} for i, t in enumerate(tokens[1:])],
        "text_offset": [sum(map(len, tokens[:i])) for i in range(len(ids))],
    }


def test_echo_with_logprobs_gives_the_prompts_tokens_then_the_outputs(
    gw: Gateway, tokenizer: Tokenizer
) -> None:
    prompt = "Score this sentence."
    want = _prompt_logprobs_expected(tokenizer, prompt)
    out = client(gw).completions.create(
        model="test-model", prompt=prompt, max_tokens=2, echo=True, logprobs=1
    )
    lp = out.choices[0].logprobs
    assert lp is not None and out.choices[0].text == prompt + tokenizer.decode(
        reply_ids(tokenizer)[:2]
    )
    n = len(want["tokens"])
    assert lp.tokens[:n] == want["tokens"] and len(lp.tokens) == n + 2
    assert lp.token_logprobs[:n] == want["token_logprobs"] and lp.token_logprobs[n:] == [-0.5] * 2
    assert lp.top_logprobs[:n] == want["top_logprobs"]
    assert lp.text_offset[:n] == want["text_offset"]
    assert lp.text_offset[n] == len(prompt)  # the output's offsets go on after the prompt
    (generate,) = [g for g in gw.nodes[-1].generates() if g.input_ids == tokenizer.encode(prompt)]
    assert generate.return_prompt_logprobs
    # max_tokens 0 with echo: the prompt and its logprobs alone (scoring)
    zero = client(gw).completions.create(
        model="test-model", prompt=prompt, max_tokens=0, echo=True, logprobs=0
    )
    assert zero.choices[0].text == prompt and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs.token_logprobs == want["token_logprobs"]
    assert zero.choices[0].logprobs.top_logprobs == [None] + [{}] * (n - 1)
    with pytest.raises(openai.BadRequestError):  # without echo, 0 is still refused
        client(gw).completions.create(model="test-model", prompt=prompt, max_tokens=0)


def test_echo_with_logprobs_streams_the_prompt_first_for_every_choice(
    gw: Gateway, tokenizer: Tokenizer
) -> None:
    stream = client(gw).completions.create(
        model="test-model",
        prompt=["One", "Two words"],
        max_tokens=2,
        echo=True,
        logprobs=1,
        stream=True,
    )
    chunks: dict[int, list[Any]] = {}
    for chunk in stream:
        for c in chunk.choices:
            chunks.setdefault(c.index, []).append(c)
    for i, prompt in enumerate(["One", "Two words"]):
        first, *rest = chunks[i]
        assert first.text == prompt
        want = _prompt_logprobs_expected(tokenizer, prompt)
        assert first.logprobs.tokens == want["tokens"]
        assert first.logprobs.token_logprobs == want["token_logprobs"]
        outputs = [c for c in rest if c.logprobs is not None]
        assert [c.logprobs.text_offset[0] for c in outputs][:1] == [len(prompt)]
        assert "".join(c.text for c in chunks[i]) == prompt + tokenizer.decode(
            reply_ids(tokenizer)[:2]
        )


def _seed_scored(tokenizer: Tokenizer) -> harness.Behaviour:
    """A decode node whose output names its sample's seed, each token's logprob
    -(seed % 1000) / 1000: best_of's ranking is known from the seeds."""

    def behave(gen: Any, send: harness.Send) -> None:
        seed = int(gen.sampling["seed"])
        ids = tokenizer.encode(f" sample {seed % 1000}")[: int(gen.sampling["max_new_tokens"])]
        lp = -(seed % 1000) / 1000
        for tid in ids:
            logprobs = [lp] if gen.return_logprob else None
            send(msg.TokenChunk(rid=gen.rid, token_ids=[tid], logprobs=logprobs, top_logprobs=None))
        send(
            msg.ReqFinished(
                rid=gen.rid,
                finish_reason="length",
                matched_stop=None,
                num_prompt_tokens=len(gen.input_ids),
                num_output_tokens=len(ids),
                num_cached_tokens=0,
            )
        )

    return behave


def test_best_of_returns_the_n_samples_of_highest_logprob_per_token(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    gw = gateway_factory()
    gw.node("prefill")
    gw.node("decode", _seed_scored(tokenizer))
    seeds = [sample_seed(5, i) for i in range(6)]
    best = sorted(range(6), key=lambda i: (seeds[i] % 1000, i))[:2]
    out = client(gw).completions.create(
        model="test-model",
        prompt=["Pick", "Pick again"],
        max_tokens=8,
        seed=5,
        n=2,
        best_of=6,
        temperature=1.0,
    )
    want = [f" sample {seeds[i] % 1000}" for i in best]
    assert [c.text for c in out.choices] == want + want  # per prompt, best first
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.logprobs is None for c in out.choices)  # not asked: not shown
    lengths = [len(tokenizer.encode(f" sample {s % 1000}")) for s in seeds]
    assert out.usage.completion_tokens == 2 * sum(lengths)  # every sample was generated
    generates = gw.nodes[-1].generates()
    assert len(generates) == 12 and all(g.return_logprob for g in generates)
    shown = client(gw).completions.create(
        model="test-model", prompt="Pick", max_tokens=8, seed=5, best_of=6, logprobs=0
    )
    assert shown.choices[0].text == want[0]
    assert shown.choices[0].logprobs.token_logprobs[0] == -(seeds[best[0]] % 1000) / 1000
    for bad in ({"best_of": 1, "n": 2}, {"best_of": 17}, {"best_of": 3, "stream": True}):
        with pytest.raises(openai.BadRequestError) as err:
            client(gw).completions.create(model="test-model", prompt="x", max_tokens=2, **bad)
        assert err.value.body["param"] == "best_of"  # type: ignore[index]


def test_prompt_logprobs_too_large_for_one_message_are_a_400(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bootstrap import prepare

    monkeypatch.setattr(prepare, "MAX_PROMPT_LOGPROB_ENTRIES", 30)
    with pytest.raises(openai.BadRequestError) as err:  # 5 tokens x 6 entries each > 30
        client(gw).completions.create(
            model="test-model",
            prompt="one two three four five six",
            max_tokens=1,
            echo=True,
            logprobs=5,
        )
    assert err.value.body["param"] == "logprobs"  # type: ignore[index]
    fine = client(gw).completions.create(
        model="test-model", prompt="one two", max_tokens=1, echo=True, logprobs=5
    )
    assert fine.choices[0].logprobs.token_logprobs[0] is None


def test_samples_of_one_prompt_compute_its_logprobs_once_and_all_show_them(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    """n = 3 with echo + logprobs: only the first sample asks the nodes for the prompt's
    logprobs; every choice shows them. Streamed, the asking sample is answered last (its
    node is slow), yet each choice's first chunk is its echo with the prompt's logprobs."""
    ids = reply_ids(tokenizer)
    plain = stream_tokens(ids, logprobs=True)

    def slow_asker(gen: msg.GenerateReq, send: harness.Send) -> None:
        if gen.return_prompt_logprobs:
            threading.Timer(0.4, plain, (gen, send)).start()
        else:
            plain(gen, send)

    gw = gateway_factory()
    gw.node("prefill")
    gw.node("decode", slow_asker)
    prompt = "Three samples of one prompt"
    want = _prompt_logprobs_expected(tokenizer, prompt)
    n = len(want["tokens"])
    body = {
        "model": "test-model",
        "prompt": prompt,
        "max_tokens": 2,
        "echo": True,
        "logprobs": 1,
        "n": 3,
    }
    out = client(gw).completions.create(**body)
    asked = [g.return_prompt_logprobs for g in gw.nodes[-1].generates()]
    assert sorted(asked) == [False, False, True]
    for c in out.choices:
        assert c.text.startswith(prompt)
        assert c.logprobs.token_logprobs[:n] == want["token_logprobs"], c.index
        assert c.logprobs.top_logprobs[:n] == want["top_logprobs"], c.index
    firsts: dict[int, Any] = {}
    for chunk in client(gw).completions.create(**body, stream=True):
        for c in chunk.choices:
            firsts.setdefault(c.index, c)
    assert sorted(firsts) == [0, 1, 2]
    for c in firsts.values():
        assert c.text == prompt and c.logprobs.token_logprobs == want["token_logprobs"]
