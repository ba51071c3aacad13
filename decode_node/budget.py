"""The decode node's admission budget (``DecodeBudget``) from its queues, as a pure function."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from common.kv_pool import pages_needed
from decode_node.prealloc_queue import BudgetReq, DecodeBudget
from decode_node.req import DecodeReq

MAX_RUNNING_REQUESTS_CAP = 4096


def default_max_running_requests(num_pages: int, page_size: int) -> int:
    """SGLang's default (half the pool's tokens), at most one request per page and 4096."""
    return max(1, min(num_pages, num_pages * page_size // 2, MAX_RUNNING_REQUESTS_CAP))


def budget_req(r: DecodeReq, num_coming: int = 0) -> BudgetReq:
    """r as the budget sees it; ``num_coming``: tokens drawn on the device for r that the
    host has not committed yet (overlap scheduling), counted as output."""
    return BudgetReq(r.num_input_tokens, r.num_output_tokens + num_coming, r.max_new_tokens)


def build_budget(
    *,
    page_size: int,
    num_free_pages: int,
    num_reserved_decode_tokens: int,
    running: Collection[BudgetReq],
    retracted: Collection[DecodeReq],
    in_transfer: Collection[DecodeReq],
    num_waiting: int,
    max_held_requests: int,
    shares_pool_with_prefill: bool,
) -> DecodeBudget:
    """What admitting more requests may take: free pages less what the running and
    retracted requests still need, and free request slots. Colocated
    (``shares_pool_with_prefill``), the pages the prefill half still computes prompts in
    transfer into count as taken. ``running``: the running requests as the budget sees
    them (RunningBatch.budget_reqs: with the tokens a pending step brings)."""
    num_held = len(in_transfer) + num_waiting + len(running) + len(retracted)
    return DecodeBudget(
        page_size=page_size,
        num_free_pages=num_free_pages,
        num_reserved_decode_tokens=num_reserved_decode_tokens,
        num_active_reqs=len(running) + len(in_transfer) + num_waiting,
        running=list(running),
        retracted=[budget_req(r) for r in retracted],
        num_free_slots=max(0, max_held_requests - num_held),
        num_prefill_tokens=(
            _prompt_pages(in_transfer, page_size) * page_size if shares_pool_with_prefill else 0
        ),
        shares_pool_with_prefill=shares_pool_with_prefill,
    )


def _prompt_pages(reqs: Iterable[DecodeReq], page_size: int) -> int:
    return sum(pages_needed(r.num_input_tokens, page_size) for r in reqs)
