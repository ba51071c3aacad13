"""Per-request state on the prefill node and the bootstrap / inflight queues around the scheduler.

    GenerateReq ─▶ bootstrap_queue ─▶ waiting_queue ─▶ (chunked) prefill ─▶ inflight_queue ─▶ done
                   sender Bootstrapping  sorted by the     KV sent after      until the sender
                   until the decode      policy, admitted   every chunk        reports Success
                   node's pages arrive   by PrefillAdder
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common import messages as msg
from prefill_node.request import Req
from common.sampling_params import SamplingParams
from prefill_node.radix_node import TreeNode
from transfer.kv_poll import KVPoll
from transfer.kv_sender import KVSender


@dataclass(eq=False)
class PrefillState:
    """What the prefill node holds for one request besides its Req."""

    req: Req
    generate: msg.GenerateReq
    sampling: SamplingParams
    sender: KVSender
    # Pages for tokens [0, num_computed): the first num_prefix_pages are the radix cache's
    # (locked through locked_node); the rest were allocated for this request.
    pages: list[int] = field(default_factory=list)
    num_prefix_pages: int = 0
    num_computed: int = 0
    num_cached_tokens: int = 0
    locked_node: TreeNode | None = None
    # Own pages whose tokens another request cached first; freed when this request ends.
    duplicate_pages: list[int] = field(default_factory=list)
    # Wall-clock marks (common/stages.py), sent on to the decode node with the KV.
    marks: dict[str, float] = field(default_factory=dict)

    @property
    def own_pages(self) -> list[int]:
        return self.pages[self.num_prefix_pages :]


class _SenderQueue:
    """Requests held until their KVSender leaves the states the queue waits on."""

    waits_on: tuple[KVPoll, ...] = ()

    def __init__(self) -> None:
        self.queue: list[PrefillState] = []

    def add(self, state: PrefillState) -> None:
        self.queue.append(state)

    def remove(self, state: PrefillState) -> bool:
        if state in self.queue:
            self.queue.remove(state)
            return True
        return False

    def _pop(self) -> tuple[list[PrefillState], list[PrefillState]]:
        """(moved on, failed), both in arrival order; the rest stay."""
        moved: list[PrefillState] = []
        failed: list[PrefillState] = []
        keep: list[PrefillState] = []
        for s in self.queue:
            state = s.sender.poll()
            if state in self.waits_on:
                keep.append(s)
            else:
                (failed if state is KVPoll.Failed else moved).append(s)
        self.queue = keep
        return moved, failed

    def __len__(self) -> int:
        return len(self.queue)


class BootstrapQueue(_SenderQueue):
    """Requests whose decode side has not yet sent destination pages for their room."""

    waits_on = (KVPoll.Bootstrapping,)

    def pop_bootstrapped(self) -> tuple[list[PrefillState], list[PrefillState]]:
        """(ready for the waiting queue, failed)."""
        return self._pop()


class InflightQueue(_SenderQueue):
    """Requests whose KV is fully computed and sent, until their transfer ends."""

    waits_on = (KVPoll.WaitingForInput, KVPoll.Transferring)

    def pop_done(self) -> tuple[list[PrefillState], list[PrefillState]]:
        """(transferred, failed)."""
        return self._pop()
