"""Streaming /v1/completions on a thread, recording the outcome and chunk times; never hangs."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from tests.faults.harness import API_KEY

# No single read may wait longer than this; a request as a whole gives up after TOTAL_S.
READ_TIMEOUT_S = 30.0
TOTAL_S = 120.0


@dataclass
class Outcome:
    """What one request got: text and finish reason, or an error, and when each part came."""

    # pending, completed, http_error, sse_error, connection_error, timeout or disconnected
    kind: str = "pending"
    status: int | None = None
    text: str = ""
    finish_reason: str | None = None
    error: Any = None
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    started: float = 0.0  # monotonic
    ended: float | None = None
    chunk_times: list[float] = field(default_factory=list)

    @property
    def is_completed(self) -> bool:
        return self.kind == "completed" and self.finish_reason is not None

    @property
    def is_clean_error(self) -> bool:
        """An HTTP 4xx/5xx with an OpenAI error body, or an SSE error event."""
        if self.kind == "http_error":
            return (
                self.status is not None
                and 400 <= self.status < 600
                and isinstance(self.error, dict)
                and "message" in self.error.get("error", {})
            )
        return self.kind == "sse_error" and isinstance(self.error, dict) and "message" in self.error

    def __repr__(self) -> str:
        took = None if self.ended is None else round(self.ended - self.started, 2)
        return (
            f"Outcome({self.kind}, status={self.status}, finish={self.finish_reason}, "
            f"chunks={len(self.chunk_times)}, took={took}s, error={self.error!r:.300}, "
            f"text={self.text[:60]!r})"
        )


class Stream:
    """One streaming completion on its own thread; `close()` is a client disconnect."""

    def __init__(
        self,
        api: str,
        prompt: str | list[int],
        *,
        max_tokens: int = 16,
        routing_key: str | None = None,
        logprobs: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.url = urlparse(api)
        self.body: dict[str, Any] = {
            "model": "default",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            **(extra or {}),
        }
        if routing_key is not None:
            self.body["routing_key"] = routing_key
        if logprobs is not None:
            self.body["logprobs"] = logprobs
        self.outcome = Outcome()
        self._conn: http.client.HTTPConnection | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Stream:
        self.outcome.started = time.monotonic()
        self._thread.start()
        return self

    def wait(self, timeout_s: float = TOTAL_S) -> Outcome:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.close()
            self._thread.join(5)
            self.outcome.kind, self.outcome.ended = "timeout", time.monotonic()
        return self.outcome

    @property
    def is_done(self) -> bool:
        return self.outcome.ended is not None

    @property
    def num_chunks(self) -> int:
        return len(self.outcome.chunk_times)

    def close(self) -> None:
        """Drop the connection as a client that goes away would."""
        self._closed.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self) -> None:
        out = self.outcome
        try:
            self._request(out)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if self._closed.is_set():
                out.kind = "disconnected"
            elif isinstance(exc, TimeoutError | socket.timeout):
                out.kind = "timeout"
            else:
                out.kind = "connection_error"
            out.error = repr(exc)
        finally:
            out.ended = time.monotonic()
            if self._conn is not None:
                self._conn.close()

    def _request(self, out: Outcome) -> None:
        conn = http.client.HTTPConnection(
            self.url.hostname or "127.0.0.1", self.url.port, timeout=READ_TIMEOUT_S
        )
        self._conn = conn
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(self.body),
            {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
        )
        resp = conn.getresponse()
        out.status = resp.status
        if resp.status != 200:
            raw = resp.read()
            out.kind = "http_error"
            try:
                out.error = json.loads(raw)
            except ValueError:
                out.error = raw.decode(errors="replace")
            return
        deadline = out.started + TOTAL_S
        while time.monotonic() < deadline:
            line = resp.readline()
            if not line:
                if out.kind == "pending":
                    out.kind = "disconnected" if self._closed.is_set() else "connection_error"
                out.error = out.error or "the stream ended without [DONE]"
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                if out.kind == "pending":
                    out.kind = "completed" if out.finish_reason else "connection_error"
                    if not out.finish_reason:
                        out.error = out.error or "[DONE] without a finish"
                return
            self._event(out, json.loads(data))
        out.kind = "timeout"

    @staticmethod
    def _event(out: Outcome, event: dict[str, Any]) -> None:
        out.chunk_times.append(time.monotonic())
        if "error" in event:
            out.kind, out.error = "sse_error", event["error"]
            return
        for choice in event.get("choices") or []:
            out.text += choice.get("text") or ""
            logprobs = choice.get("logprobs")
            if logprobs:
                out.tokens.extend(logprobs.get("tokens") or [])
                out.token_logprobs.extend(logprobs.get("token_logprobs") or [])
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]


def run(api: str, prompt: str | list[int], timeout_s: float = 60.0, **kwargs: Any) -> Outcome:
    """One request to its end (or `timeout_s`)."""
    return Stream(api, prompt, **kwargs).start().wait(timeout_s)
