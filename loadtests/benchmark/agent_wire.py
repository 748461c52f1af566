"""A scenario's chat requests as the agent APIs send them, and those APIs' streams read back.

`kvroute bench --scenario NAME --api responses|messages` plays the same conversations as
`--api chat`, each request resending the whole conversation, in the wire form of
`POST /v1/responses` (OpenAI Responses: `instructions`, `input` items, flat function tools)
or `POST /v1/messages` (Anthropic Messages: `system`, content blocks, `input_schema` tools).

Each API's stream is read by a `StreamReader`: it folds one parsed SSE event into the
request's record (usage, cached tokens, errors) and says whether the event carries content,
the first of which is the request's TTFT: a chat `delta` with content or tool calls,
`response.output_text.delta` / `response.function_call_arguments.delta`, or Anthropic
`content_block_delta`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loadtests.benchmark.harness import RequestRecord

SCENARIO_API_PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}

StreamReader = Callable[[dict[str, Any], "RequestRecord"], bool]
"""Folds one parsed stream event into the record; True when the event carries content."""

Convert = Callable[[dict[str, Any]], dict[str, Any]]


# -- requests ---------------------------------------------------------------------------------


def _text(content: Any) -> str:
    """A chat message's content as text (the workload writes strings; parts are joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _system_text(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """The system prompt (system messages joined) and the rest of the conversation."""
    system = [_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
    rest = [m for m in messages if m.get("role") not in ("system", "developer")]
    return ("\n".join(system) if system else None), rest


def responses_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat `{"type": "function", "function": {...}}` as the Responses API's flat form,
    the function's own keys in the client's order."""
    return [{"type": "function", **t["function"]} for t in tools if t.get("type") == "function"]


def responses_input(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (no system) as Responses input items, as an agent loop resends them."""
    items: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": _text(m.get("content"))})
            continue
        text = _text(m.get("content"))
        if role == "assistant":
            if text:
                items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]})
            for call in m.get("tool_calls") or ():
                fn = call["function"]
                items.append({"type": "function_call", "call_id": call["id"], "name": fn["name"], "arguments": fn["arguments"]})
            continue
        items.append({"type": "message", "role": role, "content": text})
    return items


def to_responses(chat: dict[str, Any]) -> dict[str, Any]:
    """The `/v1/responses` body of a chat-completions body (stream on, nothing stored:
    the bench resends the whole conversation each turn, as the chat form does)."""
    system, rest = _system_text(chat["messages"])
    body: dict[str, Any] = {"model": chat["model"]}
    if system is not None:
        body["instructions"] = system
    body["input"] = responses_input(rest)
    if chat.get("tools"):
        body["tools"] = responses_tools(chat["tools"])
    body["stream"] = True
    body["store"] = False
    if chat.get("max_tokens") is not None:
        body["max_output_tokens"] = chat["max_tokens"]
    if "temperature" in chat:
        body["temperature"] = chat["temperature"]
    return body


def messages_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for t in tools:
        fn = t.get("function") or {}
        tool: dict[str, Any] = {"name": fn["name"]}
        if "description" in fn:
            tool["description"] = fn["description"]
        tool["input_schema"] = fn.get("parameters") or {"type": "object", "properties": {}}
        out.append(tool)
    return out


def _blocks(m: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """One chat message as an Anthropic role and its content blocks."""
    if m.get("role") == "tool":
        block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": _text(m.get("content"))}
        return "user", [block]
    text = _text(m.get("content"))
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for call in m.get("tool_calls") or ():
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": json.loads(fn["arguments"] or "{}")})
    return ("assistant" if m.get("role") == "assistant" else "user"), blocks


def messages_list(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (no system) as Anthropic messages: tool results become `tool_result`
    blocks of a user turn, and consecutive turns of one role merge (the API alternates)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, blocks = _blocks(m)
        if not blocks:
            continue
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})
    for m in out:
        # A lone text block is sent as a plain string, the form most clients use.
        if len(m["content"]) == 1 and m["content"][0]["type"] == "text":
            m["content"] = m["content"][0]["text"]
    return out


def to_messages(chat: dict[str, Any]) -> dict[str, Any]:
    """The `/v1/messages` body of a chat-completions body (stream on)."""
    system, rest = _system_text(chat["messages"])
    body: dict[str, Any] = {"model": chat["model"], "max_tokens": chat.get("max_tokens") or 1024}
    if system is not None:
        body["system"] = system
    body["messages"] = messages_list(rest)
    if chat.get("tools"):
        body["tools"] = messages_tools(chat["tools"])
    body["stream"] = True
    if "temperature" in chat:
        body["temperature"] = chat["temperature"]
    return body


# -- streams ----------------------------------------------------------------------------------


def chat_event(obj: dict[str, Any], record: RequestRecord) -> bool:
    if "error" in obj:
        record.error = str(obj["error"])[:200]
    usage = obj.get("usage")
    if usage:
        record.completion_tokens = int(usage.get("completion_tokens") or 0)
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = int(details.get("cached_tokens") or 0)
    content = False
    for choice in obj.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or choice.get("text"):
            content = True
    return content


_RESPONSES_CONTENT = frozenset({"response.output_text.delta", "response.function_call_arguments.delta"})


def responses_event(obj: dict[str, Any], record: RequestRecord) -> bool:
    kind = obj.get("type")
    if kind in _RESPONSES_CONTENT:
        return bool(obj.get("delta"))
    if kind == "error":
        record.error = str(obj.get("message") or obj.get("error") or obj)[:200]
    elif kind in ("response.failed", "response.incomplete", "response.completed"):
        response = obj.get("response") or {}
        if kind == "response.failed":
            record.error = str(response.get("error") or "response.failed")[:200]
        usage = response.get("usage")
        if usage:
            record.prompt_tokens = int(usage.get("input_tokens") or 0)
            record.completion_tokens = int(usage.get("output_tokens") or 0)
            details = usage.get("input_tokens_details") or {}
            record.cached_tokens = int(details.get("cached_tokens") or 0)
    return False


def _anthropic_usage(usage: dict[str, Any], record: RequestRecord) -> None:
    # `input_tokens` excludes the tokens read from (and written to) the prompt cache.
    if "input_tokens" in usage or "cache_read_input_tokens" in usage:
        cached = int(usage.get("cache_read_input_tokens") or 0)
        written = int(usage.get("cache_creation_input_tokens") or 0)
        record.prompt_tokens = int(usage.get("input_tokens") or 0) + cached + written
        record.cached_tokens = cached
    if "output_tokens" in usage:
        record.completion_tokens = int(usage.get("output_tokens") or 0)


def messages_event(obj: dict[str, Any], record: RequestRecord) -> bool:
    kind = obj.get("type")
    if kind == "content_block_delta":
        delta = obj.get("delta") or {}
        return bool(delta.get("text") or delta.get("partial_json") or delta.get("thinking"))
    if kind == "message_start":
        _anthropic_usage((obj.get("message") or {}).get("usage") or {}, record)
    elif kind == "message_delta":
        _anthropic_usage(obj.get("usage") or {}, record)
    elif kind == "error":
        record.error = str(obj.get("error") or obj)[:200]
    return False


def _same(chat: dict[str, Any]) -> dict[str, Any]:
    return chat


WIRE: dict[str, tuple[str, Convert, StreamReader]] = {
    "chat": (SCENARIO_API_PATHS["chat"], _same, chat_event),
    "responses": (SCENARIO_API_PATHS["responses"], to_responses, responses_event),
    "messages": (SCENARIO_API_PATHS["messages"], to_messages, messages_event),
}
"""API name: (path, the request body from the chat body, the stream reader)."""
