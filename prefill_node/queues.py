"""Per-request state on the prefill node and the bootstrap / inflight queues around the scheduler.

    GenerateReq ─▶ bootstrap_queue ─▶ waiting_queue ─▶ (chunked) prefill ─▶ inflight_queue ─▶ done
                   sender Bootstrapping  sorted by the     KV sent after      until the sender
                   until the decode      policy, admitted   every chunk        reports Success
                   node's pages arrive   by PrefillAdder
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common import messages as msg
from common.request import Req
from common.sampling_params import SamplingParams
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
    locked_node: object | None = None
    # Own pages whose tokens another request cached first; freed when this request ends.
    duplicate_pages: list[int] = field(default_factory=list)

    @property
    def own_pages(self) -> list[int]:
        return self.pages[self.num_prefix_pages :]


class BootstrapQueue:
    """Requests whose decode side has not yet sent destination pages for their room."""

    def __init__(self) -> None:
        self.queue: list[PrefillState] = []

    def add(self, state: PrefillState) -> None:
        self.queue.append(state)

    def pop_bootstrapped(self) -> tuple[list[PrefillState], list[PrefillState]]:
        """(ready for the waiting queue, failed), both in arrival order."""
        ready, failed, keep = [], [], []
        for s in self.queue:
            state = s.sender.poll()
            if state is KVPoll.Bootstrapping:
                keep.append(s)
            elif state is KVPoll.Failed:
                failed.append(s)
            else:
                ready.append(s)
        self.queue = keep
        return ready, failed

    def remove(self, state: PrefillState) -> bool:
        if state in self.queue:
            self.queue.remove(state)
            return True
        return False

    def __len__(self) -> int:
        return len(self.queue)


class InflightQueue:
    """Requests whose KV is fully computed and sent, until their transfer ends."""

    def __init__(self) -> None:
        self.queue: list[PrefillState] = []

    def add(self, state: PrefillState) -> None:
        self.queue.append(state)

    def pop_done(self) -> tuple[list[PrefillState], list[PrefillState]]:
        """(transferred, failed)."""
        done, failed, keep = [], [], []
        for s in self.queue:
            state = s.sender.poll()
            if state is KVPoll.Success:
                done.append(s)
            elif state is KVPoll.Failed:
                failed.append(s)
            else:
                keep.append(s)
        self.queue = keep
        return done, failed

    def remove(self, state: PrefillState) -> bool:
        if state in self.queue:
            self.queue.remove(state)
            return True
        return False

    def __len__(self) -> int:
        return len(self.queue)
