"""Tests for tool calling: format detection, prompt rendering, output grammars, call parsing."""

from __future__ import annotations

import json
import os
import random
import re
from typing import Any

import pytest
import xgrammar as xgr

from bootstrap.tool_calls import (
    ToolCall,
    ToolCallParser,
    ToolFormat,
    detect_format,
    messages_for_template,
    parse_tool_calls,
    render_tool_calls,
    structural_tag,
    template_supports_tools,
    tools_system_prompt,
)
from common.tokenizer import Tokenizer

STOP_TOKEN = 2  # <|im_end|>
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
NAMES = {"get_weather", "add"}
PARIS = ("get_weather", {"city": "Paris", "days": 2})
SUM = ("add", {"a": 1, "b": 2.5})
ALL_FORMATS = list(ToolFormat)
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}"
    "{% endfor %}</tools>\nReturn calls in <tool_call></tool_call> tags.<|im_end|>\n{%- endif %}"
)
LLAMA_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n{%- if tools is not none %}Environment: "
    "ipython{%- endif %}{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}<|eot_id|>"
)
LLAMA_PYTHON_TAG_TEMPLATE = "{{- '<|python_tag|>' + tool_call.name }}"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from common.model.loader import resolve_model_dir

    return Tokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer.hf_tokenizer, vocab_size=49152, stop_token_ids=[STOP_TOKEN]
    )
    return xgr.GrammarCompiler(info)


def _calls(calls: list[ToolCall]) -> list[tuple[str, dict[str, Any]]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def _stream(
    text: str, fmt: ToolFormat, seed: int, names: set[str] = NAMES
) -> tuple[list[str], list[list[ToolCall]]]:
    """Content pieces and call lists of feeding `text` in pieces of 1-3 characters, then finish."""
    rng = random.Random(seed)
    parser = ToolCallParser(fmt, names)
    contents, calls, i = [], [], 0
    while i < len(text):
        step = rng.randint(1, 3)
        content, new_calls = parser.feed(text[i : i + step])
        contents.append(content)
        calls.append(new_calls)
        i += step
    content, new_calls = parser.finish()
    return [*contents, content], [*calls, new_calls]


# --- parsing ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_single_call(fmt: ToolFormat) -> None:
    content, calls = parse_tool_calls(render_tool_calls([PARIS], fmt), fmt, NAMES)
    assert content == ""
    assert _calls(calls) == [PARIS]
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_parallel_calls(fmt: ToolFormat) -> None:
    content, calls = parse_tool_calls(render_tool_calls([PARIS, SUM], fmt), fmt, NAMES)
    assert content == ""
    assert _calls(calls) == [PARIS, SUM]
    assert calls[0].id != calls[1].id


def test_hermes_calls_in_separate_tags_drop_the_whitespace_between() -> None:
    text = render_tool_calls([PARIS], ToolFormat.HERMES) + "\n\n"
    text += render_tool_calls([SUM], ToolFormat.HERMES) + "\n"
    content, calls = parse_tool_calls(text, ToolFormat.HERMES, NAMES)
    assert (content, _calls(calls)) == ("", [PARIS, SUM])


@pytest.mark.parametrize("fmt", [ToolFormat.SMOLLM2, ToolFormat.HERMES])
def test_text_before_and_after_a_tagged_call(fmt: ToolFormat) -> None:
    text = "Let me check. " + render_tool_calls([PARIS], fmt) + " Done."
    content, calls = parse_tool_calls(text, fmt, NAMES)
    assert content == "Let me check.  Done."
    assert _calls(calls) == [PARIS]


def test_llama_call_after_text_and_json_that_is_no_call() -> None:
    fmt = ToolFormat.LLAMA3_JSON
    text = 'Sure: {"name": "add", "parameters": {"a": 1, "b": 2.5}} and {"x": 1}'
    content, calls = parse_tool_calls(text, fmt, NAMES)
    assert content == 'Sure:  and {"x": 1}'
    assert _calls(calls) == [SUM]
    plain = '{"name": "Ada", "age": 36} is a record'  # a JSON answer, not a call
    assert parse_tool_calls(plain, fmt, NAMES) == (plain, [])


@pytest.mark.parametrize("tag", ["", "<|python_tag|>"])
def test_llama_with_and_without_python_tag(tag: str) -> None:
    fmt = ToolFormat.LLAMA3_JSON
    text = tag + '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}};\n'
    text += '{"name": "add", "parameters": {"a": 1, "b": 2.5}}'
    content, calls = parse_tool_calls(text, fmt, NAMES)
    assert (content, _calls(calls)) == ("", [PARIS, SUM])


def test_llama_call_with_other_spacing_counts_only_at_the_start() -> None:
    fmt = ToolFormat.LLAMA3_JSON
    text = '\n{\n  "name": "add",\n  "parameters": {"a": 1, "b": 2.5}\n}'
    pieces, calls = _stream(text, fmt, seed=0)
    assert "".join(pieces) == ""
    assert _calls([call for batch in calls for call in batch]) == [SUM]
    later = "Then " + text  # mid-text only the exact '{"name"' opens a call
    assert parse_tool_calls(later, fmt, NAMES) == (later, [])


def test_llama_holds_output_that_starts_like_a_call() -> None:
    parser = ToolCallParser(ToolFormat.LLAMA3_JSON, NAMES)
    assert parser.feed('  {"name": "add", "parameters": {"a": 1,') == ("", [])
    content, calls = parser.feed(' "b": 2.5}}')
    assert content == "" and _calls(calls) == [SUM]
    assert parser.feed("<|python") == ("", [])
    assert parser.finish() == ("<|python", [])


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("seed", range(8))
def test_calls_split_into_small_pieces(fmt: ToolFormat, seed: int) -> None:
    prefix = "" if fmt is ToolFormat.LLAMA3_JSON else "I will call <tools> now. "
    text = prefix + render_tool_calls([PARIS, SUM], fmt)
    pieces, calls = _stream(text, fmt, seed)
    assert "".join(pieces) == prefix
    assert _calls([call for batch in calls for call in batch]) == [PARIS, SUM]
    # The calls come from the feed that completes them, not from finish().
    assert calls[-1] == []


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("seed", range(4))
def test_plain_text_passes_through_unchanged(fmt: ToolFormat, seed: int) -> None:
    text = "  Braces {like this} and <tags> and <tool_ and ; semicolons.\n <tool"
    pieces, calls = _stream(text, fmt, seed)
    assert "".join(pieces) == text
    assert all(batch == [] for batch in calls)


def test_a_partial_marker_is_held_back_until_settled() -> None:
    parser = ToolCallParser(ToolFormat.HERMES, NAMES)
    assert parser.feed("Hi <tool_c") == ("Hi ", [])
    assert parser.feed("ar> ok") == ("<tool_car> ok", [])


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_unknown_function_stays_text(fmt: ToolFormat) -> None:
    text = render_tool_calls([("launch_rocket", {"when": "now"})], fmt)
    assert parse_tool_calls(text, fmt, NAMES) == (text, [])
    mixed = render_tool_calls([PARIS, ("launch_rocket", {})], fmt)
    content, calls = parse_tool_calls(mixed, fmt, NAMES)
    if fmt is ToolFormat.SMOLLM2:  # one block holds both: it stays text whole
        assert (content, calls) == (mixed, [])
    else:
        assert _calls(calls) == [PARIS] and "launch_rocket" in content


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_unterminated_call_becomes_text_at_finish(fmt: ToolFormat) -> None:
    text = "Result: " + render_tool_calls([PARIS], fmt)[:-3]
    parser = ToolCallParser(fmt, NAMES)
    shown, calls = parser.feed(text)
    assert calls == [] and text.startswith(shown)
    rest, calls = parser.finish()
    assert (shown + rest, calls) == (text, [])


def test_unparsable_and_empty_tagged_calls() -> None:
    bad = '<tool_call>[{"name": "add", "arguments": {"a": 1,}}]</tool_call>'
    assert parse_tool_calls(bad, ToolFormat.SMOLLM2, NAMES) == (bad, [])
    # SmolLM2's way to say "no call": an empty list, dropped.
    assert parse_tool_calls("<tool_call>[]</tool_call>", ToolFormat.SMOLLM2, NAMES) == ("", [])


# --- templates and prompts ----------------------------------------------------------------


def test_detect_format(tokenizer: Tokenizer) -> None:
    smollm2_template = tokenizer.hf_tokenizer.chat_template
    assert detect_format(smollm2_template) is ToolFormat.SMOLLM2
    assert detect_format(None) is ToolFormat.SMOLLM2
    assert detect_format(QWEN_TEMPLATE) is ToolFormat.HERMES
    assert detect_format(LLAMA_TEMPLATE) is ToolFormat.LLAMA3_JSON
    assert detect_format(LLAMA_PYTHON_TAG_TEMPLATE) is ToolFormat.LLAMA3_JSON
    assert detect_format("<|start_header_id|>user<|end_header_id|>") is ToolFormat.SMOLLM2
    assert ToolFormat("llama3_json") is ToolFormat.LLAMA3_JSON


def test_template_supports_tools(tokenizer: Tokenizer) -> None:
    assert not template_supports_tools(tokenizer.hf_tokenizer.chat_template)
    assert not template_supports_tools(None)
    assert template_supports_tools(QWEN_TEMPLATE)
    assert template_supports_tools(LLAMA_TEMPLATE)
    assert not template_supports_tools("{{ toolset }}")


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_tools_system_prompt(fmt: ToolFormat) -> None:
    prompt = tools_system_prompt(TOOLS, fmt)
    listed = re.search(r"<tools>(.*)</tools>", prompt)
    assert listed is not None
    assert json.loads(listed.group(1)) == [WEATHER["function"], ADD["function"]]
    example = {"smollm2": '<tool_call>[{"name": "func_name1"', "hermes": '<tool_call>\n{"name"'}
    assert example.get(fmt, '{"name": "func_name1", "parameters"') in prompt


def _conversation() -> list[dict[str, Any]]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
    }
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    ]


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_messages_for_template_renders_tool_use_as_text(fmt: ToolFormat) -> None:
    messages = _conversation()
    rendered = messages_for_template(messages, TOOLS, fmt, supports_tools=False)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "tool"]
    assert rendered[0]["content"] == tools_system_prompt(TOOLS, fmt)
    assert parse_tool_calls(rendered[2]["content"], fmt, NAMES)[0] == ""
    assert _calls(parse_tool_calls(rendered[2]["content"], fmt, NAMES)[1]) == [PARIS]
    assert rendered[3]["content"] == '<tool_response>\n{"temp_c": 18}\n</tool_response>'
    assert messages == _conversation()  # the input is not changed


def test_messages_for_template_merges_into_the_system_message(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *_conversation()]
    messages[2]["content"] = "Checking."
    rendered = messages_for_template(messages, TOOLS, ToolFormat.SMOLLM2, supports_tools=False)
    prompt = tools_system_prompt(TOOLS, ToolFormat.SMOLLM2)
    assert rendered[0] == {"role": "system", "content": "Be brief.\n\n" + prompt}
    call = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]'
    assert rendered[2]["content"] == f"Checking.\n{call}</tool_call>"
    text = tokenizer.decode(tokenizer.apply_chat_template(rendered), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou are an expert")
    assert "<|im_start|>tool\n<tool_response>\n" in text
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_messages_for_template_without_tools_still_renders_history() -> None:
    rendered = messages_for_template(_conversation(), None, ToolFormat.HERMES, False)
    assert [m["role"] for m in rendered] == ["user", "assistant", "tool"]
    assert rendered[1]["content"].startswith("<tool_call>\n")


def test_messages_for_template_when_the_template_renders_tools() -> None:
    messages = _conversation()
    rendered = messages_for_template(messages, TOOLS, ToolFormat.HERMES, supports_tools=True)
    assert rendered[0] == messages[0]
    assert rendered[1]["content"] == ""
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == PARIS[1]
    assert rendered[2] == messages[2]
    assert messages == _conversation()


@pytest.mark.parametrize("supports_tools", [False, True])
def test_messages_for_template_rejects_arguments_that_are_no_object(supports_tools: bool) -> None:
    messages = _conversation()
    messages[1]["tool_calls"][0]["function"]["arguments"] = "[1, 2"
    where = r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON object"
    with pytest.raises(ValueError, match=where):
        messages_for_template(messages, TOOLS, ToolFormat.SMOLLM2, supports_tools)


# --- structural tags ---------------------------------------------------------------------


def _accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    """Whether the grammar takes `text` as a whole output (the stop token then ends it)."""
    matcher = xgr.GrammarMatcher(compiled)
    return (
        matcher.accept_string(text) and matcher.accept_token(STOP_TOKEN) and matcher.is_terminated()
    )


CHOICES: list[Any] = ["auto", "required", {"type": "function", "function": {"name": "add"}}]


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "required", "named"])
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "single"])
def test_structural_tag_constrains_calls(
    compiler: xgr.GrammarCompiler, fmt: ToolFormat, choice: Any, parallel: bool
) -> None:
    text = structural_tag(TOOLS, choice, parallel, fmt)
    assert text is not None and json.loads(text)["type"] == "structural_tag"
    compiled = compiler.compile_structural_tag(text)
    is_named = isinstance(choice, dict)

    assert _accepts(compiled, render_tool_calls([SUM], fmt))
    assert _accepts(compiled, render_tool_calls([PARIS], fmt)) is not is_named
    two_calls = render_tool_calls([SUM, SUM], fmt)
    assert _accepts(compiled, two_calls) is (parallel and not is_named)
    assert _accepts(compiled, "It is sunny.") is (choice == "auto")

    assert not _accepts(compiled, render_tool_calls([("add", {"a": "one", "b": 2})], fmt))
    assert not _accepts(compiled, render_tool_calls([("add", {"a": 1})], fmt))
    assert not _accepts(compiled, render_tool_calls([("launch", {"a": 1, "b": 2})], fmt))
    if not is_named:
        assert not _accepts(compiled, render_tool_calls([("get_weather", {"days": 2})], fmt))


def test_required_text_alone_does_not_complete(compiler: xgr.GrammarCompiler) -> None:
    for fmt in ALL_FORMATS:
        text = structural_tag(TOOLS, "required", True, fmt)
        assert text is not None
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(text))
        accepted = matcher.accept_string("Hello")
        assert not (accepted and matcher.accept_token(STOP_TOKEN))
        assert not matcher.is_terminated()


def test_structural_tag_none_and_errors() -> None:
    assert structural_tag(TOOLS, "none", True, ToolFormat.SMOLLM2) is None
    assert structural_tag(None, "auto", True, ToolFormat.HERMES) is None
    assert structural_tag([], None, False, ToolFormat.LLAMA3_JSON) is None
    with pytest.raises(ValueError, match="needs a non-empty tools list"):
        structural_tag([], "required", True, ToolFormat.SMOLLM2)
    named = {"type": "function", "function": {"name": "fly"}}
    with pytest.raises(ValueError, match="'fly', which is not in tools"):
        structural_tag(TOOLS, named, True, ToolFormat.HERMES)
    with pytest.raises(ValueError, match="tool_choice must be"):
        structural_tag(TOOLS, "always", True, ToolFormat.SMOLLM2)
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name"):
        structural_tag([{"type": "function", "function": {}}], "auto", True, ToolFormat.SMOLLM2)
    with pytest.raises(ValueError, match="already taken"):
        structural_tag([ADD, ADD], "auto", True, ToolFormat.SMOLLM2)
