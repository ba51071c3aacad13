"""KVSender: the prefill side of one room, from bootstrap to the last page written.

    Bootstrapping    created with the request; waits for the decode node's TransferRequest
         │             (destination pages + aux slot); bootstrap timeout -> Failed
    WaitingForInput  destination known; the scheduler may prefill; the decode side must
         │             keep granting the room's lease (transfer/fence.py) or the room fails
    Transferring     after the first send(): pages go out chunk by chunk, each write
         │             posted only while the fence is open (queued until the first grant)
         │
    Success          every write of the last chunk completed and the TransferDone
                       (first token, logprobs, room echo) was delivered
    Failed           timeout, lease expiry, abort from either side, write error

The scheduler calls send() after each prefill chunk with the pages of the tokens
computed so far; only complete pages go out until the last chunk, which sends the
rest plus the aux data. All I/O goes through the host (the KVManager), which this
module knows only as the SenderHost protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.kv_pool import pages_needed
from common.work_done import COMPLETED, WorkDone
from transfer.fence import Fence
from transfer.kv_poll import FailureReason, KVPoll, RoomState


@dataclass(frozen=True)
class AuxData:
    """What the decode side needs besides KV: the first sampled token and its logprobs."""

    first_token_id: int
    room_echo: int
    first_logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    # The prefill node's wall-clock marks of the request (common/stages.py).
    marks: dict[str, float] = field(default_factory=dict)
    # Prompt tokens the prefill node read from its radix cache instead of computing.
    num_cached_tokens: int = 0
    # The prompt's logprobs when asked for (msg.TransferDone.prompt_logprobs): one per
    # prompt token after the first, and per position [token_id, logprob] pairs, best first.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[Any]] | None = None


class SenderHost(Protocol):
    """What a KVSender needs of its owner (the KVManager)."""

    page_size: int
    clock: Callable[[], float]

    def flush_writes(self, sender: KVSender) -> None: ...

    def stop_when_drained(self, sender: KVSender) -> None: ...

    def observe_bootstrap(self, room: KVSender) -> None: ...

    def observe_failure(self, room: KVSender, reason: str) -> None: ...

    def remove_sender(self, sender: KVSender) -> None: ...


class KVSender:
    def __init__(self, manager: SenderHost, room: int, num_tokens: int, now: float) -> None:
        self.manager = manager
        self.room = room
        self.num_tokens = num_tokens
        self.status = RoomState(KVPoll.Bootstrapping, since=now, created=now)
        self.peer_node: str | None = None
        self.dst_pages: list[int] = []
        self.aux_slot = 0
        self.attached_at = now
        self.fence = Fence()  # writes may be posted while fence.is_open(now)
        self.is_fence_held = False  # writes wait: the fence closed (counted once per closing)
        self.renew_asked_at = -float("inf")
        self.num_sent_pages = 0
        self.num_held_pages = 0  # leading pages the decode side holds: never sent
        self.pending_pairs: list[tuple[int, int]] = []  # computed, not posted yet
        # Per pending pair, the device work that fills its page (common.work_done), and the
        # last chunk's: nothing is posted before the work that computed it has completed.
        self.pending_ready: list[WorkDone] = []
        self.ready: WorkDone = COMPLETED
        self.handles: list[object] = []
        self.posted_dst_pages: list[list[int]] = []  # per handle, the pages it writes
        self.aux: AuxData | None = None
        self.is_last_sent = False  # the scheduler handed over the last chunk
        self.is_last_posted = False  # ... and its writes went out
        self.is_notified = False
        self.is_late_reported = False
        self.first_send_at: float | None = None
        self.num_bytes = 0

    def poll(self) -> KVPoll:
        return self.status.state

    @property
    def failure_reason(self) -> str | None:
        return self.status.failure_reason

    def on_transfer_request(
        self,
        peer_node: str,
        dst_pages: list[int],
        aux_slot: int,
        now: float,
        num_held_pages: int = 0,
    ) -> None:
        """The decode side is ready: it sent destination pages for this room, for the pages
        after the first ``num_held_pages`` (which it holds already: its prefix cache, or
        every page when it copied them from another sample of the prompt)."""
        if self.status.state is not KVPoll.Bootstrapping:
            return
        total = pages_needed(self.num_tokens, self.manager.page_size)
        # All of them: the decode node copied the prompt's KV from another sample of it
        # there; only the aux data (first token) moves.
        if not 0 <= num_held_pages <= total:
            self.fail(
                FailureReason.BAD_REQUEST,
                f"decode holds {num_held_pages} pages of {self.num_tokens} tokens "
                f"(at most {total})",
                now,
            )
            return
        needed = total - num_held_pages
        if len(dst_pages) != needed:
            self.fail(
                FailureReason.BAD_REQUEST,
                f"decode sent {len(dst_pages)} pages for {self.num_tokens} tokens "
                f"({needed} pages after {num_held_pages} held)",
                now,
            )
            return
        self.peer_node, self.dst_pages, self.aux_slot = peer_node, list(dst_pages), aux_slot
        self.num_held_pages = num_held_pages
        self.num_sent_pages = num_held_pages  # the held pages count as sent: they never move
        self.attached_at = now
        self.status.advance(KVPoll.WaitingForInput, now)
        self.manager.observe_bootstrap(self)

    def send(
        self,
        page_ids: list[int],
        num_computed_tokens: int,
        aux: AuxData | None = None,
        ready: WorkDone = COMPLETED,
    ) -> None:
        """Send the pages of the first `num_computed_tokens` tokens not sent yet.

        `page_ids` are this request's local pages in order. With `aux` (the last chunk),
        everything left goes, partial last page included, then the aux data. `ready` marks
        the end of the device work that computed them (common.work_done): the writes are
        posted once it has completed. Work on one stream completes in order, so the latest
        marker stands for every earlier chunk's pages too.
        """
        if self.status.state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
            return
        if self.is_last_sent:
            raise RuntimeError(f"room {self.room}: send() after the last chunk")
        is_last = aux is not None
        if is_last and num_computed_tokens != self.num_tokens:
            raise ValueError(
                f"room {self.room}: last chunk ends at {num_computed_tokens} "
                f"of {self.num_tokens} tokens"
            )
        ps = self.manager.page_size
        end = pages_needed(num_computed_tokens, ps) if is_last else num_computed_tokens // ps
        held = self.num_held_pages
        pairs = [(page_ids[i], self.dst_pages[i - held]) for i in range(self.num_sent_pages, end)]
        now = self.manager.clock()
        if self.first_send_at is None:
            self.first_send_at = now
            self.status.advance(KVPoll.Transferring, now)
        self.num_sent_pages = max(self.num_sent_pages, end)
        self.aux = aux
        self.is_last_sent = is_last
        self.pending_pairs += pairs
        self.pending_ready += [ready] * len(pairs)
        self.ready = ready
        if pairs or is_last:
            self.manager.flush_writes(self)

    def take_ready_pairs(self) -> list[tuple[int, int]]:
        """Remove and return the leading pending pairs whose work has completed (work on
        one stream completes in order, so the first pair still computing ends the run)."""
        num, last, is_done = 0, None, True
        for ready in self.pending_ready:
            if ready is not last:
                last, is_done = ready, ready.query()
            if not is_done:
                break
            num += 1
        pairs = self.pending_pairs[:num]
        del self.pending_pairs[:num], self.pending_ready[:num]
        return pairs

    @property
    def has_unposted_writes(self) -> bool:
        return bool(self.pending_pairs) or (self.is_last_sent and not self.is_last_posted)

    def abort(self, detail: str = "aborted by the prefill node") -> None:
        """Fail the room here and tell the decode side; pages are the caller's to free."""
        if self.fail(FailureReason.ABORTED, detail, self.manager.clock()):
            self.manager.stop_when_drained(self)  # once none of its writes is in flight

    def fail(self, reason: str, detail: str, now: float) -> bool:
        changed = self.status.fail(reason, detail, now)
        if changed:
            self.manager.observe_failure(self, reason)
        return changed

    def clear(self) -> None:
        """Forget the room (after Success or Failed, once the scheduler is done with it)."""
        self.manager.remove_sender(self)
