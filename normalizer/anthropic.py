"""Anthropic Messages requests (`POST /v1/messages`): canonical bodies and their chat form.

A Messages request carries `system` (a string or text blocks), `tools`
(`{"name", "description", "input_schema"}`) and `messages` whose content is a string or
content blocks: `text`, `image`, `tool_use` (`input` a JSON object), `tool_result`
(`tool_use_id`, `content` a string or blocks), `thinking`. vLLM serves it by converting it
to a chat request and rendering that through the chat template; `as_chat` is that
conversion, shared by the prefix chain, precise mode and the simulator.
"""

from __future__ import annotations

import json
from typing import Any

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


_BILLING_HEADER = "x-anthropic-billing-header"
"""Claude Code's per-request attribution line, which vLLM drops from system text."""


def _system_text(content: Any) -> str | None:
    """System text as vLLM joins it: text blocks concatenated, empty and billing-header
    blocks dropped; None when nothing is left."""
    if isinstance(content, str):
        return None if content.startswith(_BILLING_HEADER) else content
    if not isinstance(content, list):
        return None
    parts = [
        b["text"] for b in content
        if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        and b["text"] and not b["text"].startswith(_BILLING_HEADER)
    ]
    return "".join(parts) if parts else None


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": tool["name"], "description": tool.get("description"), "parameters": tool.get("input_schema")}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def chat_tools(tools: Any) -> list[Any] | None:
    """Anthropic tools as vLLM's `_convert_tools` makes them (`input_schema` as the
    parameters, `description` null when absent)."""
    if not isinstance(tools, list):
        return None
    return [_function(t) if isinstance(t, dict) and "name" in t else t for t in tools]


def _arguments(value: Any) -> str:
    """`tool_use.input` serialised as vLLM does: `json.dumps` with its default separators
    and ASCII escapes (the template re-serialises the parsed object, but the estimate
    chain hashes this string)."""
    return json.dumps(value or {})


def _tool_result_messages(block: dict[str, Any]) -> list[dict[str, Any]]:
    """A user turn's `tool_result` as vLLM's `_convert_user_tool_result`: a tool message
    (text blocks joined by newlines), then its images as a user message and its tool
    references as a second tool message."""
    content = block.get("content")
    call_id = block.get("tool_use_id") or ""
    text, images, refs = "", [], []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                images.append({"type": "image_url", "image_url": {"url": _image_url(item.get("source", {}))}})
            elif kind == "tool_reference" and (item.get("tool_name") or item.get("name")):
                refs.append({"type": "tool_reference", "name": item.get("tool_name") or item.get("name")})
        text = "\n".join(texts)
    out = [{"role": "tool", "tool_call_id": call_id, "content": text or ""}]
    if images:
        out.append({"role": "user", "content": images})
    if refs:
        out.append({"role": "tool", "tool_call_id": call_id, "content": refs})
    return out


def _image_url(source: Any) -> str:
    if not isinstance(source, dict):
        return ""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _convert_blocks(role: str, blocks: list[Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's `_convert_message_content`: the turn's message; a user turn's tool results
    are appended to `messages` first, as their own tool messages."""
    msg: dict[str, Any] = {"role": role}
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            fn = {"name": block.get("name") or "", "arguments": _arguments(block.get("input"))}
            calls.append({"id": block.get("id") or "", "type": "function", "function": fn})
        elif kind == "tool_result" and role == "user":
            messages.extend(_tool_result_messages(block))
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        msg["content"] = parts[0]["text"]
    elif parts:
        msg["content"] = parts  # several blocks: the template input joins them, one line each
    return msg


def chat_messages(turns: Any) -> list[dict[str, Any]]:
    """vLLM's `_convert_messages` (inline system turns kept in place: the template accepts
    them; a template that requires one leading system prompt is not modelled)."""
    messages: list[dict[str, Any]] = []
    for turn in turns or ():
        if not isinstance(turn, dict):
            continue
        role = str(turn.get("role", "user"))
        content = turn.get("content")
        if role == "system":
            text = _system_text(content)
            if text:
                messages.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            msg: dict[str, Any] = {"role": role, "content": content}
        else:
            msg = _convert_blocks(role, content if isinstance(content, list) else [], messages)
        # A user turn of tool results only leaves no message of its own.
        if not (role == "user" and "content" not in msg):
            messages.append(msg)
    return messages


def _reasoning_effort(body: dict[str, Any]) -> Any:
    effort = None
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        # vLLM probes the template for this ("none", or "low" if the template ignores it);
        # "none" is what a template that honours it sees.
        effort = "none"
    config = body.get("output_config")
    if isinstance(config, dict) and config.get("effort") is not None:
        effort = config["effort"]
    return effort


def as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Messages request renders as (vLLM's `to_chat_completion_request`):
    `model`, `messages`, `tools` and the template kwargs the request sets."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    # A top-level system string is kept whole; blocks lose billing headers, as inline turns do.
    system = system if isinstance(system, str) else _system_text(system)
    if system:
        messages.append({"role": "system", "content": system})
    messages.extend(chat_messages(body.get("messages")))
    chat: dict[str, Any] = {"model": body.get("model", ""), "messages": messages}
    tools = chat_tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    effort = _reasoning_effort(body)
    if effort is not None:
        chat["reasoning_effort"] = effort
    if isinstance(body.get("chat_template_kwargs"), dict):
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    return chat
