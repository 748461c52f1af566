"""Canonical request bodies and prefix keys. Everything here is a pure function."""

from normalizer.canonical import NormalizeOptions, canonical_json, canonicalize_body
from normalizer.prefix import (
    PrefixChain,
    PrefixKey,
    chat_segments,
    completion_segments,
    prefix_chain,
)
from normalizer.tokens import CHARS_PER_TOKEN, estimate_tokens

__all__ = [
    "CHARS_PER_TOKEN",
    "NormalizeOptions",
    "PrefixChain",
    "PrefixKey",
    "canonical_json",
    "canonicalize_body",
    "chat_segments",
    "completion_segments",
    "estimate_tokens",
    "prefix_chain",
]
