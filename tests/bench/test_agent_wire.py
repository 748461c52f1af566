"""`kvroute bench --api responses|messages`: a scenario's conversations in the agent APIs'
wire forms, and those APIs' streams read back into request records.

The conversions are checked against the normalizer's own reading of each API (`as_chat`,
what the router and vLLM render the request as): the same conversation must come back. The
stream readers are run on the simulated workers' real streams (no router in between).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from typing import Any

import orjson
import pytest

from loadtests.benchmark.agent_wire import (
    WIRE,
    messages_event,
    responses_event,
    to_messages,
    to_responses,
)
from loadtests.benchmark.harness import RequestRecord, _stream_one, sse_data
from loadtests.benchmark.workload import SCENARIOS, Conversation, make_group, make_session
from normalizer import anthropic, responses
from router.proxy.upstream import RawUpstreamClient

pytestmark = pytest.mark.sim_cluster(workers=1, time_scale=0.05, pool=False, extra_args=["--auto-tool-calls", "text"])


def _bodies(index: int) -> list[dict[str, Any]]:
    """Every request body of session `index` of `seed` (tools, tool calls, tool results)."""
    scenario = SCENARIOS["seed"]
    session = make_session(1, scenario, index)
    group = make_group(1, scenario, session.group) if session.group is not None else None
    return [body for _, body in Conversation(session, group).bodies()]


def _agent_session() -> list[dict[str, Any]]:
    for i in range(40):
        bodies = _bodies(i)
        if bodies[0].get("tools") and any(m["role"] == "tool" for m in bodies[-1]["messages"]):
            return bodies
    raise AssertionError("no seed session with tool turns")


def _comparable(messages: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Role, text and tool calls (arguments parsed: Anthropic sends them as objects)."""
    out = []
    for m in messages:
        calls = tuple((c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls") or ())
        out.append((m["role"], m.get("content") or None, calls, m.get("tool_call_id")))
    return out


@pytest.mark.parametrize(("convert", "reader"), [(to_responses, responses.as_chat), (to_messages, anthropic.as_chat)])
def test_the_conversation_reads_back_the_same(convert: Any, reader: Any) -> None:
    for chat in _agent_session():
        body = convert(chat)
        back = reader(body)
        assert _comparable(back["messages"]) == _comparable(chat["messages"])
        assert back["tools"] == [{"type": "function", "function": t["function"]} for t in chat["tools"]]
        assert body["stream"] is True


def test_responses_body_shape() -> None:
    chat = _agent_session()[-1]
    body = to_responses(chat)
    assert body["instructions"] == chat["messages"][0]["content"]
    kinds = {item["type"] for item in body["input"]}
    assert kinds == {"message", "function_call", "function_call_output"}
    assert all("function" not in t and t["type"] == "function" and "parameters" in t for t in body["tools"])
    # The tool's keys keep the client's order (the router canonicalizes them, not the bench).
    assert [list(t) for t in body["tools"]] == [["type", *t["function"]] for t in chat["tools"]]
    assert body["max_output_tokens"] == chat["max_tokens"] and body["store"] is False
    assert "messages" not in body and "max_tokens" not in body


def test_messages_body_shape() -> None:
    chat = _agent_session()[-1]
    body = to_messages(chat)
    assert body["system"] == chat["messages"][0]["content"]
    assert body["max_tokens"] == chat["max_tokens"]
    roles = [m["role"] for m in body["messages"]]
    assert all(a != b for a, b in itertools.pairwise(roles)), "roles must alternate"
    blocks = [b for m in body["messages"] if isinstance(m["content"], list) for b in m["content"]]
    assert {b["type"] for b in blocks} >= {"tool_use", "tool_result"}
    assert all(isinstance(b["input"], dict) for b in blocks if b["type"] == "tool_use")
    assert all(set(t) == {"name", "description", "input_schema"} for t in body["tools"])


def test_sse_data_reads_both_framings() -> None:
    assert sse_data(b'data: {"a": 1}') == b'{"a": 1}'
    assert sse_data(b'event: response.created\ndata: {"a": 1}') == b'{"a": 1}'
    assert sse_data(b": keep-alive") is None


def test_readers_take_usage_and_errors() -> None:
    r = RequestRecord(0, 0, "x", True, 0.0)
    usage = {"input_tokens": 90, "output_tokens": 7, "input_tokens_details": {"cached_tokens": 64}}
    assert responses_event({"type": "response.output_text.delta", "delta": "hi"}, r)
    assert not responses_event({"type": "response.output_text.delta", "delta": ""}, r)
    assert not responses_event({"type": "response.completed", "response": {"usage": usage}}, r)
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.error) == (90, 7, 64, None)
    responses_event({"type": "response.failed", "response": {"error": {"code": "server_error"}}}, r)
    assert r.error is not None and "server_error" in r.error

    m = RequestRecord(0, 0, "x", True, 0.0)
    start = {"usage": {"input_tokens": 26, "cache_read_input_tokens": 64, "output_tokens": 0}}
    assert not messages_event({"type": "message_start", "message": start}, m)
    assert messages_event({"type": "content_block_delta", "delta": {"type": "input_json_delta", "partial_json": "{"}}, m)
    assert not messages_event({"type": "message_delta", "usage": {"output_tokens": 5}}, m)
    assert (m.prompt_tokens, m.cached_tokens, m.completion_tokens, m.error) == (90, 64, 5, None)
    messages_event({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}, m)
    assert m.error is not None and "overloaded_error" in m.error


async def _send(url: str, api: str, chat: dict[str, Any]) -> RequestRecord:
    path, convert, reader = WIRE[api]
    record = RequestRecord(0, 0, "x", True, 0.0)
    client = RawUpstreamClient(connect_timeout_s=10.0, keepalive_expiry_s=10.0)
    try:
        headers = [(b"content-type", b"application/json")]
        loop = asyncio.get_running_loop()
        await _stream_one(client, url, path, orjson.dumps(convert(chat)), headers, record, loop.time(), 1.0, [math.inf], reader)
    finally:
        await client.aclose()
    return record


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_a_simulated_workers_stream_reads_into_the_record(cluster: Any, api: str) -> None:
    url = next(iter(cluster.worker_urls.values()))
    chat = _agent_session()[2]
    # A conversation of its own per API (the module's worker is shared), cold after the
    # shared system prompt and tools.
    messages = [dict(m) for m in chat["messages"]]
    user = next(m for m in messages if m["role"] == "user")
    user["content"] = f"[{api}] {user['content']}"
    chat = {**chat, "messages": messages, "max_tokens": 6}
    first = asyncio.run(_send(url, api, chat))
    again = asyncio.run(_send(url, api, chat))
    for r in (first, again):
        assert r.status == 200 and r.error is None, r.error
        assert r.ttft_s is not None and r.ttft_s > 0
        assert r.completion_tokens == 6
        assert r.prompt_tokens > 1000  # the whole conversation, system prompt and tools included
    # The same request again is served from the worker's cache, and the API reports it.
    assert first.prompt_tokens == again.prompt_tokens
    assert again.cached_tokens > first.cached_tokens
