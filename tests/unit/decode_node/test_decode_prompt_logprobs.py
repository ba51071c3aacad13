"""Prompt logprobs through a prefill and a decode loop: the decode node sends them to the
gateway first (before any token, or alone with max_new_tokens 0), equal to one extend."""

from __future__ import annotations

import pytest

from common import messages as msg
from common.kv_pool import pages_needed
from common.model.runner import ExtendRequest
from tests.support.decode_harness import PD, greedy, prompt


def _reference(runner, ids, k):
    pages = runner.pool.allocator.allocate(pages_needed(len(ids), runner.page_size))
    try:
        out = runner.extend([ExtendRequest(ids, 0, pages, logprob_targets=ids[1:], top_logprobs=k)])
        return out.target_logprobs[0].tolist(), out.top_logprobs[0][1][: len(ids) - 1].tolist()
    finally:
        runner.pool.allocator.free(pages)


def test_prompt_logprobs_reach_the_gateway_before_the_first_token(model_dir, ref):
    h = PD(model_dir, prefill_cfg={"chunked_prefill_size": 8, "max_prefill_tokens": 8})
    try:
        ids = prompt(21, 90)
        h.submit("plain", 90, ids, max_new_tokens=4)  # caches the prompt on the prefill node
        h.run_until(lambda: h.done("plain"))
        h.submit("scored", 91, ids, max_new_tokens=4, top_logprobs=2, return_prompt_logprobs=True)
        h.submit("zero", 92, ids, max_new_tokens=0, top_logprobs=1, return_prompt_logprobs=True)
        h.run_until(lambda: h.done("scored", "zero"))
        want, want_top = _reference(ref, ids, 2)
        first, *rest = h.replies["scored"]
        assert isinstance(first, msg.PromptLogprobs)
        assert first.logprobs == pytest.approx(want, abs=1e-4)
        assert [[t for t, _ in row] for row in first.top_logprobs] == want_top
        assert not any(isinstance(m, msg.PromptLogprobs) for m in rest)
        assert h.tokens("scored") == greedy(ref, ids, 4)  # the output is unchanged
        zero = h.replies["zero"]
        assert [type(m) for m in zero] == [msg.PromptLogprobs, msg.ReqFinished]
        assert zero[0].logprobs == pytest.approx(want, abs=1e-4)
        assert [[t for t, _ in row] for row in zero[0].top_logprobs] == [r[:1] for r in want_top]
        assert not any(isinstance(m, msg.PromptLogprobs) for m in h.replies["plain"])
    finally:
        h.close()
