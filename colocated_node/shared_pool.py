"""The decode side's view of a pool it shares with a prefill radix cache.

In a colocated process the prefill scheduler's radix cache keeps prompt pages cached
that nobody is using; they are free for the taking. The decode scheduler sees them as
free (``num_free_pages`` counts them) and an allocation it cannot serve from the free
list evicts that many least-recently-used cached pages first. The prefill scheduler
keeps the plain allocator: it already evicts for itself and counts evictable pages on
its own (counting them twice would over-admit).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from common.kv_pool import PageAllocator


class Evictable(Protocol):
    num_evictable_pages: int

    def evict(self, num_pages: int) -> int: ...


class ReclaimingAllocator:
    """PageAllocator's interface over ``inner``, reclaiming from ``cache`` on demand."""

    def __init__(self, inner: PageAllocator, cache: Evictable) -> None:
        self.inner = inner
        self.cache = cache
        self.num_reclaimed_pages = 0

    @property
    def num_pages(self) -> int:
        return self.inner.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.inner.num_free_pages + self.cache.num_evictable_pages

    @property
    def num_used_pages(self) -> int:
        return self.inner.num_used_pages

    def can_allocate(self, num: int) -> bool:
        return 0 <= num <= self.num_free_pages

    def allocate(self, num: int) -> list[int]:
        short = num - self.inner.num_free_pages
        if short > 0:
            self.num_reclaimed_pages += self.cache.evict(short)
        return self.inner.allocate(num)

    def free(self, pages: Iterable[int]) -> None:
        self.inner.free(pages)

    def check_integrity(self) -> None:
        self.inner.check_integrity()
