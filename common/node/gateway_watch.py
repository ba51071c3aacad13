"""Which requests lost their gateway: a node aborts the requests of a gateway that is gone.

A gateway (one bootstrap process) is known by its instance id, carried in every
GenerateReq. The node's registry link says which gateway answered it lately
(RegistryClient.is_gateway_alive); a request whose gateway died, or restarted as another
instance, has nobody to stream to and only holds pages. The check is cheap but runs only
every `interval_s`.

A request that arrives is itself word from its gateway: for HEARD_GRACE_S after one, that
gateway counts as alive whatever the registry link says. A gateway resumed from a pause
past the lease sends requests at once, while a node's next heartbeat may still be a
back-off away; before, the node aborted those fresh requests as orphans (499).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from common.node.registry_client import CONNECT_RETRY_MAX_S, HEARTBEAT_MAX_S

T = TypeVar("T")

CHECK_INTERVAL_S = 0.25
# By then the registry link has answered again: a node beats at least every HEARTBEAT_MAX_S
# and retries an unanswered registry at most CONNECT_RETRY_MAX_S apart.
HEARD_GRACE_S = HEARTBEAT_MAX_S + CONNECT_RETRY_MAX_S


class GatewayWatch:
    def __init__(
        self, interval_s: float = CHECK_INTERVAL_S, heard_grace_s: float = HEARD_GRACE_S
    ) -> None:
        self.interval_s = interval_s
        self.heard_grace_s = heard_grace_s
        # (gateway id, now) -> whether that gateway is still there; the node process sets it.
        self.is_alive: Callable[[str, float], bool] = lambda gateway_id, now: True
        self._next_check = 0.0
        self._heard: dict[str, float] = {}  # gateway id -> when its last request arrived

    def heard(self, gateway_id: str, now: float) -> None:
        """A request from `gateway_id` arrived at `now`: it was alive then."""
        self._heard[gateway_id] = now

    def orphans(self, items: Iterable[T], gateway_of: Callable[[T], str], now: float) -> list[T]:
        """The items whose gateway is gone (none between checks)."""
        if now < self._next_check:
            return []
        self._next_check = now + self.interval_s
        self._heard = {g: t for g, t in self._heard.items() if now - t <= self.heard_grace_s}
        return [x for x in items if not self._is_alive(gateway_of(x), now)]

    def _is_alive(self, gateway_id: str, now: float) -> bool:
        heard_at = self._heard.get(gateway_id)
        if heard_at is not None and now - heard_at <= self.heard_grace_s:
            return True
        return self.is_alive(gateway_id, now)
