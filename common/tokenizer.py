"""Tokenizer wrapper (encode, decode, chat template, eos ids) and incremental detokenizer."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context for the first output tokens (as in vLLM/TGI).
INITIAL_CONTEXT_TOKENS = 5
# Drop consumed ids once this many pile up in front of the decode window.
TRIM_THRESHOLD = 256


class Tokenizer:
    """A transformers tokenizer plus the eos ids from the model's generation/model config."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, extra_eos_ids: Iterable[int] = ()):
        self._hf = hf_tokenizer
        eos = set(extra_eos_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self._eos_token_ids = frozenset(eos)
        self._add_bos = bool(getattr(hf_tokenizer, "add_bos_token", False))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from an HF-format directory (tokenizer.json, tokenizer_config.json, ...)."""
        hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
        return cls(hf_tokenizer, _config_eos_ids(Path(path)))

    @property
    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return len(self._hf)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's string, in characters: a text of n characters has at least
        n / max_token_chars tokens (byte-level BPE: one character per byte of text;
        SentencePiece: one per character)."""
        pieces = self._hf.convert_ids_to_tokens(list(range(len(self._hf))))
        return max(1, max((len(p) for p in pieces if isinstance(p, str)), default=1))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        bos = self._hf.bos_token_id
        return None if bos is None else int(bos)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; a bos is prepended only when the tokenizer config says so."""
        ids = list(self._hf.encode(text, add_special_tokens=False))
        bos = self.bos_token_id
        if self._add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt ids for an OpenAI-style message list rendered with the model's template.

        `tools` (OpenAI function tools) go to the template, which renders them if it knows how.
        """
        if self._hf.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        normalized = validate_messages(messages)
        hf_tools: list[dict[Any, Any] | Callable[..., Any]] | None = (
            None if tools is None else list(tools)
        )
        try:
            rendered = self._hf.apply_chat_template(
                normalized,
                tools=hf_tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja's raise_exception() and template errors
            raise ValueError(f"chat template rejected the messages: {exc}") from exc
        # The template writes its own special tokens (bos included), so add none here.
        return list(self._hf.encode(str(rendered), add_special_tokens=False))


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check an OpenAI-style message list; text-part content lists are joined with newlines.

    Tool use: an assistant message with `tool_calls` may have null or no content (made "");
    a "tool" message needs a string `tool_call_id`. A call's `arguments` is a JSON string
    (OpenAI) or an already parsed object (what HF chat templates take).
    Every problem, type errors included, raises ValueError: the API answers it with a 400.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            kind = type(message).__name__
            raise ValueError(f"messages[{i}] must be an object, got {kind}")  # noqa: TRY004
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}].role must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}"
            )
        normalized.append(_normalized_message(i, message))
    return normalized


def _normalized_message(index: int, message: dict[str, Any]) -> dict[str, Any]:
    where = f"messages[{index}]"
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if message["role"] != "assistant":
            raise ValueError(f"{where}.tool_calls is allowed only on assistant messages")
        _check_tool_calls(where, tool_calls)
    if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise ValueError(f"{where}.tool_call_id must be a string")
    content = message.get("content")
    if content is None and tool_calls:
        return {**message, "content": ""}
    return {**message, "content": _content_text(index, content)}


def _check_tool_calls(where: str, tool_calls: Any) -> None:
    if not isinstance(tool_calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")  # noqa: TRY004
    for j, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise ValueError(f"{at} must be an object")  # noqa: TRY004
        if not isinstance(call.get("id"), str):
            raise ValueError(f"{at}.id must be a string")
        if call.get("type", "function") != "function":
            raise ValueError(f"{at}.type must be 'function'")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{at}.function must be an object")  # noqa: TRY004
        if not isinstance(function.get("name"), str):
            raise ValueError(f"{at}.function.name must be a string")
        if not isinstance(function.get("arguments"), (str, dict)):
            raise ValueError(f"{at}.function.arguments must be a string of JSON")


def _content_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(  # noqa: TRY004
            f"messages[{index}].content must be a string or a list of text parts, "
            f"got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise ValueError(f"{where} must be an object with type 'text'")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.text must be a string")  # noqa: TRY004
        texts.append(part["text"])
    return "\n".join(texts)


def _config_eos_ids(path: Path) -> set[int]:
    """Extra eos ids named by generation_config.json or config.json, when present."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.is_file():
            continue
        value = json.loads(file.read_text()).get("eos_token_id")
        if isinstance(value, int) and not isinstance(value, bool):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ids


class IncrementalDetokenizer:
    """Turns a stream of output ids into text, a few ids of decoding per step.

    Each step decodes only ids[prefix_offset:] and compares it with the decoding of
    ids[prefix_offset:read_offset] (text already emitted); the difference is new text.
    A tail ending in U+FFFD is an incomplete UTF-8 character and waits for more ids.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Invariant: ids[prefix_offset:read_offset] decodes to text already emitted (or context).
        self._ids: list[int] = list(prompt_ids[-INITIAL_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text_parts: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far by add() and flush()."""
        return "".join(self._text_parts)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output ids; return the text they complete (never a partial character)."""
        self._ids.extend(token_ids)
        prefix_text, full_text = self._window_texts()
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(full_text[len(prefix_text) :])

    def flush(self) -> str:
        """Emit whatever add() held back (e.g. an incomplete character at the very end)."""
        prefix_text, full_text = self._window_texts()
        if len(full_text) <= len(prefix_text):
            return ""
        return self._emit(full_text[len(prefix_text) :])

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip)
        full_text = decode(self._ids[self._prefix_offset :], skip)
        return prefix_text, full_text

    def _emit(self, new_text: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset >= TRIM_THRESHOLD:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._text_parts.append(new_text)
        return new_text
