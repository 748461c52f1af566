"""Prefix keys: a hash chain over the canonical request.

The rendered prompt is a list of segments: the model's tool schemas, then one per message
(for `/v1/completions`, the prompt). The router's estimate chain cuts each segment into
blocks of `BLOCK_TOKENS` estimated tokens from the segment's own start, the last one
shorter (`segment_blocks`), and `prefix_chain` gives every block a key that hashes the key
before it and the block's bytes: a key names everything up to the end of its block. Key 0
covers the model and the tools (an empty segment is still one block, so key 0 is always
the tools).

Blocks, not whole messages: two prompts that share a long document or system prompt inside
one message and differ only at its end share every full block before the difference in
vLLM's prefix cache, and with one key per message they shared nothing for the router
(issue 13: trace replayers and RAG send one big user message). Blocks restart at each
segment's boundary so that turn N+1, which resends turn N's messages and appends to them,
still has turn N's whole chain as its prefix (turn N's last, partial block included): the
longest shared run of keys says how much of the prompt a worker already holds, to within
one block of where two prompts diverge.

The same segment rendering doubles as the simulated engine's "chat template", so the
router's token estimates and the simulator's cache accounting agree byte for byte.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any, NewType, cast

import orjson

from normalizer.tokens import CHARS_PER_TOKEN

PrefixKey = NewType("PrefixKey", int)
"""64-bit hash identifying a whole prefix (everything up to and including one block)."""

BLOCK_TOKENS = 64
"""Estimated tokens per key: a 32k-token prompt is about 512 keys (lookup cost and Redis
memory per block measured in docs/redis.md)."""
BLOCK_BYTES = BLOCK_TOKENS * CHARS_PER_TOKEN


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
    """The prompt of a completions request in blocks (`BLOCK_BYTES`; first segment empty)."""
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            # Token ids: one id is one token; pack them so that block sizes still count tokens.
            # Masked to 32 bits: vocabularies fit, and negative ids keep their two's-complement bytes.
            data = b"".join((t & 0xFFFFFFFF).to_bytes(CHARS_PER_TOKEN, "little") for t in prompt)
        else:
            data = b"\x00".join(_text_of(p) for p in prompt)
    else:
        data = _text_of(prompt)
    return [b"", *(data[i : i + BLOCK_BYTES] for i in range(0, len(data), BLOCK_BYTES))]


def segment_blocks(segments: list[bytes], reply_at: int | None = None) -> tuple[list[bytes], int]:
    """Each segment cut into `BLOCK_BYTES` blocks from its own start (an empty one stays one
    empty block), and the index of the first block of segment `reply_at` (0 if None)."""
    blocks: list[bytes] = []
    reply_block = 0
    for i, segment in enumerate(segments):
        if i == reply_at:
            reply_block = len(blocks)
        if len(segment) <= BLOCK_BYTES:  # most messages: one block, no copy
            blocks.append(segment)
        else:
            blocks.extend(segment[start : start + BLOCK_BYTES] for start in range(0, len(segment), BLOCK_BYTES))
    return blocks, reply_block


def chain_seed(model: str, cache_salt: str | None = None) -> bytes:
    """What key 0 chains from: the model, and the request's `cache_salt` if it has one.

    vLLM mixes `cache_salt` into a prompt's first block, so requests with different salts
    share no block; seeding the chain with it keeps the index from predicting hits across
    salts (tenants' cache scopes, router/tenants/salt.py), while equal salts share keys."""
    if not cache_salt:
        return model.encode()
    return model.encode() + b"\x00cache_salt\x00" + cache_salt.encode()


def prefix_chain(
    model: str, segments: list[bytes], reply_at: int | None = None, cache_salt: str | None = None
) -> PrefixChain:
    """Hash the segments once, each chained to its predecessor: one key per segment.

    `reply_at`: index of the segment where the last model answer starts (`reply_segment()`).
    `cache_salt`: the request's vLLM cache salt, which seeds the chain (`chain_seed`).
    """
    digests: list[bytes] = []
    cum: list[int] = []
    blake2b = hashlib.blake2b
    parent = blake2b(chain_seed(model, cache_salt), digest_size=8).digest()
    total_bytes = 0
    for segment in segments:
        parent = blake2b(segment, digest_size=8, key=parent).digest()
        digests.append(parent)
        total_bytes += len(segment)
        cum.append(total_bytes // CHARS_PER_TOKEN)
    # One unpack for all keys: converting digest by digest cost a third of a long chain's time.
    keys = cast("tuple[PrefixKey, ...]", struct.unpack(f">{len(digests)}Q", b"".join(digests)))
    return PrefixChain(keys, tuple(cum), total_bytes // CHARS_PER_TOKEN, reply_at or 0)
