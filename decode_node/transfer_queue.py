"""Decode transfer queue (requests whose KV is arriving) and the release queue for failed rooms.

prealloc ─▶ transfer_queue ─┬─ Success ─▶ commit first token + aux ─▶ waiting queue
                            └─ Failed  ─▶ ReqFailed now; pages ─▶ release_queue
release_queue: (receiver, pages) of failed or aborted rooms; the pages go back to the
allocator only once receiver.is_release_safe() (no write can still land in them),
and are never handed to anything else before that. It also holds the page a decode step
still in flight writes for a request that ended meanwhile (overlap scheduling,
decode_node/running_batch.py), until that step's device work has completed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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


class Completion(Protocol):
    """Device work that may still write some pages (a decode step in flight)."""

    def is_complete(self) -> bool: ...


@dataclass
class PendingRelease:
    receiver: KVReceiver | None  # a failed room's (None: pages a step in flight writes)
    pages: list[int]
    work: Completion | None = None

    def is_safe(self) -> bool:
        if self.receiver is not None:
            return self.receiver.is_release_safe()
        return self.work is None or self.work.is_complete()


class ReleaseQueue:
    """Pages of failed rooms waiting until their receiver says no write can still land, and
    pages a decode step in flight writes, waiting for its device work."""

    def __init__(self, allocator: PageSource) -> None:
        self.allocator = allocator
        self.queue: list[PendingRelease] = []

    def add(self, receiver: KVReceiver, pages: list[int]) -> None:
        """Take over a failed room's pages; frees them at once if that is already safe."""
        self.queue.append(PendingRelease(receiver, list(pages)))
        self.release_safe()

    def add_after(self, work: Completion, pages: list[int]) -> None:
        """Take over pages that `work` (a step in flight) may still write."""
        self.queue.append(PendingRelease(None, list(pages), work))
        self.release_safe()

    def release_safe(self) -> int:
        """Free every entry that is now safe; returns the number of pages freed."""
        num_freed = 0
        keep = []
        for p in self.queue:
            if p.is_safe():
                self.allocator.free(p.pages)
                if p.receiver is not None:
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
