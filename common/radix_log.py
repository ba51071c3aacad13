"""The radix cache's log of structural changes: what a kept match is checked against.

Every change of the tree's shape (child added, node split, node evicted, node moved
between tiers) bumps ``version`` and is logged, so a ``MatchResult`` computed at some
version can be revalidated from the changes since (``is_match_current``; the prefix
matcher reads ``events_since`` the same way). A reset starts a new ``generation``.
"""

from __future__ import annotations

from common.radix_node import EV_ADD, EV_SPLIT, Event, MatchResult, TreeNode

_MAX_LOG = 1 << 16  # events kept for revalidating matches


class ChangeLog:
    """The log half of RadixCache (a base class of it)."""

    def _init_log(self) -> None:
        self.version = 0
        self.generation = 0
        self._log: list[Event] = []
        self._log_start = 0  # version of _log[0]

    def _restart_log(self) -> None:
        """After a reset: a new generation, no event before it kept."""
        self.generation += 1
        self.version += 1
        self._log.clear()
        self._log_start = self.version

    def events_since(self, version: int) -> list[Event] | None:
        """Structural changes after ``version``; None when they are no longer logged."""
        if version == self.version:
            return []
        if version < self._log_start or version > self.version:
            return None
        return self._log[version - self._log_start :]

    def is_match_current(self, match: MatchResult) -> bool:
        """Whether ``match`` is still what match_prefix would return (same pages and node)."""
        if match.generation != self.generation:
            return False
        events = self.events_since(match.version)
        if events is None:
            return False
        filed = (match.last_node, match.first_host, match.end_node)
        for kind, n, detail in events:
            if n not in filed:
                continue
            if kind == EV_ADD:
                if n is match.end_node and detail == match.extend_key:
                    return False
            elif kind != EV_SPLIT or match.first_host is not None:
                return False  # evicted, moved between tiers, or split with a host part
            elif match.is_partial and match.num_tokens <= detail:  # type: ignore[operator]
                return False
        return True

    def _log_event(self, kind: int, node: TreeNode, detail: bytes | int | None) -> None:
        self._log.append((kind, node, detail))
        self.version += 1
        if len(self._log) > 2 * _MAX_LOG:
            del self._log[:_MAX_LOG]
            self._log_start += _MAX_LOG
