"""Host-memory KV store for retracted requests: a preallocated host page pool the device
pool's pages are copied into and back, on a side stream with events on CUDA.

    offload(rid, pool, pages)   device pages -> host pages (host pool full: a pageable copy)
    load(rid, pool, pages)      host pages -> fresh device pages; the host pages are freed
    drop(rid)                   the request was aborted: its host pages are freed

On CUDA the host pool is pinned once at start (a retraction no longer copies to pageable
memory and pins it again); copies run on a side stream. Ordering is by events, never by a
host synchronisation: a copy waits for the compute stream (the KV it reads is complete),
and the compute stream waits for the copy (a freed device page is rewritten only after its
KV left, and a resumed request decodes only after its KV is back). Host pages are reused
only by later copies on the same side stream, so they too are ordered.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from common.kv_pool import KVPool, PageAllocator, page_runs_of
from common.side_stream import SideStream

logger = logging.getLogger(__name__)

HOST_MEMORY_SHARE = 8  # CUDA: the pinned pool takes at most 1/8 of the machine's memory


def default_host_pages(pool: KVPool, host_total_bytes: int) -> int:
    """As many host pages as the device pool has (retracted KV never exceeds it: admission
    stops while a request waits in host memory), on CUDA at most 1/8 of the machine's
    memory, since pinned memory is locked."""
    if pool.device.type != "cuda":
        return pool.num_pages
    return max(
        1, min(pool.num_pages, host_total_bytes // HOST_MEMORY_SHARE // pool.layout.bytes_per_page)
    )


class HostKVStore:
    """KV of retracted requests by rid: pages of a host pool, or a pageable copy when that
    pool was full. The only owner of host copies."""

    def __init__(self, pool: KVPool, num_pages: int) -> None:
        self.device = pool.device
        self.is_cuda = self.device.type == "cuda"
        self.buffer = torch.empty(
            (num_pages, *pool.layout.page_shape), dtype=pool.buffer.dtype, pin_memory=self.is_cuda
        )
        self.allocator = PageAllocator(num_pages)
        self._pages: dict[str, list[int]] = {}
        self._pageable: dict[str, torch.Tensor] = {}  # when the host pool was full
        self._page_bytes = pool.layout.bytes_per_page
        self._side = SideStream(self.device)
        self.num_pageable_copies = 0

    def offload(self, rid: str, pool: KVPool, pages: Sequence[int]) -> None:
        if rid in self:
            raise ValueError(f"request {rid} already has KV in host memory")
        if not self.allocator.can_allocate(len(pages)):
            # never lose a request: slower, but its KV is kept
            self.num_pageable_copies += 1
            logger.warning(
                "host KV pool full (%d pages free): request %s copied to pageable memory",
                self.allocator.num_free_pages,
                rid,
            )
            self._pageable[rid] = pool.read_pages(pages).to("cpu")
            return
        host_pages = self.allocator.allocate(len(pages))
        index = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        with self._side.after_compute() as compute:
            self._side.keep(index)
            staged = pool.buffer.index_select(0, index)  # contiguous, in the copy's order
            for run in page_runs_of(host_pages):
                self.buffer[run.start : run.start + run.length].copy_(
                    staged[run.offset : run.offset + run.length], non_blocking=self.is_cuda
                )
            self._side.done(compute)
        self._pages[rid] = host_pages

    def num_pages_of(self, rid: str) -> int:
        if rid in self._pageable:
            return int(self._pageable[rid].shape[0])
        return len(self._pages[rid])

    def load(self, rid: str, pool: KVPool, pages: Sequence[int]) -> None:
        if len(pages) != self.num_pages_of(rid):
            raise ValueError(
                f"request {rid}: {self.num_pages_of(rid)} pages in host memory, {len(pages)} given"
            )
        if rid in self._pageable:
            pool.write_pages(pages, self._pageable.pop(rid))
            return
        host_pages = self._pages.pop(rid)
        index = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        with self._side.after_compute() as compute:
            self._side.keep(index)
            staged = torch.empty(
                (len(pages), *pool.layout.page_shape), dtype=pool.buffer.dtype, device=self.device
            )
            for run in page_runs_of(host_pages):
                staged[run.offset : run.offset + run.length].copy_(
                    self.buffer[run.start : run.start + run.length], non_blocking=self.is_cuda
                )
            pool.buffer.index_copy_(0, index, staged)
            self._side.done(compute)
        self.allocator.free(host_pages)

    def drop(self, rid: str) -> bool:
        if self._pageable.pop(rid, None) is not None:
            return True
        host_pages = self._pages.pop(rid, None)
        if host_pages is None:
            return False
        self.allocator.free(host_pages)  # reused only by later copies on the side stream
        return True

    def __contains__(self, rid: object) -> bool:
        return rid in self._pages or rid in self._pageable

    def __len__(self) -> int:
        return len(self._pages) + len(self._pageable)

    @property
    def num_bytes(self) -> int:
        """Bytes of KV held (pages in the host pool, and pageable copies)."""
        pageable = sum(t.numel() * t.element_size() for t in self._pageable.values())
        return sum(map(len, self._pages.values())) * self._page_bytes + pageable

    def rids(self) -> set[str]:
        return set(self._pages) | set(self._pageable)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        held = sum(map(len, self._pages.values()))
        if held != self.allocator.num_used_pages:
            raise AssertionError(f"{held} host pages held, {self.allocator.num_used_pages} used")
