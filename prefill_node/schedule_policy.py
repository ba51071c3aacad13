"""The order in which the prefill node tries waiting requests (SGLang's schedule_policy.py).

Each round, before the PrefillAdder runs, ``SchedulePolicy.calc_priority`` sorts the
waiting queue in place::

    fallback? -> refresh matches -> in-batch dedup -> sort by policy -> waiting-prefix touch

Cache-agnostic: fcfs (priority, then entry time, with --enable-priority-scheduling),
lof, random, routing-key. Cache-aware: lpm, dfs-weight, hrrn, shortest-prefill-first;
without a radix cache they run as fcfs, except shortest-prefill-first which refuses.
Matches are incremental (``PrefixMatcher``), so the chosen policy stays in force at
thousands of waiting requests; ``cache_aware_fallback_threshold`` (default: never) still
turns lpm/hrrn into fcfs above a queue length, as SGLang does above 128.

The loop, each round (requests enter the queue after ``req.enter_waiting_queue``)::

    policy.calc_priority(waiting_queue, running_reqs, processed_tokens)
    limit = policy.shortest_prefill_chunk_limit(remaining, waiting_queue, rem_chunk, page)
    for req in waiting_queue:                      # in this order, until the adder stops
        match = policy.match_prefix_for_req(req)   # current even after an evict; None: no cache
        tree.inc_lock_ref(match.last_node)         # then use match.page_ids / num_tokens
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from operator import attrgetter
from typing import Any

from common import metrics
from common.config import PrefillConfig
from common.radix_cache import MatchResult, RadixCache
from prefill_node.cache_aware_orders import (
    CacheAwareOrder,
    DfsWeightOrder,
    HrrnOrder,
    StaticKeyOrder,
    sort_prefix_len,
)
from prefill_node.in_batch_dedup import InBatchDedup
from prefill_node.prefix_matcher import PrefixMatcher, RefreshResult
from prefill_node.request import Req

WAITING_PREFIX_REFRESH_INTERVAL = 32  # rounds between waiting-prefix touches
_INF = float("inf")
_IS_DEPRIORITIZED = attrgetter("is_deprioritized")
_END_NODE = attrgetter("match.end_node")  # touched: host-only nodes age too


class CacheAwarePolicy(Enum):
    LPM = "lpm"  # longest prefix match
    DFS_WEIGHT = "dfs-weight"  # radix tree DFS, heaviest subtree first
    HRRN = "hrrn"  # highest response ratio next, token-based aging
    SHORTEST_PREFILL_FIRST = "shortest-prefill-first"


class CacheAgnosticPolicy(Enum):
    FCFS = "fcfs"
    LOF = "lof"  # longest output first
    RANDOM = "random"
    ROUTING_KEY = "routing-key"  # keys already in the running batch first


Policy = CacheAwarePolicy | CacheAgnosticPolicy
_FALLBACK_POLICIES = (CacheAwarePolicy.LPM, CacheAwarePolicy.HRRN)  # as SGLang's 128 rule


@dataclass(frozen=True, slots=True)
class PriorityResult:
    """What one calc_priority round did."""

    policy: str  # the policy applied this round
    is_fallback: bool  # a cache-aware policy was replaced by fcfs this round
    num_new_matches: int  # arrivals matched for the first time
    num_rematches: int  # waiting requests matched again because the tree changed under them
    num_deprioritized: int  # sent to the back by in-batch prefix dedup


def prefill_work(req: Req) -> int:
    """Tokens shortest-prefill-first charges a request: its uncached prompt, at least 1."""
    return max(1, len(req.origin_input_ids) - req.prefix_len)


def _lpm_key_for(is_length_aware: bool = False) -> Callable[[Req], float]:
    # SGLang sorts on the match capped at the prompt less its last token (always computed).
    # Length-aware (opt-in, beyond SGLang): cached minus uncached tokens, so a request with
    # 20K cached and 100 to compute no longer waits behind one with 10K cached and 100K to
    # compute; among equal uncached work it is lpm, among equal matches shortest first.
    def key(r: Req) -> float:
        if r.is_deprioritized:
            return _INF
        cached = sort_prefix_len(r)
        if is_length_aware:
            return float(len(r.origin_input_ids) - 2 * cached)
        return -float(cached)

    return key


def _spf_key(r: Req) -> tuple[bool, int, float]:
    return (r.is_deprioritized, prefill_work(r), r.wait_queue_entry_time)


class SchedulePolicy:
    """Sorts a waiting queue in place each round; owns the prefix matches of its requests.

    tree_cache None means the radix cache is disabled. Reads the ``Req`` fields; writes
    ``req.match`` and ``req.is_deprioritized``. One policy per waiting queue.
    """

    def __init__(
        self,
        policy: str,
        tree_cache: RadixCache | None,
        *,
        enable_priority_scheduling: bool = False,
        schedule_low_priority_values_first: bool = False,
        in_batch_prefix_caching_check_threshold: int = 32,
        in_batch_prefix_caching_deprioritize_threshold: int = 32,
        cache_aware_fallback_threshold: int | None = None,
        enable_cache_agnostic_in_batch_prefix_caching: bool = False,
        waiting_prefix_refresh_interval: int = WAITING_PREFIX_REFRESH_INTERVAL,
        random_seed: int | None = None,
        dfs_weight_dedup: bool = True,
        lpm_length_aware: bool = False,
    ) -> None:
        self.tree_cache = tree_cache
        self.requested_policy = policy
        self.policy: Policy = _validate_and_adjust_policy(policy, tree_cache)
        self.enable_priority_scheduling = enable_priority_scheduling
        # Ascending sort: -1 puts higher values first, +1 lower values first.
        self.priority_sign = 1 if schedule_low_priority_values_first else -1
        self.cache_aware_fallback_threshold = cache_aware_fallback_threshold
        self.enable_cache_agnostic_in_batch = enable_cache_agnostic_in_batch_prefix_caching
        self.waiting_prefix_refresh_interval = waiting_prefix_refresh_interval
        self._rng = random.Random(random_seed)
        self._matcher = PrefixMatcher(tree_cache) if tree_cache is not None else None
        self._order = _cache_aware_order(self.policy, tree_cache, lpm_length_aware)
        # Dedup runs when this policy can apply it: cache-aware, or fcfs with the flag; not
        # under dfs-weight with dedup off (SGLang computes the set there but ignores it).
        uses_dedup = self._order is not None and (
            dfs_weight_dedup or self.policy is not CacheAwarePolicy.DFS_WEIGHT
        )
        self._dedup: InBatchDedup | None = None
        if tree_cache is not None and (uses_dedup or self._fcfs_dedup):
            self._dedup = InBatchDedup(
                in_batch_prefix_caching_check_threshold,
                in_batch_prefix_caching_deprioritize_threshold,
            )
        self._flagged: set[Req] = set()  # requests whose is_deprioritized we set
        # Whether last round's sort kept dedup leaders ahead of their groups.
        self._is_last_sort_dedup_safe = False
        self._num_touch_rounds = 0
        self._metric_children: dict[tuple[str, str], Any] = {}

    @classmethod
    def from_config(cls, config: PrefillConfig, tree_cache: RadixCache | None) -> SchedulePolicy:
        return cls(
            config.schedule_policy,
            None if config.disable_radix_cache else tree_cache,
            enable_priority_scheduling=config.enable_priority_scheduling,
            schedule_low_priority_values_first=config.schedule_low_priority_values_first,
            in_batch_prefix_caching_check_threshold=config.in_batch_prefix_caching_check_threshold,
            in_batch_prefix_caching_deprioritize_threshold=(
                config.in_batch_prefix_caching_deprioritize_threshold
            ),
            cache_aware_fallback_threshold=config.cache_aware_fallback_threshold,
            dfs_weight_dedup=config.dfs_weight_dedup == "on",
            lpm_length_aware=config.lpm_length_aware,
        )

    @property
    def is_shortest_prefill_first(self) -> bool:
        """Under this policy the adder allows one unfinished chunked request only."""
        return self.policy is CacheAwarePolicy.SHORTEST_PREFILL_FIRST

    @property
    def _fcfs_dedup(self) -> bool:
        return self.policy is CacheAgnosticPolicy.FCFS and self.enable_cache_agnostic_in_batch

    # --- the round -------------------------------------------------------------------------
    def calc_priority(
        self,
        waiting_queue: list[Req],
        running_batch: Iterable[Req] | None = None,
        processed_tokens: int | None = None,
    ) -> PriorityResult:
        """Sort ``waiting_queue`` in place for this round and refresh every request's match.

        running_batch: the running requests (routing-key counts their keys); processed_tokens:
        the prefill-token counter now (hrrn's clock; None: no aging, rid order).
        """
        start = time.perf_counter()
        policy = self._active_policy(waiting_queue)
        is_fallback = policy is not self.policy
        is_dedup_on = self._dedup is not None and (policy is self.policy)
        num_new = num_rematched = 0
        if self._matcher is not None:
            refreshed = self._matcher.refresh(waiting_queue)
            num_new, num_rematched = len(refreshed.arrivals), refreshed.num_rematched
            for r in refreshed.departed:
                self._forget(r)
            flipped = self._dedup_round(waiting_queue, refreshed, is_dedup_on)
            if self._order is not None:
                self._order.update(flipped.union(refreshed.changed))
        if not is_fallback:  # SGLang's fallback keeps the queue's order, priorities or not
            self._sort(policy, waiting_queue, running_batch, processed_tokens)
        self._is_last_sort_dedup_safe = is_dedup_on or (
            policy is CacheAgnosticPolicy.FCFS
            and (is_fallback or not self.enable_priority_scheduling)
        )
        if self._matcher is not None:
            self._matcher.remember_order(waiting_queue)
            self._touch_waiting_prefixes(waiting_queue)
        labels = (metrics.ROLE, policy.value)
        child = self._metric_children.get(labels)
        if child is None:
            child = metrics.CALC_PRIORITY_SECONDS.labels(role=labels[0], policy=labels[1])
            self._metric_children[labels] = child
        if is_fallback:
            metrics.POLICY_FALLBACKS.labels(role=metrics.ROLE).inc()
        child.observe(time.perf_counter() - start)
        return PriorityResult(policy.value, is_fallback, num_new, num_rematched, len(self._flagged))

    def match_prefix_for_req(self, req: Req) -> MatchResult | None:
        """The request's current match (memoized; the same object while the tree did not
        change under it); None without a radix cache. The adder calls this right before
        ``inc_lock_ref(req.last_node)``: anything it evicted since calc_priority is seen."""
        if self._matcher is None:
            return None
        return self._matcher.match_req(req)

    def shortest_prefill_chunk_limit(
        self, remaining_tokens: int, waiting_queue: list[Req], budget: int, page_size: int
    ) -> int | None:
        """Cap for the continuing chunked request under shortest-prefill-first, reserving
        chunk budget for shorter waiting requests; None: no cap.

        remaining_tokens: the chunked request's tokens still to prefill; budget: this round's
        chunk budget (rem_chunk_tokens); waiting_queue: as sorted by calc_priority.
        """
        if not self.is_shortest_prefill_first or budget < 2 * page_size:
            return None
        reserved = 0
        for req in waiting_queue:
            work = prefill_work(req)
            charge = -(-work // page_size) * page_size
            if work >= remaining_tokens or reserved + charge > budget - page_size:
                break
            reserved += charge
        if not reserved:
            return None
        return (budget - reserved) // page_size * page_size

    # --- steps -----------------------------------------------------------------------------
    def _active_policy(self, waiting_queue: list[Req]) -> Policy:
        limit = self.cache_aware_fallback_threshold
        if limit is not None and self.policy in _FALLBACK_POLICIES and len(waiting_queue) > limit:
            return CacheAgnosticPolicy.FCFS
        return self.policy

    def _dedup_round(self, queue: list[Req], refreshed: RefreshResult, is_on: bool) -> set[Req]:
        """Update the in-batch dedup and each request's is_deprioritized; return the
        requests whose flag changed."""
        if self._dedup is None:
            return set()
        self._dedup.update(
            refreshed.arrivals,
            refreshed.rematched,
            refreshed.departed,
            refreshed.is_order_kept and self._is_last_sort_dedup_safe,
        )
        now, moved = self._dedup.deprioritized(queue)
        if not is_on:
            now = set()
        # _flagged may be the dedup's live set, already updated: what left it is in moved.
        candidates = moved if self._flagged is now else self._flagged | moved | now
        flipped = {r for r in candidates if r.is_deprioritized != (r in now)}
        for r in flipped:
            r.is_deprioritized = not r.is_deprioritized
        self._flagged = now
        return flipped

    def _forget(self, r: Req) -> None:
        if self._order is not None:
            self._order.forget(r)
        if r in self._flagged:
            r.is_deprioritized = False

    def _sort(
        self,
        policy: Policy,
        queue: list[Req],
        running_batch: Iterable[Req] | None,
        processed_tokens: int | None,
    ) -> None:
        sign = self.priority_sign
        if policy is CacheAgnosticPolicy.FCFS:
            if self.enable_priority_scheduling:
                queue.sort(key=lambda r: _priority_key(r, sign, r.wait_queue_entry_time))
            if self._fcfs_dedup and self._flagged:
                queue.sort(key=_IS_DEPRIORITIZED)
        elif policy is CacheAgnosticPolicy.LOF:
            if self.enable_priority_scheduling:
                queue.sort(key=lambda r: _priority_key(r, sign, -r.max_new_tokens))
            else:
                queue.sort(key=lambda r: -r.max_new_tokens)
        elif policy is CacheAgnosticPolicy.RANDOM:
            self._rng.shuffle(queue)
        elif policy is CacheAgnosticPolicy.ROUTING_KEY:
            _sort_by_routing_key(queue, running_batch)
        else:
            assert self._order is not None
            self._order.sort(queue, processed_tokens)

    def _touch_waiting_prefixes(self, queue: list[Req]) -> None:
        """Every ``waiting_prefix_refresh_interval`` rounds with waiting requests, touch their
        cached prefixes, head most recently, so LRU eviction spares the head of the queue.
        SGLang does this for cache-agnostic policies only (its cache-aware ones rematch, so
        touch, every round); ours rematch only on change, so every policy needs it."""
        if self.tree_cache is None or not queue:
            return
        is_due = self._num_touch_rounds % self.waiting_prefix_refresh_interval == 0
        self._num_touch_rounds += 1
        if is_due:
            self.tree_cache.touch_paths(list(map(_END_NODE, queue)))


def _cache_aware_order(
    policy: Policy, tree: RadixCache | None, lpm_length_aware: bool = False
) -> CacheAwareOrder | None:
    if policy is CacheAwarePolicy.LPM:
        assert tree is not None
        return StaticKeyOrder(_lpm_key_for(lpm_length_aware))
    if policy is CacheAwarePolicy.SHORTEST_PREFILL_FIRST:
        return StaticKeyOrder(_spf_key)
    if policy is CacheAwarePolicy.HRRN:
        assert tree is not None
        return HrrnOrder()
    if policy is CacheAwarePolicy.DFS_WEIGHT:
        assert tree is not None
        return DfsWeightOrder(tree)
    return None


def _validate_and_adjust_policy(policy: str, tree_cache: RadixCache | None) -> Policy:
    try:
        aware = CacheAwarePolicy(policy)
    except ValueError:
        try:
            return CacheAgnosticPolicy(policy)
        except ValueError:
            raise ValueError(f"Unknown schedule_policy: {policy!r}") from None
    if tree_cache is None:
        if aware is CacheAwarePolicy.SHORTEST_PREFILL_FIRST:
            raise ValueError("shortest-prefill-first requires the radix cache (prefix caching)")
        return CacheAgnosticPolicy.FCFS
    return aware


def _priority_key(r: Req, sign: int, then: float) -> tuple[int, int, float]:
    # Requests without a priority sort after every explicit one.
    if r.priority is None:
        return (1, 0, then)
    return (0, r.priority * sign, then)


def _sort_by_routing_key(queue: list[Req], running_batch: Iterable[Req] | None) -> None:
    running = getattr(running_batch, "reqs", running_batch) or ()
    counts = Counter(r.routing_key for r in running if r.routing_key)
    if not counts:
        return

    def key(r: Req) -> tuple[int, int, str]:
        k = r.routing_key
        if k and k in counts:
            return (0, -counts[k], k)
        return (1, 0, k or "")

    queue.sort(key=key)
