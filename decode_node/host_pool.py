"""Host-memory KV store for retracted requests: whole pages copied off the device pool and back."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.kv_pool import KVPool


class HostKVStore:
    """KV of retracted requests by rid, as [pages, *page_shape] tensors in host memory.

    The only owner of host copies: `offload` takes one, `load` puts it back into freshly
    allocated device pages and drops it, `drop` forgets it (abort).
    """

    def __init__(self, pin_memory: bool = False) -> None:
        self._pin_memory = pin_memory
        self._copies: dict[str, torch.Tensor] = {}

    def offload(self, rid: str, pool: KVPool, pages: Sequence[int]) -> None:
        if rid in self._copies:
            raise ValueError(f"request {rid} already has KV in host memory")
        data = pool.read_pages(pages).to("cpu")
        if self._pin_memory:
            data = data.pin_memory()
        self._copies[rid] = data

    def num_pages_of(self, rid: str) -> int:
        return int(self._copies[rid].shape[0])

    def load(self, rid: str, pool: KVPool, pages: Sequence[int]) -> None:
        data = self._copies[rid]
        if len(pages) != data.shape[0]:
            raise ValueError(f"request {rid}: {data.shape[0]} pages in host memory, "
                             f"{len(pages)} given")
        pool.write_pages(pages, data)
        del self._copies[rid]

    def drop(self, rid: str) -> bool:
        return self._copies.pop(rid, None) is not None

    def __contains__(self, rid: object) -> bool:
        return rid in self._copies

    def __len__(self) -> int:
        return len(self._copies)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._copies.values())

    def rids(self) -> set[str]:
        return set(self._copies)
