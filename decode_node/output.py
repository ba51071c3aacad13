"""Committing one output token to a decode request: stop conditions and the gateway messages."""

from __future__ import annotations

from common import messages as msg
from common.grammar.backend import GrammarError
from common.stop import FinishReason
from decode_node.req import DecodeReq
from transfer.kv_sender import AuxData


def append_token(req: DecodeReq, token_id: int) -> FinishReason | None:
    """Add `token_id` to the output; the finish reason if it ends the request.

    Checks, in order: the grammar (a token it refuses raises GrammarError; one that ends
    it finishes the request, ignore_eos or not), stop token ids and eos (unless
    ignore_eos), max_new_tokens, then stop strings through the incremental detokenizer
    (a match wins), then the context.
    """
    if req.grammar is not None and not req.grammar.accept(token_id):
        raise GrammarError(
            500, f"token {token_id} does not match the request's grammar on the decode node"
        )
    req.output_ids.append(token_id)
    if req.penalty is not None:
        req.penalty.accept(token_id)
    num = len(req.output_ids)
    finish = req.stop.check_token(token_id, req.num_resumed_tokens + num)
    if finish is None and req.grammar is not None and req.grammar.is_terminated:
        finish = FinishReason.stop(token_id)
    if req.detokenizer is not None:
        _, is_matched = req.stop.feed(req.detokenizer.add([token_id]))
        if is_matched:
            finish = FinishReason.stop(req.stop.matched_stop or "")
    if finish is None and num >= req.max_new_tokens:
        finish = FinishReason.length()  # what is left of max_new_tokens, clipped to the context
    return finish


def token_chunk(
    req: DecodeReq,
    token_id: int,
    logprob: float | None,
    top: list[tuple[int, float]] | None,
    marks: dict[str, float] | None = None,
) -> msg.TokenChunk:
    """One new token for the gateway, with its logprobs when the request asked for them
    (and, on the first, the request's marks)."""
    if not req.is_logprob:
        return msg.TokenChunk(
            rid=req.rid, token_ids=[token_id], logprobs=None, top_logprobs=None, marks=marks
        )
    # A prefill node that did not compute the first token's logprob reports none: NaN.
    lp = float("nan") if logprob is None else float(logprob)
    tops = None
    if req.sampling.top_logprobs > 0:
        tops = [[[int(t), float(v)] for t, v in (top or [])]]
    return msg.TokenChunk(
        rid=req.rid, token_ids=[token_id], logprobs=[lp], top_logprobs=tops, marks=marks
    )


def prompt_logprobs(req: DecodeReq, aux: AuxData) -> msg.PromptLogprobs | None:
    """The prompt's logprobs the prefill node computed, when the request asked for them:
    they go to the gateway before its first token."""
    if not req.generate.return_prompt_logprobs or aux.prompt_logprobs is None:
        return None
    return msg.PromptLogprobs(
        rid=req.rid, logprobs=aux.prompt_logprobs, top_logprobs=aux.prompt_top_logprobs or []
    )


def req_finished(req: DecodeReq, finish: FinishReason) -> msg.ReqFinished:
    return msg.ReqFinished(
        rid=req.rid,
        finish_reason=finish.kind.value,
        matched_stop=finish.matched,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_resumed_tokens + len(req.output_ids),
        # Prefix-cache hits happen on the prefill node; it reports them with the KV.
        num_cached_tokens=min(req.num_cached_tokens, req.num_prompt_tokens),
    )
