"""The retracted queue (decode_node/retracted_queue.py): a retraction that runs out of memory
fails that request alone with every page accounted for; --host-pool-size sizes its host pool."""

from __future__ import annotations

import logging

import pytest
import torch

import decode_node.host_pool as host_pool
from common.config import ConfigError
from common.flags import add_decode_args, parse_decode_config
from common.kv_pool import KVLayout, KVPool
from common.launch.role_args import split_extra_args
from decode_node.req import DecodeState
from decode_node.retracted_queue import RetractedQueue, RetractionFailed
from tests.support.decode_harness import bare_req

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")


def _running(pool: KVPool, rid: str, num_tokens: int):
    r = bare_req(rid, list(range(num_tokens)))
    for state in (DecodeState.TRANSFER, DecodeState.WAITING, DecodeState.RUNNING):
        r.advance(state)
    r.pages = pool.allocator.allocate(-(-num_tokens // LAYOUT.page_size))
    pool.buffer[r.pages] = torch.randn(len(r.pages), *LAYOUT.page_shape)
    return r


def test_a_retraction_out_of_memory_fails_that_request_alone(monkeypatch):
    pool = KVPool(LAYOUT, 32)
    queue = RetractedQueue(pool, host_pages=4)
    small, big = _running(pool, "small", 12), _running(pool, "big", 24)  # 3 and 6 pages
    small_kv = pool.buffer[small.pages].clone()
    queue.retract(small)
    pinned = host_pool.PinnedPages

    def no_host_memory(*args, **kwargs):
        if not kwargs["pin"]:  # the pageable copy of a request the host pool cannot hold
            raise torch.OutOfMemoryError("can't allocate memory: you tried to allocate 3072 bytes")
        return pinned(*args, **kwargs)

    monkeypatch.setattr(host_pool, "PinnedPages", no_host_memory)
    big_pages = list(big.pages)
    with pytest.raises(RetractionFailed) as failed:
        queue.retract(big)
    assert failed.value.rid == "big"
    # big is as it was: running, outside the queue, holding its device pages
    assert big.state is DecodeState.RUNNING and big.pages == big_pages
    assert list(queue) == [small] and "big" not in queue.host
    assert queue.host.allocator.num_used_pages == 3
    queue.check_integrity()
    # what the scheduler does next: fail big, freeing its device pages
    pool.allocator.free(big.pages)
    big.pages = []
    big.advance(DecodeState.FAILED)
    assert pool.allocator.num_used_pages == 0
    (resumed,) = queue.resume(1)
    assert resumed is small and torch.equal(pool.buffer[small.pages], small_kv)
    pool.allocator.free(small.pages)
    for allocator in (pool.allocator, queue.host.allocator):
        allocator.check_integrity()
        assert allocator.num_used_pages == 0
    queue.check_integrity()


def test_the_host_pool_size_flag_reaches_the_queue(caplog):
    config = parse_decode_config(["--host-pool-size=0.001"])
    assert config.host_pool_size == 0.001
    pool = KVPool(LAYOUT, 16)
    with caplog.at_level(logging.INFO, logger="decode_node.retracted_queue"):
        queue = RetractedQueue(pool, host_pool_size_gb=config.host_pool_size)
    expected = int(0.001 * (1 << 30)) // LAYOUT.bytes_per_page
    assert queue.host.pages.num_pages == queue.host.allocator.num_pages == expected
    assert queue.host.pages.nbytes == expected * LAYOUT.bytes_per_page
    (line,) = [r.getMessage() for r in caplog.records if "retraction host pool" in r.message]
    assert f"{expected} pages" in line and "--host-pool-size 0.001" in line
    default = RetractedQueue(pool, host_pool_size_gb=parse_decode_config([]).host_pool_size)
    assert default.host.pages.num_pages == pool.num_pages  # the CPU's default: the pool's pages


def test_the_host_pool_size_flag_is_documented_checked_and_passed_to_decode_nodes():
    import argparse

    parser = argparse.ArgumentParser()
    add_decode_args(parser)
    assert "--host-pool-size" in parser.format_help()
    assert "retracted" in parser._option_string_actions["--host-pool-size"].help
    with pytest.raises(ConfigError, match="--host-pool-size"):
        parse_decode_config(["--host-pool-size=-1"])
    per_role = split_extra_args(["--host-pool-size", "8"])
    assert per_role["decode"] == ["--host-pool-size", "8"]
    assert per_role["prefill"] == per_role["bootstrap"] == []
