"""A node's small HTTP side door: GET /health and GET /metrics, served from a daemon thread."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from common import metrics


def serve_status(host: str, port: int, health: Callable[[], dict[str, Any]]) -> ThreadingHTTPServer:
    """Start the server (port 0: any free port; read server.server_address) and return it.

    `health()` returns the /health body; its "status" is "ok" for 200, anything else 503.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path.split("?")[0] == "/metrics":
                self._send(200, metrics.render_latest(), "text/plain; version=0.0.4")
            elif self.path.split("?")[0] == "/health":
                body = health()
                code = 200 if body.get("status") == "ok" else 503
                self._send(code, json.dumps(body).encode(), "application/json")
            else:
                self._send(404, b'{"error": "not found"}', "application/json")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # probes every few seconds: stay quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="status-http", daemon=True).start()
    return server
