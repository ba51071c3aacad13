"""The model benchmark's prompts, greedy decoding over our runner, and how two dtypes agree.

Used by bench/model_runner.py (bfloat16 vs transformers' float32) and by
tests/unit/common/model/test_bf16_agreement.py, which asserts the agreement over these prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PROMPTS = [
    "Explain how a paged KV cache lets a server batch requests of different lengths.",
    "Write a short poem about the tide coming in over a rocky shore at dusk.",
    "List three ways to make a Python web service more robust under load.",
    "What is the difference between prefill and decode in LLM inference?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I reverse a linked list in C? Show the code.",
    "What causes the seasons on Earth?",
    "Give me a recipe for a simple tomato soup.",
    "Translate 'Where is the train station?' into French and Spanish.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Write a haiku about autumn leaves.",
    "What are the main differences between TCP and UDP?",
    "Suggest three names for a bakery that sells sourdough bread.",
    "How does a binary search work, and what is its complexity?",
    "Describe the water cycle in a few steps.",
    "What should I pack for a weekend hiking trip in the mountains?",
]


def chat_ids(tokenizer: Any, prompts: Sequence[str] = PROMPTS) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]


def greedy(runner: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of `prompts` (any lengths).

    They are prefilled together and decoded in one batch.
    """
    from common.kv_pool import pages_needed
    from common.model.runner import ExtendRequest

    ps = runner.page_size
    tables = [
        runner.pool.allocator.allocate(pages_needed(len(p) + new_tokens, ps)) for p in prompts
    ]
    try:
        logits = runner.extend(
            [ExtendRequest(list(p), 0, t) for p, t in zip(prompts, tables)]
        ).logits
        outs = [[t] for t in logits.argmax(-1).tolist()]
        for step in range(new_tokens - 1):
            lens = [len(p) + step + 1 for p in prompts]
            logits = runner.decode([o[-1] for o in outs], lens, tables)
            for o, t in zip(outs, logits.argmax(-1).tolist()):
                o.append(t)
        return outs
    finally:
        for t in tables:
            runner.pool.allocator.free(t)


def agreement(
    reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]
) -> dict[str, float]:
    """first_token: share of prompts whose first greedy token matches; all_tokens: share whose
    whole continuation matches; mean_common_prefix: tokens matched before the first difference."""
    firsts, wholes, prefixes = 0, 0, 0
    for ref, got in zip(reference, candidate, strict=True):
        common = next(
            (i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got))
        )
        firsts += common > 0
        wholes += common == len(ref) == len(got)
        prefixes += common
    n = len(reference)
    return {"first_token": firsts / n, "all_tokens": wholes / n, "mean_common_prefix": prefixes / n}


def forced_logits(
    runner: Any, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]
) -> list[Any]:
    """Teacher forcing: each prompt prefilled, then its given continuation fed back one token
    a step (batched decode, as greedy runs it); per prompt, float32 logits [steps, vocab] at
    every step. Every run sees the same tokens, so their logits compare position by position."""
    import torch

    from common.kv_pool import pages_needed
    from common.model.runner import ExtendRequest

    ps, steps = runner.page_size, len(continuations[0])
    tables = [runner.pool.allocator.allocate(pages_needed(len(p) + steps, ps)) for p in prompts]
    try:
        out = [
            runner.extend([ExtendRequest(list(p), 0, t) for p, t in zip(prompts, tables)]).logits
        ]
        for step in range(steps - 1):
            lens = [len(p) + step + 1 for p in prompts]
            # a copy: on CUDA decode returns a view of its graph's static logits
            out.append(runner.decode([c[step] for c in continuations], lens, tables).clone())
        return list(torch.stack(out, dim=1))
    finally:
        for t in tables:
            runner.pool.allocator.free(t)


def forced_agreement(reference: Sequence[Any], candidate: Sequence[Any]) -> dict[str, float]:
    """Over teacher-forced steps: the share where both pick the same token, and the mean KL
    divergence of the candidate's next-token distribution from the reference's. Unlike
    greedy agreement, one early flip does not part the rest: a stable measure of accuracy."""
    import torch

    ref, got = torch.cat(list(reference)), torch.cat(list(candidate))
    kl = torch.nn.functional.kl_div(
        got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    return {
        "argmax_match": (ref.argmax(-1) == got.argmax(-1)).float().mean().item(),
        "kl": kl.item(),
    }
