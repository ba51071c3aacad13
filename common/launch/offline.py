"""Offline generation on one ModelRunner: one request, streamed text (for `pdserve generate`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from common.grammar.backend import GrammarState
from common.kv_pool import pages_needed
from common.model.runner import ExtendRequest, ModelRunner
from common.penalties import PenaltyState
from common.sampler import Sampler, make_generator, seed_for_position
from common.sampling_params import SamplingParams
from common.stop import FinishReason, StopChecker
from common.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class OfflineResult:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    # With params.logprobs / params.top_logprobs: per output token, as a node reports them.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def generate_stream(
    runner: ModelRunner,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    params: SamplingParams,
    grammar: GrammarState | None = None,
) -> Iterator[str | OfflineResult]:
    """Yield text pieces as they are produced, then one OfflineResult. With `grammar` (a
    matcher of params' grammar, compiled by the caller) the output follows it, as on a node."""
    params.validate(runner.spec.vocab_size)
    budget = min(len(prompt_ids) + params.max_new_tokens, runner.context_length)
    if len(prompt_ids) >= budget:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens leaves no room in the context "
            f"({runner.context_length})"
        )
    pages = runner.pool.allocator.allocate(pages_needed(budget, runner.page_size))
    sampler, gen = Sampler(), make_generator(params.seed, runner.device)
    stop = StopChecker(params, tokenizer.eos_token_ids)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    out: list[int] = []
    logprobs: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    text = ""
    try:
        logits = runner.extend([ExtendRequest(prompt_ids, 0, pages)]).logits
        penalty = PenaltyState.for_request(
            params, runner.spec.vocab_size, logits.device, prompt_ids, (), tokenizer.eos_token_ids
        )
        while True:
            if params.seed is not None:  # draw i of a seeded request: as on the nodes
                seed_for_position(gen, params.seed, len(out))
            sampled = sampler.sample(logits, [params], [gen], [grammar], [penalty])
            token = sampled.token_ids[0]
            if penalty is not None:
                penalty.accept(token)
            if sampled.logprobs is not None:
                logprobs.append(sampled.logprobs[0])
            if sampled.top_logprobs is not None:
                tops.append(sampled.top_logprobs[0])
            if grammar is not None and not grammar.accept(token):
                raise ValueError(f"the grammar refused token {token}")
            out.append(token)
            finish = stop.check_token(token, len(out))
            if finish is None and grammar is not None and grammar.is_terminated:
                finish = FinishReason.stop(token)
            piece, matched = stop.feed(detok.add([token]))
            if matched:
                finish = FinishReason.stop(stop.matched_stop or "")
            elif finish is not None or len(prompt_ids) + len(out) >= budget:
                piece += stop.feed(detok.flush())[0] + stop.flush()
                finish = finish or FinishReason.length()
            if piece:
                text += piece
                yield piece
            if finish is not None:
                yield OfflineResult(
                    out,
                    text,
                    finish,
                    logprobs if params.logprobs else None,
                    tops if params.top_logprobs else None,
                )
                return
            logits = runner.decode([token], [len(prompt_ids) + len(out)], [pages])
    finally:
        runner.pool.allocator.free(pages)
