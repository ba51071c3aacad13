"""Model output to OpenAI tool calls: an incremental parser for each ToolFormat."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from bootstrap.tool_formats import (
    PYTHON_TAG,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    ToolFormat,
    detect_format,
    messages_for_template,
    render_tool_calls,
    structural_tag,
    template_supports_tools,
    tool_functions,
    tools_system_prompt,
)

__all__ = [
    "ToolCall",
    "ToolCallParser",
    "ToolFormat",
    "detect_format",
    "messages_for_template",
    "new_call_id",
    "parse_tool_calls",
    "render_tool_calls",
    "structural_tag",
    "template_supports_tools",
    "tool_functions",
    "tools_system_prompt",
]

# How a Llama call begins after other text (xgrammar's "llama" tag writes exactly this).
LLAMA_CALL_TRIGGER = '{"name"'
_WHITESPACE = " \t\r\n"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    """One function call; `arguments` is JSON text, as OpenAI's API carries it."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Splits streamed model output into content text and completed tool calls.

    Text that may still become a call (a partial marker, a call in progress) is held back until
    it is settled. Separators (whitespace, and ";" for Llama) at the start of the output or
    right after a call are held too: they are dropped when a call follows them or when the
    output ends after a call. An unterminated call, one that does not parse, or one naming an
    unknown function comes back as content text, never dropped.
    """

    def __init__(self, fmt: ToolFormat, tool_names: set[str]) -> None:
        self._fmt = fmt
        self._tool_names = frozenset(tool_names)
        self._is_llama = fmt is ToolFormat.LLAMA3_JSON
        self._markers = (PYTHON_TAG, LLAMA_CALL_TRIGGER) if self._is_llama else (TOOL_CALL_BEGIN,)
        self._gap_chars = _WHITESPACE + ";" if self._is_llama else _WHITESPACE
        self._buffer = ""  # received, not yet returned
        self._gap = ""  # separators taken from in front of the call that starts the buffer
        self._is_in_call = False  # the buffer starts with a call's opening marker
        self._is_at_boundary = True  # only separators since the output began or the last call
        self._num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content that is safe to show now, and the calls that `text` completes."""
        self._buffer += text
        return self._drain(is_final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: the rest of the content and the last calls."""
        return self._drain(is_final=True)

    def _drain(self, is_final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self._is_in_call:
                if not self._take_text(is_final, content):
                    break
                continue
            step = (
                self._take_llama_call(is_final) if self._is_llama else self._take_tagged(is_final)
            )
            if step is None:
                break
            consumed, parsed = step
            if parsed is None:
                content.append(self._gap + self._buffer[:consumed])
                self._is_at_boundary = False
            else:
                calls.extend(parsed)
                self._num_calls += len(parsed)
                self._is_at_boundary = True
            self._buffer = self._buffer[consumed:]
            self._gap = ""
            self._is_in_call = False
        return "".join(content), calls

    def _take_text(self, is_final: bool, content: list[str]) -> bool:
        """Return the buffer's leading text as content; True when a call marker now starts it."""
        buffer = self._buffer
        start = len(buffer) - len(buffer.lstrip(self._gap_chars)) if self._is_at_boundary else 0
        marker = self._find_marker(buffer, start)
        if marker is not None:
            if self._is_at_boundary and marker == start:
                self._gap = buffer[:marker]
            else:
                content.append(buffer[:marker])
                self._is_at_boundary = False
            self._buffer = buffer[marker:]
            self._is_in_call = True
            return True
        if is_final:
            if not (self._is_at_boundary and start == len(buffer) and self._num_calls):
                content.append(buffer)
            self._buffer = ""
            return False
        visible = buffer[: len(buffer) - self._partial_marker_len(buffer)]
        if self._is_at_boundary and start >= len(visible):
            return False  # only separators so far: they may precede a call
        content.append(visible)
        self._buffer = buffer[len(visible) :]
        self._is_at_boundary = self._is_at_boundary and not visible
        return False

    def _find_marker(self, buffer: str, start: int) -> int | None:
        found = [i for i in (buffer.find(marker) for marker in self._markers) if i >= 0]
        # Llama writes a call as the whole output: a "{" first means JSON, held until parsed.
        if self._is_llama and self._is_at_boundary and buffer.startswith("{", start):
            found.append(start)
        return min(found, default=None)

    def _partial_marker_len(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that begins a marker."""
        return max(
            (
                k
                for marker in self._markers
                for k in range(1, len(marker))
                if buffer.endswith(marker[:k])
            ),
            default=0,
        )

    def _take_tagged(self, is_final: bool) -> tuple[int, list[ToolCall] | None] | None:
        """(characters consumed, the calls or None for text), or None to wait for more."""
        end = self._buffer.find(TOOL_CALL_END, len(TOOL_CALL_BEGIN))
        if end < 0:
            return (len(self._buffer), None) if is_final else None
        body = self._buffer[len(TOOL_CALL_BEGIN) : end]
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError:
            return end + len(TOOL_CALL_END), None
        items = parsed if isinstance(parsed, list) else [parsed]
        calls = [self._as_call(item) for item in items]
        valid = [call for call in calls if call is not None]
        return end + len(TOOL_CALL_END), valid if len(valid) == len(calls) else None

    def _take_llama_call(self, is_final: bool) -> tuple[int, list[ToolCall] | None] | None:
        buffer = self._buffer
        after_tag = len(PYTHON_TAG) if buffer.startswith(PYTHON_TAG) else 0
        body = len(buffer) - len(buffer[after_tag:].lstrip())
        if body == len(buffer):
            return (len(buffer), None) if is_final else None
        if buffer[body] != "{":
            return body, None  # the python tag before code, not JSON: text
        try:
            obj, end = _DECODER.raw_decode(buffer, body)
        except json.JSONDecodeError:
            # Incomplete or invalid: json cannot tell which, so wait for the end of output.
            return (len(buffer), None) if is_final else None
        call = self._as_call(obj)
        return end, None if call is None else [call]

    def _as_call(self, obj: Any) -> ToolCall | None:
        """A call object {"name", "arguments" or "parameters"} naming a known function."""
        if not isinstance(obj, dict) or not set(obj) <= {"name", "arguments", "parameters"}:
            return None
        name = obj.get("name")
        arguments = obj.get("arguments", obj.get("parameters"))
        if not isinstance(name, str) or name not in self._tool_names:
            return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(
    text: str, fmt: ToolFormat, tool_names: set[str]
) -> tuple[str, list[ToolCall]]:
    """Content text and tool calls of a whole output."""
    parser = ToolCallParser(fmt, tool_names)
    content, calls = parser.feed(text)
    rest, last_calls = parser.finish()
    return content + rest, calls + last_calls
