"""Two uvicorn servers: the API app on the service's event loop, the registry app on its own thread.

The registry answers heartbeats from its own thread and event loop, so however busy the
API loop is (thousands of streams, a huge body being parsed), no node misses a
heartbeat and is declared lost for it (NodeRegistry is thread safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

try:
    import uvloop
except ImportError:  # pragma: no cover - a dependency; the default loop works too
    uvloop = None  # type: ignore[assignment]

from bootstrap.gateway import build_api_app
from bootstrap.registry_app import build_registry_app
from bootstrap.service import BootstrapService

logger = logging.getLogger(__name__)

# On SIGTERM, open requests get this long to finish before they are cut (and aborted on nodes).
GRACEFUL_SHUTDOWN_S = 30


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals to us (two servers share one process)."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


class BootstrapServer:
    """Runs the service and its two apps until ``request_stop`` (thread safe) is called."""

    def __init__(
        self,
        service: BootstrapService,
        host: str,
        api_port: int,
        registry_port: int,
        *,
        log_level: str = "warning",
        graceful_shutdown_s: int = GRACEFUL_SHUTDOWN_S,
    ) -> None:
        self.service = service
        self.host = host
        self._servers = [
            _Server(
                uvicorn.Config(
                    app,
                    host=host,
                    port=port,
                    lifespan="off",
                    access_log=False,
                    log_level=log_level.lower(),
                    timeout_graceful_shutdown=graceful_shutdown_s,
                )
            )
            for app, port in (
                (build_api_app(service), api_port),
                (build_registry_app(service.registry), registry_port),
            )
        ]
        self.api_port = api_port
        self.registry_port = registry_port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._registry_thread = threading.Thread(
            target=self._serve_registry, name="registry-http", daemon=True
        )

    def _serve_registry(self) -> None:
        factory = uvloop.new_event_loop if uvloop is not None else None
        try:
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(self._servers[1].serve())
        except Exception:  # noqa: BLE001 - run() on the main loop sees the thread end
            logger.exception("the registry's HTTP server stopped")

    def ready_info(self) -> dict[str, Any]:
        """What the READY line announces."""
        host = _url_host(self.host)
        return {
            "role": "bootstrap",
            "node_id": self.service.settings.gateway_id,
            "http_url": f"http://{host}:{self.api_port}",
            "api_url": f"http://{host}:{self.api_port}",
            "registry_url": f"http://{host}:{self.registry_port}",
            "port": self.api_port,
            "bootstrap_port": self.registry_port,
            "reply_endpoint": self.service.dispatcher.reply_endpoint,
        }

    def request_stop(self) -> None:
        """Stop serving (from any thread); a no-op once stopped."""
        if self._loop is None or self._stop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop has already closed
            self._loop.call_soon_threadsafe(self._stop.set)

    async def run(self, on_ready: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await self.service.start()
        tasks = [asyncio.create_task(self._servers[0].serve())]
        self._registry_thread.start()
        try:
            while not all(s.started for s in self._servers):
                if any(t.done() for t in tasks) or not self._registry_thread.is_alive():
                    raise RuntimeError("an HTTP server failed to start (port in use?)")
                await asyncio.sleep(0.01)
            api, registry = (s.servers[0].sockets[0].getsockname()[1] for s in self._servers)
            self.api_port, self.registry_port = api, registry
            self.service.registry_listening()
            if on_ready is not None:
                on_ready(self.ready_info())
            stop = asyncio.create_task(self._stop.wait())
            await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
        finally:
            for s in self._servers:
                s.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._registry_thread.is_alive():
                await asyncio.to_thread(self._registry_thread.join, 5.0)
            await self.service.close()
