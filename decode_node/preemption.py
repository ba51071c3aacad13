"""Priority preemption on the decode node (pure, no I/O): which running requests to retract so that
a more urgent request waiting for pages is admitted now.

In a P/D system the place to preempt is the decode node: its pool holds the long-lived
KV. With --enable-priority-scheduling (and not --disable-priority-preemption), when the
most urgent ready request of the prealloc queue does not fit, running requests whose
priority is lower by more than --priority-scheduling-preemption-threshold (strictly, as
SGLang's) are retracted
(to host memory, as a retraction does; they resume later with their output intact),
least urgent first, until it fits. A request without a priority is the least urgent: it
can be preempted by any prioritized request and preempts no one. Nothing is retracted
unless the retractions together make the request fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from decode_node.prealloc_queue import BudgetReq, DecodeBudget, admit_preallocated
from decode_node.retract import RetractCandidate, Running, candidate, retraction_order

DEFAULT_PREEMPTION_THRESHOLD = 10  # SGLang's --priority-scheduling-preemption-threshold


def is_more_urgent_by(
    priority: int | None, other: int | None, threshold: int, low_values_first: bool
) -> bool:
    """Whether ``priority`` is more urgent than ``other`` by more than ``threshold``."""
    if priority is None:
        return False
    if other is None:
        return True
    gap = other - priority if low_values_first else priority - other
    return gap > threshold


def plan_preemption(
    head: BudgetReq,
    head_priority: int | None,
    running: Sequence[RetractCandidate],
    budget: DecodeBudget,
    threshold: int,
    low_values_first: bool = False,
) -> list[int] | None:
    """Keys of the running requests to retract, in order, so that ``head`` is admitted;
    [] when it fits as things are; None when preempting what may be preempted cannot
    make it fit. ``budget`` must not count retracted requests (the caller decides whether
    they block ``head``)."""
    eligible = [
        c
        for c in retraction_order(running, "priority", low_values_first)
        if is_more_urgent_by(head_priority, c.priority, threshold, low_values_first)
    ]
    victims: list[RetractCandidate] = []
    for victim in [None, *eligible]:
        if victim is not None:
            victims.append(victim)
        gone = {v.key for v in victims}
        after = replace(
            budget,
            num_free_pages=budget.num_free_pages + sum(v.num_freed_pages for v in victims),
            num_active_reqs=budget.num_active_reqs - len(victims),
            running=[
                BudgetReq(c.num_input_tokens, c.num_output_tokens, c.max_new_tokens)
                for c in running
                if c.key not in gone
            ],
            retracted=(),
        )
        if admit_preallocated([head], after) == [0]:
            return [v.key for v in victims]
    return None


def choose_victims(
    head: BudgetReq,
    head_priority: int,
    running: Sequence[Running],
    retracted_priorities: Iterable[int | None],
    budget: DecodeBudget,
    threshold: int,
    low_values_first: bool,
) -> list[int] | None:
    """Indices into ``running`` of the requests to retract so that ``head`` is admitted
    now (plan_preemption), or None: a retracted request at least as urgent comes back
    first, or no preemptible set makes room."""
    if not all(
        is_more_urgent_by(head_priority, p, threshold, low_values_first)
        for p in retracted_priorities
    ):
        return None
    candidates = [candidate(i, r) for i, r in enumerate(running)]
    return plan_preemption(
        head, head_priority, candidates, replace(budget, retracted=()), threshold, low_values_first
    )
