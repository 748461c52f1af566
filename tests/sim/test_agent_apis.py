"""The simulated worker's agent APIs over loopback HTTP: Responses (store, chaining, events),
Anthropic Messages, tool calls on `auto`, rerank and score — in vLLM's shapes."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest

from loadtests.sim.cluster import SimCluster
from normalizer import anthropic, responses
from normalizer.prefix import chat_segments

MODEL = "sim-llama3-8b"
SYSTEM = "You are a careful assistant that answers briefly. " * 8
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    }
]
ANTHROPIC_TOOLS = [
    {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS
]

pytestmark = pytest.mark.sim_cluster(workers=1, time_scale=0.002, pool=False)


@pytest.fixture
def url(cluster: SimCluster) -> str:
    return cluster.worker_urls["w0"]


def named_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """`event: NAME\\ndata: JSON` blocks; the event name must match the payload's type."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        head, data = block.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: "), block
        payload = orjson.loads(data[len("data: ") :])
        assert payload["type"] == head[len("event: ") :]
        out.append((payload["type"], payload))
    return out


def prompt_tokens(chat: dict[str, Any]) -> int:
    return len(b"".join(chat_segments(chat))) // 4


# -- Responses -----------------------------------------------------------------------------------


def test_response_object_and_token_accounting(url: str) -> None:
    body = {"model": MODEL, "instructions": "Object test. " + SYSTEM, "input": "what is a prefix cache?"}
    r = httpx.post(f"{url}/v1/responses", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"].startswith("resp_") and out["object"] == "response" and out["status"] == "completed"
    assert out["instructions"] == body["instructions"] and out["previous_response_id"] is None
    [item] = out["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"].startswith("msg_")
    [part] = item["content"]
    assert part["type"] == "output_text" and len(part["text"]) == 4 * 32
    usage = out["usage"]
    # The prompt is the shared estimate of the chat request vLLM renders the input as.
    assert usage["input_tokens"] == prompt_tokens(responses.as_chat(body))
    assert usage["output_tokens"] == 32 and usage["total_tokens"] == usage["input_tokens"] + 32
    assert usage["input_tokens_details"]["cached_tokens"] == 0
    got = httpx.get(f"{url}/v1/responses/{out['id']}")
    assert got.status_code == 200 and got.json() == out


def test_chained_response_prepends_the_stored_conversation_and_hits_the_cache(url: str) -> None:
    first = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "instructions": SYSTEM, "input": "first question " * 20})
    prev = first.json()
    body = {"model": MODEL, "instructions": SYSTEM, "input": "and then?", "previous_response_id": prev["id"]}
    second = httpx.post(f"{url}/v1/responses", json=body).json()
    assert second["previous_response_id"] == prev["id"]
    # vLLM's history: this request's instructions, the previous input, its output text, the new input.
    answer = prev["output"][0]["content"][0]["text"]
    history = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "first question " * 20},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "and then?"},
        ]
    }
    assert second["usage"]["input_tokens"] == prompt_tokens(history)
    assert second["usage"]["input_tokens"] > prev["usage"]["input_tokens"]
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= prev["usage"]["input_tokens"] - 16  # the whole first prompt, to the block


def test_unknown_previous_response_and_unstored_ones_are_404(url: str) -> None:
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi there", "previous_response_id": "resp_nope"})
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "Response with id 'resp_nope' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    unstored = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi there", "store": False}).json()
    assert httpx.get(f"{url}/v1/responses/{unstored['id']}").status_code == 404
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": unstored["id"]})
    assert r.status_code == 404
    assert httpx.post(f"{url}/v1/responses/resp_nope/cancel").status_code == 404


def test_cancel_of_a_finished_response_is_400(url: str) -> None:
    done = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hello world"}).json()
    r = httpx.post(f"{url}/v1/responses/{done['id']}/cancel")
    assert r.status_code == 400 and r.json()["error"]["message"] == "Cannot cancel a synchronous response."


def test_response_stream_events_in_vllm_order(url: str) -> None:
    body = {"model": MODEL, "instructions": SYSTEM, "input": "stream it", "stream": True}
    r = httpx.post(f"{url}/v1/responses", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = named_events(r.content)
    kinds = [k for k, _ in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    text = "".join(e["delta"] for k, e in events if k == "response.output_text.delta")
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == text
    assert events[2][1]["item"]["id"] == final["output"][0]["id"]
    assert final["usage"]["output_tokens"] == 32
    # Streamed responses are stored too.
    assert httpx.get(f"{url}/v1/responses/{final['id']}").json()["output"] == final["output"]


def test_response_tool_call_on_auto_then_text_after_the_result(url: str) -> None:
    body = {"model": MODEL, "input": "weather in Paris?", "tools": TOOLS}
    out = httpx.post(f"{url}/v1/responses", json=body).json()
    [call] = out["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert set(orjson.loads(call["arguments"])) >= {"city"}
    follow = {
        "model": MODEL, "tools": TOOLS,
        "input": [
            {"role": "user", "content": "weather in Paris?"},
            {"type": "function_call", "call_id": call["call_id"], "name": call["name"], "arguments": call["arguments"]},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21C"},
        ],
    }  # fmt: skip
    answer = httpx.post(f"{url}/v1/responses", json=follow).json()
    assert [i["type"] for i in answer["output"]] == ["message"]
    none = httpx.post(f"{url}/v1/responses", json={**body, "tool_choice": "none"}).json()
    assert [i["type"] for i in none["output"]] == ["message"]


def test_response_tool_call_stream_events(url: str) -> None:
    body = {"model": MODEL, "input": "weather in Oslo?", "tools": TOOLS, "stream": True}
    events = named_events(httpx.post(f"{url}/v1/responses", json=body).content)
    kinds = [k for k, _ in events]
    n = kinds.count("response.function_call_arguments.delta")
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * n,
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    args = "".join(e["delta"] for k, e in events if k == "response.function_call_arguments.delta")
    assert orjson.loads(args)["city"].startswith("sim-")
    assert events[-1][1]["response"]["output"][0]["arguments"] == args


def test_agent_loop_feeding_output_items_back_runs_and_ends(url: str) -> None:
    """An agent as the Agents SDK runs one: each response's output items go back into the
    next request's input (`to_input_list()`); every user turn is a tool call, then text."""
    items: list[dict[str, Any]] = []
    for turn in range(5):
        items.append({"role": "user", "content": f"turn {turn}: what is the weather?"})
        kinds = []
        for _ in range(3):
            r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "instructions": SYSTEM, "input": items, "tools": TOOLS})
            assert r.status_code == 200, r.text
            output = r.json()["output"]
            items.extend(output)
            kinds.append(output[0]["type"])
            if output[0]["type"] != "function_call":
                break
            call = output[0]
            items.append({"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"})
        assert kinds == ["function_call", "message"]
        assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_openai_sdk_responses(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="sim", max_retries=0)
    first = client.responses.create(model=MODEL, instructions=SYSTEM, input="sdk question " * 10)
    assert first.status == "completed" and first.output_text and first.usage is not None
    stream = client.responses.create(
        model=MODEL, instructions=SYSTEM, input="more", previous_response_id=first.id, stream=True
    )
    kinds, completed = [], None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.completed":
            completed = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert completed is not None and completed.usage is not None
    assert completed.usage.input_tokens_details.cached_tokens > 0
    with client.responses.stream(model=MODEL, input="helper stream") as s:
        final = s.get_final_response()
    assert final.output_text and final.usage is not None and final.usage.output_tokens == 32
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")


# -- Messages ------------------------------------------------------------------------------------


def test_message_object_and_count_tokens(url: str) -> None:
    body = {"model": MODEL, "max_tokens": 9, "system": "Messages test. " + SYSTEM, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{url}/v1/messages", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"].startswith("msg_") and out["type"] == "message" and out["role"] == "assistant"
    assert out["stop_reason"] == "max_tokens" and "stop_sequence" not in out
    [block] = out["content"]
    assert block["type"] == "text" and len(block["text"]) == 4 * 9
    n = prompt_tokens(anthropic.as_chat(body))
    assert out["usage"] == {"input_tokens": n, "output_tokens": 9, "cache_read_input_tokens": 0}
    counted = httpx.post(f"{url}/v1/messages/count_tokens", json=body).json()
    assert counted["input_tokens"] == n
    again = httpx.post(f"{url}/v1/messages", json={**body, "max_tokens": 5}).json()
    usage = again["usage"]
    assert usage["cache_read_input_tokens"] > 0 and usage["input_tokens"] + usage["cache_read_input_tokens"] == n


def test_message_stream_events(url: str) -> None:
    body = {"model": MODEL, "system": SYSTEM, "messages": [{"role": "user", "content": "stream"}], "stream": True}
    events = named_events(httpx.post(f"{url}/v1/messages", json=body).content)
    kinds = [k for k, _ in events]
    n = kinds.count("content_block_delta")
    assert kinds == [
        "message_start", "content_block_start", *["content_block_delta"] * n,
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(e["delta"]["text"] for k, e in events if k == "content_block_delta")
    assert len(text) == 4 * 32
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 32


def test_message_tool_use_on_auto_then_text_after_the_result(url: str) -> None:
    ask = {"role": "user", "content": "weather in Rome?"}
    body = {"model": MODEL, "max_tokens": 64, "tools": ANTHROPIC_TOOLS, "messages": [ask]}
    out = httpx.post(f"{url}/v1/messages", json=body).json()
    assert out["stop_reason"] == "tool_use"
    [use] = out["content"]
    assert use["type"] == "tool_use" and use["name"] == "get_weather" and "city" in use["input"]
    result = {"type": "tool_result", "tool_use_id": use["id"], "content": "rainy"}
    follow = {**body, "messages": [ask, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]}
    answer = httpx.post(f"{url}/v1/messages", json=follow).json()
    assert [b["type"] for b in answer["content"]] == ["text"]
    events = named_events(httpx.post(f"{url}/v1/messages", json={**body, "stream": True}).content)
    block = events[1][1]["content_block"]
    assert block["type"] == "tool_use" and block["input"] == {}
    partial = "".join(e["delta"]["partial_json"] for k, e in events if k == "content_block_delta")
    assert "city" in orjson.loads(partial)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_message_errors_in_anthropic_shape(url: str) -> None:
    r = httpx.post(f"{url}/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": []})
    assert r.status_code == 400
    out = r.json()
    assert out["type"] == "error" and set(out["error"]) == {"type", "message"}
    r = httpx.post(f"{url}/v1/messages", content=b"{not json")
    assert r.status_code == 400 and r.json()["type"] == "error"


# -- chat: tool call on auto ----------------------------------------------------------------------


def test_chat_tool_call_on_auto_then_text(url: str) -> None:
    tools = [{"type": "function", "function": {k: TOOLS[0][k] for k in ("name", "description", "parameters")}}]
    ask = {"role": "user", "content": "weather in Lima?"}
    out = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": [ask], "tools": tools}).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    turn = [ask, choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "warm"}]
    out = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": turn, "tools": tools}).json()
    assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["message"]["content"]


# -- rerank and score ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank(url: str, path: str) -> None:
    docs = ["cats purr", "dogs bark loudly", "fish swim"]
    out = httpx.post(f"{url}{path}", json={"model": MODEL, "query": "pets", "documents": docs, "top_n": 2}).json()
    assert out["model"] == MODEL and out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] > 0
    results = out["results"]
    assert len(results) == 2 and results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert all(docs[r["index"]] == r["document"]["text"] and 0 <= r["relevance_score"] < 1 for r in results)
    again = httpx.post(f"{url}{path}", json={"model": MODEL, "query": "pets", "documents": docs}).json()
    assert len(again["results"]) == 3 and again["results"][:2] == results


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score(url: str, path: str) -> None:
    out = httpx.post(f"{url}{path}", json={"model": MODEL, "text_1": "pets", "text_2": ["cats", "fish"]}).json()
    assert out["object"] == "list" and [d["index"] for d in out["data"]] == [0, 1]
    assert all(d["object"] == "score" and 0 <= d["score"] < 1 for d in out["data"])
    pairs = httpx.post(f"{url}{path}", json={"model": MODEL, "queries": ["pets", "pets"], "documents": ["cats", "fish"]})
    assert [d["score"] for d in pairs.json()["data"]] == [d["score"] for d in out["data"]]
    bad = httpx.post(f"{url}{path}", json={"model": MODEL, "text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code == 400 and "error" in bad.json()


def test_agent_requests_count_in_metrics_and_state(url: str) -> None:
    before = httpx.get(f"{url}/sim/state").json()
    body = {"model": MODEL, "instructions": SYSTEM, "input": "count me"}
    out = httpx.post(f"{url}/v1/responses", json=body).json()
    httpx.post(f"{url}/v1/messages", json={"model": MODEL, "system": SYSTEM, "messages": [{"role": "user", "content": "me"}]})
    after = httpx.get(f"{url}/sim/state").json()
    assert after["requests_total"] == before["requests_total"] + 2
    assert after["finished"] == before["finished"] + 2
    assert after["prefix_queries_tokens"] >= before["prefix_queries_tokens"] + out["usage"]["input_tokens"]


@pytest.mark.parametrize(
    "body",
    [
        {"input": "hi there", "tools": [{"type": "function"}], "tool_choice": "required"},
        {"input": "hi there", "tools": [{"type": "function", "name": "a"}], "tool_choice": {"type": "function", "name": "b"}},
        {"input": "hi there", "background": True},
        {"input": ""},
        {"input": {"a": 1}},
        {"input": "hi there", "max_output_tokens": 0},
    ],
)
def test_bad_responses_bodies_are_400_in_openai_shape(url: str, body: dict[str, Any]) -> None:
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_nameless_function_tool_is_not_called_on_auto(url: str) -> None:
    body = {"model": MODEL, "input": "hi there", "tools": [{"type": "function"}, TOOLS[0]]}
    out = httpx.post(f"{url}/v1/responses", json=body).json()
    assert out["output"][0]["name"] == "get_weather"
