"""How often a node talks to its registry: a restarted registry knows every live node again
within about a second, whatever the lease, and a registry that was down is joined within a
second of it answering."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from common import messages as msg
from common.node.registry_client import CONNECT_RETRY_MAX_S, HEARTBEAT_MAX_S, RegistryClient
from common.tokenizer import Tokenizer
from tests.support import gateway as harness
from tests.support.ports import free_port

tokenizer = harness.tokenizer


def _client(url: str) -> RegistryClient:
    return RegistryClient(
        url,
        msg.RegisterNode(
            node_id="prefill-0",
            role="prefill",
            request_endpoint="tcp://127.0.0.1:1",
            control_endpoint="tcp://127.0.0.1:1",
            http_url="http://127.0.0.1:1",
            backend="fake",
            backend_metadata=b"",
            kv_layout={"page_size": 16},
            num_pages=8,
            max_running_requests=0,
            protocol_version=msg.PROTOCOL_VERSION,
            auth_token=None,
        ),
        timeout_s=1.0,
    )


@pytest.mark.parametrize(("lease_s", "interval_s"), [(10.0, 1.0), (2.4, 0.8), (0.3, 0.2)])
def test_the_heartbeat_is_a_third_of_the_lease_and_at_most_a_second(
    lease_s: float, interval_s: float
) -> None:
    client = _client("http://127.0.0.1:1")
    client.lease_s = lease_s
    assert client.heartbeat_interval_s == pytest.approx(interval_s)
    assert HEARTBEAT_MAX_S == 1.0


def test_a_registry_down_for_seconds_is_joined_within_a_second_of_its_start(
    tokenizer: Tokenizer,
) -> None:
    """Before, tries backed off to 0.5, 1, 2, 4, 8 s: a registry that came back after 8 s
    was joined 7.5 s later."""
    port = free_port()
    client = _client(f"http://127.0.0.1:{port}").start()
    try:
        time.sleep(8.0)  # the registry is down: the client keeps trying
        assert not client.is_registered
        _joins_within_a_second_of_the_registry(client, tokenizer, port)
    finally:
        client.stop(deregister=False)


def _joins_within_a_second_of_the_registry(
    client: RegistryClient, tokenizer: Tokenizer, port: int
) -> None:
    """Start a gateway on ``port``; the client registers within CONNECT_RETRY_MAX_S + 2 s."""
    gw = harness.start_gateway(tokenizer, bootstrap_port=port)
    up = time.monotonic()
    try:
        while not client.is_registered:
            assert client._thread.is_alive(), client.last_error
            assert time.monotonic() - up < CONNECT_RETRY_MAX_S + 2.0, client.last_error
            time.sleep(0.05)
    finally:
        gw.stop()


def _broken_registry(port: int, answers: list[bytes], done: threading.Event) -> threading.Thread:
    """A registry killed mid-answer: each connection reads the request and gets the next
    of ``answers`` (a truncated body, a garbled status line), then the socket closes."""
    server = socket.create_server(("127.0.0.1", port))

    def serve() -> None:
        with server:
            for answer in answers:
                conn, _ = server.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(answer)
        done.set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_registry_killed_mid_answer_is_tried_again_until_it_answers(
    tokenizer: Tokenizer,
) -> None:
    """Before, http.client's IncompleteRead and BadStatusLine (no OSError) ended the client's
    thread: the node never beat again and its gateways dropped it for good."""
    port = free_port()
    done = threading.Event()
    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{",  # IncompleteRead
        b"garbled\r\n\r\n",  # BadStatusLine
    ]
    _broken_registry(port, answers, done)
    client = _client(f"http://127.0.0.1:{port}").start()
    try:
        assert done.wait(10.0), "the client stopped asking"
        _joins_within_a_second_of_the_registry(client, tokenizer, port)
    finally:
        client.stop(deregister=False)
