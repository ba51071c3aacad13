"""Whether a prefill node takes a GenerateReq, decided apart from the loop: the request's
sampling parameters as this node runs them, or the refusal to send back."""

from __future__ import annotations

from dataclasses import dataclass, replace

from common import messages as msg
from common.config import PrefillConfig
from common.sampling_params import SamplingParams
from prefill_node.prefill_adder import admission_tokens


@dataclass(frozen=True)
class Rejection:
    status: int
    error: str
    retryable: bool = False  # the nodes' side: another node pair may take it


@dataclass(frozen=True)
class NodeLimits:
    """What the node is, for the checks."""

    context_length: int
    pool_pages: int
    page_size: int
    vocab_size: int


def check_request(
    g: msg.GenerateReq,
    config: PrefillConfig,
    limits: NodeLimits,
    *,
    is_duplicate: bool,
    is_queue_full: bool,
    has_grammar: bool,
) -> SamplingParams | Rejection:
    """The first reason to refuse ``g`` (400 unless said), else its sampling parameters. A
    migrated request (``g.output_ids``) prefills its prompt and the output so far."""
    n = len(g.input_ids) + len(g.output_ids)
    refusal = None
    if is_duplicate:
        refusal = Rejection(400, f"duplicate request id {g.rid}")
    elif n == 0 or n >= limits.context_length:
        refusal = Rejection(
            400, f"prompt of {n} tokens; the context length is {limits.context_length}"
        )
    elif admission_tokens(n, 1, limits.page_size) > limits.pool_pages * limits.page_size:
        # The adder's budget for it would pass the whole pool: it would wait forever.
        most = max(limits.pool_pages - 2, 0) * limits.page_size
        refusal = Rejection(
            400,
            f"prompt of {n} tokens does not fit this node's KV pool ({limits.pool_pages} "
            f"pages of {limits.page_size} tokens take a prompt of at most {most})",
        )
    elif is_queue_full:
        refusal = Rejection(503, "the prefill node's queue is full; retry later", retryable=True)
    elif (
        g.priority is not None
        and not config.enable_priority_scheduling
        and config.abort_on_priority_when_disabled
    ):
        refusal = Rejection(  # SGLang's status for it (the seeds)
            503,
            "priority given but priority scheduling is disabled "
            "(--abort-on-priority-when-disabled)",
        )
    try:
        sampling = SamplingParams.from_wire(g.sampling)
        sampling.validate(limits.vocab_size)
    except ValueError as exc:
        return refusal or Rejection(400, str(exc))
    if refusal is not None:
        return refusal
    if sampling.grammar is not None and not has_grammar:
        return Rejection(400, "structured output is off on this node (--grammar-backend none)")
    if g.output_ids and len(g.output_ids) >= sampling.max_new_tokens:
        return Rejection(400, f"{len(g.output_ids)} output tokens already: max_new_tokens reached")
    if g.return_logprob and not sampling.logprobs:
        sampling = replace(sampling, logprobs=True)  # the first token's logprob
    return sampling
