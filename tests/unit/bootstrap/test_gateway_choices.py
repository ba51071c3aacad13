"""n > 1 and batched completions prompts at the gateway (fake nodes, the official client):
one request per choice, choices numbered in order, usage counting a prompt once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import openai
import pytest

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
    with pytest.raises(openai.BadRequestError) as err:
        client(gw).completions.create(
            model="test-model", prompt="x", max_tokens=2, echo=True, logprobs=1
        )
    assert err.value.body["param"] == "echo"  # type: ignore[index]
