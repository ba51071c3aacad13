"""Host-memory KV pages: the second tier under a device KV pool (the prefill radix cache's
HiCache tier, prefill_node/hiradix_cache.py).

Same page layout as the device pool, so pages move as rows: one copy per run of pages
consecutive in both pools (allocators hand out low ids first, so runs are long). On a GPU
the host buffer is pinned and the copies run on a side stream (common/side_stream.py),
overlapping compute: a backup waits for the forward that wrote its pages, and the compute
stream's next work (the extend that reads loaded pages, a forward that rewrites backed-up
ones) waits for the copies, on the GPU: the loop never waits. Host pages are read and
written only by copies on that one stream, so their reuse is ordered too. On the CPU both
tiers are host memory and a copy is a memcpy in the loop.
"""

from __future__ import annotations

import torch

from common.kv_pool import KVLayout, KVPool, PageAllocator, torch_dtype
from common.side_stream import SideStream


class HostKVPool:
    def __init__(self, device_pool: KVPool, num_pages: int) -> None:
        layout = device_pool.layout
        self.device_pool = device_pool
        self.allocator = PageAllocator(num_pages)
        self.num_pages = num_pages
        self.buffer = torch.empty(
            (num_pages, *layout.page_shape),
            dtype=torch_dtype(layout.dtype),
            pin_memory=device_pool.device.type == "cuda",
        )
        self._side = SideStream(device_pool.device)

    @staticmethod
    def num_pages_for(layout: KVLayout, num_device_pages: int, size_gb: float, ratio: float) -> int:
        """SGLang's sizing: ``size_gb`` of host memory when positive, else ``ratio`` times
        the device pool's pages."""
        if size_gb > 0:
            return max(1, int(size_gb * (1 << 30)) // layout.bytes_per_page)
        return max(1, int(num_device_pages * ratio))

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def backup(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device pages into host pages (page i into host page i)."""
        device = self.device_pool.buffer
        with self._side.after_compute() as compute:
            for src, dst, n in page_runs(device_pages, host_pages):
                self.buffer[dst : dst + n].copy_(device[src : src + n], non_blocking=True)
            self._side.done(compute)

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages into device pages (host page i into page i)."""
        device = self.device_pool.buffer
        with self._side.after_compute() as compute:
            for src, dst, n in page_runs(host_pages, device_pages):
                device[dst : dst + n].copy_(self.buffer[src : src + n], non_blocking=True)
            self._side.done(compute)


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
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
