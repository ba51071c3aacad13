"""Test harness for the gateway: a live bootstrap server in a thread and fake nodes over zmq.

Fake nodes are PULL sockets in the test process, registered through the registry's HTTP
API by the real ``RegistryClient``; a scripted behaviour answers each GenerateReq on the
request's reply endpoint. No model runs; only the tokenizer of the default model loads.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import zmq

from bootstrap.server import BootstrapServer
from bootstrap.service import BootstrapService, GatewaySettings
from common import messages as msg
from common.config import BootstrapConfig
from common.ipc import PushPool, bind_pull, poll_any, recv_messages
from common.node.registry_client import RegistryClient, wait_until
from common.tokenizer import Tokenizer

CONTEXT_LENGTH = 2048
REPLY_TEXT = "Hello from the fake decode node, one token at a time."
Send = Callable[[msg.Message], None]
Behaviour = Callable[[msg.GenerateReq, Send], None]


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    from common.model.loader import resolve_model_dir

    model_dir: Path = resolve_model_dir(None)
    return Tokenizer.from_pretrained(model_dir)


# ---- behaviours of fake decode nodes ----------------------------------------------------------


def reply_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(REPLY_TEXT)


def stream_tokens(
    token_ids: list[int], *, delay_s: float = 0.0, finish: bool = True, logprobs: bool = False
) -> Behaviour:
    """Send ``token_ids`` one per TokenChunk (capped at max_new_tokens), then ReqFinished."""

    def behave(gen: msg.GenerateReq, send: Send) -> None:
        limit = int(gen.sampling.get("max_new_tokens", len(token_ids)))
        out = token_ids[:limit]
        if gen.return_prompt_logprobs:  # prompt token i+1 gets -(i+1)/10, itself on top
            send(fake_prompt_logprobs(gen))
        for tid in out:
            lp = [-0.5] if logprobs or gen.return_logprob else None
            top = [[[tid, -0.5], [tid + 1, -1.5]]] if lp is not None else None
            send(msg.TokenChunk(rid=gen.rid, token_ids=[tid], logprobs=lp, top_logprobs=top))
            if delay_s:
                time.sleep(delay_s)
        if finish:
            reason = "length" if len(out) == limit else "stop"
            send(
                msg.ReqFinished(
                    rid=gen.rid,
                    finish_reason=reason,
                    matched_stop=None,
                    num_prompt_tokens=len(gen.input_ids),
                    num_output_tokens=len(out),
                    num_cached_tokens=3,
                )
            )

    return behave


def fake_prompt_logprobs(gen: msg.GenerateReq) -> msg.PromptLogprobs:
    follow = gen.input_ids[1:]
    k = int(gen.sampling.get("top_logprobs", 0))
    return msg.PromptLogprobs(
        rid=gen.rid,
        logprobs=[-(i + 1) / 10 for i in range(len(follow))],
        top_logprobs=[[[t, -(i + 1) / 10]][:k] for i, t in enumerate(follow)],
    )


def fail_after(token_ids: list[int], status: int = 500, error: str = "decode blew up") -> Behaviour:
    def behave(gen: msg.GenerateReq, send: Send) -> None:
        for tid in token_ids:
            send(msg.TokenChunk(rid=gen.rid, token_ids=[tid], logprobs=None, top_logprobs=None))
        send(msg.ReqFailed(rid=gen.rid, status=status, error=error))

    return behave


def silent(gen: msg.GenerateReq, send: Send) -> None:
    """Take the request and never answer (prefill nodes, hung decode nodes)."""


def _sender(push: PushPool, endpoint: str) -> Send:
    def send(reply: msg.Message) -> None:
        push.send(endpoint, reply)

    return send


# ---- fake node ----------------------------------------------------------------------------------


@dataclass
class FakeNode:
    """A node that registers over HTTP and answers GenerateReq with a behaviour."""

    role: str
    node_id: str
    registry_url: str
    behaviour: Behaviour = silent
    auth_token: str | None = None
    num_pages: int = 1000
    load: dict[str, Any] = field(default_factory=dict)
    received: list[msg.Message] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock, self.endpoint = bind_pull(self._ctx, "tcp://127.0.0.1:0")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=self.node_id)
        self.registry = RegistryClient(
            self.registry_url, self.register_message(), lambda: dict(self.load)
        )

    def register_message(self, **changes: Any) -> msg.RegisterNode:
        base = msg.RegisterNode(
            node_id=self.node_id,
            role=self.role,
            request_endpoint=self.endpoint,
            control_endpoint=self.endpoint,
            http_url="http://127.0.0.1:1",
            backend="fake",
            backend_metadata=b"\x00meta",
            kv_layout={"page_size": 16},
            num_pages=self.num_pages,
            max_running_requests=0,
            protocol_version=msg.PROTOCOL_VERSION,
            auth_token=self.auth_token,
        )
        return replace(base, **changes)

    def start(self, register: bool = True) -> FakeNode:
        self._thread.start()
        if register:
            self.registry.start()
            assert wait_until(lambda: self.registry.is_registered, 10.0), self.registry.last_error
        return self

    def stop(self) -> None:
        self.registry.stop(deregister=False)
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)

    def generates(self) -> list[msg.GenerateReq]:
        return [m for m in list(self.received) if isinstance(m, msg.GenerateReq)]

    def wait_generates(self, num: int, timeout_s: float = 5.0) -> list[msg.GenerateReq]:
        """The GenerateReqs received, once there are ``num`` (replies can beat the other node)."""
        assert wait_until(lambda: len(self.generates()) >= num, timeout_s), self.generates()
        return self.generates()

    def aborts(self) -> list[msg.AbortReq]:
        return [m for m in list(self.received) if isinstance(m, msg.AbortReq)]

    def _run(self) -> None:
        with PushPool(self._ctx) as push:
            while not self._stop.is_set():
                if not poll_any([self._sock], 50):
                    continue
                for m in recv_messages(self._sock, socket_name=f"fake_{self.role}"):
                    self.received.append(m)
                    if isinstance(m, msg.GenerateReq):
                        self.behaviour(m, _sender(push, m.reply_endpoint))


# ---- gateway ------------------------------------------------------------------------------------


@dataclass
class Gateway:
    server: BootstrapServer
    thread: threading.Thread
    nodes: list[FakeNode] = field(default_factory=list)

    @property
    def service(self) -> BootstrapService:
        return self.server.service

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.server.api_port}"

    @property
    def registry_url(self) -> str:
        return f"http://127.0.0.1:{self.server.registry_port}"

    def node(self, role: str, behaviour: Behaviour = silent, **kwargs: Any) -> FakeNode:
        node_id = kwargs.pop("node_id", f"{role}-{len(self.nodes)}")
        token = kwargs.pop("auth_token", self.service.config.auth_token)
        node = FakeNode(role, node_id, self.registry_url, behaviour, token, **kwargs).start()
        self.nodes.append(node)
        return node

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the server's event loop and return its result."""
        loop = self.server._loop
        assert loop is not None

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=5)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.server.request_stop()
        self.thread.join(timeout=10)


def start_gateway(tokenizer: Tokenizer, *, lease_s: float = 10.0, **config: Any) -> Gateway:
    # No registration window unless a test asks: a request finding no node gets its 503 now.
    defaults = {"port": 0, "bootstrap_port": 0, "auth_token": None, "registration_window_s": 0.0}
    cfg = BootstrapConfig(**{**defaults, **config})
    service = BootstrapService(
        cfg,
        tokenizer,
        model_name="test-model",
        context_length=CONTEXT_LENGTH,
        settings=GatewaySettings(lease_s=lease_s),
    )
    server = BootstrapServer(
        service, "127.0.0.1", cfg.port, cfg.bootstrap_port, graceful_shutdown_s=1
    )
    ready = threading.Event()
    thread = threading.Thread(
        target=lambda: asyncio.run(server.run(on_ready=lambda _: ready.set())), daemon=True
    )
    thread.start()
    assert ready.wait(20), "the bootstrap server did not start"
    return Gateway(server, thread)


@pytest.fixture
def gateway_factory(tokenizer: Tokenizer) -> Iterator[Callable[..., Gateway]]:
    started: list[Gateway] = []

    def make(**config: Any) -> Gateway:
        gw = start_gateway(tokenizer, **config)
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.stop()
