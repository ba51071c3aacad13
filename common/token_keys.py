"""Packed token keys and cache-salt namespaces: what the radix cache, the page hashes and the
router's KV index key pages by."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Token ids are packed as int32 into a bytes key: slicing, hashing (cached by bytes)
# and prefix comparison (memcmp) then run in C, which is what keeps matching cheap.
TOKEN_BYTES = 4


def token_key(token_ids: Sequence[int]) -> bytes:
    """The packed key of a token sequence: TOKEN_BYTES bytes per token id (int32)."""
    return struct.pack(f"={len(token_ids)}i", *token_ids)


def salt_key(cache_salt: str | None) -> bytes | None:
    """The radix-cache namespace of a cache salt (None: the shared one). 21 bytes, never a
    whole number of tokens, so it cannot collide with a page key among the root's children."""
    if cache_salt is None:
        return None
    return b"\x00" + hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).digest()[:20]
