"""Block-granular estimate keys: prompts that share a long run inside one
message share every full block of it; turn N+1 still extends turn N's chain."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cache_client.base import key_tokens_of
from cache_client.memory import MemoryIndex
from normalizer import canonicalize_body
from normalizer.prefix import BLOCK_BYTES, BLOCK_TOKENS, chat_segments
from router.chain import EstimateChainBuilder

BUILD = EstimateChainBuilder()
DOCUMENT = "".join(f"Section {i}: the parties agree to the terms set out below. " for i in range(700))


def _chat(*messages: dict, **extra: object) -> dict:
    return {"model": "m", "messages": list(messages), **extra}


def _shared_depth(a: dict, b: dict) -> int:
    index = MemoryIndex()
    ca = BUILD.build(a, "chat")
    index.record_sync("w", ca.keys, key_tokens_of(ca.cum_tokens))
    return index.lookup_sync(BUILD.build(b, "chat").keys).depth("w")


def test_one_message_prompts_sharing_a_document_share_all_its_full_blocks() -> None:
    a = _chat({"role": "user", "content": DOCUMENT + "Question: who signs first?"})
    b = _chat({"role": "user", "content": DOCUMENT + "Question: when does it end?"})
    differ_at = len(b"<|user|>" + DOCUMENT.encode() + b"Question: w")
    full_blocks = differ_at // BLOCK_BYTES
    assert full_blocks > 100  # a ~40 kB document: what one key per message shared was 1 key
    depth = _shared_depth(a, b)
    assert depth == 1 + full_blocks  # the tools key, then every full block before the difference
    chain = BUILD.build(b, "chat")
    assert chain.tokens_at_depth(depth) == full_blocks * BLOCK_TOKENS
    assert chain.cum_tokens[-1] == chain.total_tokens == len(b"".join(chat_segments(b))) // 4


def test_canonicalization_comes_before_the_blocks() -> None:
    tools_a = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    tools_b = [{"function": {"parameters": {"properties": {}, "type": "object"}, "name": "f"}, "type": "function"}]
    a = canonicalize_body(_chat({"role": "user", "content": DOCUMENT}, tools=tools_a))
    b = canonicalize_body(_chat({"role": "user", "content": DOCUMENT}, tools=tools_b))
    assert BUILD.build(a, "chat").keys == BUILD.build(b, "chat").keys


long_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": st.text(max_size=1200)}
    ),
    min_size=1,
    max_size=5,
)


@given(first=long_messages, more=long_messages)
@settings(max_examples=100, deadline=None)
def test_next_turn_extends_the_whole_chain_partial_blocks_included(first, more) -> None:
    a, b = BUILD.build(_chat(*first), "chat"), BUILD.build(_chat(*first, *more), "chat")
    assert b.keys[: len(a.keys)] == a.keys
    assert b.cum_tokens[: len(a.cum_tokens)] == a.cum_tokens
    assert list(b.cum_tokens) == sorted(b.cum_tokens)
    assert all(y - x <= BLOCK_TOKENS for x, y in zip((0, *b.cum_tokens), b.cum_tokens, strict=False))


def test_reply_depth_is_the_previous_turns_whole_chain() -> None:
    turn1 = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Summarise." * 50}]
    turn2 = [*turn1, {"role": "assistant", "content": "It is a contract. " * 40}, {"role": "user", "content": "More."}]
    previous, current = BUILD.build(_chat(*turn1), "chat"), BUILD.build(_chat(*turn2), "chat")
    assert current.reply_depth == len(previous.keys) > 100
    assert BUILD.build(_chat(*turn1), "chat").reply_depth == 0
