"""Paged KV pool: page-major KV storage and the page allocator that owns its free list."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Protocol, Sequence

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for one of the dtype names used in configs and on the wire."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV page; two pools can exchange pages only if their layouts are equal."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str

    @property
    def page_shape(self) -> tuple[int, ...]:
        # One page holds every layer's K and V for page_size tokens, contiguously.
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=torch_dtype(self.dtype)).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> KVLayout:
        return KVLayout(**{k: d[k] for k in KVLayout.__dataclass_fields__})


class OutOfPages(RuntimeError):
    """Raised by `allocate` when fewer pages are free than asked for."""


class PageSource(Protocol):
    """What a loop needs of an allocator: a PageAllocator, or on a decode node with a prefix
    cache one that hands out cached pages nobody uses (decode_node/prefix_cache.py)."""

    @property
    def num_pages(self) -> int: ...
    @property
    def num_free_pages(self) -> int: ...
    @property
    def num_used_pages(self) -> int: ...
    def can_allocate(self, num: int) -> bool: ...
    def allocate(self, num: int) -> list[int]: ...
    def free(self, pages: Iterable[int]) -> None: ...
    def check_integrity(self) -> None: ...


class PageAllocator:
    """Free list of page ids. The only owner of which pages are free."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._is_free = bytearray(b"\x01") * num_pages
        # Kept sorted descending so pop() hands out the lowest ids first, which
        # keeps a request's pages in long contiguous runs (fewer transfer descriptors).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_sorted = True

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, num: int) -> bool:
        return 0 <= num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        if num < 0:
            raise ValueError(f"cannot allocate {num} pages")
        if num > len(self._free):
            raise OutOfPages(f"asked for {num} pages, {len(self._free)} free")
        if not self._is_sorted:
            self._free.sort(reverse=True)
            self._is_sorted = True
        pages = self._free[len(self._free) - num :][::-1]
        del self._free[len(self._free) - num :]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        for i, p in enumerate(pages):
            if not (isinstance(p, int) and 0 <= p < self.num_pages):
                self._undo_partial_free(pages[:i])
                raise ValueError(f"page {p!r} does not belong to this pool")
            if self._is_free[p]:
                self._undo_partial_free(pages[:i])
                raise ValueError(f"double free of page {p}")
            self._is_free[p] = 1
        self._free.extend(pages)
        self._is_sorted = len(pages) == 0 and self._is_sorted

    def _undo_partial_free(self, pages: Sequence[int]) -> None:
        # A rejected free changes nothing: pages marked before the bad one go back.
        for p in pages:
            self._is_free[p] = 0

    def check_integrity(self) -> None:
        if len(set(self._free)) != len(self._free):
            raise AssertionError("free list holds a page twice")
        marked = sum(self._is_free)
        if marked != len(self._free):
            raise AssertionError(f"{marked} pages marked free but free list has {len(self._free)}")
        for p in self._free:
            if not self._is_free[p]:
                raise AssertionError(f"page {p} on the free list is not marked free")


class KVPool:
    """KV storage of shape [num_pages, layers, 2 (K, V), page_size, kv_heads, head_dim]."""

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        device: str | torch.device = "cpu",
        *,
        spare_pages: int = 0,
    ):
        """`spare_pages` more pages follow the `num_pages` the allocator hands out: ids
        num_pages, num_pages + 1, ... (`spare_page_ids`), never a request's, never described
        to peers; decode graphs' padding rows write there."""
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        total = num_pages + spare_pages
        self.buffer = torch.zeros(
            (total, *layout.page_shape), dtype=torch_dtype(layout.dtype), device=self.device
        )
        self.allocator = PageAllocator(num_pages)
        self.spare_page_ids = list(range(num_pages, total))
        # Rows of (page, layer, K|V) blocks of page_size * kv_heads * head_dim elements:
        # gathering KV by row index (2-D index_select) is one memcpy per block.
        layer_rows = total * layout.num_layers * 2
        self.rows = self.buffer.view(
            layer_rows, layout.page_size * layout.num_kv_heads * layout.head_dim
        )
        # One token's K (or V) of one layer per row: the model scatters new KV here by index_copy_.
        self.tokens = self.buffer.view(
            layer_rows * layout.page_size, layout.num_kv_heads * layout.head_dim
        )

    @staticmethod
    def num_pages_for(
        layout: KVLayout, max_total_tokens: int | None, memory_budget_bytes: int | None
    ) -> int:
        """Pages from a token count, or else from a memory budget in bytes."""
        if max_total_tokens is not None:
            return max(1, -(-max_total_tokens // layout.page_size))
        if memory_budget_bytes is not None:
            return max(1, memory_budget_bytes // layout.bytes_per_page)
        raise ValueError("size the KV pool with max_total_tokens or a memory budget")

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    def page_address(self, page: int) -> int:
        return self.buffer.data_ptr() + page * self.layout.bytes_per_page

    def read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """A copy of whole pages (all layers), e.g. to offload KV to host memory."""
        return self.buffer[torch.tensor(list(pages), dtype=torch.long, device=self.device)].clone()

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        idx = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        self.buffer[idx] = data.to(device=self.device, dtype=self.buffer.dtype)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole pages (all layers) on the device, src[i] into dst[i]."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source pages for {len(dst)} destinations")
        idx = torch.tensor([*src, *dst], dtype=torch.long, device=self.device)
        self.buffer[idx[len(src) :]] = self.buffer[idx[: len(src)]]

    def check_integrity(self) -> None:
        self.allocator.check_integrity()


@dataclass(frozen=True)
class PageRun:
    """Pages start .. start + length - 1, at positions offset .. offset + length - 1 of a list."""

    start: int
    offset: int
    length: int


def page_runs_of(pages: Sequence[int]) -> list[PageRun]:
    """A list of page ids cut into runs of consecutive ids (each one contiguous copy)."""
    runs: list[PageRun] = []
    for i, page in enumerate(pages):
        last = runs[-1] if runs else None
        if last is not None and page == last.start + last.length:
            runs[-1] = PageRun(last.start, last.offset, last.length + 1)
        else:
            runs.append(PageRun(page, i, 1))
    return runs


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
