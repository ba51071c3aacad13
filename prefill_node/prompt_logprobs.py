"""Prompt logprobs (completions' echo with logprobs): the targets a chunk's extend reads and
what the request keeps of them.

A request that asks for them computes its whole prompt (``Req.reads_cache`` is False: a
cached page carries KV, not the logits that produced it). Each chunk's extend reads, at
each new position, the logprob of the prompt token that follows it and the top
``sampling.top_logprobs`` alternatives; the last prompt position's target is the first
output token, which the sampler reports as the first token's logprob instead. The
positions of a migrated request's output so far (GenerateReq.output_ids) are not prompt.
"""

from __future__ import annotations

from typing import Any

import torch

from common.model.runner import ExtendRequest
from prefill_node.prefill_adder import PrefillChunk
from prefill_node.req_state import PrefillReq


def extend_request(c: PrefillChunk, s: PrefillReq) -> ExtendRequest:
    """Chunk ``c`` of ``s`` as the runner takes it, with its prompt targets when asked."""
    ids = c.req.origin_input_ids
    targets = []
    if s.generate.return_prompt_logprobs:
        targets = ids[c.start + 1 : min(c.end + 1, len(s.generate.input_ids))]
    return ExtendRequest(
        ids[c.start : c.end],
        c.start,
        s.pages,
        logprob_targets=targets or None,
        top_logprobs=s.sampling.top_logprobs if targets else 0,
    )


def collect(
    s: PrefillReq,
    request: ExtendRequest,
    target_logprobs: torch.Tensor | None,
    top: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Append what one chunk's extend read for ``s`` (nothing when it read nothing)."""
    if request.logprob_targets is None or target_logprobs is None:
        return
    n = len(request.logprob_targets)
    s.prompt_logprobs.extend(float(v) for v in target_logprobs[:n].tolist())
    if top is None:
        s.prompt_top_logprobs.extend([] for _ in range(n))
        return
    values, indices = (t[:n].tolist() for t in top)
    s.prompt_top_logprobs.extend(
        [[int(i), float(v)] for i, v in zip(row_ids, row_values, strict=True)]
        for row_ids, row_values in zip(indices, values, strict=True)
    )


def aux_fields(s: PrefillReq) -> dict[str, Any]:
    """AuxData's prompt fields of ``s``: None when it did not ask."""
    if not s.generate.return_prompt_logprobs:
        return {}
    return {"prompt_logprobs": s.prompt_logprobs, "prompt_top_logprobs": s.prompt_top_logprobs}
