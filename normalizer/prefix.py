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
(trace replayers and RAG send one big user message). Blocks restart at each
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
from typing import Any, NewType, TypeAlias, cast

import orjson

from normalizer.media import Media, MediaReader
from normalizer.tokens import CHARS_PER_TOKEN

PrefixKey = NewType("PrefixKey", int)
"""64-bit hash identifying a whole prefix (everything up to and including one block)."""

BLOCK_TOKENS = 64
"""Estimated tokens per key: a 32k-token prompt is about 512 keys (lookup cost and Redis
memory per block measured in docs/redis.md)."""
BLOCK_BYTES = BLOCK_TOKENS * CHARS_PER_TOKEN

Segment: TypeAlias = "bytes | Media"
"""A piece of the rendered prompt: text (four bytes a token), or one image, audio clip or
video, which is one element of the chain however many tokens it counts (`normalizer.media`)."""
MEDIA_PART_TYPES = frozenset({"image_url", "input_image", "image", "input_audio", "audio_url", "video_url"})


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
    fallback: bool = False
    """An estimate chain standing in for an exact one (precise mode could not tokenize the
    request: images, say): no KV event will name its keys, so the router records it where
    it sends it, as in estimate mode."""

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
    return _head(msg) + _text_of(msg.get("content")) + _tail(msg)


def _head(msg: dict[str, Any]) -> bytes:
    return b"<|" + str(msg.get("role", "")).encode() + b"|>"


def _tail(msg: dict[str, Any]) -> bytes:
    parts = []
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


def message_segments(msg: Any, model: str, media: MediaReader) -> list[Segment]:
    """A message as segments: its text, with each media part an element of its own (text
    parts between media keep their JSON rendering, as `render_message` renders them)."""
    content = msg.get("content") if isinstance(msg, dict) else None
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and isinstance(p.get("type"), str) and p["type"] in MEDIA_PART_TYPES for p in content
    ):
        return [render_message(msg)]
    out: list[Segment] = []
    text = bytearray(_head(msg))
    run: list[Any] = []
    for part in content:
        element = media.media(part, model) if isinstance(part, dict) else None
        if element is None:
            run.append(part)
            continue
        if run:
            text += orjson.dumps(run)
            run = []
        if text:
            out.append(bytes(text))
            text = bytearray()
        out.append(element)
    if run:
        text += orjson.dumps(run)
    out.append(bytes(text + _tail(msg)))
    return out


def render_tools(tools: Any) -> bytes:
    """Tools as the template's `tools | tojson` would emit them: key order as given."""
    if not tools:
        return b""
    return b"<|tools|>" + orjson.dumps(tools) + b"<|end|>\n"


def chat_prompt(body: dict[str, Any], media: MediaReader | None = None) -> tuple[list[Segment], int | None]:
    """The rendered prompt of a chat request, as [tools, message 1, message 2, ...] (a
    message with media parts is several segments: `message_segments`), and the index of
    the segment where the last assistant message starts, if there is one. Without `media`,
    media parts render as the JSON they are (a prompt's bytes, as before media had keys)."""
    segments: list[Segment] = [render_tools(body.get("tools") or body.get("functions"))]
    reply_at = None
    messages = body.get("messages")
    if isinstance(messages, list):
        model = str(body.get("model", ""))
        for m in messages:
            if isinstance(m, dict) and m.get("role") == "assistant":
                reply_at = len(segments)
            if media is None:
                segments.append(render_message(m))
            else:
                segments.extend(message_segments(m, model, media))
    return segments, reply_at


def chat_segments(body: dict[str, Any], media: MediaReader | None = None) -> list[Segment]:
    """The rendered prompt of a chat request (`chat_prompt`)."""
    return chat_prompt(body, media)[0]


def reply_segment(body: dict[str, Any]) -> int | None:
    """Index in `chat_segments(body)` of the last assistant message, if there is one."""
    return chat_prompt(body)[1]


def prompt_bytes(segments: list[Segment]) -> bytes:
    """The prompt as bytes, each media element as its placeholder (`Media.placeholder`):
    where a prompt is handled as bytes, it counts the element's tokens."""
    return b"".join(s if type(s) is bytes else s.placeholder() for s in segments)  # type: ignore[union-attr]


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


def segment_blocks(segments: list[Segment], reply_at: int | None = None) -> tuple[list[Segment], int]:
    """Each segment cut into `BLOCK_BYTES` blocks from its own start (an empty one stays one
    empty block; a media element is one block), and the index of the first block of segment
    `reply_at` (0 if None)."""
    blocks: list[Segment] = []
    reply_block = 0
    for i, segment in enumerate(segments):
        if i == reply_at:
            reply_block = len(blocks)
        if type(segment) is not bytes or len(segment) <= BLOCK_BYTES:  # most messages: one block, no copy
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
    model: str, segments: list[Segment], reply_at: int | None = None, cache_salt: str | None = None
) -> PrefixChain:
    """Hash the segments once, each chained to its predecessor: one key per segment.

    `reply_at`: index of the segment where the last model answer starts (`reply_segment()`).
    `cache_salt`: the request's vLLM cache salt, which seeds the chain (`chain_seed`).
    """
    digests: list[bytes] = []
    cum: list[int] = []
    blake2b = hashlib.blake2b
    parent = blake2b(chain_seed(model, cache_salt), digest_size=8).digest()
    total_bytes = media_tokens = 0
    for segment in segments:
        if type(segment) is bytes:
            parent = blake2b(segment, digest_size=8, key=parent).digest()
            total_bytes += len(segment)
        else:  # one media element: keyed by its content's digest, counted as its model does
            parent = blake2b(_MEDIA + segment.digest, digest_size=8, key=parent).digest()  # type: ignore[union-attr]
            media_tokens += segment.tokens  # type: ignore[union-attr]
        digests.append(parent)
        cum.append(total_bytes // CHARS_PER_TOKEN + media_tokens)
    # One unpack for all keys: converting digest by digest cost a third of a long chain's time.
    keys = cast("tuple[PrefixKey, ...]", struct.unpack(f">{len(digests)}Q", b"".join(digests)))
    return PrefixChain(keys, tuple(cum), total_bytes // CHARS_PER_TOKEN + media_tokens, reply_at or 0)


_MEDIA = b"\x00media\x00"
