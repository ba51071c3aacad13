"""Tool-calling formats: template detection, tools prompt, message rendering, output grammar."""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Any, Literal

import xgrammar
from xgrammar.structural_tag import (
    Format,
    JSONSchemaFormat,
    StructuralTag,
    TagFormat,
    TriggeredTagsFormat,
)

from common.tokenizer import validate_messages

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# tool_choice reduced: free text or calls, at least one call, one call of a named function.
ChoiceMode = Literal["auto", "required", "forced"]


class ToolFormat(StrEnum):
    """How a model writes its tool calls."""

    # SmolLM2-Instruct: <tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>
    SMOLLM2 = "smollm2"
    # Qwen2.5 / Qwen3 / Hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    HERMES = "hermes"
    # Llama 3.1-3.3: [<|python_tag|>]{"name": ..., "parameters": {...}}; several joined by ";"
    LLAMA3_JSON = "llama3_json"


_XGRAMMAR_MODELS = {ToolFormat.HERMES: "qwen_3", ToolFormat.LLAMA3_JSON: "llama"}
_ARGUMENTS_KEY = {
    ToolFormat.SMOLLM2: "arguments",
    ToolFormat.HERMES: "arguments",
    ToolFormat.LLAMA3_JSON: "parameters",
}
_PROMPT_INTRO = (
    "You are an expert in composing functions. You get a question and a set of functions you "
    "may call. Decide whether calling one or more of them answers the question. If no function "
    "fits, say so and answer in plain text. If the question lacks an argument that a function "
    "requires, ask for it instead of guessing."
)
_PROMPT_FORMAT = {
    ToolFormat.SMOLLM2: (
        "To call functions, your output MUST strictly adhere to the following format, a JSON "
        "list of calls with arguments of the right types, and contain nothing else:\n"
        '<tool_call>[{"name": "func_name1", "arguments": {"argument1": "value1"}}, '
        '{"name": "func_name2", "arguments": {"argument2": 2}}]</tool_call>'
    ),
    ToolFormat.HERMES: (
        "To call a function, write one JSON object with its name and arguments between "
        "<tool_call> and </tool_call>; use one such block per call:\n"
        '<tool_call>\n{"name": "func_name1", "arguments": {"argument1": "value1"}}\n</tool_call>'
    ),
    ToolFormat.LLAMA3_JSON: (
        "To call a function, answer with only a JSON object of this form, and separate several "
        'calls with ";":\n{"name": "func_name1", "parameters": {"argument1": "value1"}}'
    ),
}


def detect_format(chat_template: str | None) -> ToolFormat:
    """The tool-call format a model with this chat template was trained on."""
    template = chat_template or ""
    if TOOL_CALL_BEGIN in template:
        return ToolFormat.HERMES
    if PYTHON_TAG in template or ("<|start_header_id|>" in template and "tools" in template):
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.SMOLLM2


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the template renders the `tools` it is given (else a system prompt lists them)."""
    return re.search(r"\btools\b", chat_template or "") is not None


def tool_functions(tools: Any) -> list[dict[str, Any]]:
    """The function specs of OpenAI `tools`; a bad shape or a repeated name raises ValueError."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")  # noqa: TRY004
    functions: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where} must be an object with type 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object")  # noqa: TRY004
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string")
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} is already taken by another tool")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object")
        names.add(name)
        functions.append(function)
    return functions


def tools_system_prompt(tools: list[dict[str, Any]], fmt: ToolFormat) -> str:
    """System-prompt text listing the tools and the exact call format, for templates that
    ignore `tools`."""
    specs = [
        {key: function[key] for key in ("name", "description", "parameters") if key in function}
        for function in tool_functions(tools)
    ]
    listing = (
        f"You can call these functions:\n<tools>{json.dumps(specs, ensure_ascii=False)}</tools>"
    )
    return "\n\n".join([_PROMPT_INTRO, listing, _PROMPT_FORMAT[fmt]])


def render_tool_calls(calls: list[tuple[str, dict[str, Any]]], fmt: ToolFormat) -> str:
    """(name, arguments) pairs written as the model writes them in `fmt`."""
    key = _ARGUMENTS_KEY[fmt]
    objects = [json.dumps({"name": name, key: args}, ensure_ascii=False) for name, args in calls]
    if fmt is ToolFormat.SMOLLM2:
        return f"{TOOL_CALL_BEGIN}[{', '.join(objects)}]{TOOL_CALL_END}"
    if fmt is ToolFormat.HERMES:
        return "\n".join(f"{TOOL_CALL_BEGIN}\n{obj}\n{TOOL_CALL_END}" for obj in objects)
    return "; ".join(objects)


def messages_for_template(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    fmt: ToolFormat,
    supports_tools: bool,
) -> list[dict[str, Any]]:
    """The OpenAI conversation as the chat template should see it.

    A template that renders tools gets the messages as they are, with each call's `arguments`
    parsed into an object. Otherwise tool use becomes text: the tools prompt joins the first
    system message (or opens the conversation as one), an assistant's calls are written in
    `fmt` after its content, and a "tool" message keeps its role (the template prints role
    names, so the model sees a function's output, not the user's words) with its content
    wrapped in <tool_response> tags.
    """
    normalized = validate_messages(messages)
    if supports_tools:
        return [_with_parsed_arguments(i, message) for i, message in enumerate(normalized)]
    rendered = [_as_text(i, message, fmt) for i, message in enumerate(normalized)]
    if tools:
        prompt = tools_system_prompt(tools, fmt)
        first = rendered[0]
        if first["role"] == "system":
            text = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
            rendered[0] = {**first, "content": text}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered


def _call_arguments(index: int, j: int, call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(arguments, dict):
        where = f"messages[{index}].tool_calls[{j}].function.arguments"
        raise ValueError(f"{where} must be a JSON object")  # noqa: TRY004
    return arguments


def _with_parsed_arguments(index: int, message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = [
        {**call, "function": {**call["function"], "arguments": _call_arguments(index, j, call)}}
        for j, call in enumerate(message["tool_calls"])
    ]
    return {**message, "tool_calls": calls}


def _as_text(index: int, message: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    if message["role"] == "tool":
        return {**message, "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if not message.get("tool_calls"):
        return message
    pairs = [
        (call["function"]["name"], _call_arguments(index, j, call))
        for j, call in enumerate(message["tool_calls"])
    ]
    parts = [message["content"], render_tool_calls(pairs, fmt)]
    return {**message, "content": "\n".join(part for part in parts if part)}


def structural_tag(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool,
    fmt: ToolFormat,
) -> str | None:
    """JSON text of an xgrammar structural tag that makes every tool call parse and match its
    function's `parameters`; None when no call is possible (tool_choice "none", no tools).

    "auto": free text and calls; "required": at least one call; a named function: exactly one
    call of it. Without `parallel_tool_calls`, at most one call.
    """
    if tool_choice == "none":
        return None
    mode, functions = _resolve_choice(tool_functions(tools or []), tool_choice)
    if not functions:
        if mode == "auto":
            return None
        raise ValueError('tool_choice "required" needs a non-empty tools list')
    if fmt is ToolFormat.SMOLLM2:
        tag = _smollm2_tag(functions, mode, parallel_tool_calls)
    else:
        choice: Literal["auto", "required"] | dict[str, Any]
        if mode == "forced":
            choice = {"type": "function", "function": {"name": functions[0]["name"]}}
        else:
            choice = mode
        tag = xgrammar.get_model_structural_tag(
            _XGRAMMAR_MODELS[fmt],
            tools=[{"type": "function", "function": function} for function in functions],
            tool_choice=choice,
            reasoning="disabled",
            parallel_tool_calls=parallel_tool_calls,
        )
    return tag.model_dump_json()


def _resolve_choice(
    functions: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None
) -> tuple[ChoiceMode, list[dict[str, Any]]]:
    """How calls are chosen, and the functions that may be called."""
    if tool_choice is None or tool_choice == "auto":
        return "auto", functions
    if tool_choice == "required":
        return "required", functions
    named = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(named, dict)
        or not isinstance(named.get("name"), str)
    ):
        raise ValueError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )
    chosen = [function for function in functions if function["name"] == named["name"]]
    if not chosen:
        raise ValueError(f"tool_choice names function {named['name']!r}, which is not in tools")
    return "forced", chosen


def _smollm2_tag(
    functions: list[dict[str, Any]], mode: ChoiceMode, is_parallel: bool
) -> StructuralTag:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": function["name"]},
                "arguments": function.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for function in functions
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if mode == "forced" or not is_parallel:
        schema["maxItems"] = 1
    tag = TagFormat(
        begin=TOOL_CALL_BEGIN, content=JSONSchemaFormat(json_schema=schema), end=TOOL_CALL_END
    )
    if mode == "forced":
        return StructuralTag(format=tag)
    triggered: Format = TriggeredTagsFormat(
        triggers=[TOOL_CALL_BEGIN],
        tags=[tag],
        at_least_one=mode == "required",
        stop_after_first=not is_parallel,
    )
    return StructuralTag(format=triggered)
