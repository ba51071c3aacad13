"""A node's link to the bootstrap registry: register, heartbeat, re-register, learn the peers.

Runs on a daemon thread. The node heartbeats every third of its lease, and at least every
HEARTBEAT_MAX_S, so that a restarted registry hears from every live node within about a
second. A registry that does not answer (refused, reset, timed out) is tried again with
back-off from 0.25 s up to CONNECT_RETRY_MAX_S: a node started before the bootstrap service,
or one that outlives a bootstrap restart, joins within a second of the registry answering.
A heartbeat that gets 404 (the registry forgot us, e.g. after a restart) registers again at
once; a 409 (our node id is live in another instance: our previous process's lease has not
run out) is asked again like an unreachable registry, at most a second apart; any other
refusal (401) is retried with back-off from 0.5 s up to 10 s.
Each answer carries the current node table, which the node reads through `peers()`, and
the gateway's instance id: `is_gateway_alive()` tells the node's loop which requests
have lost their gateway (it died, or restarted as another instance).

Registry HTTP API (bootstrap/, port --disaggregation-bootstrap-port):
  POST /register    RegisterNode (JSON)  -> 200 {"lease_s": float, "nodes": [...]}, 401, 400
  POST /heartbeat   Heartbeat (JSON)     -> 200 {"lease_s": float, "nodes": [...]}, 404, 401
  POST /deregister  Deregister (JSON)    -> 200
  GET  /nodes                            -> 200 {"nodes": [...]}
Each entry of "nodes": id, role, healthy, metrics_url, http_url, request_endpoint,
control_endpoint, num_pages, load.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from common import messages as msg

logger = logging.getLogger(__name__)

HEARTBEAT_MAX_S = 1.0  # a restarted registry knows every live node again within this
CONNECT_RETRY_MAX_S = 1.0  # the longest wait between tries while the registry is down
REFUSED_RETRY_MAX_S = 10.0  # the longest wait after the registry refused us


class RegistryClient:
    def __init__(
        self,
        url: str,
        register: msg.RegisterNode,
        load: Callable[[], dict[str, Any]] = dict,
        *,
        timeout_s: float = 3.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.register_msg = register
        self.load = load
        self.timeout_s = timeout_s
        self.lease_s = 10.0
        self.is_registered = False
        self.last_error = ""
        self.gateway_id = ""  # of the registry's gateway, from its last answer
        self.gateway_heard_at = -float("inf")  # monotonic time of that answer
        self._nodes: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._is_leaving = threading.Event()
        self._wake = threading.Event()  # heartbeat now: the node table is needed early
        self._thread = threading.Thread(target=self._run, name="registry", daemon=True)

    def start(self) -> RegistryClient:
        self._thread.start()
        return self

    def peers(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self._nodes)

    def peer(self, node_id: str) -> dict[str, Any] | None:
        """The node's entry in the registry's table; an unknown id asks for a fresh table
        now (a request may name a node that registered since our last heartbeat)."""
        with self._lock:
            found = self._nodes.get(node_id)
        if found is None:
            self._wake.set()
        return found

    def is_gateway_alive(self, gateway_id: str, now: float) -> bool:
        """Whether requests of gateway `gateway_id` still have someone to answer to.

        Unknown ("" — a test or a static setup) is alive; otherwise it must be the gateway
        that answered us within a lease.
        """
        if not gateway_id:
            return True
        with self._lock:
            return gateway_id == self.gateway_id and now - self.gateway_heard_at <= self.lease_s

    def leave(self) -> None:
        """Deregister (we are draining) but keep watching the gateway: requests still
        running must be aborted if it dies, and must not be if it lives."""
        self._is_leaving.set()
        if self.is_registered:
            self._deregister()

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if deregister and self.is_registered:
            self._deregister()
        self._thread.join(timeout=self.timeout_s + 1)

    def _deregister(self) -> None:
        self.is_registered = False
        try:
            self._post(
                "/deregister",
                msg.Deregister(
                    node_id=self.register_msg.node_id,
                    auth_token=self.register_msg.auth_token,
                    instance_id=self.register_msg.instance_id,
                ),
            )
        except (OSError, urllib.error.URLError, ValueError, http.client.HTTPException) as exc:
            logger.info("deregister failed: %r", exc)

    def _run(self) -> None:
        refused_backoff, connect_backoff = 0.5, 0.25
        while not self._stop.is_set():
            try:
                if self._is_leaving.is_set():
                    self._accept_gateway(self._get("/health"))  # no node table, no token
                elif self.is_registered:
                    beat = msg.Heartbeat(
                        node_id=self.register_msg.node_id,
                        load=self.load(),
                        auth_token=self.register_msg.auth_token,
                        instance_id=self.register_msg.instance_id,
                    )
                    self._accept(self._post("/heartbeat", beat))
                else:
                    self._accept(self._post("/register", self.register_msg))
                    logger.info("registered %s with %s", self.register_msg.node_id, self.url)
                    self.is_registered = True
                refused_backoff, connect_backoff = 0.5, 0.25
                self._wake.wait(self.heartbeat_interval_s)
                self._wake.clear()
                self._stop.wait(0.05)  # at most 20 beats a second, however often woken
            except urllib.error.HTTPError as exc:
                self.last_error = f"HTTP {exc.code}: {exc.read()[:200]!r}"
                if exc.code == 404:
                    self.is_registered = False  # the registry forgot us: register again now
                    continue
                if exc.code == 409:  # our old instance's lease runs out soon: ask often
                    self.is_registered = False
                    self._stop.wait(connect_backoff)
                    connect_backoff = min(CONNECT_RETRY_MAX_S, connect_backoff * 2)
                    continue
                logger.warning("registry %s refused us: %s", self.url, self.last_error)
                self.is_registered = False
                self._stop.wait(refused_backoff)
                refused_backoff = min(REFUSED_RETRY_MAX_S, refused_backoff * 2)
            except (OSError, urllib.error.URLError, ValueError, http.client.HTTPException) as exc:
                # HTTPException: a registry killed mid-answer (IncompleteRead, BadStatusLine).
                # It is no OSError; escaping here ended the thread, so the node never beat
                # again and every gateway dropped it for good.
                self.last_error = repr(exc)
                self._stop.wait(connect_backoff)
                connect_backoff = min(CONNECT_RETRY_MAX_S, connect_backoff * 2)
            except Exception as exc:  # the thread must outlive any answer: log it, go on
                self.last_error = repr(exc)
                logger.exception("registry %s: unexpected error", self.url)
                self._stop.wait(refused_backoff)
                refused_backoff = min(REFUSED_RETRY_MAX_S, refused_backoff * 2)

    @property
    def heartbeat_interval_s(self) -> float:
        """A third of the lease (two beats may be lost before it runs out), at most
        HEARTBEAT_MAX_S, at least 0.2 s."""
        return max(0.2, min(HEARTBEAT_MAX_S, self.lease_s / 3))

    def _accept(self, body: dict[str, Any]) -> None:
        self.lease_s = float(body.get("lease_s", self.lease_s))
        nodes = {n["id"]: n for n in body.get("nodes", []) if isinstance(n, dict) and "id" in n}
        with self._lock:
            self._nodes = nodes
        self._accept_gateway(body)

    def _accept_gateway(self, body: dict[str, Any]) -> None:
        gateway = body.get("gateway_id")
        if isinstance(gateway, str):
            with self._lock:
                self.gateway_id, self.gateway_heard_at = gateway, time.monotonic()

    def _get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + path, timeout=self.timeout_s) as resp:
            body = json.loads(resp.read() or b"{}")
        return body if isinstance(body, dict) else {}

    def _post(self, path: str, message: msg.Message) -> dict[str, Any]:
        data = msg.encode_json(message).encode()
        headers = {"Content-Type": "application/json"}
        if self.register_msg.auth_token:
            headers["Authorization"] = f"Bearer {self.register_msg.auth_token}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read() or b"{}")


def wait_until(cond: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True
