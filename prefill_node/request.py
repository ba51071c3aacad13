"""Request state on the prefill node: what the schedule policy sorts and the adder admits.

A ``Req`` is built from a ``GenerateReq`` when it enters the bootstrap queue; wire
concerns (reply endpoint, node ids, logprob options) stay on the message. The scheduling
state at the bottom is written by ``prefill_node.schedule_policy.SchedulePolicy`` (its
prefix matcher): read it, don't assign it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from common.token_keys import TOKEN_BYTES, salt_key, token_key


class PrefixMatch(Protocol):
    """What a request keeps of its radix-cache match (``common.radix_cache.MatchResult``)."""

    @property
    def page_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def total_tokens(self) -> int: ...  # with the host tier's
    @property
    def last_node(self) -> Any: ...  # a common.radix_cache.TreeNode
    @property
    def end_node(self) -> Any: ...  # the deepest node, on either tier
    @property
    def version(self) -> int: ...


@dataclass(eq=False, slots=True)
class Req:
    """One prompt waiting for prefill. Hashable by identity (queues hold each once)."""

    rid: str
    room: int
    origin_input_ids: list[int]
    max_new_tokens: int  # from the sampling params
    priority: int | None = None  # None: sorts after every explicit priority
    routing_key: str | None = None
    arrival_time: float = 0.0  # gateway clock, seconds
    # Set by enter_waiting_queue: FCFS/SPF tie-break and HRRN's aging origin.
    wait_queue_entry_time: float = 0.0
    arrival_processed_tokens: int = 0
    # Packed origin_input_ids (see token_key); computed when not given.
    key: bytes = field(default=b"", repr=False)
    # Requests share cached pages only with requests of the same salt (None: no salt).
    cache_salt: str | None = None
    # The radix-cache namespace of the salt (salt_key), computed once.
    namespace: bytes | None = field(default=None, init=False, repr=False)
    # False: the prompt is computed whole, cached or not (its prompt logprobs are asked
    # for, and a cached page has none): it matches nothing, its pages are still cached.
    reads_cache: bool = True

    # --- scheduling state, owned by the schedule policy ----------------------------------
    # The current radix-cache match of origin_input_ids (None: not matched yet or no cache).
    match: PrefixMatch | None = field(default=None, repr=False)
    # In-batch prefix dedup put this request at the back of the queue for this round.
    is_deprioritized: bool = False

    def __post_init__(self) -> None:
        self.namespace = salt_key(self.cache_salt)
        if not self.key:
            self.key = token_key(self.origin_input_ids)
        elif len(self.key) != TOKEN_BYTES * len(self.origin_input_ids):
            raise ValueError(f"request {self.rid}: key does not pack origin_input_ids")

    def enter_waiting_queue(self, now: float, processed_tokens: int) -> None:
        """Record entry into the waiting queue: its time and the prefill-token counter."""
        self.wait_queue_entry_time = now
        self.arrival_processed_tokens = processed_tokens

    @property
    def num_input_tokens(self) -> int:
        return len(self.origin_input_ids)

    @property
    def prefix_indices(self) -> list[int]:
        """Page ids of the matched prefix (owned by the radix cache; lock before use)."""
        return self.match.page_ids if self.match is not None else []

    @property
    def prefix_len(self) -> int:
        """Tokens of the prompt found in the radix cache, on the device and the host tier
        (a multiple of the page size; SGLang's num_matched_prefix_tokens counts both)."""
        return self.match.total_tokens if self.match is not None and self.reads_cache else 0

    num_cached_tokens = prefix_len

    @property
    def device_prefix_len(self) -> int:
        """The device tier's part of ``prefix_len`` (SGLang's ``req.prefix_len``): what the
        in-batch dedup checks and where dfs-weight places the request."""
        return self.match.num_tokens if self.match is not None and self.reads_cache else 0

    @property
    def last_node(self) -> Any:
        """The deepest radix node holding matched pages: what inc_lock_ref takes."""
        return self.match.last_node if self.match is not None else None

    @property
    def match_version(self) -> int:
        """The radix cache version the match was computed at (-1: never matched)."""
        return self.match.version if self.match is not None else -1
