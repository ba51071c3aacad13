"""Page allocator and KV pool invariants."""

from __future__ import annotations

import random

import pytest
import torch

from common.kv_pool import KVLayout, KVPool, OutOfPages, PageAllocator, pages_needed

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, page_size=8, dtype="float32")


def test_allocate_and_free_round_trip_keeps_counts():
    alloc = PageAllocator(10)
    a = alloc.allocate(4)
    b = alloc.allocate(6)
    assert sorted(a + b) == list(range(10))
    assert not alloc.can_allocate(1) and alloc.can_allocate(0)
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    alloc.free(a)
    assert alloc.num_free_pages == 4 and alloc.num_used_pages == 6
    alloc.free(b)
    assert alloc.num_free_pages == 10
    alloc.check_integrity()


def test_fresh_pool_hands_out_contiguous_runs_lowest_first():
    alloc = PageAllocator(16)
    assert alloc.allocate(5) == [0, 1, 2, 3, 4]
    assert alloc.allocate(3) == [5, 6, 7]
    alloc.free([2, 1, 3])
    assert alloc.allocate(3) == [1, 2, 3]


def test_double_free_and_foreign_pages_raise_and_change_nothing():
    alloc = PageAllocator(6)
    pages = alloc.allocate(3)
    alloc.free([pages[0]])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([pages[1], pages[0]])
    with pytest.raises(ValueError, match="does not belong"):
        alloc.free([pages[1], 99])
    with pytest.raises(ValueError, match="does not belong"):
        alloc.free([-1])
    alloc.check_integrity()
    assert alloc.num_free_pages == 4  # the rejected frees freed nothing
    alloc.free(pages[1:])
    assert alloc.num_free_pages == 6


def test_random_churn_preserves_integrity():
    rng = random.Random(7)
    alloc = PageAllocator(64)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or not alloc.can_allocate(1)):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, max(1, alloc.num_free_pages // 2))
            held.append(alloc.allocate(n))
        alloc.check_integrity()
        assert alloc.num_used_pages == sum(map(len, held))
    flat = [p for h in held for p in h]
    assert len(flat) == len(set(flat))


def test_integrity_check_detects_corruption():
    alloc = PageAllocator(4)
    alloc.allocate(1)
    alloc._free.append(1)  # simulate a bug that frees behind the allocator's back
    with pytest.raises(AssertionError):
        alloc.check_integrity()


def test_page_is_one_contiguous_region_of_all_layers():
    pool = KVPool(LAYOUT, num_pages=5)
    assert LAYOUT.bytes_per_page == 3 * 2 * 8 * 2 * 4 * 4
    assert pool.nbytes == 5 * LAYOUT.bytes_per_page
    assert pool.page_address(3) - pool.page_address(2) == LAYOUT.bytes_per_page
    page = pool.buffer[2]
    assert page.is_contiguous() and page.data_ptr() == pool.page_address(2)


def test_read_and_write_pages_copy_bytes_exactly():
    pool = KVPool(LAYOUT, num_pages=6)
    data = torch.randn(2, *LAYOUT.page_shape)
    pool.write_pages([4, 1], data)
    assert torch.equal(pool.read_pages([4, 1]), data)
    assert torch.count_nonzero(pool.buffer[[0, 2, 3, 5]]) == 0


def test_copy_pages_copies_whole_pages_on_the_device_and_nothing_else(device):
    pool = KVPool(LAYOUT, num_pages=6, device=device)
    data = torch.randn(2, *LAYOUT.page_shape, device=device)
    pool.write_pages([4, 1], data)
    pool.copy_pages([4, 1], [0, 5])
    assert torch.equal(pool.read_pages([0, 5]), data)
    assert torch.equal(pool.read_pages([4, 1]), data)
    assert torch.count_nonzero(pool.buffer[[2, 3]]) == 0
    assert pool.buffer.device.type == device.type
    with pytest.raises(ValueError):
        pool.copy_pages([1], [2, 3])


def test_sizing_from_tokens_or_memory_budget():
    assert KVPool.num_pages_for(LAYOUT, 17, None) == 3
    assert KVPool.num_pages_for(LAYOUT, None, LAYOUT.bytes_per_page * 7 + 5) == 7
    with pytest.raises(ValueError):
        KVPool.num_pages_for(LAYOUT, None, None)
    assert pages_needed(16, 8) == 2 and pages_needed(17, 8) == 3 and pages_needed(0, 8) == 0


def test_layout_round_trips_through_dict():
    assert KVLayout.from_dict(LAYOUT.to_dict()) == LAYOUT


def test_spare_pages_follow_the_allocators_and_copies_between_pools_ignore_them():
    """A runner's pool has a spare page (decode graphs' scratch): no request gets it, and a
    page copy between a pool with one and a pool without lands byte for byte."""
    from transfer.loopback_backend import LoopbackBackend

    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, page_size=2, dtype="float32")
    src, dst = KVPool(layout, 6, spare_pages=1), KVPool(layout, 6)
    assert src.spare_page_ids == [6] and src.buffer.shape[0] == 7
    assert src.allocator.num_free_pages == 6 and 6 not in src.allocator.allocate(6)
    assert src.rows.shape[0] == 7 * 2 * 2
    src.buffer.copy_(torch.randn_like(src.buffer))
    a, b = LoopbackBackend("spare-a"), LoopbackBackend("spare-b")
    a.register_pool(src)
    b.register_pool(dst)
    peer = a.add_peer(b.local_metadata())
    a.write(peer, [(5, 0), (1, 3)])
    assert torch.equal(dst.buffer[0], src.buffer[5]) and torch.equal(dst.buffer[3], src.buffer[1])
    a.close()
    b.close()


def test_host_pages_copy_device_pages_both_ways_bit_exactly(device):
    from common.host_kv_pool import HostKVPool

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype="bfloat16")
    pool = KVPool(layout, 8, device)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(0)))
    host = HostKVPool(pool, 5)
    for block in host.pages.blocks:  # on CUDA: blocks of 4 and 1 pages
        assert block.device.type == "cpu" and block.is_pinned() == (device.type == "cuda")
    assert host.nbytes == 5 * layout.bytes_per_page
    host.backup([6, 1, 3], [4, 0, 2])
    expected = pool.buffer[[6, 1, 3]].cpu()
    assert torch.equal(host.pages.read([4, 0, 2]), expected)
    host.load([4, 0, 2], [0, 7, 5])
    assert torch.equal(pool.buffer[[0, 7, 5]].cpu(), expected)


def test_host_tier_is_sized_by_gigabytes_or_by_a_ratio_of_the_device_pool():
    from common.host_kv_pool import HostKVPool

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype="float32")
    assert HostKVPool.num_pages_for(layout, 100, 0.0, 2.5) == 250
    gib = 1 << 30
    assert HostKVPool.num_pages_for(layout, 100, 1.0, 2.5) == gib // layout.bytes_per_page


def test_page_runs_cover_the_pairs_in_order_with_the_fewest_copies():
    from common.page_copy import page_runs

    assert page_runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 4, 8]) == [(4, 0, 3), (9, 3, 2), (2, 8, 1)]
    assert page_runs([], []) == []
    rng = random.Random(3)
    src, dst = rng.sample(range(40), 20), rng.sample(range(40), 20)
    pairs = [(s + k, d + k) for s, d, n in page_runs(src, dst) for k in range(n)]
    assert pairs == list(zip(src, dst))
    with pytest.raises(ValueError):
        page_runs([1], [])
