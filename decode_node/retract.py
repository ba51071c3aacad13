"""Retraction decisions on the decode node and the new_token_ratio estimate (pure, no I/O).

When the pool cannot hold the next decode step, requests are retracted in victim order
until the rest can each run RETRACT_DECODE_STEPS more steps; one request always stays.
Victim order, per --retraction-policy:
  length    SGLang's: sort by (len(output), -len(input)) descending and pop from the tail,
            so the fewest output tokens go first and, on ties, the longest input
  priority  least urgent first (see prealloc_queue.priority_order_key: no priority is
            least urgent), then the length order
The caller moves each victim's KV to host memory and frees its device pages.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from common.kv_pool import pages_needed
from decode_node.prealloc_queue import priority_order_key

RETRACT_DECODE_STEPS = int(os.environ.get("SGLANG_RETRACT_DECODE_STEPS", "20"))
INIT_NEW_TOKEN_RATIO = float(os.environ.get("SGLANG_INIT_NEW_TOKEN_RATIO", "0.7"))
MIN_NEW_TOKEN_RATIO_FACTOR = float(os.environ.get("SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR", "0.14"))
NEW_TOKEN_RATIO_DECAY_STEPS = int(os.environ.get("SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS", "600"))


@dataclass(frozen=True)
class RetractCandidate:
    """One running request as retraction sees it; `key` is the caller's handle."""

    key: int
    num_input_tokens: int
    num_output_tokens: int
    max_new_tokens: int
    num_pages: int  # device pages it holds
    priority: int | None = None
    # Of those, the pages retracting it frees (not a cached prefix it shares: decode
    # prefix cache); None: all of them.
    num_own_pages: int | None = None

    @property
    def num_freed_pages(self) -> int:
        return self.num_pages if self.num_own_pages is None else self.num_own_pages

    @property
    def kv_len(self) -> int:
        return self.num_input_tokens + max(self.num_output_tokens - 1, 0)


class Running(Protocol):
    """What retraction and preemption read of a running request (a DecodeReq)."""

    @property
    def num_input_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def pages(self) -> list[int]: ...
    @property
    def own_pages(self) -> list[int]: ...
    @property
    def priority(self) -> int | None: ...


def candidate(key: int, r: Running) -> RetractCandidate:
    """``r`` as retraction sees it: what it holds, and what retracting it frees."""
    return RetractCandidate(
        key,
        r.num_input_tokens,
        r.num_output_tokens,
        r.max_new_tokens,
        len(r.pages),
        r.priority,
        len(r.own_pages),
    )


@dataclass(frozen=True)
class RetractPlan:
    victims: list[int]  # keys, in the order to retract them
    new_token_ratio: float | None  # the estimate after retracting; None when nothing was
    can_run: bool  # whether the remaining requests' next step fits


def retraction_order(
    cands: Sequence[RetractCandidate], policy: str, low_priority_values_first: bool = False
) -> list[RetractCandidate]:
    """Candidates in the order they are retracted: the first victim first."""
    if policy not in ("length", "priority"):
        raise ValueError(f"unknown retraction policy {policy!r}")

    def keep_key(c: RetractCandidate) -> tuple[int, ...]:
        # Larger keys stay longer: more output tokens, then a shorter input.
        length = (c.num_output_tokens, -c.num_input_tokens)
        if policy == "length":
            return length
        urgency = priority_order_key(c.priority, low_priority_values_first)  # small: urgent
        return (-urgency[0], -urgency[1], *length)

    # SGLang sorts descending (stable) and pops from the tail; reversing gives pop order.
    order = sorted(cands, key=keep_key, reverse=True)
    order.reverse()
    return order


def pages_to_run(cands: Sequence[RetractCandidate], page_size: int, steps: int) -> int:
    """New pages the requests need to decode `steps` more tokens each."""
    return sum(max(0, pages_needed(c.kv_len + steps, page_size) - c.num_pages) for c in cands)


def retract_new_token_ratio(
    remaining: Sequence[RetractCandidate], steps: int = RETRACT_DECODE_STEPS
) -> float:
    """SGLang's estimate after a retraction: (decoded + steps * n) / (max_new + 1), at most 1."""
    decoded = sum(c.num_output_tokens for c in remaining)
    max_new = sum(c.max_new_tokens for c in remaining)
    return min(1.0, (decoded + steps * len(remaining)) / (max_new + 1))


def plan_retraction(
    cands: Sequence[RetractCandidate],
    num_free_pages: int,
    page_size: int,
    policy: str,
    low_priority_values_first: bool = False,
    steps: int = RETRACT_DECODE_STEPS,
) -> RetractPlan:
    """Which requests to retract so the next step fits; nothing when it already does."""
    if pages_to_run(cands, page_size, 1) <= num_free_pages:
        return RetractPlan([], None, True)
    remaining = retraction_order(cands, policy, low_priority_values_first)
    victims: list[int] = []
    free = num_free_pages
    while len(remaining) > 1 and pages_to_run(remaining, page_size, steps) > free:
        victim = remaining.pop(0)
        victims.append(victim.key)
        free += victim.num_freed_pages
    return RetractPlan(
        victims,
        retract_new_token_ratio(remaining, steps),
        pages_to_run(remaining, page_size, 1) <= free,
    )


class NewTokenRatio:
    """SGLang's new_token_ratio: decays while decoding goes well, jumps after a retraction."""

    def __init__(self, schedule_conservativeness: float = 1.0) -> None:
        self.init = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min = self.init * MIN_NEW_TOKEN_RATIO_FACTOR
        self.decay = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.value = self.init

    def on_decode_step(self) -> None:
        """One decode iteration ran without a retraction."""
        self.value = max(self.value - self.decay, self.min)

    def on_retract(self, estimate: float) -> None:
        self.value = estimate

    def on_idle(self) -> None:
        self.value = self.init
