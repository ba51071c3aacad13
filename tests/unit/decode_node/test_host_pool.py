"""Retraction's host page pool (decode_node/host_pool.py): bytes back equal, pages accounted,
one pool allocated once (pinned on CUDA), a pageable copy only when it is full, no copy that
stages a whole request on the device, and an out-of-memory that fails one retraction alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from common.kv_pool import KVLayout, KVPool, page_runs_of
from decode_node.host_pool import (
    HostKVStore,
    RetractionFailed,
    default_host_pages,
    host_pages_for,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")
SCATTERED = list(range(1, 200, 2))  # 100 pages, none next to another


def _pool(device, num_pages=16) -> KVPool:
    pool = KVPool(LAYOUT, num_pages, device)
    gen = torch.Generator().manual_seed(3)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(pool.buffer.dtype))
    return pool


class NewTensors(TorchDispatchMode):
    """The bytes of every tensor an op makes that is no view of a tensor it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.nbytes.append(t.untyped_storage().nbytes())
        return out


def test_page_runs():
    runs = page_runs_of([4, 5, 6, 1, 9, 10])
    assert [(r.start, r.offset, r.length) for r in runs] == [(4, 0, 3), (1, 3, 1), (9, 4, 2)]
    assert page_runs_of([]) == []


def test_offload_and_load_bring_every_byte_back_through_fragmented_host_pages(device):
    pool = _pool(device)
    store = HostKVStore(pool, 8)
    addresses = [b.data_ptr() for b in store.pages.blocks]
    assert [b.shape[0] for b in store.pages.blocks] == [8]
    assert all(b.is_pinned() == (device.type == "cuda") for b in store.pages.blocks)
    expect = {
        rid: pool.buffer[pages].clone()
        for rid, pages in (("a", [3, 7]), ("b", [0, 1, 2]), ("c", [9]))
    }
    store.offload("a", pool, [3, 7])
    store.offload("b", pool, [0, 1, 2])
    store.offload("c", pool, [9])
    assert store.drop("b")  # its host pages free again, between a's and c's
    store.offload("d", pool, [10, 11, 12, 13])  # fills b's hole and runs past c's page
    expect["d"] = pool.buffer[[10, 11, 12, 13]].clone()
    pool.buffer.zero_()  # the device pages are reused by others meanwhile
    store.check_integrity()
    assert store.allocator.num_used_pages == 7 and len(store) == 3
    for rid, pages in (("d", [0, 1, 2, 3]), ("a", [14, 15]), ("c", [5])):
        store.load(rid, pool, pages)
        torch.cuda.synchronize() if device.type == "cuda" else None
        assert torch.equal(pool.buffer[pages], expect[rid]), rid
    assert len(store) == 0 and store.allocator.num_used_pages == 0
    assert [b.data_ptr() for b in store.pages.blocks] == addresses  # allocated (pinned) once
    store.check_integrity()


@pytest.mark.parametrize(
    "pages",
    [list(range(10, 110)), SCATTERED, [*range(0, 40), *SCATTERED[30:90]]],
    ids=["contiguous", "scattered", "both"],
)
@pytest.mark.parametrize("block_pages", [None, [64, 32, 16, 8]], ids=["one-block", "blocks"])
def test_no_copy_takes_more_device_memory_than_the_staging_buffer(device, pages, block_pages):
    pool = _pool(device, num_pages=256)
    store = HostKVStore(pool, 120, staging_pages=16)
    if block_pages is not None:  # CUDA's blocks, on any device: runs cut at block ends
        store.pages = type(store.pages)(
            120, LAYOUT.page_shape, pool.buffer.dtype, pin=False, block_pages=block_pages
        )
    store.offload("pad", pool, [255] * 7)  # the request's host pages start at 7: mid-block
    expect = pool.buffer[pages].clone()
    back = [p + 1 for p in pages[::-1]]  # reloaded elsewhere, in another order
    allocations = NewTensors()
    with allocations:
        store.offload("r", pool, pages)
        pool.buffer.zero_()
        store.load("r", pool, back)
    torch.cuda.synchronize() if device.type == "cuda" else None
    assert torch.equal(pool.buffer[back], expect)
    staging = store.copier.staging_pages * LAYOUT.bytes_per_page
    assert store.copier.staging_pages == 16
    assert max(allocations.nbytes, default=0) <= staging < len(pages) * LAYOUT.bytes_per_page
    store.drop("pad")
    store.check_integrity()
    assert store.allocator.num_used_pages == 0


def test_a_full_host_pool_falls_back_to_a_pageable_copy_in_bounded_chunks(device):
    pool = _pool(device, num_pages=256)
    store = HostKVStore(pool, 2, staging_pages=8)
    expect = pool.buffer[SCATTERED].clone()
    allocations = NewTensors()
    with allocations:
        store.offload("big", pool, SCATTERED)
    assert store.num_pageable_copies == 1 and store.num_pages_of("big") == 100
    assert store.allocator.num_used_pages == 0
    page = LAYOUT.bytes_per_page
    largest, *others = sorted(allocations.nbytes, reverse=True)
    assert largest == 100 * page  # the pageable copy itself, on the host
    assert max(others, default=0) <= 8 * page  # and no more than the staging buffer
    pool.buffer.zero_()
    store.load("big", pool, list(range(100)))
    torch.cuda.synchronize() if device.type == "cuda" else None
    assert torch.equal(pool.buffer[:100], expect) and "big" not in store
    with pytest.raises(ValueError):
        store.offload("x", pool, [1])
        store.offload("x", pool, [2])


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB"),
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes"),
    ],
    ids=["OutOfMemoryError", "host"],
)
def test_no_memory_for_a_pageable_copy_fails_that_retraction_alone(monkeypatch, error):
    import decode_node.host_pool as host_pool

    pool = _pool("cpu")
    store = HostKVStore(pool, 4)
    store.offload("small", pool, [0, 1, 2])
    pinned = host_pool.PinnedPages

    def no_memory(*args, **kwargs):
        if not kwargs["pin"]:
            raise error
        return pinned(*args, **kwargs)

    monkeypatch.setattr(host_pool, "PinnedPages", no_memory)
    with pytest.raises(RetractionFailed) as failed:
        store.offload("big", pool, [4, 5, 6, 7])
    assert failed.value.rid == "big" and "big" in str(failed.value)
    assert store.rids() == {"small"} and store.num_pageable_copies == 0
    assert store.allocator.num_used_pages == 3
    store.check_integrity()


def test_an_out_of_memory_while_copying_frees_the_host_pages_it_took(monkeypatch):
    pool = _pool("cpu", num_pages=64)
    store = HostKVStore(pool, 40, staging_pages=4)
    store.offload("a", pool, [0, 1])

    def no_memory(pages):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(store.copier, "_device_index", no_memory)
    with pytest.raises(RetractionFailed, match="out of memory"):
        store.offload("b", pool, list(range(10, 40, 2)))  # scattered: needs an index
    assert store.rids() == {"a"} and store.allocator.num_used_pages == 2
    store.check_integrity()
    monkeypatch.undo()
    store.offload("b", pool, list(range(10, 40, 2)))  # its host pages are free again
    assert store.allocator.num_used_pages == 2 + 15


def test_other_errors_are_not_a_failed_retraction(monkeypatch):
    pool = _pool("cpu")
    store = HostKVStore(pool, 4)

    def broken(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(store.copier, "to_host", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        store.offload("a", pool, [0])
    assert len(store) == 0 and store.allocator.num_used_pages == 0


def test_the_default_size_is_the_device_pool_capped_on_cuda():
    pool = _pool("cpu", num_pages=100)
    assert default_host_pages(pool, 1 << 40) == 100
    assert default_host_pages(pool, 0) == 100  # the CPU: plain memory, touched only when used


def test_host_pool_size_in_gigabytes_or_else_the_default():
    pool = _pool("cpu", num_pages=100)
    assert host_pages_for(pool, 1.0, 1 << 40) == (1 << 30) // LAYOUT.bytes_per_page
    assert host_pages_for(pool, 1e-9, 1 << 40) == 1
    assert host_pages_for(pool, 0.0, 1 << 40) == default_host_pages(pool, 1 << 40) == 100
