"""Penalties and min_tokens in the batched sampler, against a per-request reference written
from the definitions (common/penalties.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from common.penalties import PenaltyState, apply_penalties, has_penalties
from common.sampler import Sampler
from common.sampling_params import SamplingParams

VOCAB = 50
EOS = 7


def reference(logits: list[float], p: SamplingParams, prompt, output, eos=(EOS,)) -> list[float]:
    """One row, token by token, as the definitions read (vLLM's order)."""
    out = list(logits)
    seen = set(prompt) | set(output)
    if p.repetition_penalty != 1.0:
        for t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= output.count(t) * p.frequency_penalty + p.presence_penalty
    for t, bias in p.logit_bias:
        out[t] += bias
    if len(output) < p.min_tokens:
        ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        for t in ends:
            out[t] = -math.inf
    return out


def _case(rng: random.Random) -> tuple[SamplingParams, list[int], list[int]]:
    p = SamplingParams(
        max_new_tokens=20,
        frequency_penalty=rng.choice([0.0, 0.5, -1.25, 2.0]),
        presence_penalty=rng.choice([0.0, 1.0, -0.5]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        min_tokens=rng.choice([0, 0, 3, 20]),
        stop_token_ids=tuple(rng.sample(range(VOCAB), rng.choice([0, 2]))),
        ignore_eos=rng.random() < 0.3,
        logit_bias=tuple(
            (t, rng.choice([-100.0, -2.5, 0.75, 100.0]))
            for t in rng.sample(range(VOCAB), rng.choice([0, 0, 1, 4]))
        ),
    )
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))]
    return p, prompt, output


@pytest.mark.parametrize("seed", range(20))
def test_a_batch_of_rows_matches_the_per_request_definitions(seed: int) -> None:
    rng = random.Random(seed)
    cases = [_case(rng) for _ in range(6)]
    logits = torch.randn(len(cases), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    states = []
    for p, prompt, output in cases:
        state = PenaltyState.for_request(p, VOCAB, "cpu", prompt, output[:2], (EOS,))
        for t in output[2:]:  # committed one by one, as the nodes do
            if state is not None:
                state.accept(t)
        assert (state is None) == (not has_penalties(p))
        states.append(state)
    got = apply_penalties(logits, states)
    for row, (p, prompt, output) in enumerate(cases):
        want = reference(logits[row].tolist(), p, prompt, output)
        assert got[row].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6), row
        alone = apply_penalties(logits[row : row + 1], [states[row]])  # batch-independent
        assert torch.equal(alone[0], got[row])


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached() -> None:
    p = SamplingParams(max_new_tokens=8, min_tokens=2, stop_token_ids=(3,), temperature=0.0)
    state = PenaltyState(p, VOCAB, "cpu", [1, 2], (), (EOS,))
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 3] = 9.0
    logits[0, 11] = 1.0
    sampler = Sampler()
    picks = []
    for _ in range(3):
        token = sampler.sample(logits, [p], [None], None, [state]).token_ids[0]
        state.accept(token)
        picks.append(token)
    assert picks == [11, 11, EOS]  # EOS (and 3) only once two tokens are out


def test_greedy_with_a_frequency_penalty_moves_off_a_repeated_token() -> None:
    p = SamplingParams(max_new_tokens=8, temperature=0.0, frequency_penalty=1.0)
    state = PenaltyState(p, VOCAB, "cpu", [], ())
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 2.5
    logits[0, 6] = 1.0
    sampler = Sampler()
    picks = []
    for _ in range(4):
        token = sampler.sample(logits, [p], [None], None, [state]).token_ids[0]
        state.accept(token)
        picks.append(token)
    # 5 scores 2.5, 1.5, 0.5 after 0, 1, 2 picks; 6 scores 1.0 until picked.
    assert picks == [5, 5, 6, 5]


def test_logit_bias_bans_and_forces_tokens_under_greedy_and_sampling() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 30.0
    banned = SamplingParams(max_new_tokens=4, temperature=0.0, logit_bias=((5, -100.0),))
    forced = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3, logit_bias=((9, 100.0),))
    states = [PenaltyState.for_request(p, VOCAB, "cpu", [1]) for p in (banned, forced)]
    out = Sampler().sample(logits, [banned, forced], [None, None], None, states)
    assert out.token_ids[0] != 5 and out.token_ids[1] == 9
    assert has_penalties(forced) and not has_penalties(SamplingParams())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("min_tokens", -1),
        ("min_tokens", 9),
    ],
)
def test_out_of_range_values_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_new_tokens=8, **{field: value}).validate()


@pytest.mark.parametrize(
    "bias",
    [((5, 100.5),), ((5, math.nan),), ((-1, 1.0),), ((VOCAB, 1.0),), ((3, 1.0), (3, 2.0))],
)
def test_out_of_range_logit_biases_are_refused(bias: tuple[tuple[int, float], ...]) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias).validate(VOCAB)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_wire({"logit_bias": [[1, 2.0, 3]]})


def test_the_wire_form_carries_them() -> None:
    p = SamplingParams(
        max_new_tokens=9,
        frequency_penalty=0.5,
        presence_penalty=-1.0,
        repetition_penalty=1.2,
        min_tokens=3,
        logit_bias=((4, -100.0), (11, 2.5)),
    )
    assert SamplingParams.from_wire(p.to_wire()) == p
