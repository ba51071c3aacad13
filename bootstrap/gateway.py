"""The public API (on --port): OpenAI completions and chat, SGLang /generate, models, nodes, health.

Per request: parse (strict types, 400), prepare (template, tokenize, lengths; 400), admit
(429 when --max-queued-requests are in flight, 503 without nodes), then stream SSE from
the first token on, or answer once at the end. A streaming response starts only when the
first event arrives, so a failure before any token still gets its own status code. The
API keys (``--api-key``, ``--api-key-file``; never the cluster token), when set, guard
every route except /health, /metrics and the OpenAPI schema (``Authorization: Bearer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from fastapi import Depends, FastAPI, Header, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse

from bootstrap.choices import Choice, Choices
from bootstrap.errors import (
    RECEIVED_STATE_KEY,
    APIError,
    BodyLimit,
    CatchAll,
    documented,
    install_error_handlers,
)
from bootstrap.gateway_metrics import count_request
from bootstrap.generation import Generation, PreparedRequest
from bootstrap.openai_schema import ChatCompletionRequest, CompletionRequest, GenerateRequest
from bootstrap.prepare import (
    best_of,
    prepare_chat,
    prepare_completion,
    prepare_generate,
    samples,
)
from bootstrap.registry import bearer_token
from bootstrap.service import BootstrapService
from bootstrap.streaming import (
    ChatFormat,
    CompletionFormat,
    GenerateFormat,
    OutputFormat,
    collect,
    sse_stream,
)
from common import metrics, stages

T = TypeVar("T")
CLIENT_CLOSED_STATUS = 499
# Threads that tokenize and render chat templates off the event loop. HF's fast tokenizer
# releases the GIL while it encodes (a Python thread keeps running beside a long encode),
# so the loop serves streams and heartbeats meanwhile.
TOKENIZER_THREADS = 2
SERVED_ALIAS = "default"  # accepted as the model name besides the served one
GENERATION_ERRORS = documented(400, 401, 404, 413, 429, 503, 504)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Abandonable(Protocol):
    def abandon(self) -> None: ...


async def _unless_disconnected(request: Request, work: Awaitable[T], gen: Abandonable) -> T:
    """``work``'s result, or ClientGone (the request aborted on both nodes) if the client left."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, APIError):
                await task
            gen.abandon()  # also when the task never started its generator
    if task.cancelled():
        raise ClientGone
    return task.result()


def _document_limits(app: FastAPI, service: BootstrapService) -> None:
    """Write this deployment's vocabulary and context sizes into the OpenAPI schema."""
    max_id = service.tokenizer.vocab_size - 1

    def fill(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("description") == "below the vocabulary size":
                node["maximum"] = max_id
            for key in ("max_tokens", "max_completion_tokens", "max_new_tokens"):
                prop = node.get("properties", {}).get(key)
                if isinstance(prop, dict):
                    prop["maximum"] = service.context_length
            for value in node.values():
                fill(value)
        elif isinstance(node, list):
            for value in node:
                fill(value)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            fill(app.openapi_schema)
            for path in app.openapi_schema["paths"].values():
                for operation in path.values():
                    # FastAPI documents a 422 for bodies; invalid bodies are 400s here.
                    operation.get("responses", {}).pop("422", None)
            schemas = app.openapi_schema.get("components", {}).get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class Marks(dict[str, float]):
    """The gateway's marks of one request (common/stages.py) and its monotonic arrival."""

    arrival: float

    @classmethod
    def of(cls, request: Request) -> Marks:
        """At the top of a route handler: the body has been read and validated."""
        marks = cls()
        marks.arrival = time.monotonic()
        now = time.time()
        marks[stages.RECEIVED] = float(getattr(request.state, RECEIVED_STATE_KEY, now))
        marks[stages.PARSED] = now
        return marks


def build_api_app(service: BootstrapService) -> FastAPI:
    """The API app over ``service`` (shared with the registry app in the same process)."""
    app = FastAPI(
        title="pdserve",
        summary="Prefill/decode disaggregated serving: OpenAI-compatible API",
        version="0.1.0",
        responses=documented(404),
    )
    install_error_handlers(app, on_invalid=lambda: count_request("rejected"))
    app.add_middleware(BodyLimit, max_bytes=service.config.max_request_bytes)
    app.add_middleware(CatchAll)  # outermost: whatever slips through is still JSON
    _document_limits(app, service)

    async def require_token(authorization: str | None = Header(default=None)) -> None:
        if not service.api_keys.accepts(bearer_token(authorization)):
            raise APIError(401, "missing or wrong API key (--api-key)", code="invalid_api_key")

    auth = [Depends(require_token)]

    def check_model(name: str | None) -> None:
        """The served model, its alias "default", or no name: anything else is a 404."""
        if name is not None and name not in (service.model_name, SERVED_ALIAS):
            count_request("rejected")
            raise APIError(
                404,
                f"the model {name!r:.300} does not exist here; this server serves "
                f"{service.model_name!r} (also as {SERVED_ALIAS!r})",
                param="model",
                code="model_not_found",
            )

    tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
    service.tokenizer.max_token_chars  # noqa: B018 - computed now, not on a first request

    async def prepared_or_400(prepare: Any, body: Any, routing_key: str | None) -> Any:
        """Template, tokenize, check and hash the request (or each prompt of a batch) in a
        worker thread, not on the loop."""
        loop = asyncio.get_running_loop()

        def work() -> PreparedRequest | list[PreparedRequest]:
            result = prepare(body, service.tokenizer, service.context_length, routing_key)
            if isinstance(result, list):
                return [service.page_hashes(p) for p in result]
            return service.page_hashes(result)

        try:
            return await loop.run_in_executor(tokenize_pool, work)
        except APIError:
            count_request("rejected")
            raise

    async def serve_choices(
        request: Request,
        items: list[tuple[PreparedRequest, int]],
        fmt_of: Any,
        stream: bool,
        marks: Marks,
        include_usage: bool,
        keep: int | None = None,
        show_logprobs: bool = True,
    ) -> Response:
        """Several choices (prompts of a batch, samples of n), each its own request;
        ``keep``: best_of's n (bootstrap/choices.py)."""
        marks[stages.TOKENIZED] = time.time()
        gens: list[Generation] = []
        pairs: dict[int, tuple[str, str]] = {}  # samples of one prompt go to one pair
        try:
            for prepared, idx in items:
                gen = await service.admit(prepared, marks.arrival, pairs.get(idx))
                pairs.setdefault(idx, (gen.req.prefill_id, gen.req.decode_id))
                gens.append(gen)
        except APIError:
            for g in gens:
                g.abandon()
            raise
        marks[stages.DISPATCHED] = time.time()
        for g in gens:
            g.marks.update(marks)
            g.is_streamed = stream
        rid = gens[0].rid  # one response id for every choice
        choices = Choices(
            [
                Choice(g, fmt_of(rid, p), idx, p.echo_logprobs and not p.prompt_logprobs)
                for g, (p, idx) in zip(gens, items, strict=True)
            ],
            include_usage,
            keep,
            show_logprobs,
        )
        if not stream:
            try:
                body = await _unless_disconnected(request, choices.collect(), choices)
            except ClientGone:
                return Response(status_code=CLIENT_CLOSED_STATUS)
            return JSONResponse(body)
        return StreamingResponse(
            choices.stream(on_first_bytes=choices.first_bytes_sent),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )

    async def serve(
        request: Request, prepared: PreparedRequest, fmt_of: Any, stream: bool, marks: Marks
    ) -> Response:
        marks[stages.TOKENIZED] = time.time()
        gen = await service.admit(prepared, marks.arrival)
        marks[stages.DISPATCHED] = time.time()
        gen.marks.update(marks)
        gen.is_streamed = stream
        fmt: OutputFormat = fmt_of(gen.rid, prepared)
        try:
            if not stream:
                return JSONResponse(await _unless_disconnected(request, collect(gen, fmt), gen))
            events = gen.events()
            first = await _unless_disconnected(request, anext(events), gen)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        return StreamingResponse(
            sse_stream(first, events, fmt, on_first_bytes=gen.first_bytes_sent),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )

    @app.post(
        "/v1/chat/completions", dependencies=auth, response_model=None, responses=GENERATION_ERRORS
    )
    async def chat_completions(
        body: ChatCompletionRequest,
        request: Request,
        x_routing_key: str | None = Header(default=None),
    ) -> Response:
        marks = Marks.of(request)
        check_model(body.model)
        prepare = functools.partial(prepare_chat, max_n=service.config.max_n)
        prepared = await prepared_or_400(prepare, body, x_routing_key)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        n = body.n or 1

        def fmt(rid: str, prepared: PreparedRequest) -> OutputFormat:
            return ChatFormat(
                rid,
                service.model_name,
                service.tokenizer,
                include_usage=include_usage and n == 1,
                tool_format=prepared.tool_format,
                tool_names=prepared.tool_names,
            )

        if n == 1:
            return await serve(request, prepared, fmt, body.stream, marks)
        items = [(p, 0) for p in samples(prepared, n)]
        return await serve_choices(request, items, fmt, body.stream, marks, include_usage)

    @app.post(
        "/v1/completions", dependencies=auth, response_model=None, responses=GENERATION_ERRORS
    )
    async def completions(
        body: CompletionRequest, request: Request, x_routing_key: str | None = Header(default=None)
    ) -> Response:
        marks = Marks.of(request)
        check_model(body.model)
        prepare = functools.partial(prepare_completion, max_n=service.config.max_n)
        prompts: list[PreparedRequest] = await prepared_or_400(prepare, body, x_routing_key)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        n, draws = body.n or 1, best_of(body, service.config.max_n)
        items = [(s, i) for i, p in enumerate(prompts) for s in samples(p, draws)]

        def fmt(rid: str, prepared: PreparedRequest) -> OutputFormat:
            return CompletionFormat(
                rid,
                service.model_name,
                service.tokenizer,
                include_usage=include_usage and len(items) == 1,
                echo=prepared.echo,
                echo_logprobs=prepared.echo_logprobs,
            )

        if len(items) == 1:
            return await serve(request, items[0][0], fmt, body.stream, marks)
        if draws == n:
            return await serve_choices(request, items, fmt, body.stream, marks, include_usage)
        return await serve_choices(
            request, items, fmt, False, marks, include_usage, n, body.logprobs is not None
        )

    @app.post("/generate", dependencies=auth, response_model=None, responses=GENERATION_ERRORS)
    async def generate(
        body: GenerateRequest, request: Request, x_routing_key: str | None = Header(default=None)
    ) -> Response:
        marks = Marks.of(request)
        prepared = await prepared_or_400(prepare_generate, body, x_routing_key)

        def fmt(rid: str, prepared: PreparedRequest) -> OutputFormat:
            return GenerateFormat(
                rid,
                service.model_name,
                service.tokenizer,
                include_usage=False,
                arrival=marks.arrival,
            )

        return await serve(request, prepared, fmt, body.stream, marks)

    def model_card() -> dict[str, Any]:
        return {
            "id": service.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": service.context_length,
        }

    @app.get("/v1/models", dependencies=auth, responses=documented(401))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=auth, responses=documented(401, 404))
    async def model(model: str) -> dict[str, Any]:
        check_model(model)
        return model_card()

    @app.get("/nodes", dependencies=auth, responses=documented(401))
    async def nodes() -> dict[str, Any]:
        return {"nodes": service.registry.table()}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "role": "bootstrap",
            "num_prefill_nodes": len(service.registry.views("prefill")),
            "num_decode_nodes": len(service.registry.views("decode")),
            "num_requests": service.num_active,
        }

    @app.get("/ready", responses=documented(503))
    async def ready() -> JSONResponse:
        """Readiness (the chart's probe): 200 only while a healthy prefill and a healthy decode
        node are registered and the registration window after the start has passed (the
        nodes alive then have all registered again), so no traffic reaches a gateway that
        would answer 503 or know only some of its nodes.
        /health stays the liveness check: no nodes is no reason to restart the gateway."""
        views = {role: service.registry.views(role) for role in ("prefill", "decode")}
        missing = [role for role, vs in views.items() if not any(v.is_healthy for v in vs)]
        registering = service.is_registering()
        body: dict[str, Any] = {
            "status": "not_ready" if missing or registering else "ready",
            "missing_roles": missing,
            "num_prefill_nodes": len(views["prefill"]),
            "num_decode_nodes": len(views["decode"]),
        }
        if missing:
            body["message"] = f"no healthy {' or '.join(missing)} node is registered"
        elif registering:
            body["message"] = "started less than --registration-window ago; nodes registering"
        return JSONResponse(body, status_code=503 if missing or registering else 200)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render_latest(), media_type="text/plain; version=0.0.4")

    return app
