"""Errors in OpenAI's shape {"error": {"message", "type", "param", "code"}} and their handlers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

# HTTP status -> OpenAI error type.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "request_aborted",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class APIError(Exception):
    """An error the API returns as is: status, message, and optionally the field and a code."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # The top-level field is the param (union members add type names further down the loc).
    param = loc[0] if loc else None
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    if first.get("type") == "missing" and not loc:
        return "request body is missing", None
    where = f"{'.'.join(loc)}: " if loc else ""
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where}{first.get('msg', 'invalid value')}{more}", param


def install_error_handlers(app: FastAPI, on_invalid: Callable[[], None] | None = None) -> None:
    """Every error the app returns, FastAPI's own included, takes OpenAI's shape.

    ``on_invalid`` is called for each body that fails validation (to count rejections).
    """

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        if on_invalid is not None:
            on_invalid()
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code
        )


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error body of the API (OpenAI's shape)."""

    error: ErrorDetail


_DESCRIPTIONS = {
    400: "invalid request: bad JSON, a wrong type, a value out of range, a prompt too long "
    "(code context_length_exceeded), a parameter that is not served",
    401: "missing or wrong API key",
    404: "no such route, or a model this server does not serve (code model_not_found)",
    413: "request body over the limit",
    429: "too many requests in flight (--max-queued-requests)",
    503: "no healthy prefill or decode node, or the node is shutting down",
    504: "the request timed out (--request-timeout)",
}


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the given error statuses, all with the ErrorResponse body."""
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS[s]} for s in statuses}


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` is a 413 (by Content-Length, or as it streams)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._too_large(send)
                return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read: the app's handler answers it.
                    raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"request body over {self.max_bytes} bytes"

    async def _too_large(self, send: Send) -> None:
        response = JSONResponse(error_body(413, self._message()), status_code=413)
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


RECEIVED_STATE_KEY = "pdserve_received"  # request.state.pdserve_received: wall clock


class CatchAll:
    """ASGI middleware: an unexpected exception is a JSON 500 (logged), never plain text.

    Starlette's own last resort answers in plain text and re-raises, which also cost the
    client its keep-alive connection; here the exception ends with the response.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # The request's first mark (common/stages.py): its headers are in, its body is not.
        scope.setdefault("state", {})[RECEIVED_STATE_KEY] = time.time()
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            logger.exception(
                "unexpected error serving %s %s", scope.get("method"), scope.get("path")
            )
            if started:
                return  # the body was under way: nothing can be said any more
            response = JSONResponse(
                error_body(500, "internal error; the request was not served", code="internal"),
                status_code=500,
            )
            await response(scope, _no_receive, send)
