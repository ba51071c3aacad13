"""Free loopback ports for test processes, never the same one twice in a test run.

Binding port 0 and closing the socket lets the kernel hand the same port out again at
the next call: two flags given "free" ports could then be equal (a bootstrap once got
--port and --disaggregation-bootstrap-port both 48373). Ports handed out are remembered.
"""

from __future__ import annotations

import socket

_GIVEN: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
