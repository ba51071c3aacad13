"""The prefill loop's radix cache in one process (tiny Llama, real zmq sockets, loopback
KV transfer to a test receiver, tests/support/prefill_harness.py): shared prefixes served
from it, shared as soon as computed, kept apart by cache salt, and locked no wider than the
match."""

from __future__ import annotations

from tests.support.prefill_harness import Harness, check_landed, prompt
from transfer.kv_poll import KVPoll


def test_shared_prefix_is_served_from_the_radix_cache(h):
    base = prompt(32, 3)
    first, second = base + prompt(5, 4), base + prompt(9, 5)
    h.submit("one", 11, first)
    r1, p1 = h.receive(11, len(first))
    h.run_until(lambda: r1.poll() is KVPoll.Success and not h.sched.states)
    computed_before = h.sched.processed_tokens
    h.submit("two", 12, second)
    r2, p2 = h.receive(12, len(second))
    h.run_until(lambda: r2.poll() is KVPoll.Success and not h.sched.states)
    assert h.sched.processed_tokens - computed_before == len(second) - 32
    check_landed(h, r2, p2, second)
    h.sched.check_integrity()


def test_a_prompt_sharing_the_start_of_a_long_cached_node_is_admitted(model_dir):
    """A pool of 16 pages, 10 of them one cached prompt's node; a prompt sharing its first
    2 pages needs 5 more and its reserve. Locking the whole node left 6 pages of room, too
    few, and nothing would ever evict the node: the request waited forever with the node
    idle. The lock now holds the 2 shared pages; the node's other 8 make room."""
    h = Harness(model_dir, num_pages=16)
    try:
        first = prompt(40, 1)
        h.submit("one", 21, first)
        r1, p1 = h.receive(21, len(first))
        h.run_until(lambda: r1.poll() is KVPoll.Success and not h.sched.states)
        h.dpool.allocator.free(p1)  # the test's decode side is done with them
        assert h.sched.tree.num_pages == 10
        second = first[:8] + prompt(20, 2)
        h.submit("two", 22, second)
        r2, p2 = h.receive(22, len(second))
        h.run_until(lambda: r2.poll() is KVPoll.Success and not h.sched.states)
        check_landed(h, r2, p2, second)
        h.sched.check_integrity()
    finally:
        h.close()


def test_a_prefix_is_shared_as_soon_as_it_is_computed_not_after_its_transfer(model_dir):
    h = Harness(model_dir, chunked_prefill_size=8, max_prefill_tokens=8)
    try:
        base = prompt(32, 9)
        first, second = base + prompt(5, 10), base + prompt(9, 11)
        h.submit("first", 41, first)
        h.submit("second", 42, second)
        r1, _ = h.receive(41, len(first))
        r2, p2 = h.receive(42, len(second))
        h.run_until(
            lambda: (
                r1.poll() is KVPoll.Success and r2.poll() is KVPoll.Success and not h.sched.states
            )
        )
        # "second" ran while "first" was still in flight, and reused its 32 cached tokens.
        assert h.sched.processed_tokens == len(first) + len(second) - 32
        check_landed(h, r2, p2, second)
        h.sched.check_integrity()
    finally:
        h.close()


def test_requests_of_different_cache_salts_share_no_cached_page(h):
    ids = prompt(33, 21)

    def computed(rid, room, salt):
        before = h.sched.processed_tokens
        h.submit(rid, room, ids, cache_salt=salt)
        r, pages = h.receive(room, len(ids))
        h.run_until(lambda: r.poll() is KVPoll.Success and not h.sched.states)
        check_landed(h, r, pages, ids)
        return h.sched.processed_tokens - before

    assert computed("a1", 41, "tenant-a") == 33
    assert computed("b1", 42, "tenant-b") == 33  # identical prompt, another salt: no reuse
    assert computed("n1", 43, None) == 33  # unsalted: no reuse of either
    assert computed("a2", 44, "tenant-a") == 33 - 32  # its own salt: 8 cached pages of 4
    h.sched.check_integrity()
