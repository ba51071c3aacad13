"""Who may call the public API: keys of ``--api-key`` and ``--api-key-file``, not the cluster token.

The cluster token lets a process join the cluster and receive requests and KV, so no API
client holds it. Clients present one of the API keys as ``Authorization: Bearer <key>``;
with no key configured the API is open. The key file holds one key per line (blank lines
and ``#`` comments skipped) and is read again when it changes, so keys rotate without a
restart: add the new key, move the clients, remove the old one.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

RELOAD_INTERVAL_S = 1.0


class ApiKeyError(ValueError):
    """The key file cannot be read or holds no key."""


def read_key_file(path: Path) -> tuple[str, ...]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiKeyError(f"cannot read --api-key-file {path}: {exc}") from None
    keys = tuple(
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    )
    if not keys:
        raise ApiKeyError(f"--api-key-file {path} holds no key")
    return keys


class ApiKeys:
    """The accepted API keys: the fixed ones plus the key file's current contents."""

    def __init__(self, keys: tuple[str, ...] = (), key_file: str | None = None) -> None:
        self._fixed = keys
        self._path = Path(key_file) if key_file else None
        self._from_file: tuple[str, ...] = ()
        self._mtime_ns: int | None = None
        self._next_check = 0.0
        if self._path is not None:
            self._from_file = read_key_file(self._path)
            self._mtime_ns = os.stat(self._path).st_mtime_ns

    @property
    def is_required(self) -> bool:
        return bool(self._fixed) or self._path is not None

    def accepts(self, candidate: str | None) -> bool:
        """Whether ``candidate`` is a current key (any value when no key is configured)."""
        if not self.is_required:
            return True
        if candidate is None:
            return False
        self._reload_if_changed()
        given = candidate.encode()
        # Compare against every key so the time taken does not tell which one matched.
        matches = [
            hmac.compare_digest(given, key.encode()) for key in self._fixed + self._from_file
        ]
        return any(matches)

    def _reload_if_changed(self) -> None:
        now = time.monotonic()
        if self._path is None or now < self._next_check:
            return
        self._next_check = now + RELOAD_INTERVAL_S
        try:
            mtime_ns = os.stat(self._path).st_mtime_ns
            if mtime_ns == self._mtime_ns:
                return
            self._from_file = read_key_file(self._path)
            self._mtime_ns = mtime_ns
            logger.info("API keys reloaded from %s (%d keys)", self._path, len(self._from_file))
        except (OSError, ApiKeyError) as exc:
            # Keep serving with the last good keys rather than locking every client out.
            logger.warning("keeping the previous API keys: %s", exc)
