"""Prefix keys: a hash chain over the canonical request.

Key 0 covers the model and the tool schemas; key i covers key i-1 plus message i (for
`/v1/completions`, plus the i-th fixed-size chunk of the prompt). Turn N+1 of a
conversation resends turn N's messages and appends to them, so its chain extends turn N's
and the longest shared run of keys says how much of the prompt a worker already holds.

The same segment rendering doubles as the simulated engine's "chat template", so the
router's token estimates and the simulator's cache accounting agree byte for byte.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, NewType

import orjson

from normalizer.tokens import CHARS_PER_TOKEN

PrefixKey = NewType("PrefixKey", int)
"""64-bit hash identifying a whole prefix (everything up to and including one segment)."""

COMPLETION_CHUNK_TOKENS = 64
COMPLETION_CHUNK_BYTES = COMPLETION_CHUNK_TOKENS * CHARS_PER_TOKEN


@dataclass(frozen=True, slots=True)
class PrefixChain:
    keys: tuple[PrefixKey, ...]
    cum_tokens: tuple[int, ...]
    """Estimated prompt tokens covered by keys[0..i] (whole tokens)."""
    total_tokens: int
    reply_depth: int = 0
    """Keys before the request's last assistant message: the prompt of the turn whose
    answer that message is, so a worker holding this many keys served the conversation's
    previous turn (0: the request carries no model output, e.g. a new session)."""

    def tokens_at_depth(self, depth: int) -> int:
        """Tokens covered by the first `depth` keys."""
        if depth <= 0:
            return 0
        return self.cum_tokens[min(depth, len(self.cum_tokens)) - 1]

    def __len__(self) -> int:
        return len(self.keys)


def _text_of(content: Any) -> bytes:
    if content is None:
        return b""
    if isinstance(content, str):
        return content.encode()
    # Multi-part content: keep the parts' order and values; images etc. render as JSON.
    return orjson.dumps(content)


def render_message(msg: Any) -> bytes:
    """Render one message the way a chat template would: fields by name, not dict order."""
    if not isinstance(msg, dict):
        return orjson.dumps(msg)
    parts = [b"<|", str(msg.get("role", "")).encode(), b"|>", _text_of(msg.get("content"))]
    if msg.get("name") is not None:
        parts += [b"<|name|>", str(msg["name"]).encode()]
    for call in msg.get("tool_calls") or ():
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments", "")
        parts += [
            b"<|tool_call|>",
            str(fn.get("name", "")).encode(),
            args.encode() if isinstance(args, str) else orjson.dumps(args),
        ]
    if msg.get("tool_call_id") is not None:
        parts += [b"<|tool_result|>", str(msg["tool_call_id"]).encode()]
    parts.append(b"<|end|>\n")
    return b"".join(parts)


def render_tools(tools: Any) -> bytes:
    """Tools as the template's `tools | tojson` would emit them: key order as given."""
    if not tools:
        return b""
    return b"<|tools|>" + orjson.dumps(tools) + b"<|end|>\n"


def chat_segments(body: dict[str, Any]) -> list[bytes]:
    """The rendered prompt of a chat request, as [tools, message 1, message 2, ...]."""
    segments = [render_tools(body.get("tools") or body.get("functions"))]
    messages = body.get("messages")
    if isinstance(messages, list):
        segments.extend(render_message(m) for m in messages)
    return segments


def reply_segment(body: dict[str, Any]) -> int | None:
    """Index in `chat_segments(body)` of the last assistant message, if there is one."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if isinstance(m, dict) and m.get("role") == "assistant":
            return i + 1  # segment 0 is the tools
    return None


def completion_segments(body: dict[str, Any]) -> list[bytes]:
    """The prompt of a completions request in fixed-size chunks (first segment empty)."""
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            # Token ids: one id is one token; pack them so that chunk sizes still count tokens.
            # Masked to 32 bits: vocabularies fit, and negative ids keep their two's-complement bytes.
            data = b"".join((t & 0xFFFFFFFF).to_bytes(CHARS_PER_TOKEN, "little") for t in prompt)
        else:
            data = b"\x00".join(_text_of(p) for p in prompt)
    else:
        data = _text_of(prompt)
    chunks = [data[i : i + COMPLETION_CHUNK_BYTES] for i in range(0, len(data), COMPLETION_CHUNK_BYTES)]
    return [b"", *chunks]


def _digest(parent: bytes, segment: bytes) -> bytes:
    return hashlib.blake2b(segment, digest_size=8, key=parent).digest()


def prefix_chain(model: str, segments: list[bytes], reply_at: int | None = None) -> PrefixChain:
    """Hash the segments once, each chained to its predecessor.

    `reply_at`: index of the segment holding the last model answer (`reply_segment()`).
    """
    keys: list[PrefixKey] = []
    cum: list[int] = []
    parent = hashlib.blake2b(model.encode(), digest_size=8).digest()
    total_bytes = 0
    for segment in segments:
        parent = _digest(parent, segment)
        total_bytes += len(segment)
        keys.append(PrefixKey(int.from_bytes(parent, "big")))
        cum.append(total_bytes // CHARS_PER_TOKEN)
    reply_depth = reply_at if reply_at is not None else 0
    return PrefixChain(tuple(keys), tuple(cum), total_bytes // CHARS_PER_TOKEN, reply_depth)
