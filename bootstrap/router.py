"""Pair choice: prefill by cached prefix (precise) or prefix affinity, decode by least load.

Pure decisions: every call takes the candidate nodes and the mappings their loads are kept
in (read in place, not copied per node) and returns a decision; no sockets, clocks or
metrics here (the gateway counts what the decisions say).

Prefill: the affinity key is a stable 64-bit hash of the request's ``routing_key`` when one
is given, else of its leading prompt tokens (the first ``affinity_tokens``, whole pages
only once the prompt has one), so prompts that share a system prompt share a key. Keys
and nodes live on a hash ring (``virtual_nodes`` points per node); the key's home is the
first node clockwise. Bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): with ``m``
requests already pending prefill over ``n`` nodes, no node takes the new one while it
holds ``ceil((1 + epsilon) * (m + 1) / n)`` or more; the walk goes on clockwise. A hot
prefix therefore fills its home node up to the bound, then spreads to its ring neighbours.

Precise (``--prefill-router precise``, the default): the gateway's KV index
(bootstrap/kv_index.py) says how many leading prompt pages each node holds, counting the
pages of requests it was sent whose prefill has not ended yet (without those, a prefix
its holders were too busy for was copied once per request until the first copy
reported, and at high load the copies evicted other prefixes, copied in turn: the
collapse bench/routing_sim.py swept cost models for). Each node's
cost, in tokens: the tokens queued on it plus RECOMPUTE_WEIGHT (2) times this prompt's
tokens it does not hold (at least one: the last token is always computed). Waiting
behind a queue delays one request; computing a cached prefix again also takes that
capacity from every later request and evicts other prefixes. With weight 1 (the
request's own TTFT only) bench/routing_sim.py collapsed at 32+ nodes: nodes report
their queue between steps, so a holder in the middle of a long prefill looks as busy as
at its start, and contexts were recomputed elsewhere (bench/routing_sim.py prints each
router's hit rate against the oracle's). The cheapest node wins; ties go to the longer
cached prefix, then to the key's place on the ring. When no node holds a page of the
prompt, the affinity choice is made.
A request with a routing key goes where its key says (the client asked for that
placement; its requests share their cache there anyway).
``round-robin`` and ``random`` are baselines.

Decode: the node with the fewest requests in flight; more free KV pages (as a fraction of
its pool) breaks ties; a node that reported a full pool is skipped while another is not.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import operator
import random
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import cached_property
from itertools import compress, filterfalse, repeat
from typing import NamedTuple

from common.config import PREFILL_ROUTERS

DEFAULT_AFFINITY_TOKENS = 32  # two pages of 16 tokens
# Precise routing weighs the tokens a node would compute against the tokens queued ahead:
# computing a prompt again takes capacity from every later request, waiting does not.
RECOMPUTE_WEIGHT = 2.0
DEFAULT_VIRTUAL_NODES = 64
DEFAULT_EPSILON = 0.25
# How many affinity keys the router remembers to tell an affinity hit from a first sight.
AFFINITY_MEMORY = 65_536
ROOM_BITS = 63


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def affinity_key(
    input_ids: Sequence[int],
    routing_key: str | None,
    affinity_tokens: int = DEFAULT_AFFINITY_TOKENS,
    page_size: int = 16,
    cache_salt: str | None = None,
) -> int:
    """The stable 64-bit key a request is placed on the ring by (same in every process).

    A cache salt is part of it: requests of different salts share no cached page, so
    nothing is gained by placing them together."""
    salt = b""  # unsalted keys stay what they were
    if cache_salt is not None:
        raw = cache_salt.encode("utf-8", "surrogatepass")
        salt = b"s:" + len(raw).to_bytes(4, "little") + raw
    if routing_key is not None:
        return _hash64(b"k:" + salt + routing_key.encode())
    n = min(len(input_ids), affinity_tokens)
    if n >= page_size:
        n -= n % page_size  # a radix cache shares whole pages only
    lead = input_ids[:n]
    return _hash64(b"t:" + salt + struct.pack(f"<{n}q", *lead))


class HashRing:
    """Nodes placed at ``virtual_nodes`` points each on a 64-bit ring."""

    def __init__(self, node_ids: Sequence[str], virtual_nodes: int = DEFAULT_VIRTUAL_NODES):
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        points = sorted(
            (_hash64(f"{node_id}#{i}".encode()), node_id)
            for node_id in set(node_ids)
            for i in range(virtual_nodes)
        )
        self.node_ids = frozenset(node_ids)
        self._hashes = [h for h, _ in points]
        self._owners = [node_id for _, node_id in points]
        self._positions: dict[str, list[int]] = {}  # node -> its indices in _hashes, ascending
        for i, node_id in enumerate(self._owners):
            self._positions.setdefault(node_id, []).append(i)

    def walk(self, key: int) -> Iterator[str]:
        """Each node once, clockwise from ``key``: the key's home first."""
        if not self._hashes:
            return
        start = bisect.bisect_left(self._hashes, key)
        seen: set[str] = set()
        for i in range(len(self._hashes)):
            node_id = self._owners[(start + i) % len(self._owners)]
            if node_id not in seen:
                seen.add(node_id)
                yield node_id
                if len(seen) == len(self.node_ids):
                    return

    def first_of(self, key: int, wanted: Iterable[str]) -> str | None:
        """The first of ``wanted`` that ``walk(key)`` meets (None: none is on the ring),
        found by a bisection per wanted node instead of walking past the others."""
        size = len(self._hashes)
        start = bisect.bisect_left(self._hashes, key)
        best, best_step = None, size
        for node_id in wanted:
            positions = self._positions.get(node_id)
            if not positions:
                continue
            i = bisect.bisect_left(positions, start)
            step = positions[i] - start if i < len(positions) else positions[0] + size - start
            if step < best_step:
                best, best_step = node_id, step
        return best


def bounded_load_capacity(total_load: int, num_nodes: int, epsilon: float) -> int:
    """The most requests a node may already hold and still take the next one."""
    return math.ceil((1.0 + epsilon) * (total_load + 1) / num_nodes)


@dataclass(frozen=True)
class PrefillLoads:
    """The prefill nodes a request may go to, and where their loads are kept.

    Read in place, not copied into a tuple per node: at 128 nodes those tuples were most
    of a routing decision's time and, as garbage, what set off the collector inside it
    (bench/routing_sim.py's routing p99). A node missing from a mapping counts 0."""

    node_ids: Sequence[str]
    # requests routed there that have not prefilled yet
    pending: Mapping[str, int] = field(default_factory=dict)
    # prefill tokens waiting there (precise routing's load)
    queued: Mapping[str, int] = field(default_factory=dict)

    @cached_property
    def members(self) -> AbstractSet[str]:
        ids = self.node_ids
        return ids if isinstance(ids, AbstractSet) else frozenset(ids)


class HostHits(NamedTuple):
    """Of the prompt pages each node holds, those on its host tier alone, and what loading
    one back costs there as a fraction of computing it (from the nodes' KV events)."""

    pages: Mapping[str, int]
    costs: Mapping[str, float]


class DecodeCandidate(NamedTuple):
    """A live decode node: requests in flight on it, and its pool as last reported."""

    node_id: str
    num_inflight: int
    num_pages: int = 0
    free_pages: int | None = None  # None: not reported yet
    caches_prefixes: bool = False  # it keeps finished requests' KV (session affinity)

    @property
    def free_fraction(self) -> float:
        if self.free_pages is None or self.num_pages <= 0:
            return 1.0
        return self.free_pages / self.num_pages

    @property
    def is_full(self) -> bool:
        return self.free_pages is not None and self.free_pages <= 0


@dataclass(frozen=True)
class PrefillChoice:
    """Where a key goes on the ring and why."""

    node_id: str
    home_id: str  # the key's first node on the ring
    is_spilled: bool  # the home node was over the load bound
    cached_pages: int = 0  # leading prompt pages the node holds (precise routing)


@dataclass(frozen=True)
class RouteDecision:
    """The chosen (prefill, decode) pair of one request and what the choice was based on."""

    prefill_id: str
    decode_id: str
    key: int
    is_routing_key: bool
    is_spilled: bool
    # The key was last routed to this same prefill node: its prefix is likely cached there.
    is_affinity_hit: bool
    kind: str = "affinity"  # cache | affinity | spilled | routing_key | round_robin | random
    cached_pages: int = 0  # leading prompt pages the KV index says the node holds


def choose_prefill(ring: HashRing, key: int, loads: PrefillLoads, epsilon: float) -> PrefillChoice:
    """Consistent hashing with bounded loads over ``loads.node_ids`` (all on ``ring``)."""
    ids = loads.node_ids
    if not ids:
        raise ValueError("no prefill candidate")
    pending, members = loads.pending.get, loads.members
    capacity = bounded_load_capacity(sum(map(pending, ids, repeat(0))), len(ids), epsilon)
    home = None
    for node_id in ring.walk(key):  # lazily: it usually stops at the first candidate
        if node_id not in members:
            continue
        home = home or node_id
        if pending(node_id, 0) < capacity:
            return PrefillChoice(node_id, home, is_spilled=node_id != home)
    # Unreachable while capacity * n > total load; kept for floats at the edge.
    best = min(ids, key=lambda n: pending(n, 0))
    return PrefillChoice(best, home or best, is_spilled=best != home)


def choose_prefill_by_cache(
    overlaps: Mapping[str, int],
    loads: PrefillLoads,
    prompt_tokens: int,
    page_size: int,
    ring: HashRing,
    key: int,
    recompute_weight: float = RECOMPUTE_WEIGHT,
    host: HostHits | None = None,
) -> PrefillChoice | None:
    """The node that would finish this prefill's wait soonest, or None when no candidate
    holds a page of the prompt. ``overlaps``: leading pages held per node id; ties go to
    the longer cached prefix, then to the first of the tied nodes clockwise from ``key``
    on ``ring``.

    The holders are priced by depth; every other node would compute the whole prompt, so
    of those only the least queued can win. Both in C-level passes over the node ids (no
    object per node: hundreds of nodes a request)."""
    members = loads.members
    held: Mapping[str, int] = overlaps
    if 0 in overlaps.values() or not members >= overlaps.keys():  # else as the index gives
        held = {n: h for n, h in overlaps.items() if h > 0 and n in members}
    if not held:
        return None  # no candidate holds a page of it
    queued = loads.queued.get
    # A holder's cost: its queue plus what holding ``h`` pages leaves to compute; the few
    # distinct depths are priced once, the holders (up to every node) in C-level passes.
    holders, depths = list(held), list(held.values())
    cached = {h: min(h * page_size, prompt_tokens) for h in set(depths)}
    extra = {h: recompute_weight * max(1, prompt_tokens - c) for h, c in cached.items()}
    costs = list(map(operator.add, map(queued, holders, repeat(0)), map(extra.__getitem__, depths)))
    if host is not None:  # a page on a host tier costs its load back there
        for i, n in enumerate(holders):
            if n in host.pages:
                loaded = min(host.pages[n] * page_size, cached[held[n]])
                costs[i] += recompute_weight * loaded * host.costs.get(n, 0.0)
    best_cost = min(costs)
    best = list(compress(holders, map(best_cost.__eq__, costs)))
    if len(best) > 1:  # the longer cached prefix
        most = max(cached[held[n]] for n in best)
        best = [n for n in best if cached[held[n]] == most]
    rest = list(filterfalse(held.__contains__, loads.node_ids))
    if rest:
        rest_loads = list(map(queued, rest, repeat(0)))
        least = min(rest_loads)
        # A holder ties a non-holder of equal cost with a longer cached prefix: it wins.
        if least + recompute_weight * max(1, prompt_tokens) < best_cost:
            best = list(compress(rest, map(least.__eq__, rest_loads)))
    home = next(ring.walk(key), best[0])
    chosen = best[0]
    if len(best) > 1:
        chosen = ring.first_of(key, best) or min(best)
    return PrefillChoice(chosen, home, is_spilled=False, cached_pages=held.get(chosen, 0))


def choose_decode(candidates: Sequence[DecodeCandidate]) -> str:
    """Least loaded decode node: fewest in flight, then most free pages, then id."""
    if not candidates:
        raise ValueError("no decode candidate")
    open_nodes = [c for c in candidates if not c.is_full] or list(candidates)
    best = min(open_nodes, key=lambda c: (c.num_inflight, -c.free_fraction, c.node_id))
    return best.node_id


def choose_decode_by_session(
    ring: HashRing,
    key: int,
    candidates: Sequence[DecodeCandidate],
    epsilon: float,
    session_node: str | None = None,
) -> str:
    """Session affinity over decode nodes with a prefix cache (all on ``ring``): a
    conversation goes to ``session_node`` (the node the gateway saw serve its last turn,
    bootstrap/decode_sessions.py) or else to its key's node on the ring (its routing key,
    or its leading tokens), unless that node is full or past its bounded load; then the
    next node on the ring (a node gone moves only its own conversations); least loaded
    when none fits."""
    by_id = {c.node_id: c for c in candidates}
    capacity = bounded_load_capacity(
        sum(c.num_inflight for c in candidates), len(candidates), epsilon
    )
    held = by_id.get(session_node) if session_node is not None else None
    if held is not None and not held.is_full and held.num_inflight < capacity:
        return held.node_id
    for node_id in ring.walk(key):
        c = by_id.get(node_id)
        if c is not None and not c.is_full and c.num_inflight < capacity:
            return node_id
    return choose_decode(candidates)


class Router:
    """Chooses pairs; keeps the ring of the current prefill nodes and recent key placements."""

    def __init__(
        self,
        *,
        affinity_tokens: int = DEFAULT_AFFINITY_TOKENS,
        page_size: int = 16,
        virtual_nodes: int = DEFAULT_VIRTUAL_NODES,
        epsilon: float = DEFAULT_EPSILON,
        affinity_memory: int = AFFINITY_MEMORY,
        mode: str = "affinity",
        seed: int | None = None,
    ) -> None:
        if epsilon <= 0:
            raise ValueError(f"epsilon must be > 0, got {epsilon}")
        if mode not in PREFILL_ROUTERS:
            raise ValueError(f"prefill router must be one of {', '.join(PREFILL_ROUTERS)}")
        self.mode = mode
        self._rng = random.Random(seed)
        self._turn = 0
        self.affinity_tokens = affinity_tokens
        self.page_size = page_size
        self.virtual_nodes = virtual_nodes
        self.epsilon = epsilon
        self._ring = HashRing((), virtual_nodes)
        self._decode_ring = HashRing((), virtual_nodes)  # decode nodes with a prefix cache
        self._last_node_of_key: OrderedDict[int, str] = OrderedDict()
        self._affinity_memory = affinity_memory

    def route(
        self,
        input_ids: Sequence[int],
        routing_key: str | None,
        prefills: PrefillLoads,
        decodes: Sequence[DecodeCandidate],
        cache_salt: str | None = None,
        overlaps: Mapping[str, int] | None = None,
        partners: Mapping[str, str] | None = None,
        host: HostHits | None = None,
        session_node: str | None = None,
    ) -> RouteDecision:
        """The pair for one request; both candidate lists must be non-empty. ``overlaps``
        (precise mode): leading prompt pages each node holds, from the KV index; ``host``:
        of those, the ones on a host tier alone; ``session_node``: the decode node known to
        cache the longest prefix of the prompt (its conversation's last turn).
        ``partners``: prefill id -> its colocated decode id; such a prefill is paired with
        that decode node only, and other prefills never with a colocated decode node."""
        partners = partners or {}
        key = affinity_key(input_ids, routing_key, self.affinity_tokens, self.page_size, cache_salt)
        prefill, kind = self._choose_prefill(
            key, len(input_ids), routing_key, prefills, overlaps or {}, host
        )
        if prefill.node_id in partners:
            decode_id = partners[prefill.node_id]
        else:
            colocated = set(partners.values())
            decode_id = self._choose_decode(
                key, [d for d in decodes if d.node_id not in colocated] or decodes, session_node
            )
        is_hit = self._last_node_of_key.get(key) == prefill.node_id
        self._remember(key, prefill.node_id)
        return RouteDecision(
            prefill_id=prefill.node_id,
            decode_id=decode_id,
            key=key,
            is_routing_key=routing_key is not None,
            is_spilled=prefill.is_spilled,
            is_affinity_hit=is_hit,
            kind=kind,
            cached_pages=(overlaps or {}).get(prefill.node_id, 0),
        )

    def _choose_prefill(
        self,
        key: int,
        prompt_tokens: int,
        routing_key: str | None,
        prefills: PrefillLoads,
        overlaps: Mapping[str, int],
        host: HostHits | None = None,
    ) -> tuple[PrefillChoice, str]:
        if not prefills.node_ids:
            raise ValueError("no prefill candidate")
        if self.mode == "round-robin":
            ordered = sorted(prefills.node_ids)
            self._turn = (self._turn + 1) % len(ordered)
            node_id = ordered[self._turn]
            return PrefillChoice(node_id, node_id, False), "round_robin"
        if self.mode == "random":
            node_id = self._rng.choice(list(prefills.node_ids))
            return PrefillChoice(node_id, node_id, False), "random"
        if prefills.members != self._ring.node_ids:
            self._ring = HashRing(sorted(prefills.members), self.virtual_nodes)
        if self.mode == "precise" and overlaps and routing_key is None:
            by_cache = choose_prefill_by_cache(
                overlaps, prefills, prompt_tokens, self.page_size, self._ring, key, host=host
            )
            if by_cache is not None:
                return by_cache, "cache"
        choice = choose_prefill(self._ring, key, prefills, self.epsilon)
        kind = (
            "routing_key"
            if routing_key is not None
            else "spilled"
            if choice.is_spilled
            else "affinity"
        )
        return choice, kind

    def _choose_decode(
        self, key: int, decodes: Sequence[DecodeCandidate], session_node: str | None
    ) -> str:
        """By session where decode nodes keep a prefix cache, else least loaded."""
        caching = [d for d in decodes if d.caches_prefixes]
        if not caching:
            return choose_decode(decodes)
        ids = frozenset(d.node_id for d in caching)
        if ids != self._decode_ring.node_ids:
            self._decode_ring = HashRing(sorted(ids), self.virtual_nodes)
        return choose_decode_by_session(self._decode_ring, key, caching, self.epsilon, session_node)

    def _remember(self, key: int, node_id: str) -> None:
        self._last_node_of_key[key] = node_id
        self._last_node_of_key.move_to_end(key)
        while len(self._last_node_of_key) > self._affinity_memory:
            self._last_node_of_key.popitem(last=False)


class RoomAllocator:
    """Unique 63-bit room ids: a counter from a random start (no repeat for 2**63 rooms).

    The random start keeps rooms of a restarted bootstrap apart from the old one's.
    """

    def __init__(self, seed: int | None = None) -> None:
        rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self._next = rng.getrandbits(ROOM_BITS)
        self.num_allocated = 0

    def allocate(self) -> int:
        room = self._next
        self._next = (self._next + 1) % (1 << ROOM_BITS)
        if room == 0:  # 0 reads as "no room" too easily; skip it
            room = self._next
            self._next += 1
        self.num_allocated += 1
        return room
