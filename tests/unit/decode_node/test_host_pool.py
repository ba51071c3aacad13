"""Retraction's host page pool (decode_node/host_pool.py): bytes back equal, pages accounted,
one pool allocated once (pinned on CUDA), a pageable copy only when it is full."""

from __future__ import annotations

import pytest
import torch

from common.kv_pool import KVLayout, KVPool, page_runs_of
from decode_node.host_pool import HostKVStore, default_host_pages

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")


def _pool(device, num_pages=16) -> KVPool:
    pool = KVPool(LAYOUT, num_pages, device)
    gen = torch.Generator().manual_seed(3)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(pool.buffer.dtype))
    return pool


def test_page_runs():
    runs = page_runs_of([4, 5, 6, 1, 9, 10])
    assert [(r.start, r.offset, r.length) for r in runs] == [(4, 0, 3), (1, 3, 1), (9, 4, 2)]
    assert page_runs_of([]) == []


def test_offload_and_load_bring_every_byte_back_through_fragmented_host_pages(device):
    pool = _pool(device)
    store = HostKVStore(pool, 8)
    address = store.buffer.data_ptr()
    assert store.buffer.is_pinned() == (device.type == "cuda")
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
    assert store.buffer.data_ptr() == address  # allocated (and pinned) once
    store.check_integrity()


def test_a_full_host_pool_falls_back_to_a_pageable_copy(device):
    pool = _pool(device)
    store = HostKVStore(pool, 2)
    expect = pool.buffer[[4, 5, 6]].clone()
    store.offload("big", pool, [4, 5, 6])
    assert store.num_pageable_copies == 1 and store.num_pages_of("big") == 3
    assert store.allocator.num_used_pages == 0
    pool.buffer.zero_()
    store.load("big", pool, [1, 2, 3])
    assert torch.equal(pool.buffer[[1, 2, 3]], expect) and "big" not in store
    with pytest.raises(ValueError):
        store.offload("x", pool, [1])
        store.offload("x", pool, [2])


def test_the_default_size_is_the_device_pool_capped_on_cuda():
    pool = _pool("cpu", num_pages=100)
    assert default_host_pages(pool, 1 << 40) == 100
    assert default_host_pages(pool, 0) == 100  # the CPU: plain memory, touched only when used
