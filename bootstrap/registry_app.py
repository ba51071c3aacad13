"""The registry's HTTP API (port --disaggregation-bootstrap-port): JSON wire messages from nodes.

  POST /register    RegisterNode  -> 200 {"lease_s", "gateway_id", "nodes"} | 400 (malformed,
                                     version, role) | 401 | 409 (node id live in another instance)
  POST /heartbeat   Heartbeat     -> 200 {"lease_s", "gateway_id", "nodes"} | 404 (unknown:
                                     register again) | 401 | 409 (another instance's node id)
  POST /deregister  Deregister    -> 200 {"deregistered": bool} | 401 | 409
  GET  /nodes                     -> 200 {"nodes": [...]} | 401
  GET  /health, GET /metrics      (no token)

Bodies are ``encode_json`` of the message (``[tag, {fields}]``); the token is the body's
``auth_token`` or ``Authorization: Bearer``. Errors take the OpenAI error shape.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from bootstrap.errors import APIError, install_error_handlers
from bootstrap.registry import NodeRegistry, RegistryError, bearer_token, check_token
from common import messages as msg
from common import metrics

MAX_BODY_BYTES = 4 << 20  # transfer metadata is a few KB; anything near this is not a node


def _parse(body: bytes, expected: type[msg.Message], has_header_token: bool) -> msg.Message:
    if len(body) > MAX_BODY_BYTES:
        raise APIError(413, f"body of {len(body)} bytes is over {MAX_BODY_BYTES}")
    try:
        message = msg.decode_json(body)
    except msg.MalformedMessage as exc:
        if not has_header_token:  # don't describe our schema to someone without the token
            raise APIError(401, "missing or malformed registry message", code="invalid_auth_token")
        raise APIError(400, f"malformed message: {exc}", code="malformed_message") from None
    if not isinstance(message, expected):
        raise APIError(400, f"expected {expected.TAG}, got {message.TAG}", code="wrong_message")
    return message


def build_registry_app(registry: NodeRegistry) -> FastAPI:
    """The registry app over ``registry`` (which the gateway shares in the same process)."""
    app = FastAPI(title="pdserve registry", docs_url=None, redoc_url=None)
    install_error_handlers(app)

    def header_token(request: Request) -> str | None:
        return bearer_token(request.headers.get("authorization"))

    def has_valid_header(request: Request) -> bool:
        token = header_token(request)
        return registry.auth_token is None or check_token(registry.auth_token, token)

    def answer(extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "lease_s": registry.lease_s,
            "gateway_id": registry.gateway_id,
            "nodes": registry.table(),
            **(extra or {}),
        }

    def refused(exc: RegistryError) -> JSONResponse:
        return APIError(exc.status, exc.message, code=exc.code).response()

    @app.post("/register")
    async def register(request: Request) -> Any:
        m = _parse(await request.body(), msg.RegisterNode, has_valid_header(request))
        assert isinstance(m, msg.RegisterNode)
        try:
            registry.register(m, header_token(request))
        except RegistryError as exc:
            return refused(exc)
        return answer()

    @app.post("/heartbeat")
    async def heartbeat(request: Request) -> Any:
        m = _parse(await request.body(), msg.Heartbeat, has_valid_header(request))
        assert isinstance(m, msg.Heartbeat)
        try:
            registry.heartbeat(m, header_token(request))
        except RegistryError as exc:
            return refused(exc)
        return answer()

    @app.post("/deregister")
    async def deregister(request: Request) -> Any:
        m = _parse(await request.body(), msg.Deregister, has_valid_header(request))
        assert isinstance(m, msg.Deregister)
        try:
            was_registered = registry.deregister(m, header_token(request))
        except RegistryError as exc:
            return refused(exc)
        return {"deregistered": was_registered}

    @app.get("/nodes")
    async def nodes(request: Request) -> Any:
        if not has_valid_header(request):
            raise APIError(401, "missing or wrong cluster token", code="invalid_auth_token")
        return {"nodes": registry.table()}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "role": "bootstrap",
            "num_nodes": len(registry),
            "gateway_id": registry.gateway_id,
        }

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render_latest(), media_type="text/plain; version=0.0.4")

    return app
