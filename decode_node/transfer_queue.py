"""Decode transfer queue (requests whose KV is arriving) and the release queue for failed rooms.

prealloc ─▶ transfer_queue ─┬─ Success ─▶ commit first token + aux ─▶ waiting queue
                            └─ Failed  ─▶ ReqFailed now; pages ─▶ release_queue
release_queue: (receiver, pages) of failed or aborted rooms; the pages go back to the
allocator only once receiver.is_release_safe() (no write can still land in them),
and are never handed to anything else before that.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.kv_pool import PageSource
from decode_node.req import DecodeReq
from transfer.kv_poll import KVPoll
from transfer.kv_receiver import KVReceiver


class DecodeTransferQueue:
    """Requests with destination pages allocated and metadata sent, in admission order."""

    def __init__(self) -> None:
        self.queue: list[DecodeReq] = []

    def add(self, req: DecodeReq) -> None:
        self.queue.append(req)

    def remove(self, req: DecodeReq) -> bool:
        if req in self.queue:
            self.queue.remove(req)
            return True
        return False

    def pop_transferred(self) -> tuple[list[DecodeReq], list[DecodeReq]]:
        """(KV and aux data in place, transfer failed); both leave the queue.

        The receiver verified the room echo and the page count before reporting Success.
        """
        done, failed, keep = [], [], []
        for r in self.queue:
            state = r.receiver.poll() if r.receiver is not None else KVPoll.Failed
            if state is KVPoll.Success:
                done.append(r)
            elif state is KVPoll.Failed:
                failed.append(r)
            else:
                keep.append(r)
        self.queue = keep
        return done, failed

    def __len__(self) -> int:
        return len(self.queue)


@dataclass
class PendingRelease:
    receiver: KVReceiver
    pages: list[int]


class ReleaseQueue:
    """Pages of failed rooms waiting until their receiver says no write can still land."""

    def __init__(self, allocator: PageSource) -> None:
        self.allocator = allocator
        self.queue: list[PendingRelease] = []

    def add(self, receiver: KVReceiver, pages: list[int]) -> None:
        """Take over a failed room's pages; frees them at once if that is already safe."""
        self.queue.append(PendingRelease(receiver, list(pages)))
        self.release_safe()

    def release_safe(self) -> int:
        """Free every entry that is now safe; returns the number of pages freed."""
        num_freed = 0
        keep = []
        for p in self.queue:
            if p.receiver.is_release_safe():
                self.allocator.free(p.pages)
                p.receiver.clear()
                num_freed += len(p.pages)
            else:
                keep.append(p)
        self.queue = keep
        return num_freed

    @property
    def num_pages(self) -> int:
        return sum(len(p.pages) for p in self.queue)

    def all_pages(self) -> list[int]:
        return [page for p in self.queue for page in p.pages]

    def __len__(self) -> int:
        return len(self.queue)
