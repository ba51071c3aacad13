"""A node's links to every bootstrap replica: one RegistryClient per replica, found by URL or DNS.

Each bootstrap replica keeps its own registry and gateway; a node registers with,
heartbeats to and is routable from every one of them. The replicas are named by one or
more ``--bootstrap-url`` values; a URL whose host name resolves to several addresses (a
Kubernetes headless Service: one A record per ready pod) stands for one replica per
address, re-resolved every ``resolve_interval_s`` so replicas that come and go during a
rollout are joined and left. A URL that is an IP address, or a name that resolves to one
address, is one replica (``localhost`` is kept as it is).

What the node asks of its registry, answered over all replicas:
  is_registered             with at least one replica
  peers(), peer(node_id)    the union of the replicas' node tables
  is_gateway_alive(id)      some replica whose gateway is ``id`` answered within its lease:
                            requests of a replica that died are aborted by the node's
                            gateway watch, the other replicas' requests go on.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from common import messages as msg
from common.node.registry_client import RegistryClient

logger = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 10.0


def expand_url(url: str) -> list[str]:
    """The replica URLs behind ``url``: one per address its host resolves to (sorted),
    or ``url`` itself for an IP address, localhost, or a name that does not resolve now."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
        return [url]
    except ValueError:
        pass
    if host in ("", "localhost"):
        return [url]
    try:
        infos = socket.getaddrinfo(host, parts.port or 80, type=socket.SOCK_STREAM)
    except OSError:
        return [url]  # not resolvable yet: the client's back-off retries it
    addresses = sorted({str(info[4][0]) for info in infos})
    if len(addresses) <= 1:
        return [url]
    out = []
    for address in addresses:
        shown = f"[{address}]" if ":" in address else address
        netloc = f"{shown}:{parts.port}" if parts.port else shown
        out.append(urllib.parse.urlunsplit(parts._replace(netloc=netloc)))
    return out


class RegistrySet:
    def __init__(
        self,
        urls: Sequence[str],
        register: msg.RegisterNode,
        load: Callable[[], dict[str, Any]] = dict,
        *,
        resolve_interval_s: float = RESOLVE_INTERVAL_S,
        resolve: Callable[[str], list[str]] = expand_url,
    ) -> None:
        if not urls:
            raise ValueError("at least one bootstrap URL is needed")
        self.urls = list(urls)
        self.register_msg = register
        self.load = load
        self.resolve_interval_s = resolve_interval_s
        self._resolve = resolve
        self._clients: dict[str, RegistryClient] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._is_leaving = False
        self._thread = threading.Thread(target=self._watch, name="registry-set", daemon=True)

    def start(self) -> RegistrySet:
        self._refresh()
        self._thread.start()
        return self

    # ---- what the node asks -----------------------------------------------------------------

    def clients(self) -> list[RegistryClient]:
        with self._lock:
            return list(self._clients.values())

    @property
    def is_registered(self) -> bool:
        return any(c.is_registered for c in self.clients())

    @property
    def last_error(self) -> str:
        return "; ".join(f"{c.url}: {c.last_error}" for c in self.clients() if c.last_error)

    def peers(self) -> dict[str, dict[str, Any]]:
        table: dict[str, dict[str, Any]] = {}
        for c in self.clients():
            for node_id, entry in c.peers().items():
                table.setdefault(node_id, entry)
        return table

    def peer(self, node_id: str) -> dict[str, Any] | None:
        found = None
        for c in self.clients():  # every miss wakes that client's heartbeat
            entry = c.peer(node_id)
            found = found or entry
        return found

    def is_gateway_alive(self, gateway_id: str, now: float) -> bool:
        if not gateway_id:
            return True
        return any(c.is_gateway_alive(gateway_id, now) for c in self.clients())

    def leave(self) -> None:
        self._is_leaving = True
        for c in self.clients():
            c.leave()

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        for c in self.clients():
            c.stop(deregister=deregister)

    # ---- replicas coming and going -----------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(self.resolve_interval_s):
            self._refresh()

    def _refresh(self) -> None:
        wanted = {u for url in self.urls for u in self._resolve(url)}
        with self._lock:
            gone = [self._clients.pop(u) for u in list(self._clients) if u not in wanted]
            new = []
            for url in sorted(wanted - set(self._clients)):
                client = RegistryClient(url, self.register_msg, self.load)
                self._clients[url] = client
                new.append(client)
        for client in gone:  # its replica left the Service (or its pod was replaced)
            logger.info("bootstrap replica %s is gone", client.url)
            client.stop(deregister=False)
        for client in new:
            logger.info("joining bootstrap replica %s", client.url)
            if self._is_leaving:
                client.leave()
            client.start()
