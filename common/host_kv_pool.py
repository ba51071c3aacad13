"""Host-memory KV pages: the second tier under a device KV pool (the prefill radix cache's
HiCache tier, prefill_node/hiradix_cache.py).

Same page layout as the device pool, so pages move as rows: one copy per run of pages
consecutive in both pools (allocators hand out low ids first, so runs are long), scattered
pages through a small staging buffer (common/page_copy.py). On a GPU the host pages are
pinned once, in power-of-two blocks that pin exactly their bytes (common/pinned_pages.py),
and the copies run on a side stream (common/side_stream.py), overlapping compute: a backup
waits for the forward that wrote its pages, and the compute stream's next work (the extend
that reads loaded pages, a forward that rewrites backed-up ones) waits for the copies, on
the GPU: the loop never waits. Host pages (and the staging buffer) are read and written
only by copies on that one stream, so their reuse is ordered too. On the CPU both tiers are
host memory and a copy is a memcpy in the loop.
"""

from __future__ import annotations

from common.kv_pool import KVLayout, KVPool, PageAllocator, torch_dtype
from common.page_copy import PageCopier
from common.pinned_pages import PinnedPages


class HostKVPool:
    def __init__(self, device_pool: KVPool, num_pages: int) -> None:
        layout = device_pool.layout
        self.device_pool = device_pool
        self.allocator = PageAllocator(num_pages)
        self.num_pages = num_pages
        self.pages = PinnedPages(
            num_pages,
            layout.page_shape,
            torch_dtype(layout.dtype),
            pin=device_pool.device.type == "cuda",
        )
        self._copier = PageCopier(device_pool)

    @staticmethod
    def num_pages_for(layout: KVLayout, num_device_pages: int, size_gb: float, ratio: float) -> int:
        """SGLang's sizing: ``size_gb`` of host memory when positive, else ``ratio`` times
        the device pool's pages."""
        if size_gb > 0:
            return max(1, int(size_gb * (1 << 30)) // layout.bytes_per_page)
        return max(1, int(num_device_pages * ratio))

    @property
    def nbytes(self) -> int:
        return self.pages.nbytes

    def backup(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages into host pages (page i into host page i)."""
        self._copier.to_host(self.device_pool.buffer, device_pages, self.pages, host_pages)

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages into device pages (host page i into page i)."""
        self._copier.to_device(self.pages, host_pages, self.device_pool.buffer, device_pages)
