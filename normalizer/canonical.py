"""Canonical request bodies.

Agent frameworks resend the same system prompt and tool schemas every turn, but different
SDKs (and different turns of the same SDK) serialise them with different key order and
whitespace. Chat templates render tools with `tojson` without sorting, so those byte
differences become token differences and every prefix-cache lookup misses. These rules
remove differences that carry no meaning; the router forwards the result so the engine's
own prefix cache sees the same bytes the router hashed.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

import orjson

SYSTEM_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True)
class NormalizeOptions:
    """Each rule can be switched off on its own (`--no-normalize-*`)."""

    tool_schemas: bool = True
    tool_call_arguments: bool = True
    system_prompt: bool = True

    @property
    def any(self) -> bool:
        return self.tool_schemas or self.tool_call_arguments or self.system_prompt


def canonical_json(value: Any) -> bytes:
    """Compact JSON with object keys sorted at every depth."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def sort_keys_deep(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: sort_keys_deep(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [sort_keys_deep(v) for v in value]
    return value


def canonical_arguments(arguments: Any) -> Any:
    """Re-serialise a tool call's `arguments` string canonically when it is valid JSON.

    Anything else (truncated JSON from a model, a non-string) is left untouched: changing
    it could change what the model sees, and we only remove differences without meaning.
    """
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    return canonical_json(parsed).decode()


def canonical_text(text: str) -> str:
    """NFC, LF line ends, no trailing whitespace on any line."""
    text = unicodedata.normalize("NFC", text)
    # Splitting on LF and stripping each line also turns CRLF (and stray CRs before LF) into LF.
    lines = text.split("\n")
    return "\n".join(line.rstrip() for line in lines)


def _canonical_content(content: Any) -> Any:
    if isinstance(content, str):
        return canonical_text(content)
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                part = {**part, "text": canonical_text(part["text"])}
            out.append(part)
        return out
    return content


def _canonical_tool_calls(tool_calls: Any) -> Any:
    if not isinstance(tool_calls, list):
        return tool_calls
    out = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and "arguments" in fn:
            call = {**call, "function": {**fn, "arguments": canonical_arguments(fn["arguments"])}}
        out.append(call)
    return out


def canonicalize_body(body: dict[str, Any], options: NormalizeOptions = NormalizeOptions()) -> dict[str, Any]:
    """Return a canonical copy of an OpenAI chat/completions request body.

    Idempotent, and it changes no parsed JSON value except the whitespace of system text.
    The input is not modified.
    """
    if not options.any:
        return body
    out = dict(body)
    if options.tool_schemas:
        for field in ("tools", "functions"):
            if isinstance(out.get(field), list):
                out[field] = sort_keys_deep(out[field])
    messages = out.get("messages")
    if isinstance(messages, list) and (options.system_prompt or options.tool_call_arguments):
        new_messages = []
        for msg in messages:
            if isinstance(msg, dict):
                if options.system_prompt and msg.get("role") in SYSTEM_ROLES and "content" in msg:
                    msg = {**msg, "content": _canonical_content(msg["content"])}
                if options.tool_call_arguments and "tool_calls" in msg:
                    msg = {**msg, "tool_calls": _canonical_tool_calls(msg["tool_calls"])}
            new_messages.append(msg)
        out["messages"] = new_messages
    return out
