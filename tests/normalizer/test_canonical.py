"""Canonical bodies: idempotent, semantics-preserving, every rule switchable."""

from __future__ import annotations

import json
import unicodedata

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from normalizer import NormalizeOptions, canonicalize_body
from normalizer.canonical import canonical_arguments, canonical_text

json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)
texts = st.lists(
    st.sampled_from(["a", "b", " ", "\t", "\r", "\n", "\u00e9", "e\u0301", "\u0301", "\u2028", "\u3000", "x"]), max_size=40
).map("".join) | st.text(max_size=40)


def body_with(tools, system: str, arguments: str) -> dict:
    return {
        "model": "m",
        "tools": tools,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
    }


@given(tools=st.lists(json_values, max_size=3), system=texts, args=json_values)
@settings(max_examples=200, deadline=None)
def test_idempotent_and_semantics_preserved(tools, system, args) -> None:
    body = body_with(tools, system, json.dumps(args, indent=2))
    once = canonicalize_body(body)
    assert canonicalize_body(once) == once
    # Tool schemas and tool-call arguments keep their parsed values.
    assert orjson.loads(orjson.dumps(once["tools"])) == tools
    assert orjson.loads(once["messages"][2]["tool_calls"][0]["function"]["arguments"]) == args
    # Non-system messages are untouched; the input is not modified.
    assert once["messages"][1] == body["messages"][1]
    assert body["messages"][0]["content"] == system


@given(system=texts)
@settings(max_examples=300, deadline=None)
def test_system_text_rules(system) -> None:
    out = canonical_text(system)
    assert canonical_text(out) == out
    assert "\r\n" not in out
    assert all(line == line.rstrip() for line in out.split("\n"))
    assert unicodedata.is_normalized("NFC", out)


@given(value=json_values)
@settings(max_examples=200, deadline=None)
def test_reordered_and_rewhitespaced_json_canonicalizes_to_same_bytes(value) -> None:
    a = json.dumps(value, indent=2, sort_keys=False)
    b = json.dumps(value, separators=(",", ":"), sort_keys=True)
    assert canonical_arguments(a) == canonical_arguments(b)


def test_tool_schema_key_order_and_whitespace_give_identical_bytes() -> None:
    schema_a = {"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}}}}
    schema_b = json.loads(json.dumps({"function": {"parameters": {"properties": {"n": {"type": "integer"}, "q": {"type": "string"}}, "type": "object"}, "name": "get"}, "type": "function"}))
    a = body_with([schema_a], "You are helpful.\r\n", '{"a": 1, "b": [1, 2]}')
    b = body_with([schema_b], "You are helpful.  \n", '{"b":[1,2],"a":1}')
    assert orjson.dumps(canonicalize_body(a)) == orjson.dumps(canonicalize_body(b))
    assert orjson.dumps(a) != orjson.dumps(b)


def test_invalid_arguments_left_untouched() -> None:
    assert canonical_arguments('{"a": 1,') == '{"a": 1,'
    assert canonical_arguments("not json") == "not json"
    assert canonical_arguments(7) == 7


def test_each_rule_can_be_switched_off() -> None:
    body = body_with([{"b": 1, "a": 2}], "x  \r\ny", '{"b": 1, "a": 2}')
    off = NormalizeOptions(tool_schemas=False, tool_call_arguments=False, system_prompt=False)
    assert canonicalize_body(body, off) == body
    only_tools = canonicalize_body(body, NormalizeOptions(tool_call_arguments=False, system_prompt=False))
    assert list(only_tools["tools"][0]) == ["a", "b"]
    assert only_tools["messages"][0]["content"] == "x  \r\ny"
    assert only_tools["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"b": 1, "a": 2}'
    only_args = canonicalize_body(body, NormalizeOptions(tool_schemas=False, system_prompt=False))
    assert only_args["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"a":2,"b":1}'
    assert list(only_args["tools"][0]) == ["b", "a"]
    only_system = canonicalize_body(body, NormalizeOptions(tool_schemas=False, tool_call_arguments=False))
    assert only_system["messages"][0]["content"] == "x\ny"


def test_system_content_parts() -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": [{"type": "text", "text": "a \r\nb"}, {"type": "image_url", "image_url": {"url": "u"}}]}]}
    out = canonicalize_body(body)
    assert out["messages"][0]["content"][0]["text"] == "a\nb"
    assert out["messages"][0]["content"][1] == body["messages"][0]["content"][1]
