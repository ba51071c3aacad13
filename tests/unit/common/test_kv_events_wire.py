"""KV events over real zmq: the prefill node's publisher to the gateway's subscriber and index.

In one process: a RadixCache publishing through a KVEventPublisher (PUB), a
KVEventSubscriber (SUB thread) filling its KVIndex, and a PULL socket standing in for the
node's request socket, where snapshot requests arrive.
"""

from __future__ import annotations

import random
import time

import zmq

from bootstrap.kv_events import KVEventSubscriber, PrefillSource
from common import messages as msg
from common import page_hash
from common.ipc import bind_pull, close_pull, recv_messages
from common.radix_cache import RadixCache
from prefill_node.kv_events import KVEventPublisher
from tests.support.host_pages import NoCopyHost

PS = 16


def _wait(cond, timeout=10.0, tick=None):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        if tick is not None:
            tick()
        time.sleep(0.01)


class Node:
    """A prefill node's cache, publisher and request socket."""

    def __init__(self, node_id: str, instance_id: str = "i1") -> None:
        self.events = KVEventPublisher(
            node_id, instance_id, 256, "tcp://127.0.0.1:0", interval_s=0.0, keepalive_s=0.05
        )
        self.cache = RadixCache(PS, events=self.events)
        self.requests, self.request_endpoint = bind_pull(
            zmq.Context.instance(), "tcp://127.0.0.1:0"
        )
        self.num_snapshot_requests = 0

    def source(self, instance_id: str = "i1") -> PrefillSource:
        return PrefillSource(
            self.events.node_id, instance_id, self.events.endpoint, self.request_endpoint, 256
        )

    def step(self) -> None:
        """What the prefill loop does with these each round."""
        for m in recv_messages(self.requests, socket_name="test"):
            if isinstance(m, msg.KVSnapshotRequest):
                self.num_snapshot_requests += 1
                self.events.request_snapshot()
        self.events.flush(lambda: 123, self.cache.page_hashes)

    def close(self) -> None:
        self.events.close()
        close_pull(self.requests)


def _prompt(seed: int, n: int = 96) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def test_the_gateway_index_follows_a_nodes_cache_over_the_wire():
    node = Node("p0")
    sub = KVEventSubscriber("gw", snapshot_retry_s=0.2)
    try:
        a, b = _prompt(1), _prompt(2)
        node.cache.insert(a, list(range(6)))  # cached before the gateway subscribed
        sub.start()
        sub.sync([node.source()])
        ha, hb = page_hash.prompt_hashes(a, PS).tolist(), page_hash.prompt_hashes(b, PS).tolist()
        # The subscriber asks for a snapshot on joining: it learns what was there before.
        _wait(lambda: sub.overlaps(ha, ["p0"]) == {"p0": 6}, tick=node.step)
        assert node.num_snapshot_requests >= 1
        node.cache.insert(b, list(range(10, 16)))
        _wait(lambda: sub.overlaps(hb, ["p0"]) == {"p0": 6}, tick=node.step)
        assert sub.queued_tokens().get("p0", 0) == 123
        node.cache.evict(6)  # least recently used: a's pages
        _wait(lambda: sub.overlaps(ha, ["p0"]) == {}, tick=node.step)
        assert sub.overlaps(hb, ["p0"]) == {"p0": 6}
        sub.drop("p0")  # the registry lost it
        assert sub.overlaps(hb, ["p0"]) == {} and sub.index.num_pages == 0
    finally:
        sub.close()
        node.close()


def test_batches_of_another_instance_or_an_unregistered_node_are_dropped():
    node, stranger = Node("p0", "old-instance"), Node("p9")
    sub = KVEventSubscriber("gw", snapshot_retry_s=0.2)
    try:
        sub.start()
        sub.sync([node.source("new-instance")])  # the registry knows a newer process
        node.cache.insert(_prompt(3), list(range(6)))
        stranger.cache.insert(_prompt(4), list(range(6)))
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            node.step()
            stranger.step()
            time.sleep(0.01)
        assert sub.index.num_pages == 0 and sub.index.node_ids() == []
    finally:
        sub.close()
        node.close()
        stranger.close()


def test_a_lost_batch_is_repaired_by_a_snapshot():
    node = Node("p0")
    sub = KVEventSubscriber("gw", snapshot_retry_s=0.2)
    try:
        sub.start()
        sub.sync([node.source()])
        first = _prompt(5)
        node.cache.insert(first, list(range(6)))
        h = page_hash.prompt_hashes(first, PS).tolist()
        _wait(lambda: sub.overlaps(h, ["p0"]) == {"p0": 6}, tick=node.step)
        # A batch goes missing (as PUB drops for a slow subscriber): evictions unseen.
        node.cache.evict(6)
        node.events._net.clear()
        node.events.seq += 1
        second = _prompt(6)
        node.cache.insert(second, list(range(6)))  # the next batch shows the gap
        _wait(lambda: sub.overlaps(h, ["p0"]) == {}, tick=node.step)
        assert sub.index.num_gaps >= 1
        assert sub.overlaps(page_hash.prompt_hashes(second, PS).tolist(), ["p0"]) == {"p0": 6}
    finally:
        sub.close()
        node.close()


def test_queued_tokens_are_the_last_report_plus_what_was_sent_since():
    node = Node("p0")
    sub = KVEventSubscriber("gw", snapshot_retry_s=0.2)
    try:
        sub.start()
        sub.sync([node.source()])
        _wait(
            lambda: sub.queued_tokens().get("p0", 0) == 123, tick=node.step
        )  # the node reports 123
        node.events.keepalive_s = 3600.0  # no report for a while
        sub.note_dispatched("p0", 500)
        sub.note_dispatched("p0", 20)
        assert sub.queued_tokens().get("p0", 0) == 643
        node.events.keepalive_s = 0.0  # the next report has them (the node says 123 still)
        _wait(lambda: sub.queued_tokens().get("p0", 0) == 123, tick=node.step)
    finally:
        sub.close()
        node.close()


def test_the_index_knows_which_pages_a_node_holds_on_its_host_tier_alone():
    from common.kv_pool import PageAllocator
    from prefill_node.hiradix_cache import HiRadixCache

    node = Node("p0")
    alloc = PageAllocator(64)
    node.cache = HiRadixCache(PS, alloc, NoCopyHost(64), "write_through", events=node.events)
    node.events.host_load_cost = 0.25
    sub = KVEventSubscriber("gw", snapshot_retry_s=0.2)
    try:
        sub.start()
        sub.sync([node.source()])
        a, b = _prompt(1), _prompt(1)[:64] + _prompt(2)[:32]
        ha, hb = page_hash.prompt_hashes(a, PS).tolist(), page_hash.prompt_hashes(b, PS).tolist()
        node.cache.insert(a, alloc.allocate(6))
        node.cache.insert(b, alloc.allocate(6))  # shares 4 pages with a
        _wait(lambda: sub.overlaps(ha, ["p0"]) == {"p0": 6}, tick=node.step)
        assert sub.host_hits(ha, {"p0": 6}) is None  # all on the device
        node.cache.touch(b)
        assert node.cache.evict(2) == 2  # a's last two pages: to the host
        _wait(lambda: sub.host_hits(ha, {"p0": 6}) is not None, tick=node.step)
        hits = sub.host_hits(ha, {"p0": 6})
        assert hits is not None and hits.pages == {"p0": 2} and hits.costs == {"p0": 0.25}
        assert sub.overlaps(ha, ["p0"]) == {"p0": 6}  # still held: a hit, on the host
        assert sub.host_hits(hb, {"p0": 6}) is None
        node.cache.evict(100)  # everything: the shared part too
        _wait(lambda: sub.host_hits(ha, {"p0": 6}).pages == {"p0": 6}, tick=node.step)
        assert sub.host_hits(hb, {"p0": 6}).pages == {"p0": 6}
        # A snapshot says the same (a gateway that joins later).
        late = KVEventSubscriber("gw2", snapshot_retry_s=0.2)
        try:
            late.start()
            late.sync([node.source()])
            _wait(lambda: late.host_hits(ha, {"p0": 6}) is not None, tick=node.step)
            assert late.host_hits(ha, {"p0": 6}).pages == {"p0": 6}
        finally:
            late.close()
        # Loaded back: on the device again.
        node.cache.load_back(a, None, alloc.allocate(6))
        _wait(lambda: sub.host_hits(ha, {"p0": 6}) is None, tick=node.step)
        assert sub.host_hits(hb, {"p0": 6}).pages == {"p0": 2}
    finally:
        sub.close()
        node.close()
