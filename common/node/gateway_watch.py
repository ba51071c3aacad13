"""Which requests lost their gateway: a node aborts the requests of a gateway that is gone.

A gateway (one bootstrap process) is known by its instance id, carried in every
GenerateReq. The node's registry link says which gateway answered it lately
(RegistryClient.is_gateway_alive); a request whose gateway died, or restarted as another
instance, has nobody to stream to and only holds pages. The check is cheap but runs only
every `interval_s`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

CHECK_INTERVAL_S = 0.25


class GatewayWatch:
    def __init__(self, interval_s: float = CHECK_INTERVAL_S) -> None:
        self.interval_s = interval_s
        # (gateway id, now) -> whether that gateway is still there; the node process sets it.
        self.is_alive: Callable[[str, float], bool] = lambda gateway_id, now: True
        self._next_check = 0.0

    def orphans(self, items: Iterable[T], gateway_of: Callable[[T], str], now: float) -> list[T]:
        """The items whose gateway is gone (none between checks)."""
        if now < self._next_check:
            return []
        self._next_check = now + self.interval_s
        return [x for x in items if not self.is_alive(gateway_of(x), now)]
