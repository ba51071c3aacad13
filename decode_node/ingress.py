"""Checking a GenerateReq on the decode node and building its DecodeReq (no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from common import messages as msg
from common.kv_pool import pages_needed
from common.penalties import PenaltyState
from common.sampler import draw_seed, make_generator
from common.sampling_params import SamplingParams
from common.stop import StopChecker
from common.tokenizer import IncrementalDetokenizer, Tokenizer
from decode_node.prealloc_queue import CLIP_MAX_NEW_TOKENS
from decode_node.req import DecodeReq


@dataclass(frozen=True)
class Rejection:
    """Why a request is refused, with the HTTP status the gateway should answer."""

    status: int
    error: str
    retryable: bool = False  # another node pair may take it (this node's queue is full)


@dataclass(frozen=True)
class NodeLimits:
    context_length: int
    vocab_size: int
    page_size: int
    num_pages: int


def check_request(
    g: msg.GenerateReq,
    limits: NodeLimits,
    *,
    is_duplicate: bool = False,
    is_room_in_use: bool = False,
    has_grammar: bool = True,
    is_queue_full: bool = False,
) -> SamplingParams | Rejection:
    """The request's validated sampling params, or why it is refused (400; 503 when the
    node's queue is full, which another node pair may not be)."""
    if is_duplicate:
        return Rejection(400, f"duplicate request id {g.rid}")
    if is_room_in_use:
        return Rejection(400, f"room {g.room} is already in use on this decode node")
    n = len(g.input_ids) + len(g.output_ids)  # a migrated request's output so far is prefilled
    if not g.input_ids or n >= limits.context_length:
        return Rejection(
            400, f"prompt of {n} tokens; the context length is {limits.context_length}"
        )
    try:
        sampling = SamplingParams.from_wire(g.sampling)
        sampling.validate(limits.vocab_size)
    except ValueError as exc:
        return Rejection(400, str(exc))
    if g.output_ids and len(g.output_ids) >= sampling.max_new_tokens:
        return Rejection(400, f"{len(g.output_ids)} output tokens already: max_new_tokens reached")
    # The request must be able to finish alone in this pool (the budget's guarantee).
    left = clipped_max_new_tokens(n, sampling, limits, len(g.output_ids))
    single = n + min(left, CLIP_MAX_NEW_TOKENS)
    if pages_needed(single, limits.page_size) > limits.num_pages:
        return Rejection(
            400,
            f"prompt of {n} tokens plus {single - n} new tokens does not fit "
            f"this decode node's KV pool of {limits.num_pages * limits.page_size}"
            " tokens; lower max_new_tokens",
        )
    if sampling.grammar is not None and not has_grammar:
        return Rejection(400, "structured output is off on this node (--grammar-backend none)")
    if is_queue_full:
        return Rejection(503, "the decode node's queue is full; retry later", retryable=True)
    return sampling


def clipped_max_new_tokens(
    n: int, sampling: SamplingParams, limits: NodeLimits, num_resumed: int = 0
) -> int:
    """Tokens a request with ``n`` prefilled tokens may still produce: what is left of
    max_new_tokens after the ``num_resumed`` a migrated request had, clipped to the context."""
    return min(sampling.max_new_tokens - num_resumed, limits.context_length - n)


def build_request(
    g: msg.GenerateReq,
    sampling: SamplingParams,
    limits: NodeLimits,
    tokenizer: Tokenizer,
    device: torch.device,
    now: float,
) -> DecodeReq:
    """A DecodeReq in PREALLOC (the caller attaches its receiver)."""
    is_logprob = g.return_logprob or sampling.logprobs or sampling.top_logprobs > 0
    if is_logprob and not sampling.logprobs:
        sampling = replace(sampling, logprobs=True)
    ids = [*g.input_ids, *g.output_ids]
    seed = draw_seed(sampling.seed)
    return DecodeReq(
        generate=g,
        sampling=sampling,
        stop=StopChecker(sampling, tokenizer.eos_token_ids),
        max_new_tokens=clipped_max_new_tokens(len(ids), sampling, limits, len(g.output_ids)),
        # A stop string across the migration point is the gateway's to find (it sees it all).
        detokenizer=IncrementalDetokenizer(tokenizer, ids) if sampling.stop else None,
        generator=None if sampling.is_greedy else make_generator(seed, device),
        seed=seed,
        is_logprob=is_logprob,
        arrival=now,
        penalty=PenaltyState.for_request(
            sampling,
            limits.vocab_size,
            device,
            g.input_ids,
            g.output_ids,
            tokenizer.eos_token_ids,
        ),
    )
