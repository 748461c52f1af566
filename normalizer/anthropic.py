"""Anthropic Messages requests (`POST /v1/messages`): canonical bodies and their chat form.

A Messages request carries `system` (a string or text blocks), `tools`
(`{"name", "description", "input_schema"}`) and `messages` whose content is a string or
content blocks: `text`, `image`, `tool_use` (`input` a JSON object), `tool_result`
(`tool_use_id`, `content` a string or blocks), `thinking`. vLLM serves it by converting it
to a chat request and rendering that through the chat template; `as_chat` is that
conversion, shared by the prefix chain, precise mode and the simulator.
"""

from __future__ import annotations

from typing import Any

import orjson

from normalizer.canonical import NormalizeOptions, canonical_text, sort_keys_deep

_BLOCKS_WITH_JSON = frozenset({"tool_use", "tool_result"})

_DEFAULTS = NormalizeOptions()


def _canonical_system(system: Any) -> Any:
    if isinstance(system, str):
        return canonical_text(system)
    if not isinstance(system, list):
        return system
    out = []
    for block in system:
        if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            block = {**block, "text": canonical_text(block["text"])}
        out.append(block)
    return out


def _canonical_message(msg: Any) -> Any:
    if not isinstance(msg, dict) or not isinstance(msg.get("content"), list):
        return msg
    content = [
        sort_keys_deep(block) if isinstance(block, dict) and block.get("type") in _BLOCKS_WITH_JSON else block
        for block in msg["content"]
    ]
    return {**msg, "content": content}


def canonicalize_messages_body(body: dict[str, Any], options: NormalizeOptions = _DEFAULTS) -> dict[str, Any]:
    """A canonical copy of a Messages request: tools and `tool_use` / `tool_result` blocks
    with sorted keys (so `tool_use.input` serialises the same whatever the client's key
    order), `system` text with canonical whitespace. Idempotent; the input is not modified."""
    if not options.any:
        return body
    out = dict(body)
    if options.tool_schemas and isinstance(out.get("tools"), list):
        out["tools"] = sort_keys_deep(out["tools"])
    if options.system_prompt and "system" in out:
        out["system"] = _canonical_system(out["system"])
    messages = out.get("messages")
    if options.tool_call_arguments and isinstance(messages, list):
        out["messages"] = [_canonical_message(m) for m in messages]
    return out


def _text(content: Any) -> Any:
    """Blocks as chat content: text blocks joined; anything else kept as blocks."""
    if not isinstance(content, list):
        return content
    if all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    return content


def chat_tools(tools: Any) -> list[Any] | None:
    if not isinstance(tools, list) or not tools:
        return None
    out: list[Any] = []
    for tool in tools:
        if isinstance(tool, dict) and "name" in tool:
            fn = {"name": tool["name"], "description": tool.get("description", ""), "parameters": tool.get("input_schema", {})}
            out.append({"type": "function", "function": fn})
        else:
            out.append(tool)
    return out


def _arguments(value: Any) -> str:
    return orjson.dumps(value).decode() if not isinstance(value, str) else value


def _append_message(messages: list[dict[str, Any]], msg: Any) -> None:
    if not isinstance(msg, dict):
        messages.append({"role": "user", "content": msg})
        return
    role = str(msg.get("role", "user"))
    content = msg.get("content")
    if not isinstance(content, list):
        messages.append({"role": role, "content": content})
        return
    other: list[Any] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""), "content": _text(block.get("content", ""))})
        elif kind == "tool_use":
            fn = {"name": block.get("name", ""), "arguments": _arguments(block.get("input", {}))}
            calls.append({"id": block.get("id", ""), "type": "function", "function": fn})
        else:
            other.append(block)
    # A user turn's tool results come first, one tool message each, then the rest of it.
    messages.extend(results)
    if other or not (calls or results):
        messages.append({"role": role, "content": _text(other)})
    if calls:
        if role == "assistant" and other:
            messages[-1]["tool_calls"] = calls
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})


def as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Messages request renders as: `model`, `messages`, `tools`."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text(system)})
    for msg in body.get("messages") or ():
        _append_message(messages, msg)
    chat: dict[str, Any] = {"model": body.get("model", ""), "messages": messages}
    tools = chat_tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    return chat
