"""Host-memory KV store for retracted requests: a host page pool, sized once at start, that
the device pool's pages are copied into and back, in bounded device memory.

    offload(rid, pool, pages)   device pages -> host pages (host pool full: a pageable copy)
    load(rid, pool, pages)      host pages -> fresh device pages; the host pages are freed
    drop(rid)                   the request was aborted: its host pages are freed

On CUDA the host pool is pinned once at start, in power-of-two blocks of pages that pin
exactly its bytes (common/pinned_pages.py); a retraction copies no whole request through
the device: each run of pages consecutive in both pools is one copy, scattered pages go
through a staging buffer of a few pages (common/page_copy.py). Copies run on a side stream,
ordered by events, never by a host synchronisation: a copy waits for the compute stream
(the KV it reads is complete), and the compute stream waits for the copy (a freed device
page is rewritten only after its KV left, and a resumed request decodes only after its KV
is back). Host pages and the staging buffer are reused only by later copies on the same
side stream, so they too are ordered.

A retraction that runs out of memory (no host memory for a pageable copy) raises
RetractionFailed and leaves nothing behind: that request alone fails, holding its device
pages as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from common.kv_pool import KVPool, PageAllocator
from common.page_copy import STAGING_PAGES, PageCopier, is_out_of_memory
from common.pinned_pages import PinnedPages

logger = logging.getLogger(__name__)

HOST_MEMORY_SHARE = 8  # CUDA: the default pinned pool takes at most 1/8 of the machine's memory


class RetractionFailed(RuntimeError):
    """A request's KV could not be copied to host memory (out of memory). Nothing of it is
    in the store; it still holds its device pages, and the caller fails it (retryable)."""

    def __init__(self, rid: str, reason: str) -> None:
        super().__init__(f"request {rid}: retraction to host memory failed: {reason}")
        self.rid = rid
        self.reason = reason


def default_host_pages(pool: KVPool, host_total_bytes: int) -> int:
    """As many host pages as the device pool has (retracted KV never exceeds it: admission
    stops while a request waits in host memory), on CUDA at most 1/8 of the machine's
    memory, since pinned memory is locked."""
    if pool.device.type != "cuda":
        return pool.num_pages
    return max(
        1, min(pool.num_pages, host_total_bytes // HOST_MEMORY_SHARE // pool.layout.bytes_per_page)
    )


def host_pages_for(pool: KVPool, size_gb: float, host_total_bytes: int) -> int:
    """--host-pool-size: `size_gb` GB of host pages when positive, else default_host_pages."""
    if size_gb > 0:
        return max(1, int(size_gb * (1 << 30)) // pool.layout.bytes_per_page)
    return default_host_pages(pool, host_total_bytes)


class HostKVStore:
    """KV of retracted requests by rid: pages of a host pool, or a pageable copy when that
    pool was full. The only owner of host copies."""

    def __init__(self, pool: KVPool, num_pages: int, *, staging_pages: int = STAGING_PAGES) -> None:
        self.device = pool.device
        self.is_cuda = self.device.type == "cuda"
        self.page_shape = pool.layout.page_shape
        self.dtype = pool.buffer.dtype
        self.pages = PinnedPages(num_pages, self.page_shape, self.dtype, pin=self.is_cuda)
        self.allocator = PageAllocator(num_pages)
        self.copier = PageCopier(pool, staging_pages=staging_pages)
        self._host_pages: dict[str, list[int]] = {}
        self._pageable: dict[str, PinnedPages] = {}  # when the host pool was full
        self.num_pageable_copies = 0

    def offload(self, rid: str, pool: KVPool, pages: Sequence[int]) -> None:
        """Copy a request's device pages to host memory; RetractionFailed when it runs out
        of memory (the store is as before)."""
        if rid in self:
            raise ValueError(f"request {rid} already has KV in host memory")
        if not self.allocator.can_allocate(len(pages)):
            self._offload_pageable(rid, pool, pages)
            return
        host_pages = self.allocator.allocate(len(pages))
        try:
            self.copier.to_host(pool.buffer, pages, self.pages, host_pages)
        except RuntimeError as exc:
            self.allocator.free(host_pages)  # reused only by later copies on the side stream
            if is_out_of_memory(exc):
                raise RetractionFailed(rid, str(exc)) from exc
            raise
        self._host_pages[rid] = host_pages

    def _offload_pageable(self, rid: str, pool: KVPool, pages: Sequence[int]) -> None:
        # never lose a request to a full host pool: slower, but its KV is kept
        logger.warning(
            "host KV pool full (%d pages free): request %s copied to pageable memory",
            self.allocator.num_free_pages,
            rid,
        )
        try:
            copy = PinnedPages(len(pages), self.page_shape, self.dtype, pin=False)
            self.copier.to_host(pool.buffer, pages, copy, range(len(pages)))
        except RuntimeError as exc:
            if not is_out_of_memory(exc):
                raise
            raise RetractionFailed(rid, f"a pageable copy of {len(pages)} pages: {exc}") from exc
        self.num_pageable_copies += 1
        self._pageable[rid] = copy

    def num_pages_of(self, rid: str) -> int:
        if rid in self._pageable:
            return self._pageable[rid].num_pages
        return len(self._host_pages[rid])

    def load(self, rid: str, pool: KVPool, pages: Sequence[int]) -> None:
        if len(pages) != self.num_pages_of(rid):
            raise ValueError(
                f"request {rid}: {self.num_pages_of(rid)} pages in host memory, {len(pages)} given"
            )
        copy = self._pageable.get(rid)
        if copy is not None:
            self.copier.to_device(copy, range(len(pages)), pool.buffer, pages)
            del self._pageable[rid]  # a pageable copy is read before to_device returns
            return
        host_pages = self._host_pages[rid]
        self.copier.to_device(self.pages, host_pages, pool.buffer, pages)
        del self._host_pages[rid]
        self.allocator.free(host_pages)

    def drop(self, rid: str) -> bool:
        if self._pageable.pop(rid, None) is not None:
            return True
        host_pages = self._host_pages.pop(rid, None)
        if host_pages is None:
            return False
        self.allocator.free(host_pages)  # reused only by later copies on the side stream
        return True

    def __contains__(self, rid: object) -> bool:
        return rid in self._host_pages or rid in self._pageable

    def __len__(self) -> int:
        return len(self._host_pages) + len(self._pageable)

    @property
    def num_bytes(self) -> int:
        """Bytes of KV held (pages in the host pool, and pageable copies)."""
        pageable = sum(copy.nbytes for copy in self._pageable.values())
        return sum(map(len, self._host_pages.values())) * self.pages.page_bytes + pageable

    def rids(self) -> set[str]:
        return set(self._host_pages) | set(self._pageable)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        held = sum(map(len, self._host_pages.values()))
        if held != self.allocator.num_used_pages:
            raise AssertionError(f"{held} host pages held, {self.allocator.num_used_pages} used")
