"""Parsing and validating client requests: parse once, reject bad input with a clear 4xx."""

from __future__ import annotations

from typing import Any

import orjson

from router.chain import RequestKind
from router.errors import RouterError


def _bad(message: str, code: str) -> RouterError:
    return RouterError(400, message, code)


def parse_body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise _bad("The request body is empty; expected a JSON object.", "empty_body")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"The request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.", "invalid_body")
    return body


def _check_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise _bad("Missing required parameter: 'model'.", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string.", "invalid_type")
    return model


def validate(body: dict[str, Any], kind: RequestKind | None, model_optional: bool = False) -> str:
    """Check the fields the router itself relies on; the worker validates the rest.

    Returns the model ("" when it is optional and absent: any worker may serve it)."""
    model = "" if model_optional and body.get("model") is None else _check_model(body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean.", "invalid_type")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string.", "invalid_type")
    if kind == "chat":
        _check_messages(_messages(body))
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise _bad("'tools' must be an array.", "invalid_type")
    elif kind == "completion":
        # Not part of a completions request, but the normalizer reads it if present.
        if isinstance(body.get("messages"), list):
            _check_messages(body["messages"])
        prompt = body.get("prompt")
        if prompt is None:
            raise _bad("Missing required parameter: 'prompt'.", "missing_required_parameter")
        if not isinstance(prompt, str | list) or (isinstance(prompt, list) and not prompt):
            raise _bad("'prompt' must be a string or a non-empty array.", "invalid_type")
    elif kind == "responses":
        _check_responses(body)
    elif kind == "messages":
        _check_anthropic(body)
    return model


def _check_tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise _bad("'tools' must be an array of objects.", "invalid_type")


def _check_responses(body: dict[str, Any]) -> None:
    """A Responses request: `input` a string or an array of items (objects)."""
    data = body.get("input")
    if data is None:
        raise _bad("Missing required parameter: 'input'.", "missing_required_parameter")
    if not isinstance(data, str) and not (isinstance(data, list) and all(isinstance(i, dict) for i in data)):
        raise _bad("'input' must be a string or an array of objects.", "invalid_type")
    if isinstance(data, list):
        for i, item in enumerate(data):
            _check_strings(item, f"input[{i}]", ("type", "role"))
    for name in ("instructions", "previous_response_id"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise _bad(f"'{name}' must be a string.", "invalid_type")
    _check_tools(body)


def _check_strings(obj: dict[str, Any], where: str, names: tuple[str, ...]) -> None:
    """The discriminating fields the normalizer branches on, when present, are strings."""
    for name in names:
        value = obj.get(name)
        if value is not None and not isinstance(value, str):
            raise _bad(f"'{where}.{name}' must be a string.", "invalid_type")


def _check_anthropic(body: dict[str, Any]) -> None:
    """An Anthropic Messages request: `messages`, `max_tokens` (required by Anthropic), `system`."""
    for i, msg in enumerate(_messages(body)):
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise _bad(f"'messages[{i}]' must be an object whose 'role' is 'user' or 'assistant'.", "invalid_type")
        content = msg.get("content")
        if isinstance(content, list):
            for j, block in enumerate(content):
                if isinstance(block, dict):
                    _check_strings(block, f"messages[{i}].content[{j}]", ("type",))
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise _bad("Missing required parameter: 'max_tokens'.", "missing_required_parameter")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise _bad("'max_tokens' must be an integer.", "invalid_type")
    system = body.get("system")
    if system is not None and not isinstance(system, str) and not (
        isinstance(system, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in system)
    ):
        raise _bad("'system' must be a string or an array of text blocks.", "invalid_type")
    _check_tools(body)


def _messages(body: dict[str, Any]) -> list[Any]:
    """The required, non-empty `messages` array (chat and Anthropic Messages)."""
    messages = body.get("messages")
    if messages is None:
        raise _bad("Missing required parameter: 'messages'.", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array.", "invalid_type")
    return messages


def _check_messages(messages: list[Any]) -> None:
    """The message shape the normalizer and the prefix-key builder rely on."""
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise _bad(f"'messages[{i}]' must be an object with a string 'role'.", "invalid_type")
        tool_calls = msg.get("tool_calls")
        if tool_calls is None:
            continue
        if not isinstance(tool_calls, list):
            raise _bad(f"'messages[{i}].tool_calls' must be an array.", "invalid_type")
        for j, call in enumerate(tool_calls):
            if not isinstance(call, dict) or not isinstance(call.get("function", {}), dict):
                raise _bad(f"'messages[{i}].tool_calls[{j}]' must be an object whose 'function' is an object.", "invalid_type")
