"""Which requests a prefill node refuses, and with which status (check_request, no I/O)."""

from __future__ import annotations

import pytest

from common import messages as msg
from common.config import ModelConfig, PrefillConfig
from prefill_node.request_check import NodeLimits, Rejection, check_request
from tests.support.generate_req import generate_req

LIMITS = NodeLimits(context_length=64, pool_pages=8, page_size=4, vocab_size=100)


def generate(**kw) -> msg.GenerateReq:
    defaults = {"input_ids": [5] * 10, "sampling": {"max_new_tokens": 8, "temperature": 0.0}}
    return generate_req(**{**defaults, **kw})


def check(g: msg.GenerateReq, config: PrefillConfig | None = None, **flags):
    flags = {"is_duplicate": False, "is_queue_full": False, "has_grammar": True, **flags}
    config = config or PrefillConfig(model=ModelConfig(page_size=4))
    return check_request(g, config, LIMITS, **flags)


@pytest.mark.parametrize(
    ("g", "flags", "status", "fragment"),
    [
        (generate(), {"is_duplicate": True}, 400, "duplicate request id"),
        (generate(input_ids=[]), {}, 400, "the context length is 64"),
        (generate(input_ids=[5] * 64), {}, 400, "the context length is 64"),
        (generate(input_ids=[5] * 33), {}, 400, "does not fit this node's KV pool"),
        # 6 pages of prompt, one page of overhead and the first token: more than 8 pages.
        (generate(input_ids=[5] * 25), {}, 400, "take a prompt of at most 24"),
        (generate(), {"is_queue_full": True}, 503, "queue is full"),
        (generate(sampling={"temperature": -1.0}), {}, 400, "temperature"),
        (
            generate(sampling={"regex": "a+", "max_new_tokens": 4}),
            {"has_grammar": False},
            400,
            "structured output is off",
        ),
        (
            generate(output_ids=[7] * 8),
            {},
            400,
            "8 output tokens already",
        ),
    ],
)
def test_refusals_name_the_reason_and_status(g, flags, status, fragment):
    result = check(g, **flags)
    assert isinstance(result, Rejection) and result.status == status
    assert fragment in result.error
    assert result.retryable == (status == 503)


def test_the_longest_prompt_the_pool_takes_is_taken():
    assert not isinstance(check(generate(input_ids=[5] * 24)), Rejection)


def test_a_priority_while_priority_scheduling_is_off_is_refused_only_when_asked():
    g = generate(priority=3)
    assert not isinstance(check(g), Rejection)
    strict = PrefillConfig(model=ModelConfig(page_size=4), abort_on_priority_when_disabled=True)
    refused = check(g, strict)
    assert isinstance(refused, Rejection) and refused.status == 503 and not refused.retryable


def test_the_first_tokens_logprob_is_computed_when_the_request_asks_for_logprobs():
    plain = check(generate())
    asked = check(generate(return_logprob=True))
    assert not isinstance(plain, Rejection) and not plain.logprobs
    assert not isinstance(asked, Rejection) and asked.logprobs
