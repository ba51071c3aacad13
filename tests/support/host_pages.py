"""A host tier's page store without KV (common/radix_node.HostPages): the page ids are
allocated and freed as the tier does, no byte is copied. For tests of what the tree does
with its host tier (matches, orders, events), not of what the pages hold."""

from __future__ import annotations

from common.kv_pool import PageAllocator


class NoCopyHost:
    def __init__(self, num_pages: int) -> None:
        self.allocator = PageAllocator(num_pages)

    def backup(self, device_pages: list[int], host_pages: list[int]) -> None:
        pass

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        pass
