"""Host-memory KV pages: the second tier under a device KV pool (the prefill radix cache's
HiCache tier, prefill_node/hiradix_cache.py).

Same page layout as the device pool, so a page moves with one row copy. On a GPU the host
buffer is pinned (copies by DMA, no staging); on the CPU both tiers are host memory and a
copy is a memcpy per page.
"""

from __future__ import annotations

import torch

from common.kv_pool import KVLayout, KVPool, PageAllocator, torch_dtype


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
        """Copy device pages into host pages (one row each)."""
        src = torch.tensor(device_pages, dtype=torch.long, device=self.device_pool.device)
        rows = self.device_pool.buffer.index_select(0, src)
        self.buffer.index_copy_(0, torch.tensor(host_pages, dtype=torch.long), rows.cpu())

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host pages into device pages (one row each)."""
        device = self.device_pool.device
        rows = self.buffer.index_select(0, torch.tensor(host_pages, dtype=torch.long))
        dst = torch.tensor(device_pages, dtype=torch.long, device=device)
        self.device_pool.buffer.index_copy_(0, dst, rows.to(device, non_blocking=True))
