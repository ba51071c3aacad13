"""Per-request decode state kept on the device, updated where it changes (SGLang's
req_to_token): a page table row per request slot and the next input token of each slot.

A decode step names its requests by slot; the kernels read each one's pages through its row
(common.model.triton_attention), so nothing per request is rebuilt or copied per step: a
request's row is written once when it takes a slot and one entry each time it gets a page,
and its next token is written by the sampler on the device (or once by the host, for a
request's first token). Changes are staged on the host and reach the device in one copy
before the next step (`flush`), in stream order, so a row is never rewritten under a step
still reading it.

    slot = slots.acquire()
    slots.set_pages(slot, pages)         # the request's pages so far; later calls append
    slots.set_token(slot, first_token)   # the token the next step feeds
    ... steps ...
    slots.release(slot)

A slot's pages only grow while it is held (a request's pages are appended, never replaced,
while it decodes); a request that changes its pages otherwise (retraction) releases its
slot and takes a new one. Page ids are checked once, when they enter a row: every entry of
a row is a valid page (entries past a request's pages hold the pool's spare page).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# the table's entries: 4096 slots of 128k-token contexts in 16-token pages take 128 MiB
PAGE_ID = torch.int32


class SlotsFull(RuntimeError):
    """Raised by `acquire` when every slot is held."""


class DecodeSlots:
    """`num_slots` request slots of up to `max_pages` pages each, plus one padding slot
    (`padding_slot`: every entry the spare page, token 0) that a CUDA graph's padding rows
    read. The only owner of which slots are held."""

    def __init__(
        self,
        num_slots: int,
        max_pages: int,
        page_size: int,
        num_pool_pages: int,
        spare_page: int,
        device: torch.device,
    ) -> None:
        if num_slots < 1 or max_pages < 1:
            raise ValueError(f"decode slots need at least one slot and page, got {num_slots}")
        self.num_slots = num_slots
        self.max_pages = max_pages
        self.page_size = page_size
        self.num_pool_pages = num_pool_pages
        self.spare_page = spare_page
        self.device = device
        self.padding_slot = num_slots
        self.page_table = torch.full(
            (num_slots + 1, max_pages), spare_page, dtype=PAGE_ID, device=device
        )
        self.tokens = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self._is_held = bytearray(num_slots)
        self.num_pages = [0] * num_slots  # host: pages written in each slot's row
        # staged changes: (flat table index, page id) and (slot, token)
        self._page_index: list[int] = []
        self._page_value: list[int] = []
        self._token_slot: list[int] = []
        self._token_value: list[int] = []
        self._pin = device.type == "cuda"

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise SlotsFull(f"all {self.num_slots} decode slots are held")
        slot = self._free.pop()
        self._is_held[slot] = 1
        self.num_pages[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        """The slot is free again; its row's entries stay until a new holder writes them
        (a step still in flight may read them: they are valid pages)."""
        self._check_held(slot)
        self._is_held[slot] = 0
        self._free.append(slot)

    def set_pages(self, slot: int, pages: Sequence[int]) -> None:
        """The slot's pages are `pages`: the entries past those already written are staged
        (each id checked against the pool)."""
        self._check_held(slot)
        have = self.num_pages[slot]
        if len(pages) < have:
            raise ValueError(f"slot {slot}: {len(pages)} pages, fewer than its {have}")
        if len(pages) > self.max_pages:
            raise ValueError(f"{len(pages)} pages exceed a slot's {self.max_pages}")
        new = pages[have:]
        if not new:
            return
        if min(new) < 0 or max(new) >= self.num_pool_pages:
            raise ValueError(f"a page id is outside the pool of {self.num_pool_pages} pages")
        base = slot * self.max_pages + have
        self._page_index.extend(range(base, base + len(new)))
        self._page_value.extend(new)
        self.num_pages[slot] = len(pages)

    def set_token(self, slot: int, token: int) -> None:
        """The token the slot's next step feeds (its first, or one the host chose)."""
        self._check_held(slot)
        self._token_slot.append(slot)
        self._token_value.append(token)

    def check_step(self, slot: int, seq_len: int) -> None:
        """A step of `seq_len` tokens fits the slot's pages (O(1): the ids were checked
        when they entered the row)."""
        if seq_len < 1:
            raise ValueError(f"a decode step needs at least one token, got {seq_len}")
        if seq_len > self.num_pages[slot] * self.page_size:
            raise ValueError(f"slot {slot}: {self.num_pages[slot]} pages cannot hold {seq_len}")

    @property
    def has_staged(self) -> bool:
        return bool(self._page_index or self._token_slot)

    def flush(self) -> None:
        """The staged changes to the device: one copy from (pinned) host memory, then two
        scatters, queued on the current stream (nothing waits on the host)."""
        if not self.has_staged:
            return
        num_pages, num_tokens = len(self._page_index), len(self._token_slot)
        host = torch.empty(2 * (num_pages + num_tokens), dtype=torch.long, pin_memory=self._pin)
        flat = host.numpy()
        flat[:num_pages] = self._page_index
        flat[num_pages : 2 * num_pages] = self._page_value
        rest = flat[2 * num_pages :]
        rest[:num_tokens] = self._token_slot
        rest[num_tokens:] = self._token_value
        self._page_index, self._page_value = [], []
        self._token_slot, self._token_value = [], []
        staged = host.to(self.device, non_blocking=self._pin)
        if num_pages:
            index, value = staged[:num_pages], staged[num_pages : 2 * num_pages]
            self.page_table.view(-1).index_copy_(0, index, value.to(PAGE_ID))
        if num_tokens:
            tail = staged[2 * num_pages :]
            self.tokens.index_copy_(0, tail[:num_tokens], tail[num_tokens:])

    def row(self, slot: int) -> list[int]:
        """The slot's pages as the device holds them (tests and integrity checks)."""
        self.flush()
        return self.page_table[slot, : self.num_pages[slot]].tolist()

    def _check_held(self, slot: int) -> None:
        if not (0 <= slot < self.num_slots and self._is_held[slot]):
            raise ValueError(f"decode slot {slot} is not held")

    def check_integrity(self) -> None:
        held = sum(self._is_held)
        if held + len(self._free) != self.num_slots or len(set(self._free)) != len(self._free):
            free = len(self._free)
            raise AssertionError(f"{held} slots held and {free} free of {self.num_slots}")
        if any(self._is_held[s] for s in self._free):
            raise AssertionError("a free decode slot is marked held")


def default_num_slots(num_pages: int, page_size: int, cap: int = 4096) -> int:
    """Request slots for a pool: as many as requests it can run by SGLang's default (half
    the pool's tokens, at most one request per page and `cap`)."""
    return max(1, min(num_pages, num_pages * page_size // 2, cap))
