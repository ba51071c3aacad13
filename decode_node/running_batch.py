"""The running batch: requests decoded together, and the decode steps it has on the device.

Each running request holds a decode slot (common.model.decode_slots): its pages' row and
its next token live on the device, so a step sends only slots and lengths. A step's life:

    launch()   pages for each row's next token, the forward queued (nothing waits)
    sample()   the rows' tokens drawn on the device and written into their slots (the next
               step's inputs); their copy to the host starts: the step is now pending
    results()  waits for the pending step's copy: (rows, tokens) for the scheduler to commit

With overlap scheduling (the default) the scheduler launches step N+1 before it commits
step N's results, so the host's work for one step runs while the device computes the next
(mini-sglang's and SGLang's overlap): a row's token of step N is then not yet known on the
host when step N+1 is planned, only that it comes (`next_len` counts it), and a request
that step N finishes has a row in step N+1 whose result is dropped. Anything that must see
every token first (retraction, preemption) commits the pending step before it decides.
Sampling always follows the commit of the step before it, so grammar masks and penalties
see every earlier token, and outputs equal those of `--disable-overlap-schedule`.

A request that leaves the batch while a launched step still writes its next KV slot hands
that page to the release queue until the step's device work has completed: no other
request, transfer or peer gets it before (decode_node/transfer_queue.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from common.kv_pool import PageSource, pages_needed
from common.model.runner import ModelRunner
from common.sampler import PendingSample, SampleOutput, Sampler, seed_for_position
from common.sampling_params import SamplingParams
from common.work_done import WorkDone, record_work_done
from decode_node.budget import budget_req
from decode_node.prealloc_queue import BudgetReq, priority_order_key
from decode_node.req import DecodeReq, DecodeState
from decode_node.retract import RetractCandidate, RetractPlan, plan_retraction
from decode_node.transfer_queue import ReleaseQueue

_DROPPED = SamplingParams(temperature=0.0)  # a row whose request ended: drawn, never read


@dataclass(eq=False)
class DecodeStep:
    """One launched decode step: its rows, the page each row's KV is written to, the
    logits, and once sampled its tokens on their way to the host."""

    reqs: list[DecodeReq]
    write_pages: list[int]
    logits: torch.Tensor
    pending: PendingSample | None = None
    done: WorkDone | None = None  # after its forward and sampling, once sampled
    row_of: dict[int, int] = field(default_factory=dict)  # id(request) -> row

    def is_complete(self) -> bool:
        """Whether the step's device work (forward and sampling) has completed."""
        return self.done is not None and self.done.query()

    def has(self, r: DecodeReq) -> bool:
        return id(r) in self.row_of


class RunningBatch:
    """Continuous batching: waiting requests join between steps, up to max_running_requests."""

    def __init__(
        self,
        runner: ModelRunner,
        max_running_requests: int,
        release_queue: ReleaseQueue,
        *,
        retraction_policy: str = "length",
        enable_priority: bool = False,
        low_priority_values_first: bool = False,
    ) -> None:
        self.runner = runner
        self.slots = runner.slots
        self.sampler = Sampler()
        self.release_queue = release_queue
        # a request needs a slot to run: no more than there are
        self.max_running_requests = min(max_running_requests, self.slots.num_slots)
        self.retraction_policy = retraction_policy
        self.enable_priority = enable_priority
        self.low_priority_values_first = low_priority_values_first
        self.reqs: list[DecodeReq] = []
        self.pending: DecodeStep | None = None  # sampled, its tokens not yet committed
        self.launched: DecodeStep | None = None  # launched, not yet sampled

    def admit(self, waiting: list[DecodeReq]) -> None:
        """Move waiting requests (priority order first when enabled) into free batch slots:
        each takes a decode slot with its pages and its last token."""
        room = self.max_running_requests - len(self.reqs)
        if room <= 0 or not waiting:
            return
        if self.enable_priority:
            low = self.low_priority_values_first
            waiting.sort(key=lambda r: priority_order_key(r.priority, low))
        for r in waiting[:room]:
            slot = self.slots.acquire()
            r.decode_slot = slot
            self.slots.set_pages(slot, r.pages)
            self.slots.set_token(slot, r.output_ids[-1])
            r.advance(DecodeState.RUNNING)
            self.reqs.append(r)
        del waiting[:room]

    def num_coming(self, r: DecodeReq) -> int:
        """Tokens r has drawn on the device that the host has not committed (0 or 1)."""
        return 1 if self.pending is not None and self.pending.has(r) else 0

    def next_len(self, r: DecodeReq) -> int:
        """The sequence length r's next step runs at."""
        return r.seq_len + self.num_coming(r)

    def budget_reqs(self) -> list[BudgetReq]:
        """The running requests as the admission budget sees them (pending tokens counted)."""
        return [budget_req(r, self.num_coming(r)) for r in self.reqs]

    def plan_retraction(self, num_free_pages: int) -> tuple[list[DecodeReq], RetractPlan]:
        """Victims (in order) so the next step fits, and the plan they come from (the
        tokens a pending step brings counted as output already)."""
        cands = []
        for i, r in enumerate(self.reqs):
            cands.append(
                RetractCandidate(
                    i,
                    r.num_input_tokens,
                    r.num_output_tokens + self.num_coming(r),
                    r.max_new_tokens,
                    len(r.pages),
                    r.priority,
                    len(r.own_pages),
                )
            )
        plan = plan_retraction(
            cands,
            num_free_pages,
            self.runner.page_size,
            self.retraction_policy,
            self.low_priority_values_first,
        )
        return [self.reqs[k] for k in plan.victims], plan

    def launch(self, allocator: PageSource) -> DecodeStep | None:
        """Give each row a page for its next token if it needs one and queue the forward.
        A request whose pending token is its last (max_new_tokens) gets no row. The caller
        made sure the pages exist (plan_retraction)."""
        assert self.launched is None, "a launched step has not been sampled"
        ps = self.runner.page_size
        rows: list[DecodeReq] = []
        slots: list[int] = []
        lens: list[int] = []
        write_pages: list[int] = []
        for r in self.reqs:
            coming = self.num_coming(r)
            if r.num_output_tokens + coming >= r.max_new_tokens:
                continue  # its pending token ends it
            n = r.seq_len + coming
            need = pages_needed(n, ps) - len(r.pages)
            if need > 0:
                r.pages += allocator.allocate(need)
            assert r.decode_slot is not None
            self.slots.set_pages(r.decode_slot, r.pages)
            rows.append(r)
            slots.append(r.decode_slot)
            lens.append(n)
            write_pages.append(r.pages[(n - 1) // ps])
        if not rows:
            return None
        logits = self.runner.decode_slots(slots, lens)
        step = DecodeStep(rows, write_pages, logits, row_of={id(r): i for i, r in enumerate(rows)})
        self.launched = step
        return step

    def sample(self, step: DecodeStep) -> None:
        """Draw the launched step's tokens on the device, feed them to its rows' slots and
        start their copy to the host; the step becomes the pending one. The step before it
        must have been committed (results()): grammar matchers and penalties hold every
        earlier token, and each row's draw is seeded by its position."""
        assert step is self.launched and self.pending is None
        self.launched = None
        if not any(r.state is DecodeState.RUNNING for r in step.reqs):
            # every row's request ended at the last commit: nothing to draw; what the
            # step writes is released once it has completed
            step.done = record_work_done(self.runner.device)
            return
        params, generators, grammars, penalties = [], [], [], []
        for r in step.reqs:
            live = r.state is DecodeState.RUNNING  # still in the batch
            if live and r.generator is not None:
                seed_for_position(r.generator, r.seed, r.num_resumed_tokens + len(r.output_ids))
            params.append(r.sampling if live else _DROPPED)
            generators.append(r.generator if live else None)
            grammars.append(r.grammar if live else None)
            penalties.append(r.penalty if live else None)
        device_sample = self.sampler.sample_on_device(
            step.logits, params, generators, grammars, penalties
        )
        # the next step's inputs, on the device (a row that ended writes a slot no one
        # reads before a new holder's first token, which is staged after this)
        self.runner.feed_tokens(device_sample.token_ids)
        step.pending = device_sample.to_host()
        step.done = record_work_done(self.runner.device)
        self.pending = step

    def results(self) -> tuple[list[DecodeReq], SampleOutput] | None:
        """The pending step's rows and tokens (waits for their copy only); None when no
        step is pending. Rows whose request left the batch meanwhile are the caller's to
        skip (their state is no longer RUNNING)."""
        step = self.pending
        if step is None:
            return None
        self.pending = None
        assert step.pending is not None
        return step.reqs, step.pending.result()

    @property
    def is_busy(self) -> bool:
        """Whether a step whose rows are still running awaits its commit, or one still
        runs on the device (a step whose rows all ended and that has completed is not)."""
        step = self.pending
        if step is None:
            return False
        return not step.is_complete() or any(r.state is DecodeState.RUNNING for r in step.reqs)

    def remove(self, r: DecodeReq) -> bool:
        """Take r out of the batch and give its slot back; a page a launched or pending step
        still writes for r goes to the release queue until that step has completed."""
        if r not in self.reqs:
            return False
        self.reqs.remove(r)
        for step in (self.launched, self.pending):
            if step is None or not step.has(r) or step.is_complete():
                continue
            page = step.write_pages[step.row_of[id(r)]]
            if r.pages and r.pages[-1] == page and page in r.own_pages:
                # its last page, the one past its KV's whole pages (never cached): freed
                # with r, but only once the step's write into it has landed
                r.pages.pop()
                self.release_queue.add_after(step, [page])
        assert r.decode_slot is not None
        self.slots.release(r.decode_slot)
        r.decode_slot = None
        return True

    def check_integrity(self) -> None:
        """Each running request holds a slot whose row is its pages."""
        self.slots.check_integrity()
        held = [r.decode_slot for r in self.reqs]
        if None in held or len(set(held)) != len(held):
            raise AssertionError(f"running requests hold decode slots {held}")
        for r in self.reqs:
            assert r.decode_slot is not None
            if self.slots.num_pages[r.decode_slot] != len(r.pages):
                raise AssertionError(f"request {r.rid}: its slot's row is not its pages")
            if self.runner.device.type == "cpu" and self.slots.row(r.decode_slot) != r.pages:
                raise AssertionError(f"request {r.rid}: its slot's row is not its pages")

    def __len__(self) -> int:
        return len(self.reqs)

    def __bool__(self) -> bool:
        return bool(self.reqs)

    def __iter__(self) -> Iterator[DecodeReq]:
        return iter(self.reqs)
