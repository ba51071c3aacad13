"""Retracted requests: their KV in host memory, their device pages freed, resumed first in order.

running ──retract()──▶ retracted_queue (KV copied to HostKVStore, device pages freed)
retracted_queue ──resume(n)──▶ waiting (pages allocated, KV written back, host copy dropped)
retracted_queue ──remove()──▶ gone (abort: the host copy is dropped)

A retraction that runs out of memory raises RetractionFailed (decode_node/host_pool.py) and
leaves the request as it was, outside the queue with its device pages: the caller fails it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from common.kv_pool import KVPool, PageSource, pages_needed
from common.model.memory import device_memory
from decode_node.host_pool import HostKVStore, RetractionFailed, host_pages_for
from decode_node.req import DecodeReq, DecodeState

__all__ = ["RetractedQueue", "RetractionFailed"]

logger = logging.getLogger(__name__)


class RetractedQueue:
    def __init__(
        self,
        pool: KVPool,
        allocator: PageSource | None = None,
        release: Callable[[DecodeReq], None] | None = None,
        *,
        host_pool_size_gb: float = 0.0,
        host_pages: int | None = None,
    ) -> None:
        """`allocator`: where pages come from (the pool's when None); `release`: frees what
        a retracted request holds (with a prefix cache its prefix goes back to the cache;
        None: its pages are freed); `host_pool_size_gb`: the host pool's size
        (--host-pool-size; 0: default_host_pages's rule); `host_pages`: its size in pages
        instead (tests)."""
        self.pool = pool
        self.allocator: PageSource = allocator if allocator is not None else pool.allocator
        self._release = release
        sized_by = f"{host_pages} pages given"
        if host_pages is None:
            ram = device_memory(torch.device("cpu")).total
            host_pages = host_pages_for(pool, host_pool_size_gb, ram)
            sized_by = (
                f"--host-pool-size {host_pool_size_gb:g}"
                if host_pool_size_gb > 0
                else "the default: the device pool's pages, on CUDA at most 1/8 of RAM"
            )
        self.host = HostKVStore(pool, host_pages)
        pages = self.host.pages
        logger.info(
            "retraction host pool: %d pages, %.2f GB%s (%s)",
            host_pages,
            pages.nbytes / 2**30,
            f" pinned in {len(pages.blocks)} blocks" if pages.is_pinned else "",
            sized_by,
        )
        self.queue: list[DecodeReq] = []

    def retract(self, r: DecodeReq) -> None:
        """Copy r's KV to host memory and free its device pages; its output stays.

        The caller has taken r out of the running batch. RetractionFailed (out of memory):
        r is unchanged, not in the queue and holding its pages; the caller fails it.
        """
        kv_pages = r.pages[: pages_needed(r.kv_len, self.pool.page_size)]
        self.host.offload(r.rid, self.pool, kv_pages)
        if self._release is not None:
            self._release(r)
        else:
            self.allocator.free(r.pages)
        r.pages = []
        r.advance(DecodeState.RETRACTED)
        r.num_retractions += 1
        self.queue.append(r)

    def resume(self, num: int) -> list[DecodeReq]:
        """Bring back up to `num` requests from the head (fewer if pages run short), WAITING."""
        resumed = []
        for r in self.queue[:num]:
            num_pages = pages_needed(r.kv_len, self.pool.page_size)
            if not self.allocator.can_allocate(num_pages):
                break
            r.pages = self.allocator.allocate(num_pages)
            self.host.load(r.rid, self.pool, r.pages)
            r.advance(DecodeState.WAITING)
            resumed.append(r)
        del self.queue[: len(resumed)]
        return resumed

    def remove(self, r: DecodeReq) -> bool:
        """Forget r (aborted) and drop its host copy."""
        if r not in self.queue:
            return False
        self.queue.remove(r)
        self.host.drop(r.rid)
        return True

    def check_integrity(self) -> None:
        self.host.check_integrity()
        if self.host.rids() != {r.rid for r in self.queue}:
            raise AssertionError("host KV copies and retracted requests disagree")
        for r in self.queue:
            if r.pages or r.state is not DecodeState.RETRACTED:
                raise AssertionError(
                    f"retracted request {r.rid} is {r.state.value} with {len(r.pages)} device pages"
                )
            if self.host.num_pages_of(r.rid) != pages_needed(r.kv_len, self.pool.page_size):
                raise AssertionError(f"retracted request {r.rid}: host copy has the wrong size")

    def __len__(self) -> int:
        return len(self.queue)

    def __bool__(self) -> bool:
        return bool(self.queue)

    def __iter__(self) -> Iterator[DecodeReq]:
        return iter(self.queue)

    def __getitem__(self, i: int) -> DecodeReq:
        return self.queue[i]
