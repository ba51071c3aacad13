"""The decode node's prefix cache (decode_node/prefix_cache.py) with the real prefill and
decode loops over the loopback backend: a chat's next turn receives only its new pages,
outputs equal single-request greedy runs, and every page is free, cached or held once
(the harness checks integrity after every step)."""

from __future__ import annotations

import pytest

from common import messages as msg
from tests.support.decode_harness import (
    PAGE,
    PD,
    bare_req,
    greedy,
    prompt,
    spy_transfer_requests,
)

CACHE = {"disaggregation_decode_enable_radix_cache": True}


def _run(h, rid, room, ids, max_new, **kw):
    h.submit(rid, room, ids, max_new_tokens=max_new, **kw)
    h.run_until(lambda: h.done(rid), timeout=60)
    end = h.result(rid)
    assert isinstance(end, msg.ReqFinished), end
    return h.tokens(rid)


def _assert_only_cache_holds_pages(h):
    d = h.decode
    d.check_integrity()
    assert d.is_idle() and d.stats.num_held_pages() == 0
    cache = d.prefix_cache
    assert cache.tree.num_protected_pages == 0
    assert h.runner.pool.allocator.num_used_pages == cache.num_pages


def test_a_chats_next_turn_receives_only_its_new_pages(model_dir, ref):
    h = PD(model_dir, **CACHE)
    sent = spy_transfer_requests(h)
    try:
        turn1 = prompt(14, 1)
        out1 = _run(h, "t1", 301, turn1, 10)
        assert out1 == greedy(ref, turn1, 10)
        # Its KV: 14 + 10 - 1 = 23 tokens, 5 whole pages cached.
        assert h.decode.prefix_cache.num_pages == 5
        turn2 = turn1 + out1 + prompt(6, 2)  # 30 tokens, 8 pages
        out2 = _run(h, "t2", 302, turn2, 9)
        assert out2 == greedy(ref, turn2, 9)
        assert sent == [(301, 0, 4), (302, 5, 3)]
        assert h.decode.prefix_cache.num_hit_pages == 5
        _assert_only_cache_holds_pages(h)
        assert h.prefill.stats.num_held_pages() == 0
    finally:
        h.close()


def test_another_cache_salt_gets_no_hit(model_dir, ref):
    h = PD(model_dir, **CACHE)
    sent = spy_transfer_requests(h)
    try:
        turn1 = prompt(14, 3)
        out1 = _run(h, "s1", 311, turn1, 6, cache_salt="alice")
        turn2 = turn1 + out1 + prompt(5, 4)
        assert _run(h, "s2", 312, turn2, 5, cache_salt="bob") == greedy(ref, turn2, 5)
        assert _run(h, "s3", 313, turn2, 5, cache_salt="alice") == greedy(ref, turn2, 5)
        assert [s[1] for s in sent] == [0, 0, 4]  # alice's 19 tokens: 4 whole pages
        _assert_only_cache_holds_pages(h)
    finally:
        h.close()


def test_the_cache_yields_its_pages_to_admission_under_pressure(model_dir, ref):
    """A pool of 16 pages: each request needs most of it, so every admission evicts what
    the last one cached; nothing is lost and every output is exact."""
    h = PD(model_dir, decode_pages=16, num_reserved_decode_tokens=4, **CACHE)
    try:
        for i in range(5):
            ids = prompt(30, 20 + i)
            assert _run(h, f"p{i}", 320 + i, ids, 12) == greedy(ref, ids, 12)
            assert h.decode.prefix_cache.num_pages > 0
        _assert_only_cache_holds_pages(h)
    finally:
        h.close()


def test_requests_sharing_a_cached_prefix_survive_retraction(model_dir, ref):
    """Several continuations of one cached conversation at once in a small pool: some are
    retracted (their prefix goes back to the cache, their KV to host memory) and resumed
    with pages of their own; outputs exact, every page accounted for."""
    h = PD(model_dir, decode_pages=28, num_reserved_decode_tokens=4, **CACHE)
    sent = spy_transfer_requests(h)
    try:
        base = prompt(17, 40)
        out = _run(h, "base", 330, base, 8)
        turns = [base + out + prompt(3 + i, 41 + i) for i in range(4)]
        for i, ids in enumerate(turns):
            h.submit(f"c{i}", 331 + i, ids, max_new_tokens=24)
            h.step()
        h.run_until(lambda: h.done(*[f"c{i}" for i in range(4)]), timeout=60)
        assert h.decode.stats.num_retractions > 0
        assert any(held > 0 for _, held, _ in sent[1:])
        for i, ids in enumerate(turns):
            assert isinstance(h.result(f"c{i}"), msg.ReqFinished)
            assert h.tokens(f"c{i}") == greedy(ref, ids, 24), i
        _assert_only_cache_holds_pages(h)
    finally:
        h.close()


def test_an_aborted_partial_transfer_unlocks_its_prefix_and_frees_its_own_pages(model_dir, ref):
    h = PD(model_dir, **CACHE)
    try:
        turn1 = prompt(13, 50)
        out1 = _run(h, "a1", 340, turn1, 8)
        h.is_prefill_paused = True  # the KV never comes: abort it while in transfer
        turn2 = turn1 + out1 + prompt(7, 51)
        h.submit("a2", 341, turn2, max_new_tokens=4)
        h.run_until(lambda: h.state("a2") is not None and h.state("a2").value == "transfer")
        r = h.decode.reqs["a2"]
        assert r.num_prefix_pages == 5 and h.decode.prefix_cache.tree.num_protected_pages == 5
        h.decode.abort("a2", None, "client gone")
        h.is_prefill_paused = False
        h.run_until(lambda: h.done("a2") and not h.decode.release_queue, timeout=30)
        # The decode node answers 499; the prefill node's own failure may come after it.
        assert any(isinstance(m, msg.ReqFailed) and m.status == 499 for m in h.replies["a2"])
        _assert_only_cache_holds_pages(h)
        # The prefix is still there for the next request.
        assert _run(h, "a3", 342, turn2, 4) == greedy(ref, turn2, 4)
    finally:
        h.close()


def test_a_late_write_into_a_cached_page_drops_the_cache_and_fails_its_readers(model_dir, ref):
    h = PD(model_dir, **CACHE)
    try:
        turn1 = prompt(13, 60)
        out1 = _run(h, "l1", 350, turn1, 8)
        h.is_prefill_paused = True
        turn2 = turn1 + out1 + prompt(7, 61)
        h.submit("l2", 351, turn2, max_new_tokens=4)
        h.run_until(lambda: h.state("l2") is not None and h.state("l2").value == "transfer")
        cached = h.decode.prefix_cache.cached_pages()
        h.dkv.on_late_write(999, [cached[0]])  # another room's write landed in a cached page
        h.run_until(lambda: h.done("l2"))
        end = h.result("l2")
        assert isinstance(end, msg.ReqFailed) and end.status == 500 and end.retryable
        assert h.decode.prefix_cache.num_pages == 0
        h.is_prefill_paused = False
        h.run_until(lambda: not h.decode.release_queue, timeout=30)
        _assert_only_cache_holds_pages(h)
        assert h.runner.pool.allocator.num_used_pages == 0
    finally:
        h.close()


@pytest.mark.parametrize("flags", [CACHE, {}], ids=["cache", "no-cache"])
def test_samples_of_one_prompt_wait_for_its_transfer_and_move_only_their_last_page(
    model_dir, ref, flags
):
    """Four samples of one prompt (n = 4) reach the decode node together: the first moves
    the prompt's KV, the others wait for it and receive only the page of their last token
    (the prefill node computes the prompt once: its radix cache has the rest). Without the
    flag too: prompts in use are shared, nothing is kept after."""
    h = PD(model_dir, **flags)
    sent = spy_transfer_requests(h)
    computed = []
    count = h.prefill.stats.prefill_tokens
    h.prefill.stats.prefill_tokens = lambda n: (computed.append(n), count(n))
    try:
        ids = prompt(30, 90)  # 8 pages, the last partial
        for i in range(4):
            h.submit(f"s{i}", 370 + i, ids, max_new_tokens=6)
        h.run_until(lambda: h.done(*[f"s{i}" for i in range(4)]), timeout=60)
        for i in range(4):
            assert h.tokens(f"s{i}") == greedy(ref, ids, 6), i
        assert sorted((held, dst) for _, held, dst in sent) == [(0, 8), (7, 1), (7, 1), (7, 1)]
        # The prompt was computed once: the others found 7 of its pages in prefill's cache.
        assert sum(computed) == 30 + 3 * 2
        _assert_only_cache_holds_pages(h)
        if not flags:
            assert h.decode.prefix_cache.num_pages == 0
    finally:
        h.close()


@pytest.mark.parametrize("flags", [CACHE, {}], ids=["cache", "no-cache"])
def test_samples_of_one_group_compute_and_move_the_prompt_once(model_dir, ref, flags):
    """n = 4 as the gateway sends it (one sample group): the first sample's prefill is the
    only one; the others copy its last page on the decode node, hold every page of their
    room and receive only their first token, sampled from its logits. Greedy outputs equal
    the single-request run; seeded ones equal an ungrouped request of the same seed."""
    h = PD(model_dir, **flags)
    sent = spy_transfer_requests(h)
    computed = []
    count = h.prefill.stats.prefill_tokens
    h.prefill.stats.prefill_tokens = lambda n: (computed.append(n), count(n))
    steps, step = [0], h.decode.step
    h.decode.step = lambda: (steps.__setitem__(0, steps[0] + 1), step())[1]
    when: dict[int, int] = {}
    send = h.dkv.send_transfer_request
    h.dkv.send_transfer_request = lambda r: (when.setdefault(r.room, steps[0]), send(r))
    try:
        ids = prompt(30, 91)  # 8 pages, the last partial
        group = {"sample_group": "g1", "num_group_samples": 4}
        for i in range(4):
            h.submit(f"s{i}", 380 + i, ids, max_new_tokens=6, **group)
        h.run_until(lambda: h.done(*[f"s{i}" for i in range(4)]), timeout=60)
        for i in range(4):
            assert h.tokens(f"s{i}") == greedy(ref, ids, 6), i
        assert sorted((held, dst) for _, held, dst in sent) == [(0, 8), (8, 0), (8, 0), (8, 0)]
        assert computed == [30]
        # The copies go in one step, not one after another's transfer.
        assert when[381] == when[382] == when[383] > when[380]
        # 7 pages shared, the 8th (2 tokens) copied, per sample.
        assert h.decode.prefix_cache.num_copied_tokens == 3 * 2
        assert len(h.prefill.groups) == 0  # every sample took the logits
        seeded = {"temperature": 0.9, "max_new_tokens": 8}
        seeds = [11, 12, 13]
        group = {"sample_group": "g2", "num_group_samples": 3}
        for i, seed in enumerate(seeds):
            h.submit(f"z{i}", 390 + i, ids, seed=seed, **seeded, **group)
        h.run_until(lambda: h.done("z0", "z1", "z2"), timeout=60)
        assert computed == [30, 2]  # the prompt's last page (the rest cached)
        for i, seed in enumerate(seeds):
            _run(h, f"u{i}", 395 + i, ids, seeded["max_new_tokens"], seed=seed, temperature=0.9)
            assert h.tokens(f"z{i}") == h.tokens(f"u{i}"), i
        assert h.tokens("z0") != h.tokens("z1") or h.tokens("z1") != h.tokens("z2")
        _assert_only_cache_holds_pages(h)
    finally:
        h.close()


@pytest.mark.parametrize("flags", [CACHE, {}], ids=["cache", "no-cache"])
def test_samples_of_one_group_survive_retraction_and_abort_in_a_small_pool(model_dir, ref, flags):
    """n = 6 in a pool too small for all of them to finish: samples that copied the first
    one's KV are retracted (their own pages to host memory, the shared prefix back to the
    cache) and resumed; one is aborted mid-way. Outputs exact, every page accounted for
    after every step (the harness) and at the end."""
    h = PD(model_dir, decode_pages=30, num_reserved_decode_tokens=4, **flags)
    sent = spy_transfer_requests(h)
    try:
        ids = prompt(22, 93)  # 6 pages, the last partial
        group = {"sample_group": "g4", "num_group_samples": 6}
        for i in range(6):
            h.submit(f"k{i}", 400 + i, ids, max_new_tokens=28, **group)
        h.run_until(lambda: len(h.tokens("k3")) >= 4, timeout=60)
        h.decode.abort("k3", None, "client gone")
        h.run_until(lambda: h.done(*[f"k{i}" for i in range(6)]), timeout=90)
        assert h.decode.stats.num_retractions > 0
        assert sum(held == 6 for _, held, _ in sent) >= 4  # copies
        for i in (0, 1, 2, 4, 5):
            assert isinstance(h.result(f"k{i}"), msg.ReqFinished), i
            assert h.tokens(f"k{i}") == greedy(ref, ids, 28), i
        assert isinstance(h.result("k3"), msg.ReqFailed)
        h.run_until(lambda: h.decode.is_idle(), timeout=10)
        _assert_only_cache_holds_pages(h)
    finally:
        h.close()


def test_a_late_write_into_a_page_a_sample_copied_fails_that_sample_too(model_dir, ref):
    """A late write may have landed in the first sample's last page before another sample
    copied it: both fail (500, retryable), not only the one holding the page."""
    h = PD(model_dir)
    try:
        ids = prompt(30, 94)
        group = {"sample_group": "g5", "num_group_samples": 2}
        for i in range(2):
            h.submit(f"w{i}", 410 + i, ids, max_new_tokens=40, **group)
        h.run_until(lambda: all(len(h.tokens(f"w{i}")) >= 2 for i in range(2)), timeout=60)
        donor, copy = h.decode.reqs["w0"], h.decode.reqs["w1"]
        assert copy.copied_from == [donor.pages[7]] and donor.pages[7] not in copy.pages
        h.dkv.on_late_write(999, [donor.pages[7]])
        h.run_until(lambda: h.done("w0", "w1"))
        for rid in ("w0", "w1"):
            end = h.result(rid)
            assert isinstance(end, msg.ReqFailed) and end.status == 500 and end.retryable, rid
        h.run_until(lambda: h.decode.is_idle(), timeout=10)
        assert h.runner.pool.allocator.num_used_pages == 0
    finally:
        h.close()


def test_a_sample_whose_first_sample_has_finished_receives_its_pages(model_dir, ref):
    """The first sample ends with its first token (max_tokens 1), before the others are
    preallocated: nothing to copy from, so the next one receives its pages and the prefill
    node computes what it needs (its last page), as without a group; the third copies
    from that one."""
    h = PD(model_dir)
    sent = spy_transfer_requests(h)
    computed = []
    count = h.prefill.stats.prefill_tokens
    h.prefill.stats.prefill_tokens = lambda n: (computed.append(n), count(n))
    try:
        ids = prompt(30, 92)
        group = {"sample_group": "g3", "num_group_samples": 3}
        h.submit("f0", 385, ids, max_new_tokens=1, **group)
        h.run_until(lambda: h.done("f0"), timeout=60)
        for i in (1, 2):
            h.submit(f"f{i}", 385 + i, ids, max_new_tokens=5, **group)
        h.run_until(lambda: h.done("f1", "f2"), timeout=60)
        for i in (1, 2):
            assert h.tokens(f"f{i}") == greedy(ref, ids, 5), i
        assert sent == [(385, 0, 8), (386, 0, 8), (387, 8, 0)]
        assert computed == [30, 2]
        assert h.decode.prefix_cache.num_copied_tokens == 2
    finally:
        h.close()


def test_without_the_flag_nothing_is_kept(model_dir, ref):
    h = PD(model_dir)
    sent = spy_transfer_requests(h)
    try:
        ids = prompt(14, 70)
        out = _run(h, "n1", 360, ids, 6)
        assert h.decode.prefix_cache.num_pages == 0
        assert h.runner.pool.allocator.num_used_pages == 0
        _run(h, "n2", 361, ids + out + prompt(5, 71), 4)
        assert [held for _, held, _ in sent] == [0, 0]
    finally:
        h.close()


assert PAGE == 4  # the page counts above are for 4-token pages


def test_a_match_ending_inside_a_cached_node_locks_only_its_pages():
    """A pool of 8 pages, all in one cached node of 8; a prompt sharing its first 2 pages.
    The budget counts the 8 as free; after the match 6 must still be (locking the whole
    node left none, and the allocation of the prompt's other 2 pages failed: a decode
    node's step raised OutOfPages)."""
    from common.kv_pool import PageAllocator
    from decode_node.prefix_cache import CacheYieldingAllocator, DecodePrefixCache

    raw = PageAllocator(8)
    cache = DecodePrefixCache(raw, PAGE)
    allocator = CacheYieldingAllocator(raw, cache)
    cached = list(range(100, 100 + 8 * PAGE))
    cache.tree.insert(cached, raw.allocate(8))
    assert allocator.num_free_pages == 8
    r = bare_req("r", cached[: 2 * PAGE] + [1, 2, 3, 4, 5, 6])  # 14 tokens: 4 pages
    cache.match(r)
    assert r.num_prefix_pages == 2 and allocator.num_free_pages == 6
    other = bare_req("o", cached[: 5 * PAGE] + [7])  # into the split node's lower part
    cache.match(other)
    assert other.num_prefix_pages == 5 and allocator.num_free_pages == 3
    r.pages += allocator.allocate(2)  # evicts the unread 3 pages (a whole leaf)
    cache.check_integrity()
    cache.unlock(r)
    cache.unlock(other)
    allocator.free(r.pages)
    cache.check_integrity()
    assert allocator.num_free_pages == 8 and cache.tree.num_protected_pages == 0
    assert cache.num_pages == 5
