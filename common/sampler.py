"""Batched next-token sampling (greedy, temperature, top-k, top-p, min-p, penalties, grammar
masks)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.grammar.backend import GrammarState
from common.grammar.mask import GrammarMasker
from common.penalties import PenaltyState, apply_penalties
from common.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int | None) -> int:
    """``seed``, or 64 bits from os.urandom when the request gave none."""
    return int.from_bytes(os.urandom(8), "little") if seed is None else seed


def position_seed(seed: int, position: int) -> int:
    """The seed of the draw for output token ``position`` of a request seeded ``seed``.

    Each output position draws from its own stream (SplitMix64 of seed and position), so
    a request's tokens depend on (seed, position) alone: no generator state has to travel
    with a request from prefill to decode, across a retraction or to another node pair
    when the gateway migrates it mid-stream.
    """
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # torch seeds are taken modulo 2**64; keep it positive


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded ``seed`` that asks for several (n):
    sample 0 keeps ``seed``, each other one its own SplitMix64 stream of it, so every sample
    is reproducible alone and none repeats another."""
    if index == 0:
        return seed
    return position_seed(seed ^ 0x6A09E667F3BCC909, index) & _MASK64


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded with `seed`, or with 64 bits from os.urandom when seed is None."""
    generator = torch.Generator(device=device)
    generator.manual_seed(draw_seed(seed))
    return generator


def seed_for_position(generator: torch.Generator, seed: int, position: int) -> torch.Generator:
    """``generator`` set to draw output token ``position`` of the request seeded ``seed``."""
    generator.manual_seed(position_seed(seed, position))
    return generator


@dataclass(frozen=True)
class SampleOutput:
    """One sampled token per request, plus logprobs when any request asked for them.

    logprobs[i] is the log-probability of token_ids[i] under log_softmax of the raw
    logits (before temperature or filters). top_logprobs[i] holds request i's
    `top_logprobs` best (token id, logprob) pairs, best first; empty when it asked none.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    """Turns a [B, V] batch of logits into one token per row.

    Filtering is vectorised over the batch; each random row draws with its own
    generator only, so a seeded request's tokens don't depend on its batch companions.
    Generators live on the logits' device; None draws from torch's default generator.
    A row whose request follows a grammar (`grammars[i]` set) is masked first, in place:
    the tokens its grammar forbids get -inf before greedy, sampling and logprobs.
    """

    def __init__(self) -> None:
        self._masker: GrammarMasker | None = None

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        grammars: Sequence[GrammarState | None] | None = None,
        penalties: Sequence[PenaltyState | None] | None = None,
    ) -> SampleOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch_size = logits.shape[0]
        if len(params) != batch_size or len(generators) != batch_size:
            raise ValueError(
                f"batch of {batch_size} logits rows needs as many params and generators, "
                f"got {len(params)} and {len(generators)}"
            )
        for generator in generators:
            if generator is not None and generator.device != logits.device:
                raise ValueError(
                    f"a sampling generator on {generator.device} cannot draw for "
                    f"logits on {logits.device}"
                )
        logits = logits.float()
        if penalties is not None:
            if len(penalties) != batch_size:
                raise ValueError(f"{len(penalties)} penalty states for {batch_size} rows")
            logits = apply_penalties(logits, penalties)
        if grammars is not None and any(g is not None for g in grammars):
            if len(grammars) != batch_size:
                raise ValueError(f"{len(grammars)} grammar states for {batch_size} rows")
            if self._masker is None:
                self._masker = GrammarMasker()
            logits = self._masker.apply(logits, grammars)
        device = logits.device
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = torch.empty(batch_size, dtype=torch.long, device=device)
            greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
            if greedy_rows:
                greedy_index = torch.tensor(greedy_rows, device=device)
                token_ids[greedy_index] = logits[greedy_index].argmax(dim=-1)
            random_index = torch.tensor(random_rows, device=device)
            token_ids[random_index] = _sample_random(
                logits[random_index],
                [params[i] for i in random_rows],
                [generators[i] for i in random_rows],
            )
        return _logprobs(logits, token_ids, params)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, renormalised; vocab order.

    The top token always survives. Every row takes the same arithmetic whether or not
    other rows filter, so a row's result depends on that row alone.
    """
    device = logits.device
    vocab_size = logits.shape[-1]
    temperatures = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits / temperatures[:, None]
    probs = scaled.softmax(dim=-1)
    if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        probs = probs.masked_fill(_filter_mask(scaled, params, vocab_size), 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _filter_mask(
    scaled: torch.Tensor, params: Sequence[SamplingParams], vocab_size: int
) -> torch.Tensor:
    """Boolean [B, V] mask of the tokens that top-k, top-p or min-p remove (vocab order)."""
    device = scaled.device
    # A top_k at or past the vocabulary keeps every token (and a huge one fits no tensor).
    top_k = torch.tensor(
        [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], device=device
    )
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    sorted_logits, sorted_index = scaled.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab_size, device=device)
    sorted_logits = sorted_logits.masked_fill(positions[None, :] >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Nucleus: drop a token once the mass strictly above it already reaches top_p.
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (mass_above >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop |= sorted_probs < (min_p * sorted_probs[:, 0])[:, None]
    drop |= torch.isneginf(sorted_logits)
    drop[:, 0] = False
    return torch.empty_like(drop).scatter_(-1, sorted_index, drop)


def _sample_random(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    probs = filtered_probs(logits, params)
    draws = [
        torch.multinomial(probs[row], num_samples=1, generator=generator)
        for row, generator in enumerate(generators)
    ]
    return torch.cat(draws)


def _logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
) -> SampleOutput:
    """The sampled tokens with the logprobs asked for, read back in one copy."""
    max_top = max(p.top_logprobs for p in params)
    if max_top == 0 and not any(p.logprobs for p in params):
        (tokens,) = to_host([token_ids])
        return SampleOutput(token_ids=[int(t) for t in tokens], logprobs=None, top_logprobs=None)
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    if max_top == 0:
        tokens, chosen_l = to_host([token_ids, chosen])
        return SampleOutput(
            token_ids=[int(t) for t in tokens], logprobs=chosen_l, top_logprobs=None
        )
    values, indices = logprobs.topk(max_top, dim=-1)
    tokens, chosen_l, values_l, indices_l = to_host([token_ids, chosen, values, indices])
    top = [
        list(
            zip((int(i) for i in indices_l[row][: p.top_logprobs]), values_l[row][: p.top_logprobs])
        )
        for row, p in enumerate(params)
    ]
    return SampleOutput(token_ids=[int(t) for t in tokens], logprobs=chosen_l, top_logprobs=top)


def to_host(tensors: Sequence[torch.Tensor]) -> list[list]:
    """Tensors (ints up to 2^53, floats) as host lists through one device-to-host copy: on
    CUDA a non-blocking copy into pinned memory and one event waited on, instead of a
    blocking `.tolist()` per tensor. Shapes are kept (1-D -> list, 2-D -> list of lists)."""
    if not tensors[0].is_cuda:
        return [t.tolist() for t in tensors]  # already on the host: nothing to copy
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    out, start = [], 0
    values = host.tolist()
    for t in tensors:
        n = t.numel()
        part = values[start : start + n]
        start += n
        if t.dim() == 2:
            width = t.shape[1]
            part = [part[r * width : (r + 1) * width] for r in range(t.shape[0])]
        out.append(part)
    return out
