"""From a canonical request body to its prefix-key chain.

`EstimateChainBuilder` (the default) hashes the rendered prompt in blocks of 64 estimated
tokens that restart at each message (`normalizer.prefix.segment_blocks`), at four bytes a
token; the router records each routed chain in the index itself. Precise mode
(`router/precise/`) tokenizes with the model's own tokenizer and reproduces vLLM's block
hashes, and its index is fed by the workers' KV events instead.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from normalizer import anthropic, responses
from normalizer.media import Media, MediaReader
from normalizer.prefix import (
    PrefixChain,
    chat_prompt,
    completion_segments,
    prefix_chain,
    segment_blocks,
)

RequestKind = Literal["chat", "completion", "responses", "messages"]
"""What a proxied request's prompt is: a chat request, a completions prompt, an OpenAI
Responses request or an Anthropic Messages request (the last two read as the chat request
vLLM renders them as, `chat_form`)."""

_AS_CHAT = {"responses": responses.as_chat, "messages": anthropic.as_chat}


def chat_form(body: dict[str, Any], kind: RequestKind) -> dict[str, Any]:
    """The chat request whose rendering is the prompt of `body` (completions: none, the body)."""
    as_chat = _AS_CHAT.get(kind)
    return body if as_chat is None else as_chat(body)


class ChainBuilder(Protocol):
    records_on_route: bool
    """Whether the router records the chain on the chosen worker after routing (estimate
    mode), or the workers' KV events keep the index (precise mode)."""

    def build(self, body: dict[str, Any], kind: RequestKind) -> PrefixChain: ...


class EstimateChainBuilder:
    records_on_route = True

    def __init__(self, media: MediaReader | None = None) -> None:
        self.media = media if media is not None else MediaReader()
        """Turns images, audio and video into one chain element each (normalizer/media.py)."""

    def build(self, body: dict[str, Any], kind: RequestKind) -> PrefixChain:
        model = str(body.get("model", ""))
        salt = cache_salt_of(body)  # read before chat_form, which keeps only the prompt
        if kind != "completion":
            body = chat_form(body, kind)
            blocks, reply_block = segment_blocks(*chat_prompt(body, self.media))
            return prefix_chain(model, blocks, reply_block or None, salt)
        return prefix_chain(model, completion_segments(body), cache_salt=salt)


def media_elements(body: dict[str, Any], kind: RequestKind, media: MediaReader) -> list[Media]:
    """The images, audio and video of a request's prompt, in order, as the chain counts them."""
    if kind == "completion":
        return []
    segments, _ = chat_prompt(chat_form(body, kind), media)
    return [s for s in segments if isinstance(s, Media)]


def cache_salt_of(body: dict[str, Any]) -> str | None:
    """The request's vLLM `cache_salt` (with tenants, always the router's own)."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None
