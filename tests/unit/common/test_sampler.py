"""Tests for SamplingParams (validation, wire form) and the batched Sampler."""

from __future__ import annotations

import math
import re

import pytest
import torch

from common.sampler import Sampler, filtered_probs, make_generator
from common.sampling_params import SamplingParams

VOCAB = 64
GREEDY = SamplingParams(temperature=0.0)


def _logits(seed: int, batch: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=make_generator(seed)) * 3.0


def _logits_from_probs(probs: list[float], order: list[int]) -> torch.Tensor:
    """Row of logits whose softmax puts probs[i] on token order[i] (tiny mass elsewhere)."""
    logits = torch.full((1, VOCAB), -30.0)
    for token, p in zip(order, probs):
        logits[0, token] = math.log(p)
    return logits


# --- SamplingParams -------------------------------------------------------------------


def test_defaults_match_sglang() -> None:
    params = SamplingParams()
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k) == (
        128,
        1.0,
        1.0,
        -1,
    )
    assert (params.min_p, params.seed, params.stop, params.stop_token_ids) == (0.0, None, (), ())
    assert not params.is_greedy
    params.validate(vocab_size=VOCAB)


@pytest.mark.parametrize(
    ("params", "is_greedy"),
    [
        (SamplingParams(temperature=0.0), True),
        (SamplingParams(temperature=1e-6), True),
        (SamplingParams(temperature=0.7, top_k=1), True),
        (SamplingParams(temperature=0.7, top_k=2), False),
    ],
)
def test_is_greedy(params: SamplingParams, is_greedy: bool) -> None:
    assert params.is_greedy is is_greedy


def test_wire_round_trip() -> None:
    params = SamplingParams(
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=2**64 - 1,
        stop=("\n\n", "END"),
        stop_token_ids=(2, 5),
        ignore_eos=True,
        logprobs=True,
        top_logprobs=3,
    )
    wire = params.to_wire()
    assert wire["stop"] == ["\n\n", "END"] and wire["stop_token_ids"] == [2, 5]
    assert all(not isinstance(v, tuple) for v in wire.values())
    assert SamplingParams.from_wire(wire) == params


def test_from_wire_fills_defaults_and_accepts_int_floats() -> None:
    assert SamplingParams.from_wire({"temperature": 0}) == SamplingParams(temperature=0.0)


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        ({"max_new_tokens": "12"}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop": "END"}, "stop"),
        ({"stop": ["ok", 3]}, "stop[1]"),
        ({"stop_token_ids": [1, 2.5]}, "stop_token_ids[1]"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"seed": 1.5}, "seed"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_from_wire_rejects_malformed(wire: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"sampling params: {field} ")):
        SamplingParams.from_wire(wire)


def test_from_wire_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown field.*bogus"):
        SamplingParams.from_wire({"temperature": 1.0, "bogus": 1})


def test_from_wire_rejects_non_dict() -> None:
    with pytest.raises(ValueError, match="dict"):
        SamplingParams.from_wire([("temperature", 1.0)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_new_tokens=-1), "max_new_tokens"),
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(min_p=-0.1), "min_p"),
        (SamplingParams(min_p=1.1), "min_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(top_logprobs=21), "top_logprobs"),
        (SamplingParams(top_logprobs=-1), "top_logprobs"),
        (SamplingParams(seed=-1), "seed"),
        (SamplingParams(stop=("ok", "")), r"stop\[1\]"),
        (SamplingParams(stop_token_ids=(3, VOCAB)), r"stop_token_ids\[1\]"),
        (SamplingParams(stop_token_ids=(-1,)), r"stop_token_ids\[0\]"),
        # One request must not make every token's stop search costly.
        (SamplingParams(stop=("x",) * 65), r"stop must hold at most 64"),
        (SamplingParams(stop=("x" * 1025,)), r"stop\[0\] must be at most 1024"),
        (SamplingParams(stop_token_ids=(1,) * 1025), r"stop_token_ids must hold at most 1024"),
    ],
)
def test_validate_names_the_bad_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        params.validate(vocab_size=VOCAB)
    assert "\n" not in str(info.value)


def test_validate_accepts_edges() -> None:
    SamplingParams(max_new_tokens=0, top_k=0, top_p=1.0, min_p=1.0, top_logprobs=20).validate()
    SamplingParams(stop_token_ids=(VOCAB - 1,)).validate(vocab_size=VOCAB)
    SamplingParams(stop=("y" * 1024,) * 64, stop_token_ids=(1,) * 1024).validate(vocab_size=VOCAB)


# --- make_generator ---------------------------------------------------------------------


def test_make_generator_seeded_and_unseeded() -> None:
    a, b = make_generator(7), make_generator(7)
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    c, d = make_generator(None), make_generator(None)
    assert not torch.equal(torch.rand(8, generator=c), torch.rand(8, generator=d))


# --- Sampler ----------------------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
    logits = _logits(0, batch=5)
    out = Sampler().sample(logits, [GREEDY] * 5, [None] * 5)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_ties_take_lowest_id() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, [9, 4, 30]] = 5.0
    assert Sampler().sample(logits, [GREEDY], [None]).token_ids == [4]


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = _logits(1, batch=4)
    expected = logits.argmax(dim=-1).tolist()
    sampler = Sampler()
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6, temperature=2.0)):
        gens = [make_generator(i) for i in range(4)]
        for _ in range(20):
            assert sampler.sample(logits, [params] * 4, gens).token_ids == expected


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    logits = _logits(2, batch=3)
    params = [GREEDY, SamplingParams(seed=1), GREEDY]
    out = Sampler().sample(logits, params, [None, make_generator(1), None])
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[2] == logits[2].argmax().item()


def _seeded_run(seed: int, companions: list[SamplingParams], position: int) -> list[int]:
    """50 tokens for a seeded request at `position` in a batch with `companions` around it."""
    target = SamplingParams(seed=seed, temperature=0.9)
    params = list(companions)
    params.insert(position, target)
    gens: list[torch.Generator | None] = [
        None if p.seed is None else make_generator(p.seed) for p in params
    ]
    sampler = Sampler()
    tokens = []
    for step in range(50):
        logits = _logits(1000 + step, batch=len(params))
        logits[position] = _logits(step)[0]  # the target's logits depend on the step only
        tokens.append(sampler.sample(logits, params, gens).token_ids[position])
    return tokens


def test_seeded_sampling_is_reproducible_across_batches() -> None:
    alone = _seeded_run(42, [], 0)
    assert _seeded_run(42, [], 0) == alone
    companions = [
        SamplingParams(seed=5, top_k=3),
        GREEDY,
        SamplingParams(top_p=0.5, min_p=0.1),  # unseeded: draws from the global generator
        SamplingParams(seed=9, logprobs=True, top_logprobs=4),
    ]
    assert _seeded_run(42, companions, 2) == alone
    assert _seeded_run(42, companions[:1], 1) == alone
    assert len(set(alone)) > 5  # really sampled, not argmax


def test_different_seeds_differ() -> None:
    assert _seeded_run(42, [], 0) != _seeded_run(43, [], 0)


def test_min_p_draws_stay_in_allowed_set() -> None:
    # max prob 0.4, min_p 0.4 -> threshold 0.16 keeps the tokens with 0.4, 0.3, 0.2.
    logits = _logits_from_probs([0.4, 0.3, 0.2, 0.05, 0.05], [17, 3, 50, 8, 33])
    params = SamplingParams(min_p=0.4, seed=0)
    gen = make_generator(0)
    drawn = {Sampler().sample(logits, [params], [gen]).token_ids[0] for _ in range(200)}
    assert drawn == {17, 3, 50}


def test_top_k_draws_stay_in_top_k() -> None:
    logits = _logits(3)
    allowed = set(logits[0].topk(4).indices.tolist())
    params = SamplingParams(top_k=4, temperature=5.0)
    gen = make_generator(3)
    drawn = {Sampler().sample(logits, [params], [gen]).token_ids[0] for _ in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_filtered_probs_top_p_keeps_smallest_nucleus() -> None:
    logits = _logits_from_probs([0.5, 0.3, 0.15, 0.05], [10, 20, 30, 40])
    probs = filtered_probs(logits, [SamplingParams(top_p=0.75)])[0]
    assert set(probs.nonzero().flatten().tolist()) == {10, 20}
    assert probs[10].item() == pytest.approx(0.5 / 0.8, rel=1e-4)
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_filtered_probs_applies_temperature_then_filters_per_row() -> None:
    logits = _logits(4, batch=2)
    params = [SamplingParams(temperature=0.5), SamplingParams(top_k=2)]
    probs = filtered_probs(logits, params)
    torch.testing.assert_close(probs[0], (logits[0] / 0.5).softmax(-1))
    assert (probs[1] > 0).sum().item() == 2


def test_logprobs_are_raw_log_softmax_of_chosen() -> None:
    logits = _logits(5, batch=3).to(torch.bfloat16)
    params = [SamplingParams(logprobs=True, seed=1, temperature=2.0), GREEDY, SamplingParams()]
    out = Sampler().sample(logits, params, [make_generator(1), None, make_generator(2)])
    expected = logits.float().log_softmax(-1)
    assert out.logprobs is not None and len(out.logprobs) == 3
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(expected[row, token].item(), abs=1e-6)
    assert out.top_logprobs is None


def test_top_logprobs_sorted_and_correct() -> None:
    logits = _logits(6, batch=3)
    params = [SamplingParams(top_logprobs=5), GREEDY, SamplingParams(top_logprobs=2, top_k=1)]
    out = Sampler().sample(logits, params, [make_generator(0), None, None])
    assert out.top_logprobs is not None and out.logprobs is not None
    assert [len(t) for t in out.top_logprobs] == [5, 0, 2]
    expected = logits.log_softmax(-1)
    for row, pairs in enumerate(out.top_logprobs):
        values = [v for _, v in pairs]
        assert values == sorted(values, reverse=True)
        reference = expected[row].topk(len(pairs))
        assert [t for t, _ in pairs] == reference.indices.tolist()
        for (token, value), ref in zip(pairs, reference.values.tolist()):
            assert value == pytest.approx(ref, abs=1e-6)
            assert value == pytest.approx(expected[row, token].item(), abs=1e-6)
    assert out.top_logprobs[2][0][0] == out.token_ids[2]


def test_sample_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError, match="batch"):
        Sampler().sample(_logits(0, batch=2), [GREEDY], [None])
    with pytest.raises(ValueError, match="shape"):
        Sampler().sample(torch.zeros(VOCAB), [GREEDY], [None])


def test_a_top_k_past_the_vocabulary_keeps_every_token() -> None:
    """top_k 2**63 - 1 fits the wire but no int64 tensor arithmetic: it means "all tokens"."""
    from common.sampler import Sampler, make_generator

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    huge = SamplingParams(temperature=0.7, top_k=2**63 - 1, seed=5)
    off = SamplingParams(temperature=0.7, top_k=-1, seed=5)
    got = Sampler().sample(logits, [huge, huge], [make_generator(5), make_generator(5)])
    want = Sampler().sample(logits, [off, off], [make_generator(5), make_generator(5)])
    assert got.token_ids == want.token_ids


def test_sample_outputs_come_back_in_one_copy_exactly(device):
    """Token ids, their logprobs and the top-k lists go to the host through one copy (on
    CUDA a non-blocking one into pinned memory and an event): values exact, shapes kept."""
    from common.sampler import to_host

    ids = torch.tensor([0, 49151, 128255, 7], device=device)
    lp = torch.tensor([-0.1, -1e-8, -30.5, -2.25], device=device)
    top = torch.tensor([[1.5, 2.5], [3.5, 4.5], [-1.0, -2.0], [0.0, 9.0]], device=device)
    got_ids, got_lp, got_top = to_host([ids, lp, top])
    assert got_ids == ids.tolist() and got_lp == lp.tolist() and got_top == top.tolist()
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)).to(device)
    params = [SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)] * 3
    out = Sampler().sample(logits, params, [None] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert all(isinstance(t, int) for t in out.token_ids)
    assert out.top_logprobs is not None and [p[0][0] for p in out.top_logprobs] == out.token_ids
