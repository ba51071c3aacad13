"""SGLang's exact orders on the smallest cases where pdserve used to differ, and cache salts."""

from __future__ import annotations

from common.config import PrefillConfig
from common.kv_pool import PageAllocator
from common.radix_cache import RadixCache
from prefill_node.hiradix_cache import HiRadixCache
from prefill_node.request import Req
from prefill_node.schedule_policy import SchedulePolicy
from tests.support.host_pages import NoCopyHost
from tests.unit.prefill_node.test_schedule_policy import PAGE, make_tree, req, rids

# --- SGLang's exact orders on the smallest cases where pdserve used to differ ------------


def _page1_tree(*cached: list[int]) -> RadixCache:
    alloc = PageAllocator(64)
    tree = RadixCache(1, alloc)
    for tokens in cached:
        tree.insert(tokens, alloc.allocate(len(tokens)))
    return tree


def test_lpm_sorts_on_the_prompt_less_its_last_token():
    # Cache [[5, 6]]: y=[5, 6] is fully cached, but its last token is computed anyway, so
    # SGLang matches y[:-1] = [5] (1 token), as for x=[5, 7]: a tie, queue order x, y.
    # (pdserve used to sort y first on its uncapped match of 2.)
    queue = [req("x", [5, 7]), req("y", [5, 6])]
    SchedulePolicy("lpm", _page1_tree([5, 6])).calc_priority(queue)
    assert rids(queue) == ["x", "y"]


def test_hrrn_counts_a_fully_cached_prompt_as_one_uncached_token():
    # Cache [[637]], processed 0: both have waited 0 tokens, ratio 0 for both (r1 has 1
    # uncached token, not 0), so rid order: r0, r1. (pdserve drained r1 first.)
    queue = [req("r1", [637]), req("r0", [345])]
    SchedulePolicy("hrrn", _page1_tree([637])).calc_priority(queue, None, processed_tokens=0)
    assert rids(queue) == ["r0", "r1"]


def test_dfs_weight_orders_as_if_the_node_were_split_at_each_match_end():
    # Cache [[79, 743]]: b=[79, 743] matches [79] (less its last token), ending inside the
    # node; SGLang splits it and b hangs on the new [79] node, a child of the root where
    # a=[79] (match of nothing) hangs: children first, so b, a.
    queue = [req("a", [79]), req("b", [79, 743])]
    SchedulePolicy("dfs-weight", _page1_tree([79, 743])).calc_priority(queue)
    assert rids(queue) == ["b", "a"]
    # Deeper ends inside one node come first; the node's children before all of them.
    tree = _page1_tree([1, 2, 3, 4], [1, 2, 3, 4, 5, 6])
    queue = [
        req("one", [1, 2, 9]),  # ends after 2 tokens of node [1, 2, 3, 4]
        req("child", [1, 2, 3, 4, 5, 6, 7]),  # in the child node [5, 6]
        req("three", [1, 2, 3, 9]),  # ends after 3 tokens
        req("whole", [1, 2, 3, 4, 8]),  # ends at the node's end
    ]
    SchedulePolicy("dfs-weight", tree).calc_priority(queue)
    assert rids(queue) == ["child", "whole", "three", "one"]


def _page4_tree(*cached: list[int]) -> RadixCache:
    alloc = PageAllocator(64)
    tree = RadixCache(4, alloc)
    for tokens in cached:
        tree.insert(tokens, alloc.allocate(len(tokens) // 4))
    return tree


def test_lpm_and_hrrn_key_on_the_capped_match_in_tokens_not_pages():
    # Page 4, cache [0..19]: "whole" (those 20 tokens) keys 20 capped at 19 in SGLang, "part"
    # (16 of them + 1) keys 16. pdserve used to round both to 16 pages' worth: a tie kept
    # queue order part, whole; SGLang sorts whole first.
    base = list(range(20))
    tree = _page4_tree(base)
    queue = [req("part", base[:16] + [99]), req("whole", base)]
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert rids(queue) == ["whole", "part"] and queue[1].prefix_len == 16
    # hrrn, 4 tokens waited: whole has 1 token to compute (ratio 4), part 2 (ratio 2).
    # Rounded to pages whole had 4 to compute (ratio 1) and went behind part.
    queue = [
        req("part", base[:16] + [98, 99], arrival_processed_tokens=0),
        req("whole", base, arrival_processed_tokens=0),
    ]
    SchedulePolicy("hrrn", tree).calc_priority(queue, None, processed_tokens=4)
    assert rids(queue) == ["whole", "part"]


def test_dfs_weight_places_a_fully_cached_prompt_at_its_whole_match():
    # The case, page 1: cache 28 tokens; r2 = those 28, r5 = those 28 and 27 more.
    # SGLang matches r2's whole prompt (28 tokens, the node's end: no split), so both hang
    # on the one node, queue order: r2, r5. pdserve used to place r2 at its capped match
    # (27 tokens, inside the node) and put r5 first.
    cached = [921, 63, *range(300, 326)]
    assert len(cached) == 28
    queue = [req("r2", list(cached)), req("r5", cached + list(range(500, 527)))]
    SchedulePolicy("dfs-weight", _page1_tree(cached), dfs_weight_dedup=False).calc_priority(queue)
    assert rids(queue) == ["r2", "r5"]


def test_dfs_weight_dedup_off_is_sglangs_unused_dedup_set():
    tree = _page1_tree([1])
    shared = [1, *range(100, 140)]  # 1 cached token, then 40 shared that are not

    def queue() -> list[Req]:
        return [req("plain", [7, 8]), req("lead", shared + [1]), req("mate", shared + [2])]

    on = queue()
    SchedulePolicy("dfs-weight", tree).calc_priority(on)
    # pdserve: the mate would compute the lead's 40 tokens again; it goes last.
    assert rids(on) == ["lead", "plain", "mate"] and on[2].is_deprioritized
    off = queue()
    SchedulePolicy("dfs-weight", tree, dfs_weight_dedup=False).calc_priority(off)
    # SGLang 0.5.23: the dedup set is not used; both hang on the [1] node, before the root.
    assert rids(off) == ["lead", "mate", "plain"]
    assert not any(r.is_deprioritized for r in off)


def test_dfs_weight_dedup_flag_reaches_the_policy():
    config = PrefillConfig(schedule_policy="dfs-weight", dfs_weight_dedup="off")
    policy = SchedulePolicy.from_config(config, _page1_tree([1]))
    assert policy._dedup is None
    assert (
        SchedulePolicy.from_config(
            PrefillConfig(schedule_policy="dfs-weight"), _page1_tree([1])
        )._dedup
        is not None
    )


# --- host-tier hits (SGLang 0.5.23's UnifiedRadixCache with HiCache's tree) --------------


def _page1_tiers(*cached: list[int], evict: int) -> HiRadixCache:
    """Page 1, every node written through to the host; the least recently inserted
    ``evict`` device pages then moved to the host."""
    alloc = PageAllocator(64)
    tree = HiRadixCache(1, alloc, NoCopyHost(64), "write_through")
    for tokens in cached:
        tree.insert(tokens, alloc.allocate(len(tokens)))
    assert tree.evict(evict) == evict
    return tree


def test_the_in_batch_dedup_checks_the_device_part_of_a_match():
    # 40 shared tokens, all on the host: SGLang checks req.prefix_len (device only, 0), so
    # mate matches lead's 40 tokens in the queue's tree and goes last; pdserve used to
    # check the match with its host part (40, past the 32-token threshold) and let both
    # go, each loading the same pages back.
    shared = list(range(100, 140))
    tree = _page1_tiers(shared, evict=40)
    queue = [req("lead", shared + [1]), req("mate", shared + [2]), req("plain", [7, 8])]
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert rids(queue) == ["lead", "plain", "mate"] and queue[2].is_deprioritized
    assert [r.prefix_len for r in queue] == [40, 0, 40]  # host hits count for the sort


def test_dfs_weight_places_a_host_hit_at_its_last_device_node():
    # Cache [1, 2, 3] (inserted first, then evicted to the host) and [5, 6, 7] (device).
    # SGLang hangs "host" (a host hit of 3, nothing on the device) on its last device node,
    # the root, visited after its children: device, host. pdserve used to place it at the
    # host-only node, which ties with [5, 6, 7] and came first (inserted first).
    tree = _page1_tiers([1, 2, 3], [5, 6, 7], evict=3)
    queue = [req("host", [1, 2, 3, 9]), req("device", [5, 6, 7, 9])]
    SchedulePolicy("dfs-weight", tree, dfs_weight_dedup=False).calc_priority(queue)
    assert [r.prefix_len for r in queue] == [3, 3]
    assert [r.device_prefix_len for r in queue] == [3, 0]
    assert rids(queue) == ["device", "host"]


# --- cache salts ---------------------------------------------------------------------------


def test_salted_requests_match_only_their_salts_pages_and_are_never_deduped_together():
    from common.token_keys import salt_key

    tree, alloc = make_tree()
    prompt = list(range(50, 90))  # 40 tokens: far past the dedup thresholds
    queue = [
        req("a1", prompt, cache_salt="a"),
        req("b1", prompt, cache_salt="b"),
        req("plain", prompt),
    ]
    policy = SchedulePolicy("lpm", tree)
    policy.calc_priority(queue)
    # Three salts (none is one): three groups, nobody deprioritized.
    assert not any(r.is_deprioritized for r in queue)
    pages = alloc.allocate(len(prompt) // PAGE)
    tree.insert(prompt, pages, salt_key("a"))  # a1's prefill finished
    policy.calc_priority(queue)
    by_rid = {r.rid: r for r in queue}
    assert by_rid["a1"].prefix_len == len(prompt)  # rematched when salt a's subtree appeared
    assert by_rid["b1"].prefix_len == 0 and by_rid["plain"].prefix_len == 0
    assert rids(queue)[0] == "a1"
    # Same salt: shared, and deduped as usual.
    mates = [req("a2", prompt + [1], cache_salt="a"), req("a3", prompt + [2], cache_salt="a")]
    policy.calc_priority(mates)
    assert [r.prefix_len for r in mates] == [len(prompt), len(prompt)]
