"""Prefix chains: turn N+1 extends turn N; keys depend on every byte before them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from normalizer import (
    canonicalize_body,
    chat_segments,
    completion_segments,
    estimate_tokens,
    prefix_chain,
)

messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.text(max_size=50)}),
    min_size=1,
    max_size=6,
)


def chain_of(body: dict):
    return prefix_chain(body["model"], chat_segments(body))


@given(first=messages, more=messages)
@settings(max_examples=150, deadline=None)
def test_next_turn_extends_the_chain(first, more) -> None:
    turn1 = {"model": "m", "messages": first}
    turn2 = {"model": "m", "messages": first + more}
    a, b = chain_of(turn1), chain_of(turn2)
    assert b.keys[: len(a.keys)] == a.keys
    assert b.cum_tokens[: len(a.cum_tokens)] == a.cum_tokens
    assert list(b.cum_tokens) == sorted(b.cum_tokens)
    assert b.total_tokens == estimate_tokens(b"".join(chat_segments(turn2)))


@given(msgs=messages, i=st.integers(0, 5))
@settings(max_examples=150, deadline=None)
def test_changing_a_message_changes_its_key_and_all_after(msgs, i) -> None:
    i = i % len(msgs)
    changed = [dict(m) for m in msgs]
    changed[i]["content"] = changed[i]["content"] + "!"
    a = chain_of({"model": "m", "messages": msgs})
    b = chain_of({"model": "m", "messages": changed})
    # Key 0 is the tools segment; message i is key i+1.
    assert a.keys[: i + 1] == b.keys[: i + 1]
    assert all(x != y for x, y in zip(a.keys[i + 1 :], b.keys[i + 1 :], strict=True))


def test_model_and_tools_are_part_of_the_chain() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    base = chain_of({"model": "m", "messages": msgs})
    assert chain_of({"model": "other", "messages": msgs}).keys[0] != base.keys[0]
    with_tools = chain_of({"model": "m", "messages": msgs, "tools": [{"type": "function"}]})
    assert with_tools.keys[0] != base.keys[0]


def test_message_key_order_does_not_matter() -> None:
    a = chain_of({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    b = chain_of({"model": "m", "messages": [{"content": "x", "role": "user"}]})
    assert a.keys == b.keys


def test_canonical_tools_hash_equal() -> None:
    t1 = [{"type": "function", "function": {"name": "f", "parameters": {"a": 1, "b": 2}}}]
    t2 = [{"function": {"parameters": {"b": 2, "a": 1}, "name": "f"}, "type": "function"}]
    msgs = [{"role": "user", "content": "x"}]
    raw1 = chain_of({"model": "m", "tools": t1, "messages": msgs})
    raw2 = chain_of({"model": "m", "tools": t2, "messages": msgs})
    assert raw1.keys[0] != raw2.keys[0]  # what a non-canonicalizing router would see
    c1 = chain_of(canonicalize_body({"model": "m", "tools": t1, "messages": msgs}))
    c2 = chain_of(canonicalize_body({"model": "m", "tools": t2, "messages": msgs}))
    assert c1.keys == c2.keys


@given(text=st.text(min_size=0, max_size=2000), extra=st.text(min_size=1, max_size=600))
@settings(max_examples=100, deadline=None)
def test_completion_chunks_extend(text, extra) -> None:
    a = prefix_chain("m", completion_segments({"prompt": text}))
    b = prefix_chain("m", completion_segments({"prompt": text + extra}))
    full_chunks = len(text.encode()) // 256
    assert b.keys[: 1 + full_chunks] == a.keys[: 1 + full_chunks]


def test_completion_token_ids() -> None:
    chain = prefix_chain("m", completion_segments({"prompt": list(range(200))}))
    assert chain.total_tokens == 200
    assert len(chain.keys) == 1 + 4  # head + ceil(200 / 64)


def test_completion_token_ids_beyond_int32() -> None:
    big = prefix_chain("m", completion_segments({"prompt": [2**31 + 5, 2**32 - 1, 7]}))
    assert big.total_tokens == 3
