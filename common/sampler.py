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
        """One token per row, on the host (the device work, then its one copy waited on)."""
        sample = self.sample_on_device(logits, params, generators, grammars, penalties)
        return sample.to_host().result()

    def sample_on_device(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        grammars: Sequence[GrammarState | None] | None = None,
        penalties: Sequence[PenaltyState | None] | None = None,
    ) -> DeviceSample:
        """One token per row, left on the device with the logprobs asked for: nothing here
        waits for the device (the host state it reads, grammar matchers and penalty counts,
        must already hold the rows' earlier tokens)."""
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
) -> DeviceSample:
    """The sampled tokens with the logprobs asked for, on the device."""
    max_top = max(p.top_logprobs for p in params)
    if max_top == 0 and not any(p.logprobs for p in params):
        return DeviceSample(token_ids, params)
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    if max_top == 0:
        return DeviceSample(token_ids, params, chosen)
    values, indices = logprobs.topk(max_top, dim=-1)
    return DeviceSample(token_ids, params, chosen, values, indices)


@dataclass
class DeviceSample:
    """A batch's sampled tokens on the device (`token_ids`, [B] long), with the chosen
    tokens' logprobs and the top logprobs when a row asked for them."""

    token_ids: torch.Tensor
    params: Sequence[SamplingParams]
    chosen: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_indices: torch.Tensor | None = None

    def to_host(self) -> PendingSample:
        """Start the one device-to-host copy of everything (non-blocking on CUDA)."""
        tensors = [self.token_ids]
        tensors += [t for t in (self.chosen, self.top_values, self.top_indices) if t is not None]
        return PendingSample(self, HostCopy(tensors))


class PendingSample:
    """A DeviceSample on its way to the host: `result()` waits for the copy (only it)."""

    def __init__(self, sample: DeviceSample, copy: HostCopy) -> None:
        self.sample = sample
        self.copy = copy

    def is_ready(self) -> bool:
        return self.copy.is_ready()

    def result(self) -> SampleOutput:
        parts = self.copy.result()
        tokens = [int(t) for t in parts[0]]
        if self.sample.chosen is None:
            return SampleOutput(token_ids=tokens, logprobs=None, top_logprobs=None)
        if self.sample.top_values is None:
            return SampleOutput(token_ids=tokens, logprobs=parts[1], top_logprobs=None)
        values, indices = parts[2], parts[3]
        top = [
            list(
                zip((int(i) for i in indices[row][: p.top_logprobs]), values[row][: p.top_logprobs])
            )
            for row, p in enumerate(self.sample.params)
        ]
        return SampleOutput(token_ids=tokens, logprobs=parts[1], top_logprobs=top)


class HostCopy:
    """Tensors (ints up to 2^53, floats) on their way to host lists in one device-to-host
    copy: on CUDA a non-blocking copy into pinned memory and an event recorded on the
    tensors' device, instead of a blocking `.tolist()` per tensor; on the CPU the lists at
    once. Shapes are kept (1-D -> list, 2-D -> list of lists)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.shapes = [tuple(t.shape) for t in tensors]
        self._lists: list[list] | None = None
        self._event: torch.cuda.Event | None = None
        if not tensors[0].is_cuda:
            self._lists = [t.tolist() for t in tensors]  # already on the host
            return
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
        self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        self._host.copy_(flat, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(tensors[0].device))

    def is_ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> list[list]:
        if self._lists is not None:
            return self._lists
        assert self._event is not None
        self._event.synchronize()
        values = self._host.tolist()
        out, start = [], 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            part = values[start : start + n]
            start += n
            if len(shape) == 2:
                width = shape[1]
                part = [part[r * width : (r + 1) * width] for r in range(shape[0])]
            out.append(part)
        self._lists = out
        return out


def to_host(tensors: Sequence[torch.Tensor]) -> list[list]:
    """Tensors as host lists through one device-to-host copy, waited for (HostCopy)."""
    return HostCopy(tensors).result()
