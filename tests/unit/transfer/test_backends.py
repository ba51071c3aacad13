"""Page-run merging, the backend factory, and fake and loopback backend semantics."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack  # type: ignore[import-untyped]
import pytest
import torch

from common.kv_pool import KVLayout, KVPool
from transfer.backend import BackendError, PageRun, XferState, page_runs
from transfer.backends import make_backend
from transfer.fake_backend import FakeBackend
from transfer.loopback_backend import LoopbackBackend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype="float32")


@pytest.mark.parametrize(
    ("pairs", "runs"),
    [
        ([], []),
        ([(3, 7)], [PageRun(3, 7, 1)]),
        ([(0, 10), (1, 11), (2, 12)], [PageRun(0, 10, 3)]),
        # Consecutive on one side only: no merge.
        ([(0, 10), (1, 12), (2, 13)], [PageRun(0, 10, 1), PageRun(1, 12, 2)]),
        ([(0, 10), (2, 11)], [PageRun(0, 10, 1), PageRun(2, 11, 1)]),
        # Descending pages never merge; a run restarts after a break.
        ([(5, 5), (4, 4)], [PageRun(5, 5, 1), PageRun(4, 4, 1)]),
        (
            [(0, 3), (1, 4), (9, 0), (10, 1), (11, 2), (2, 5)],
            [PageRun(0, 3, 2), PageRun(9, 0, 3), PageRun(2, 5, 1)],
        ),
    ],
)
def test_page_runs_merge_only_pages_consecutive_on_both_sides(pairs, runs):
    assert page_runs(pairs) == runs


def test_page_runs_cover_every_pair_in_order():
    pairs = [(0, 0), (1, 1), (2, 5), (3, 6), (7, 2), (8, 3), (9, 4), (20, 30)]
    expanded = [(r.src + i, r.dst + i) for r in page_runs(pairs) for i in range(r.length)]
    assert expanded == pairs


def test_make_backend_knows_fake_and_loopback_and_rejects_others():
    fake = make_backend("fake", "f0")
    assert isinstance(fake, FakeBackend) and fake.name == "f0"
    loop = make_backend("loopback", "lb-factory")
    try:
        assert isinstance(loop, LoopbackBackend) and loop.name == "lb-factory"
    finally:
        loop.close()
    with pytest.raises(ValueError, match="nixl.*fake.*loopback"):
        make_backend("tcp", "x")


def test_fake_backend_completes_at_once_and_moves_nothing():
    pool = KVPool(LAYOUT, 8)
    pool.buffer.fill_(1.0)
    prefill, decode = FakeBackend("prefill"), FakeBackend("decode")
    prefill.register_pool(pool)
    decode.register_pool(KVPool(LAYOUT, 8))
    assert msgpack.unpackb(decode.local_metadata()) == {"name": "decode"}
    peer = prefill.add_peer(decode.local_metadata())
    assert peer == "decode"
    handle = prefill.write(peer, [(0, 1), (1, 2)], b"req-1")
    assert prefill.poll(handle) is XferState.DONE
    prefill.release(handle)
    assert not prefill.carries_notifications
    assert decode.get_notifications() == []
    assert (prefill.num_writes, prefill.num_pages_written) == (1, 2)
    assert torch.all(pool.buffer == 1.0)


def test_fake_backend_rejects_unknown_and_removed_peers():
    fake = FakeBackend("prefill")
    with pytest.raises(BackendError, match="unknown peer"):
        fake.write("nobody", [(0, 0)])
    peer = fake.add_peer(FakeBackend("decode").local_metadata())
    fake.remove_peer(peer)
    with pytest.raises(BackendError, match="unknown peer"):
        fake.write(peer, [(0, 0)])
    with pytest.raises(BackendError, match="malformed"):
        fake.add_peer(b"\x01not msgpack of a dict")


@pytest.fixture
def loopback_pair() -> Iterator[tuple[LoopbackBackend, LoopbackBackend, KVPool, KVPool]]:
    src_pool, dst_pool = KVPool(LAYOUT, 16), KVPool(LAYOUT, 16)
    gen = torch.Generator().manual_seed(1234)
    src_bytes = src_pool.buffer.view(-1).view(torch.uint8)
    src_bytes.copy_(torch.randint(0, 256, src_bytes.shape, dtype=torch.uint8, generator=gen))
    prefill, decode = LoopbackBackend("lb-prefill"), LoopbackBackend("lb-decode")
    prefill.register_pool(src_pool)
    decode.register_pool(dst_pool)
    try:
        yield prefill, decode, src_pool, dst_pool
    finally:
        prefill.close()
        decode.close()


def test_loopback_copies_scattered_pages_byte_for_byte(loopback_pair):
    prefill, decode, src_pool, dst_pool = loopback_pair
    peer = prefill.add_peer(decode.local_metadata())
    pairs = [(0, 9), (1, 10), (2, 11), (7, 3), (15, 0), (4, 14)]
    handle = prefill.write(peer, pairs, b"req-7")
    assert prefill.poll(handle) is XferState.DONE
    prefill.release(handle)
    src_bytes = src_pool.buffer.view(16, -1).view(torch.uint8)
    dst_bytes = dst_pool.buffer.view(16, -1).view(torch.uint8)
    for src, dst in pairs:
        assert torch.equal(dst_bytes[dst], src_bytes[src]), (src, dst)
    untouched = sorted(set(range(16)) - {dst for _, dst in pairs})
    assert not dst_bytes[untouched].any()
    assert decode.get_notifications() == [("lb-prefill", b"req-7")]
    assert decode.get_notifications() == []
    assert prefill.get_notifications() == []


def test_loopback_notification_alone_and_in_order(loopback_pair):
    prefill, decode, src_pool, dst_pool = loopback_pair
    peer = prefill.add_peer(decode.local_metadata())
    for notification in (b"a", b"b"):
        assert prefill.poll(prefill.write(peer, [], notification)) is XferState.DONE
    assert prefill.poll(prefill.write(peer, [(0, 0)])) is XferState.DONE
    assert decode.get_notifications() == [("lb-prefill", b"a"), ("lb-prefill", b"b")]
    assert torch.equal(dst_pool.buffer[0].view(torch.uint8), src_pool.buffer[0].view(torch.uint8))


def test_loopback_write_errors_after_peer_removed_or_closed(loopback_pair):
    prefill, decode, _, dst_pool = loopback_pair
    peer = prefill.add_peer(decode.local_metadata())
    prefill.remove_peer(peer)
    assert prefill.poll(prefill.write(peer, [(0, 0)], b"late")) is XferState.ERROR
    peer = prefill.add_peer(decode.local_metadata())
    decode.close()
    assert prefill.poll(prefill.write(peer, [(1, 1)], b"late")) is XferState.ERROR
    # A new backend under the dead peer's name is not the peer that was added.
    reborn = LoopbackBackend("lb-decode")
    try:
        reborn.register_pool(KVPool(LAYOUT, 16))
        assert prefill.poll(prefill.write(peer, [(1, 1)], b"late")) is XferState.ERROR
        assert reborn.get_notifications() == []
    finally:
        reborn.close()
    assert not dst_pool.buffer.any()
    with pytest.raises(BackendError, match="no open loopback backend"):
        prefill.add_peer(decode.local_metadata())


def test_loopback_fail_next_write_fails_once_and_delivers_nothing(loopback_pair):
    prefill, decode, _, dst_pool = loopback_pair
    peer = prefill.add_peer(decode.local_metadata())
    prefill.fail_next_write = True
    assert prefill.poll(prefill.write(peer, [(2, 2)], b"x")) is XferState.ERROR
    assert decode.get_notifications() == [] and not dst_pool.buffer.any()
    assert prefill.poll(prefill.write(peer, [(2, 2)], b"y")) is XferState.DONE
    assert decode.get_notifications() == [("lb-prefill", b"y")]


def test_loopback_rejects_out_of_range_pages_and_duplicate_names(loopback_pair):
    prefill, decode, _, _ = loopback_pair
    peer = prefill.add_peer(decode.local_metadata())
    with pytest.raises(BackendError, match="out of range"):
        prefill.write(peer, [(0, 16)])
    with pytest.raises(BackendError, match="out of range"):
        prefill.write(peer, [(-1, 0)])
    with pytest.raises(BackendError, match="already open"):
        LoopbackBackend("lb-prefill")
