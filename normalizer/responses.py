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


def _text_of_parts(content: Any) -> Any:
    """Message content as chat content: text parts joined, anything else kept as parts."""
    if not isinstance(content, list):
        return content
    texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in _TEXT_PARTS]
    if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
        return "".join(texts)  # type: ignore[arg-type]
    return content


def chat_tools(tools: Any) -> list[Any] | None:
    """Responses function tools as chat tools; built-in tools (web search, ...) as given."""
    if not isinstance(tools, list) or not tools:
        return None
    out: list[Any] = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "function" and "function" not in tool:
            fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            out.append({"type": "function", "function": fn})
        else:
            out.append(tool)
    return out


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        return ""
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def _append_item(messages: list[dict[str, Any]], item: Any) -> None:
    if not isinstance(item, dict):
        messages.append({"role": "user", "content": item})
        return
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {
            "id": item.get("call_id", item.get("id", "")),
            "type": "function",
            "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")},
        }
        last = messages[-1] if messages else None
        if last is not None and last.get("role") == "assistant" and not last.get("content"):
            # Parallel calls of one turn: one assistant message, as the model produced them.
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": item.get("output", "")})
    elif kind == "reasoning":
        messages.append({"role": "assistant", "content": None, "reasoning": _reasoning_text(item)})
    else:
        messages.append({"role": str(item.get("role", "user")), "content": _text_of_parts(item.get("content"))})


def as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request a Responses request renders as: `model`, `messages`, `tools`."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            _append_item(messages, item)
    chat: dict[str, Any] = {"model": body.get("model", ""), "messages": messages}
    tools = chat_tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    return chat
