"""The Anthropic SDK's tools, sent twice with their keys in different orders, reach the
worker as identical bytes: kvroute forwards the canonical body, so a worker's
prefix cache sees one prompt however the client happened to order its JSON. The recording
upstream stands in for the worker, because only it can show the bytes it received.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.upstream import RecordingUpstream

pytestmark = pytest.mark.router_process(policy="cache_aware")

TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]},
}


def _reversed(value: Any) -> Any:
    """The same JSON value with every object's keys in reverse order (lists keep theirs)."""
    if isinstance(value, dict):
        return {k: _reversed(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reversed(v) for v in value]
    return value


@pytest.fixture(scope="module")
def router_workers(upstream: RecordingUpstream) -> dict[str, str]:
    return {"rec": upstream.url}


def test_tools_in_another_key_order_reach_the_worker_as_the_same_bytes(router: Any, upstream: RecordingUpstream) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=router.url, api_key="sk-ant-test", max_retries=0)
    def history(call_input: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "tu_1", "name": "get_weather", "input": call_input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "sunny"}]},
        ]

    call = {"city": "Paris", "unit": "C"}
    sent = []
    # The tools' keys (the JSON schema's too) and the tool call's input in another order:
    # both are rendered into the prompt as JSON text.
    for tools, messages in (([TOOL], history(call)), ([_reversed(TOOL)], history(_reversed(call)))):
        start = len(upstream.received)
        reply = client.messages.create(model=upstream.model, max_tokens=8, system="terse", tools=tools, messages=messages)
        assert reply.content[0].text == "ok"
        forwarded = [r for r in upstream.received[start:] if r.path == "/v1/messages"]
        assert len(forwarded) == 1
        sent.append(forwarded[0].body)
    assert b'"input_schema"' in sent[0]
    assert sent[0] == sent[1]
