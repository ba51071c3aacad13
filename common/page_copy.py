"""Copies of KV pages between a device pool and a host page store, in bounded device memory.

    copier = PageCopier(pool)
    copier.to_host(pool.buffer, device_pages, host, host_pages)   # device page i -> host page i
    copier.to_device(host, host_pages, pool.buffer, device_pages)

A run of pages consecutive in both (cut where a host block ends, common/pinned_pages.py) is
one copy between the two, with no device memory of its own. Pages in short runs (a
fragmented pool) are gathered through a small staging buffer on the device instead, at most
STAGING_PAGES pages and STAGING_BYTES, allocated at the first need and reused chunk by chunk:
a few large host copies rather than many small ones. Every copy of a copier runs on its side
stream (common/side_stream.py) in issue order, so a chunk overwrites the staging buffer only
after the last chunk's copies read it, and a freed host page is rewritten only after the copy
that read it. A staging buffer the device has no memory for leaves every copy a direct one,
slower, never a failure.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from common.kv_pool import KVPool
from common.pinned_pages import PinnedPages
from common.side_stream import SideStream

logger = logging.getLogger(__name__)

STAGING_PAGES = 64  # the staging buffer's pages at most
STAGING_BYTES = 64 << 20  # and its bytes (a page over this: one page)
DIRECT_RUN_BYTES = 1 << 20  # a copy this large runs near the link's speed: never staged


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an allocation failed for want of memory (a device's, or the host's)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source page, first destination page, length) of the runs in which both lists
    go up by one, covering src -> dst in order."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages for {len(dst)} destination pages")
    runs: list[tuple[int, int, int]] = []
    for i, (s, d) in enumerate(zip(src, dst)):
        if i and s == src[i - 1] + 1 and d == dst[i - 1] + 1:
            first_s, first_d, n = runs[-1]
            runs[-1] = (first_s, first_d, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


class PageCopier:
    """The copies between one device pool's pages and host pages; owns the side stream and
    the staging buffer."""

    def __init__(self, pool: KVPool, *, staging_pages: int = STAGING_PAGES) -> None:
        self.device = pool.device
        self.page_shape = pool.layout.page_shape
        self.dtype = pool.buffer.dtype
        page_bytes = pool.layout.bytes_per_page
        self.staging_pages = max(1, min(staging_pages, STAGING_BYTES // page_bytes))
        # runs at least this long are copied directly (the staging buffer would take them
        # whole, or they are past the per-copy overhead)
        self.direct_run_pages = min(self.staging_pages, max(1, -(-DIRECT_RUN_BYTES // page_bytes)))
        self.side = SideStream(self.device)
        self._staging: torch.Tensor | None = None
        self.has_no_staging = False  # its allocation ran out of memory: direct copies only

    def to_host(
        self,
        device: torch.Tensor,
        device_pages: Sequence[int],
        host: PinnedPages,
        host_pages: Sequence[int],
    ) -> None:
        """Copy device[device_pages[i]] into host page host_pages[i], after the compute
        stream's work so far; the compute stream's next work waits for the copies."""
        non_blocking = host.is_pinned and self.device.type == "cuda"
        with self.side.after_compute() as compute:
            direct, staged = self._split(device_pages, host_pages)
            for d, h, n in direct:
                for k, rows in host.rows(h, n):
                    rows.copy_(device[d + k : d + k + len(rows)], non_blocking=non_blocking)
            for staging, index, chunk in self._chunks(staged):
                torch.index_select(device, 0, index, out=staging)
                for s, h, n in page_runs(range(len(chunk)), chunk):
                    for k, rows in host.rows(h, n):
                        rows.copy_(staging[s + k : s + k + len(rows)], non_blocking=non_blocking)
            self.side.done(compute)

    def to_device(
        self,
        host: PinnedPages,
        host_pages: Sequence[int],
        device: torch.Tensor,
        device_pages: Sequence[int],
    ) -> None:
        """Copy host page host_pages[i] into device[device_pages[i]], ordered as to_host."""
        non_blocking = host.is_pinned and self.device.type == "cuda"
        with self.side.after_compute() as compute:
            direct, staged = self._split(device_pages, host_pages)
            for d, h, n in direct:
                for k, rows in host.rows(h, n):
                    device[d + k : d + k + len(rows)].copy_(rows, non_blocking=non_blocking)
            for staging, index, chunk in self._chunks(staged):
                for s, h, n in page_runs(range(len(chunk)), chunk):
                    for k, rows in host.rows(h, n):
                        staging[s + k : s + k + len(rows)].copy_(rows, non_blocking=non_blocking)
                device.index_copy_(0, index, staging)
            self.side.done(compute)

    def _split(
        self, device_pages: Sequence[int], host_pages: Sequence[int]
    ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
        """The runs copied directly, and the (device, host) page pairs of the others, which
        go through the staging buffer (all runs direct when it is missing)."""
        runs = page_runs(device_pages, host_pages)
        short = [run for run in runs if run[2] < self.direct_run_pages]
        if not short or self._staging_buffer() is None:
            return runs, []
        direct = [run for run in runs if run[2] >= self.direct_run_pages]
        return direct, [(d + k, h + k) for d, h, n in short for k in range(n)]

    def _chunks(
        self, pairs: list[tuple[int, int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
        """(the staging rows, the device pages' index, the host pages) of each chunk of at
        most staging_pages pairs; made on the side stream, where they are used."""
        if not pairs:
            return []
        assert self._staging is not None
        index = self._device_index([d for d, _ in pairs])
        chunks = []
        for i in range(0, len(pairs), self.staging_pages):
            chunk = pairs[i : i + self.staging_pages]
            rows, host_pages = self._staging[: len(chunk)], [h for _, h in chunk]
            chunks.append((rows, index[i : i + len(chunk)], host_pages))
        return chunks

    def _device_index(self, pages: list[int]) -> torch.Tensor:
        index = torch.tensor(pages, dtype=torch.long)
        if self.device.type != "cuda":
            return index
        return index.pin_memory().to(self.device, non_blocking=True)  # the host never waits

    def _staging_buffer(self) -> torch.Tensor | None:
        if self._staging is None and not self.has_no_staging:
            try:
                self._staging = torch.empty(
                    (self.staging_pages, *self.page_shape), dtype=self.dtype, device=self.device
                )
            except RuntimeError as exc:  # torch.OutOfMemoryError is one
                if not is_out_of_memory(exc):
                    raise
                self.has_no_staging = True
                logger.warning(
                    "no device memory for a %d-page staging buffer: host copies of scattered "
                    "pages go page by page from now on (%s)",
                    self.staging_pages,
                    exc,
                )
        return self._staging
