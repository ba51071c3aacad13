"""The one token a prefill node samples: the request's first output token (or, for a
migrated request, the one after its output so far), under its seed's stream for that
position, its grammar and its penalties, as the decode node samples every later one."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from common.grammar.backend import GrammarError, GrammarState
from common.penalties import PenaltyState
from common.sampler import SampleOutput, Sampler, make_generator, seed_for_position
from prefill_node import prompt_logprobs
from prefill_node.req_state import PrefillReq
from transfer.kv_sender import AuxData


def sample_first_token(
    sampler: Sampler,
    s: PrefillReq,
    logits: torch.Tensor,
    vocab_size: int,
    eos_token_ids: Iterable[int],
) -> SampleOutput:
    """Sample from ``logits`` ([1, V], the prompt's last position) for ``s``."""
    # the generator lives where the logits are (torch refuses a CPU one for cuda logits)
    generator = make_generator(s.sampling.seed, logits.device)
    resumed = s.generate.output_ids  # a migrated request goes on after these
    if s.sampling.seed is not None:
        seed_for_position(generator, s.sampling.seed, len(resumed))
    grammar = GrammarState(s.grammar, resumed) if s.grammar is not None else None
    penalty = PenaltyState.for_request(
        s.sampling, vocab_size, logits.device, s.generate.input_ids, resumed, eos_token_ids
    )
    sample = sampler.sample(logits, [s.sampling], [generator], [grammar], [penalty])
    if grammar is not None and not grammar.accept(sample.token_ids[0]):
        raise GrammarError(500, f"the grammar refused its own first token {sample.token_ids[0]}")
    return sample


def first_token_aux(s: PrefillReq, sample: SampleOutput) -> AuxData:
    """What goes to the decode node with the last chunk: the sampled token, its logprobs,
    the request's marks and cached tokens, the prompt's logprobs when asked for."""
    top = sample.top_logprobs[0] if sample.top_logprobs else []
    return AuxData(
        first_token_id=sample.token_ids[0],
        room_echo=s.req.room,
        first_logprob=sample.logprobs[0] if sample.logprobs else None,
        top_logprobs=list(top),
        marks=dict(s.marks),
        num_cached_tokens=s.num_cached_tokens,
        **prompt_logprobs.aux_fields(s),
    )
