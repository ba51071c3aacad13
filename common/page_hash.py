"""Chained page hashes: the name of a cached KV page that every process computes the same way.

A prefill node's radix cache names each page it stores by the hash of its parent page's
hash and the page's token ids; the gateway names a prompt's leading pages the same way
and looks them up in its index of what each node holds (bootstrap/kv_index.py). Two pages
have the same hash exactly when (but for a 2**-64 collision) they hold the same tokens
after the same prefix under the same cache salt, which is when a radix cache shares them.

    h_0 = root(salt)            64 bits of blake2b over the salt's namespace key
    g_i = mix(sum_k (t_ik + 1) * A_k)   the page's tokens t_i0..t_i(P-1), fixed odd A_k
    h_i = M * h_(i-1) + g_i     (mod 2**64), M odd

The chain is linear in h so that a prompt's hashes come out of numpy in one pass
(h_i = M**i * (h_0 + sum_(j<=i) M**-j * g_j), wrapping uint64 arithmetic); `mix` is
splitmix64's finalizer, so pages that differ anywhere differ in g. Not cryptographic: a
client who crafted two prompts with equal hashes would only misroute its own request —
the radix cache itself matches token bytes, never hashes.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from common.token_keys import salt_key

HashArray = npt.NDArray[np.uint64]

_MASK = (1 << 64) - 1
_M = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64
_M_INV = pow(_M, -1, 1 << 64)
_ROOT_LABEL = b"pdserve page hash v1"


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class _Tables:
    """Per-position token multipliers and the powers of M and M**-1, grown on demand."""

    def __init__(self) -> None:
        self.mult: dict[int, HashArray] = {}
        self.pow = np.ones(1, dtype=np.uint64)
        self.inv = np.ones(1, dtype=np.uint64)

    def multipliers(self, page_size: int) -> HashArray:
        found = self.mult.get(page_size)
        if found is None:
            found = np.array([_splitmix(k) | 1 for k in range(page_size)], dtype=np.uint64)
            self.mult[page_size] = found
        return found

    def powers(self, n: int) -> tuple[HashArray, HashArray]:
        """M**0..M**n and M**-0..M**-n."""
        if len(self.pow) <= n:
            size = max(n + 1, 2 * len(self.pow))
            pw, iv, p, q = [], [], 1, 1
            for _ in range(size):
                pw.append(p)
                iv.append(q)
                p, q = (p * _M) & _MASK, (q * _M_INV) & _MASK
            self.pow = np.array(pw, dtype=np.uint64)
            self.inv = np.array(iv, dtype=np.uint64)
        return self.pow[: n + 1], self.inv[: n + 1]


_TABLES = _Tables()


def root_hash(namespace: bytes | None) -> int:
    """h_0 of a radix-cache namespace (``common.token_keys.salt_key``; None: no salt)."""
    digest = hashlib.blake2b(_ROOT_LABEL + (namespace or b""), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(x: HashArray) -> HashArray:
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _as_tokens(tokens: Sequence[int] | bytes | npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
    if isinstance(tokens, bytes):
        return np.frombuffer(tokens, dtype=np.int32)  # the radix cache's packed key
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int32, copy=False)
    return np.frombuffer(array.array("i", tokens), dtype=np.int32)


def chain(
    tokens: Sequence[int] | bytes | npt.NDArray[np.int32], page_size: int, parent: int
) -> HashArray:
    """The hashes of the whole pages of ``tokens``, which follow a page hashed ``parent``
    (a root hash for the first page of a sequence)."""
    t = _as_tokens(tokens)
    n = len(t) // page_size
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        pages = t[: n * page_size].reshape(n, page_size).astype(np.uint64) + np.uint64(1)
        g = _mix((pages * _TABLES.multipliers(page_size)).sum(axis=1, dtype=np.uint64))
        pw, iv = _TABLES.powers(n)
        acc = np.cumsum(g * iv[1:], dtype=np.uint64) + np.uint64(parent)
        return acc * pw[1:]  # type: ignore[no-any-return]


def prompt_hashes(
    input_ids: Sequence[int], page_size: int, cache_salt: str | None = None
) -> HashArray:
    """Hashes of a prompt's whole pages, as the radix cache of a node holding them names them."""
    return chain(input_ids, page_size, root_hash(salt_key(cache_salt)))


def pack(hashes: HashArray | Sequence[int]) -> bytes:
    """Hashes on the wire: little-endian uint64s."""
    return np.asarray(hashes, dtype="<u8").tobytes()


def unpack(data: bytes) -> HashArray:
    """The inverse of pack; raises ValueError on a length that is not a multiple of 8."""
    if len(data) % 8:
        raise ValueError(f"{len(data)} bytes is not a whole number of 64-bit hashes")
    return np.frombuffer(data, dtype="<u8").astype(np.uint64)
