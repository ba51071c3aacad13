"""Repetition, frequency and presence penalties, logit bias and min_tokens, applied to a batch
of logits.

    repetition_penalty  (SGLang's, vLLM's, HF's) a token seen in the prompt or the output so
                        far has its logit divided by the penalty where positive, multiplied
                        where not (1: off)
    frequency_penalty   (OpenAI's) logit -= penalty * times the token was output so far
    presence_penalty    (OpenAI's) logit -= penalty if the token was output at all (0: off)
    logit_bias          (OpenAI's) each listed id's logit += its bias (-100 .. 100)
    min_tokens          until that many tokens are output, the end-of-sequence ids and the
                        request's stop_token_ids cannot be sampled

Applied in that order (vLLM's for the penalties), to the raw logits, before grammar masks,
temperature and the filters; the logprobs a request gets are of the penalised logits (what
it sampled from). "Output" counts every token after the prompt, a migrated request's earlier ones
included, so a request that moves to another node pair goes on with the same penalties.

A request with any of them holds a PenaltyState on the logits' device: its output counts
per vocabulary id (int32) and, with a repetition penalty, which ids its prompt holds.
``apply`` stacks the rows that have one and adjusts them in a few tensor operations (no
Python loop over the vocabulary); ``accept`` counts each committed token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from common.sampling_params import SamplingParams


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or params.repetition_penalty != 1.0
        or params.min_tokens > 0
        or bool(params.logit_bias)
    )


class PenaltyState:
    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        device: torch.device | str,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.frequency = params.frequency_penalty
        self.presence = params.presence_penalty
        self.repetition = params.repetition_penalty
        self.min_tokens = params.min_tokens
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        if output_ids:
            ids = torch.tensor(list(output_ids), dtype=torch.long, device=device)
            self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self.num_output = len(output_ids)
        self.prompt_seen: torch.Tensor | None = None
        if self.repetition != 1.0:
            self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if prompt_ids:
                self.prompt_seen[torch.tensor(list(prompt_ids), device=device)] = True
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        if params.logit_bias:
            biased = [tid for tid, _ in params.logit_bias]
            self.bias_ids = torch.tensor(biased, dtype=torch.long, device=device)
            self.bias_values = torch.tensor(
                [bias for _, bias in params.logit_bias], dtype=torch.float32, device=device
            )
        ends = set(params.stop_token_ids)
        if not params.ignore_eos:
            ends |= set(eos_token_ids)
        self.ends = torch.tensor(sorted(ends), dtype=torch.long, device=device)

    @classmethod
    def for_request(
        cls,
        params: SamplingParams,
        vocab_size: int,
        device: torch.device | str,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
        eos_token_ids: Iterable[int] = (),
    ) -> PenaltyState | None:
        """The state of a request that asks for a penalty, a logit bias or min_tokens; None
        otherwise."""
        if not has_penalties(params):
            return None
        return cls(params, vocab_size, device, prompt_ids, output_ids, eos_token_ids)

    @property
    def blocks_ends(self) -> bool:
        return self.num_output < self.min_tokens and self.ends.numel() > 0

    def accept(self, token_id: int) -> None:
        """Count one committed output token."""
        self.counts[token_id] += 1
        self.num_output += 1


def apply_penalties(logits: torch.Tensor, states: Sequence[PenaltyState | None]) -> torch.Tensor:
    """``logits`` ([B, V] float) with each row's penalties applied (rows without a state
    unchanged); a new tensor when any row has one."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    device = logits.device
    picked = [s for s in states if s is not None]
    index = torch.tensor(rows, device=device)
    sub = logits[index]
    counts = torch.stack([s.counts for s in picked])
    output_seen = counts > 0
    if any(s.repetition != 1.0 for s in picked):
        rep = torch.tensor([s.repetition for s in picked], device=device)[:, None]
        seen = output_seen.clone()
        for k, s in enumerate(picked):
            if s.prompt_seen is not None:
                seen[k] |= s.prompt_seen
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
    if any(s.frequency != 0.0 or s.presence != 0.0 for s in picked):
        freq = torch.tensor([s.frequency for s in picked], device=device)[:, None]
        pres = torch.tensor([s.presence for s in picked], device=device)[:, None]
        sub = sub - counts.to(sub.dtype) * freq - output_seen.to(sub.dtype) * pres
    for k, s in enumerate(picked):
        if s.bias_ids is not None and s.bias_values is not None:
            sub[k].index_add_(0, s.bias_ids, s.bias_values.to(sub.dtype))
        if s.blocks_ends:
            sub[k, s.ends] = float("-inf")
    out = logits.clone()
    out[index] = sub
    return out
