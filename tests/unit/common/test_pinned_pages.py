"""Host page stores in power-of-two blocks (common/pinned_pages.py) and the bounded copies
between them and a device pool (common/page_copy.py): the decomposition, the addressing,
runs cut at block ends, bytes equal after a round trip through scattered pages."""

from __future__ import annotations

import random

import pytest
import torch

from common.kv_pool import KVLayout, KVPool
from common.page_copy import PageCopier, is_out_of_memory
from common.pinned_pages import PinnedPages, power_of_two_blocks

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")


def _pool(device, num_pages=256) -> KVPool:
    pool = KVPool(LAYOUT, num_pages, device)
    gen = torch.Generator().manual_seed(5)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(pool.buffer.dtype))
    return pool


@pytest.mark.parametrize(
    ("num_pages", "blocks"),
    [(1, [1]), (13, [8, 4, 1]), (64, [64]), (1000, [512, 256, 128, 64, 32, 8])],
)
def test_a_store_is_the_binary_decomposition_of_its_pages(num_pages, blocks):
    assert power_of_two_blocks(num_pages) == blocks
    assert sum(blocks) == num_pages and all(n & (n - 1) == 0 for n in blocks)
    with pytest.raises(ValueError):
        power_of_two_blocks(0)


def test_the_blocks_hold_exactly_the_bytes_asked():
    # 9 pages of a power-of-two page: one tensor would be pinned as 16 pages; 8 + 1 are 9
    page = LAYOUT.page_shape
    store = PinnedPages(9, page, torch.bfloat16, pin=False, block_pages=power_of_two_blocks(9))
    assert [b.shape[0] for b in store.blocks] == [8, 1]
    assert store.nbytes == 9 * LAYOUT.bytes_per_page == store.page_bytes * 9
    for block in store.blocks:
        nbytes = block.numel() * block.element_size()
        assert nbytes & (nbytes - 1) == 0  # what torch's pinned allocator holds for it
    plain = PinnedPages(9, page, torch.bfloat16, pin=False)  # off CUDA: one plain tensor
    assert len(plain.blocks) == 1 and not plain.blocks[0].is_pinned()
    assert plain.nbytes == store.nbytes
    with pytest.raises(ValueError):
        PinnedPages(9, page, torch.bfloat16, pin=False, block_pages=[8, 2])


def test_page_ids_address_block_rows_and_runs_are_cut_at_block_ends():
    store = PinnedPages(13, (2,), torch.float32, pin=False, block_pages=[8, 4, 1])
    assert [store.locate(p) for p in (0, 7, 8, 11, 12)] == [(0, 0), (0, 7), (1, 0), (1, 3), (2, 0)]
    with pytest.raises(IndexError):
        store.locate(13)
    views = store.rows(6, 7)  # pages 6 .. 12: rows 6-7 of block 0, 0-3 of block 1, 0 of 2
    assert [(k, len(rows)) for k, rows in views] == [(0, 2), (2, 4), (6, 1)]
    assert views[1][1].data_ptr() == store.blocks[1].data_ptr()
    for page in range(13):
        store.rows(page, 1)[0][1].fill_(page)
    assert store.read([12, 0, 8]).tolist() == [[12.0, 12.0], [0.0, 0.0], [8.0, 8.0]]
    assert store.rows(3, 0) == []


def test_scattered_pages_go_through_the_staging_buffer_chunk_by_chunk_bytes_equal(device):
    pool = _pool(device)
    copier = PageCopier(pool, staging_pages=8)
    host = PinnedPages(
        100, LAYOUT.page_shape, pool.buffer.dtype, pin=False, block_pages=[64, 32, 4]
    )
    rng = random.Random(1)
    device_pages = rng.sample(range(200), 60)  # scattered: runs of one page, 60 > 8
    device_pages[30:50] = range(200, 220)  # and one long run, copied directly
    host_pages = list(range(30, 90))  # the long run (host pages 60 .. 79) crosses 64
    copier.to_host(pool.buffer, device_pages, host, host_pages)
    expect = pool.buffer[device_pages].cpu()
    assert torch.equal(host.read(host_pages), expect)
    assert copier._staging is not None and copier._staging.shape[0] == 8
    back = rng.sample(range(256), 60)
    pool.buffer.zero_()
    copier.to_device(host, host_pages, pool.buffer, back)
    assert torch.equal(pool.buffer[back].cpu(), expect)


def test_the_staging_buffer_is_bounded_in_bytes_too():
    big = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")
    pool = KVPool(big, 1, "meta")  # 2 MiB pages, nothing allocated
    copier = PageCopier(pool)
    assert copier.staging_pages * big.bytes_per_page <= 64 << 20
    assert copier.direct_run_pages == 1  # a 2 MiB page is a copy large enough alone


def test_a_staging_buffer_out_of_memory_leaves_direct_copies_bytes_equal(monkeypatch):
    pool = _pool("cpu")
    copier = PageCopier(pool, staging_pages=8)
    host = PinnedPages(40, LAYOUT.page_shape, pool.buffer.dtype, pin=False)
    empty = torch.empty

    def no_device_memory(*args, **kwargs):
        if kwargs.get("device") is not None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_device_memory)
    pages = list(range(0, 80, 2))
    copier.to_host(pool.buffer, pages, host, range(40))
    assert copier.has_no_staging and copier._staging is None
    assert torch.equal(host.read(range(40)), pool.buffer[pages])


def test_out_of_memory_is_told_from_other_errors():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: 9 bytes"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("index out of range"))
    assert not is_out_of_memory(ValueError("out of memory"))
