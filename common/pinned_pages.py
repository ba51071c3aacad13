"""Host page stores pinned once, in blocks of a power of two pages each, exactly the bytes asked.

torch's pinned allocator (its CachingHostAllocator) rounds every allocation up to a power of
two of bytes: one 9 GiB pinned tensor holds 16 GiB. A store of N pages is instead the binary
decomposition of N, largest first (13 pages: blocks of 8, 4 and 1), each block one tensor:

    pages 0 .. 7 -> block 0, rows 0 .. 7
    pages 8 .. 11 -> block 1, rows 0 .. 3
    page 12 -> block 2, row 0

A block whose bytes are a power of two (a page's bytes are one for most layouts: page_size is
one, and so are most models' layers x KV heads x head_dim) comes from torch's allocator, which
then holds exactly it; any other block is allocated plain and pinned in place
(cudaHostRegister: exactly its bytes), unpinned when its memory goes. Either way the pinned
bytes equal the pages' bytes. Off CUDA there is nothing to pin: one plain tensor.

A run of consecutive page ids is one copy inside a block and is cut where a block ends
(`rows`).
"""

from __future__ import annotations

import math
import weakref
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

import torch

_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def power_of_two_blocks(num_pages: int) -> list[int]:
    """The binary decomposition of `num_pages`, largest first: 13 -> [8, 4, 1]."""
    if num_pages <= 0:
        raise ValueError(f"a page store needs at least one page, got {num_pages}")
    return [1 << bit for bit in range(num_pages.bit_length() - 1, -1, -1) if num_pages >> bit & 1]


class PinnedPages:
    """`num_pages` pages of `page_shape` in host memory, ids 0 .. num_pages - 1: pinned
    blocks of a power of two pages each when `pin` (a GPU copies to and from them), else
    one plain tensor. `block_pages` gives the blocks' sizes instead (tests)."""

    def __init__(
        self,
        num_pages: int,
        page_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        pin: bool,
        block_pages: Sequence[int] | None = None,
    ) -> None:
        if block_pages is None:
            block_pages = power_of_two_blocks(num_pages) if pin else [num_pages]
        if num_pages <= 0 or sum(block_pages) != num_pages or min(block_pages) <= 0:
            raise ValueError(f"blocks of {list(block_pages)} pages for a store of {num_pages}")
        self.num_pages = num_pages
        self.page_shape = tuple(page_shape)
        self.dtype = dtype
        self.is_pinned = pin
        self.blocks = [_host_block((n, *self.page_shape), dtype, pin) for n in block_pages]
        self._starts = list(accumulate(block_pages, initial=0))[:-1]  # each block's first page

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * self.blocks[0].element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks: the pages' bytes, and what is pinned when `is_pinned`."""
        return sum(b.numel() * b.element_size() for b in self.blocks)

    def locate(self, page: int) -> tuple[int, int]:
        """(block, row in that block) of a page id."""
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} is not in a store of {self.num_pages} pages")
        block = bisect_right(self._starts, page) - 1
        return block, page - self._starts[block]

    def rows(self, first: int, length: int) -> list[tuple[int, torch.Tensor]]:
        """Pages first .. first + length - 1 as views of block rows, cut where a block ends:
        (the view's first page's position in the range, the view)."""
        views: list[tuple[int, torch.Tensor]] = []
        position = 0
        while position < length:
            block, row = self.locate(first + position)
            n = min(length - position, self.blocks[block].shape[0] - row)
            views.append((position, self.blocks[block][row : row + n]))
            position += n
        return views

    def read(self, pages: Sequence[int]) -> torch.Tensor:
        """A copy of some pages, in order (checks and tests)."""
        out = torch.empty((len(pages), *self.page_shape), dtype=self.dtype)
        for i, page in enumerate(pages):
            block, row = self.locate(page)
            out[i] = self.blocks[block][row]
        return out


def _host_block(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    if not pin:
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes & (nbytes - 1) == 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)  # no rounding: a power of two
    block = torch.empty(shape, dtype=dtype)
    _pin_in_place(block)
    return block


def _pin_in_place(block: torch.Tensor) -> None:
    """Pin a plain tensor's memory (exactly its bytes); unpinned before that memory is freed."""
    storage = block.untyped_storage()
    address, nbytes = storage.data_ptr(), storage.nbytes()
    error = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _REGISTER_PORTABLE))
    if error != 0:
        raise RuntimeError(f"pinning {nbytes} bytes of host memory failed: cudaError {error}")
    # on the block tensor the store keeps (a storage's Python object may be a fresh wrapper)
    unpin = weakref.finalize(block, _unpin, address)
    unpin.atexit = False  # at exit the CUDA context may be gone already; the process frees it


def _unpin(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)
