"""OpenAI Responses requests (`POST /v1/responses`): canonical bodies and their chat form.

A Responses request carries its prompt as `instructions` (a system prompt), `tools` in the
flat Responses format (`{"type": "function", "name", "description", "parameters"}`) and
`input`: a string, or a list of items — messages (`input_text` / `output_text` parts),
`function_call` (the model's call, `arguments` a JSON string), `function_call_output` and
`reasoning` items — in conversation order. vLLM serves it by turning that into chat
messages and rendering them through the model's chat template; `as_chat` does the same
conversion, so the router's prefix chain, precise mode and the simulator all read a
Responses request as the chat request the engine actually renders.

`previous_response_id` chains a request onto a stored response: the engine prepends the
stored conversation, which the router never sees, so `as_chat` converts only what the
request itself carries (the stateful routing is the router's, see router/proxy/stateful.py).
"""

from __future__ import annotations

import json
from typing import Any

from normalizer.canonical import (
    NormalizeOptions,
    canonical_arguments,
    canonical_text,
    sort_keys_deep,
)

_SYSTEM_ROLES = frozenset({"system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})

_DEFAULTS = NormalizeOptions()

# vLLM's names for a namespace's functions and a custom tool's function shim
# (vllm/tool_parsers/utils.py).
NAMESPACE_SEPARATOR = "__"
CUSTOM_TOOL_INPUT_KEY = "input"
CUSTOM_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {CUSTOM_TOOL_INPUT_KEY: {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": [CUSTOM_TOOL_INPUT_KEY],
    "additionalProperties": False,
}


def _canonical_parts(content: Any) -> Any:
    if isinstance(content, str):
        return canonical_text(content)
    if not isinstance(content, list):
        return content
    out = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
            part = {**part, "text": canonical_text(part["text"])}
        out.append(part)
    return out


def _canonical_item(item: Any, options: NormalizeOptions) -> Any:
    if not isinstance(item, dict):
        return item
    kind = item.get("type", "message")
    if kind == "function_call" and options.tool_call_arguments and "arguments" in item:
        return {**item, "arguments": canonical_arguments(item["arguments"])}
    if kind == "message" and options.system_prompt and item.get("role") in _SYSTEM_ROLES and "content" in item:
        return {**item, "content": _canonical_parts(item["content"])}
    return item


def canonicalize_responses_body(body: dict[str, Any], options: NormalizeOptions = _DEFAULTS) -> dict[str, Any]:
    """A canonical copy of a Responses request: tool schemas with sorted keys, function-call
    arguments re-serialised canonically, instructions and system/developer messages with
    canonical whitespace. Idempotent; the input is not modified."""
    if not options.any:
        return body
    out = dict(body)
    if options.tool_schemas and isinstance(out.get("tools"), list):
        out["tools"] = sort_keys_deep(out["tools"])
    if options.system_prompt and isinstance(out.get("instructions"), str):
        out["instructions"] = canonical_text(out["instructions"])
    items = out.get("input")
    if isinstance(items, list) and (options.system_prompt or options.tool_call_arguments):
        out["input"] = [_canonical_item(item, options) for item in items]
    return out


def _function_tool(tool: dict[str, Any], name: Any) -> dict[str, Any]:
    """One function tool as vLLM dumps it for the template (`FunctionDefinition`):
    `description` and `parameters` always (null when absent), `strict` / `defer_loading`
    only when set."""
    fn: dict[str, Any] = {"name": name, "description": tool.get("description"), "parameters": tool.get("parameters")}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def chat_tools(tools: Any) -> list[Any] | None:
    """The tools vLLM shows the model (`get_function_tools`), in request order: function
    tools, a namespace's functions as `<namespace>__<name>`, custom tools as a one-string
    function shim. Built-in tools (web search, ...) are not rendered: dropped."""
    if not isinstance(tools, list) or not tools:
        return None
    out: list[Any] = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type")
        if kind == "function" and isinstance(tool.get("function"), dict):
            out.append(tool)  # already in chat form
        elif kind == "function":
            out.append(_function_tool(tool, tool.get("name")))
        elif kind == "namespace":
            for sub in tool.get("tools") or ():
                if isinstance(sub, dict) and sub.get("type") == "function":
                    out.append(_function_tool(sub, f"{tool.get('name')}{NAMESPACE_SEPARATOR}{sub.get('name')}"))
        elif kind == "custom":
            shim = {"description": tool.get("description"), "parameters": CUSTOM_TOOL_PARAMETERS}
            out.append(_function_tool(shim, tool.get("name")))
    return out or None


def _reasoning_text(item: dict[str, Any]) -> str:
    """vLLM keeps the first content part's text, else the first summary part's."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts and isinstance(parts[0], dict):
            return str(parts[0].get("text", ""))
    return ""


def _tool_call(item: dict[str, Any]) -> dict[str, Any]:
    name = item.get("name", "")
    if item.get("type") == "custom_tool_call":
        # The custom tool's payload as the shim function's one argument, as vLLM encodes it.
        arguments = json.dumps({CUSTOM_TOOL_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
    else:
        arguments = item.get("arguments", "")
        if item.get("namespace"):
            name = f"{item['namespace']}{NAMESPACE_SEPARATOR}{name}"
    return {"id": item.get("call_id", ""), "function": {"name": name, "arguments": arguments}, "type": "function"}


def _assistant_text(item: dict[str, Any]) -> str | None:
    """An assistant message's text as vLLM takes it: the content string, or its first part's."""
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def _merge(prev: dict[str, Any] | None, key: str, value: Any, message: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM folds an item into the previous assistant message while that message has no
    `key` yet (a reasoning item, its text and its calls are one turn); else a new message."""
    if prev is not None and prev.get(key) is None:
        prev[key] = value
        return None
    return message


def _message_of(item: Any, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's `_construct_message_from_response_item`: a new chat message, or None when
    the item was folded into `prev` (the previous message, if it is the assistant's)."""
    if not isinstance(item, dict):
        return {"role": "user", "content": item}
    kind = item.get("type", "message")
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item)
        if prev is not None and isinstance(prev.get("tool_calls"), list):
            prev["tool_calls"] = [*prev["tool_calls"], call]  # a new list: the input is not modified
            return None
        return _merge(prev, "tool_calls", [call], {"role": "assistant", "tool_calls": [call]})
    if kind == "reasoning":
        text = _reasoning_text(item)
        return _merge(prev, "reasoning", text, {"role": "assistant", "reasoning": text})
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        text = _assistant_text(item)
        if text is not None:
            return _merge(prev, "content", text, {"role": "assistant", "content": text})
    # Other messages (user / system / developer) go to the template as given: their
    # content parts are joined there, one line each.
    return item


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for item in items:
        prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        message = _message_of(item, prev)
        if message is not None:
            messages.append(message)
    return messages


def _continues_final(items: Any) -> bool:
    """vLLM continues (no generation prompt) a final assistant message or reasoning item
    that is still in progress."""
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in ("in_progress", "incomplete")


def as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Responses request renders as (vLLM's `construct_input_messages`,
    `construct_tool_dicts` and `build_chat_params`): `model`, `messages`, `tools`, and
    the template kwargs the request sets. Items are copied, never modified."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        messages.extend(chat_messages([dict(i) if isinstance(i, dict) else i for i in items]))
    # vLLM tokenizes a rendered Responses prompt with the tokenizer's special tokens (its
    # TokenizeParams default), unlike a chat completion's: a template that writes the BOS
    # itself gets a second one, and the engine's prompt starts with both.
    chat: dict[str, Any] = {"model": body.get("model", ""), "messages": messages, "add_special_tokens": True}
    tools = chat_tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    if _continues_final(items):
        chat["add_generation_prompt"] = False
        chat["continue_final_message"] = True
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    if isinstance(body.get("chat_template_kwargs"), dict):
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    return chat
