"""The running batch: requests decoded together, one runner.decode call per iteration."""

from __future__ import annotations

from collections.abc import Iterator

from common.kv_pool import PageSource, pages_needed
from common.model.runner import ModelRunner
from common.sampler import SampleOutput, Sampler, seed_for_position
from decode_node.prealloc_queue import priority_order_key
from decode_node.req import DecodeReq, DecodeState
from decode_node.retract import RetractPlan, candidate, plan_retraction


class RunningBatch:
    """Continuous batching: waiting requests join between steps, up to max_running_requests."""

    def __init__(
        self,
        runner: ModelRunner,
        max_running_requests: int,
        *,
        retraction_policy: str = "length",
        enable_priority: bool = False,
        low_priority_values_first: bool = False,
    ) -> None:
        self.runner = runner
        self.sampler = Sampler()
        self.max_running_requests = max_running_requests
        self.retraction_policy = retraction_policy
        self.enable_priority = enable_priority
        self.low_priority_values_first = low_priority_values_first
        self.reqs: list[DecodeReq] = []

    def admit(self, waiting: list[DecodeReq]) -> None:
        """Move waiting requests (priority order first when enabled) into free batch slots."""
        room = self.max_running_requests - len(self.reqs)
        if room <= 0 or not waiting:
            return
        if self.enable_priority:
            low = self.low_priority_values_first
            waiting.sort(key=lambda r: priority_order_key(r.priority, low))
        for r in waiting[:room]:
            r.advance(DecodeState.RUNNING)
            self.reqs.append(r)
        del waiting[:room]

    def plan_retraction(self, num_free_pages: int) -> tuple[list[DecodeReq], RetractPlan]:
        """Victims (in order) so the next step fits, and the plan they come from."""
        cands = [candidate(i, r) for i, r in enumerate(self.reqs)]
        plan = plan_retraction(
            cands,
            num_free_pages,
            self.runner.page_size,
            self.retraction_policy,
            self.low_priority_values_first,
        )
        return [self.reqs[k] for k in plan.victims], plan

    def step(self, allocator: PageSource) -> tuple[list[DecodeReq], SampleOutput]:
        """Give each request a page for its next token if it needs one, decode, sample.

        Each request feeds its last output token at position seq_len - 1; the caller made
        sure the pages exist (plan_retraction).
        """
        batch = list(self.reqs)
        for r in batch:
            need = pages_needed(r.seq_len, self.runner.page_size) - len(r.pages)
            if need > 0:
                r.pages += allocator.allocate(need)
        logits = self.runner.decode(
            [r.output_ids[-1] for r in batch], [r.seq_len for r in batch], [r.pages for r in batch]
        )
        for r in batch:  # each output position draws from its own stream (common/sampler.py)
            if r.generator is not None:
                seed_for_position(r.generator, r.seed, r.num_resumed_tokens + len(r.output_ids))
        out = self.sampler.sample(
            logits,
            [r.sampling for r in batch],
            [r.generator for r in batch],
            [r.grammar for r in batch],
            [r.penalty for r in batch],
        )
        return batch, out

    def remove(self, r: DecodeReq) -> bool:
        if r in self.reqs:
            self.reqs.remove(r)
            return True
        return False

    def __len__(self) -> int:
        return len(self.reqs)

    def __bool__(self) -> bool:
        return bool(self.reqs)

    def __iter__(self) -> Iterator[DecodeReq]:
        return iter(self.reqs)
