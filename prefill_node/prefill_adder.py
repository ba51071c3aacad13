"""PrefillAdder: admits sorted waiting requests into one prefill batch under SGLang's budgets.

Budgets (tokens):
  rem_total   = free pool tokens + evictable radix tokens - offset, where offset grows
                with each admission by ceil_page(extend) + reserved output tokens + a page
  rem_input   = --max-prefill-tokens, less each admitted extend
  rem_chunk   = --chunked-prefill-size (None: chunking off), less each admitted extend
  requests    = --prefill-max-requests
Results: CONTINUE (keep adding), NO_TOKEN (memory is short: stop, the batch is full),
OTHER (a non-memory limit: stop). At most one chunked request exists; the scheduler
continues it first each round (add_chunked_req) before any new request.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from common.radix_node import TreeNode
from prefill_node.request import Req

CLIP_MAX_NEW_TOKENS = 4096


def admission_tokens(extend: int, max_new_tokens: int, page_size: int) -> int:
    """What admitting a request takes off rem_total: its extend in whole pages, its output
    reserve and a page of overhead (SGLang's). More than the whole pool: never admitted."""
    return ceil_page(extend, page_size) + min(max_new_tokens, CLIP_MAX_NEW_TOKENS) + page_size


class AddReqResult(Enum):
    CONTINUE = "continue"
    NO_TOKEN = "no_token"
    OTHER = "other"


class LockingCache(Protocol):
    def cut(self, node: TreeNode, num_pages: int) -> TreeNode: ...
    def inc_lock_ref(self, node: TreeNode) -> None: ...
    def dec_lock_ref(self, node: TreeNode) -> None: ...
    def evictable_size(self) -> int: ...


@dataclass
class PrefillChunk:
    """One request's share of this round: KV for tokens [start, end) gets computed."""

    req: Req
    start: int
    end: int
    # Radix node this admission locked (the caller unlocks it when the request is done).
    locked_node: TreeNode | None = None

    @property
    def extend_len(self) -> int:
        return self.end - self.start

    @property
    def is_last(self) -> bool:
        return self.end == self.req.num_input_tokens


def ceil_page(n: int, page: int) -> int:
    return -(-n // page) * page


class PrefillAdder:
    def __init__(
        self,
        page_size: int,
        free_tokens: int,
        tree_cache: LockingCache | None,
        *,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        prefill_max_requests: int | None = None,
        running_reserved_tokens: int = 0,
    ) -> None:
        self.page_size = page_size
        self.free_tokens = free_tokens
        self.tree_cache = tree_cache
        self.offset = running_reserved_tokens
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        self.prefill_max_requests = prefill_max_requests
        self.can_run_list: list[PrefillChunk] = []
        self.new_chunked_req: Req | None = None
        # False while an earlier chunked request stays unfinished this round: a new request
        # is then admitted only whole.
        self.can_start_chunk = True

    @property
    def rem_total_tokens(self) -> int:
        evictable = self.tree_cache.evictable_size() if self.tree_cache is not None else 0
        return self.free_tokens + evictable - self.offset

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (
            self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0
        ):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def add_chunked_req(
        self, req: Req, num_computed: int, chunk_limit: int | None = None
    ) -> Req | None:
        """Continue the chunked request first; returns it if still unfinished after this round."""
        end = self._truncate(num_computed, req.num_input_tokens, chunk_limit)
        if end <= num_computed:
            return req
        self._charge(PrefillChunk(req, num_computed, end), reserved=0)
        return req if end < req.num_input_tokens else None

    def add_one_req(
        self,
        req: Req,
        prefix_len: int,
        last_node: TreeNode | None = None,
        chunk_limit: int | None = None,
    ) -> AddReqResult:
        """Admit a new request whose first `prefix_len` tokens are cached (at `last_node`)."""
        if (
            self.prefill_max_requests is not None
            and len(self.can_run_list) >= self.prefill_max_requests
        ):
            return AddReqResult.OTHER
        extend = req.num_input_tokens - prefix_len
        reserved = min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS)
        total = admission_tokens(extend, req.max_new_tokens, self.page_size)
        locked = None
        if self.tree_cache is not None and last_node is not None:
            # Locked first: its pages must not count as evictable room for itself. Only
            # the prefix's: the node it ends inside is cut there (the rest stays evictable).
            locked = self.tree_cache.cut(last_node, prefix_len // self.page_size)
            self.tree_cache.inc_lock_ref(locked)
        if total > self.rem_total_tokens:
            self._unlock(locked)
            return AddReqResult.NO_TOKEN
        # As SGLang: past the round's prefill-token cap only the first request may go
        # (chunked or not); the others wait for the next round.
        if self.can_run_list and ceil_page(extend, self.page_size) >= self.rem_input_tokens:
            self._unlock(locked)
            return AddReqResult.OTHER
        end = self._truncate(prefix_len, req.num_input_tokens, chunk_limit)
        if end <= prefix_len:
            self._unlock(locked)
            return AddReqResult.OTHER
        if end < req.num_input_tokens and not self.can_start_chunk:
            self._unlock(locked)
            return AddReqResult.OTHER
        if end < req.num_input_tokens:
            self.new_chunked_req = req
            reserved = 0  # a chunked request reserves no output until its last chunk
        self._charge(PrefillChunk(req, prefix_len, end, locked), reserved)
        if self.new_chunked_req is not None:
            return AddReqResult.OTHER  # one chunked request at a time: the batch is closed
        return self.budget_state()

    def _truncate(self, start: int, stop: int, chunk_limit: int | None) -> int:
        """End of this round's chunk: everything, or up to an absolute page boundary."""
        limit = self.rem_chunk_tokens
        if chunk_limit is not None:
            limit = chunk_limit if limit is None else min(limit, chunk_limit)
        if limit is None or stop - start <= limit:
            return stop
        return (start + limit) // self.page_size * self.page_size

    def _charge(self, chunk: PrefillChunk, reserved: int) -> None:
        self.can_run_list.append(chunk)
        self.offset += ceil_page(chunk.extend_len, self.page_size) + reserved + self.page_size
        self.rem_input_tokens -= chunk.extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= chunk.extend_len

    def _unlock(self, node: TreeNode | None) -> None:
        if node is not None and self.tree_cache is not None:
            self.tree_cache.dec_lock_ref(node)
