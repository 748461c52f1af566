"""The simulated worker through real loopback HTTP: OpenAI shapes, SDK, metrics, errors."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import orjson
import pytest

from loadtests.sim.cluster import SimCluster
from loadtests.sim.costs import build_cost_model
from normalizer.prefix import chat_segments, completion_segments

MODEL = "sim-llama3-8b"

pytestmark = pytest.mark.sim_cluster(workers=2, time_scale=0.002, pool=False)


@pytest.fixture
def url(cluster: SimCluster) -> str:
    return cluster.worker_urls["w0"]


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": content}],
        **extra,
    }


def sse_events(raw: bytes) -> list[Any]:
    assert raw.endswith(b"data: [DONE]\n\n")
    out: list[Any] = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def test_chat_completion_shape_and_token_accounting(url: str) -> None:
    body = chat_body("count my tokens please", max_tokens=7)
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == MODEL
    assert out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    # The prompt is tokenized exactly as received: 4 bytes of the rendered segments each.
    expected_prompt = len(b"".join(chat_segments(body))) // 4
    assert out["usage"]["prompt_tokens"] == expected_prompt
    assert out["usage"]["completion_tokens"] == 7
    assert out["usage"]["total_tokens"] == expected_prompt + 7
    assert len(choice["message"]["content"]) == 7 * 4
    # Same request again: same text, and its whole-block prefix comes from the GPU cache.
    again = httpx.post(f"{url}/v1/chat/completions", json=body).json()
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (expected_prompt - 1) // 16 * 16


def test_prompt_is_not_canonicalized(url: str) -> None:
    # Key order of a tool schema changes what the engine sees, so the cache misses.
    tool_a = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    tool_b = {"function": {"parameters": {"properties": {}, "type": "object"}, "name": "f"}, "type": "function"}
    first = httpx.post(f"{url}/v1/chat/completions", json=chat_body("hi", tools=[tool_a], max_tokens=1)).json()
    second = httpx.post(f"{url}/v1/chat/completions", json=chat_body("hi", tools=[tool_b], max_tokens=1)).json()
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_chat_stream_matches_vllm_shape(url: str) -> None:
    body = chat_body("stream to me", max_tokens=5, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks if c["choices"] and "content" in c["choices"][0]["delta"]][1:]
    assert "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    # Without include_usage no usage chunk is sent.
    body.pop("stream_options")
    raw = httpx.post(f"{url}/v1/chat/completions", json=body).content
    assert all(e == "[DONE]" or e["choices"] for e in sse_events(raw))


def test_completions_stream_and_not(url: str) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time " * 30, "max_tokens": 4}
    out = httpx.post(f"{url}/v1/completions", json=body).json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["usage"]["prompt_tokens"] == len(b"".join(completion_segments(body))) // 4
    assert out["choices"][0]["finish_reason"] == "length" and len(out["choices"][0]["text"]) == 16
    raw = httpx.post(
        f"{url}/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ).content
    events = sse_events(raw)
    texts = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert texts == out["choices"][0]["text"]
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_default_max_tokens_stops(url: str) -> None:
    out = httpx.post(f"{url}/v1/chat/completions", json=chat_body("no limit given")).json()
    assert out["usage"]["completion_tokens"] == 32
    assert out["choices"][0]["finish_reason"] == "stop"


def test_errors_are_openai_shaped(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat_body("x"), "model": "nope"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == 404 and "nope" in err["message"]
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x" * 40, "max_tokens": 0})
    assert r.status_code == 400
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x" * 4 * 200_000, "max_tokens": 1})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_models_health_and_version(url: str) -> None:
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(f"{url}/health").status_code == 200
    assert "version" in httpx.get(f"{url}/version").json()


def test_openai_sdk_text_and_stream(cluster: SimCluster) -> None:
    client = openai.OpenAI(base_url=cluster.worker_urls["w1"] + "/v1", api_key="sim", max_retries=0)
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello sdk"}], max_completion_tokens=6
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello sdk"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == resp.choices[0].message.content
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (resp.usage.prompt_tokens - 1) // 16 * 16
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_openai_sdk_tool_calls(cluster: SimCluster) -> None:
    client = openai.OpenAI(base_url=cluster.worker_urls["w1"] + "/v1", api_key="sim", max_retries=0)
    messages: Any = [{"role": "user", "content": "weather in Paris?"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    args = json.loads(calls[0].function.arguments)
    assert isinstance(args["city"], str) and args["unit"] == "celsius" and isinstance(args["days"], int)
    # Deterministic: the same request gives the same arguments.
    again = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], tool_choice="required")
    assert again.choices[0].message.tool_calls[0].function.arguments == calls[0].function.arguments  # type: ignore[index]

    named: Any = {"type": "function", "function": {"name": "get_time"}}
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], tool_choice=named, stream=True)
    name, arguments, ids, finish = None, "", set(), None
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        for call in (delta.tool_calls or []) if delta else []:
            assert call.index == 0
            if call.id:
                ids.add(call.id)
            if call.function and call.function.name:
                name = call.function.name
            if call.function and call.function.arguments:
                arguments += call.function.arguments
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert name == "get_time" and json.loads(arguments) == {} and len(ids) == 1 and finish == "tool_calls"

    # With tool_choice "auto" (the default) the simulated model calls the first tool after a
    # user turn, answers in text after the tool's result, and never calls one on "none".
    auto = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK])
    [auto_call] = auto.choices[0].message.tool_calls or []
    assert auto_call.function.name == "get_weather" and auto.choices[0].finish_reason == "tool_calls"
    messages += [auto.choices[0].message.model_dump(), {"role": "tool", "tool_call_id": auto_call.id, "content": "sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=3)
    assert answer.choices[0].message.tool_calls in (None, []) and answer.choices[0].message.content
    none = client.chat.completions.create(model=MODEL, messages=messages[:1], tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.tool_calls in (None, []) and none.choices[0].finish_reason == "stop"


def test_metrics_count_tokens_hits_and_ttft(cluster: SimCluster) -> None:
    url = cluster.worker_urls["w1"]
    before = httpx.get(f"{url}/metrics").text
    body = chat_body("metrics " * 50, max_tokens=3)
    prompt = len(b"".join(chat_segments(body))) // 4
    for _ in range(2):
        assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200
    after = httpx.get(f"{url}/metrics").text

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert delta("vllm:prompt_tokens_total") == 2 * prompt
    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:prefix_cache_queries_total") == 2 * prompt
    assert delta("vllm:prefix_cache_hits_total") == (prompt - 1) // 16 * 16
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:request_success_total") == 2
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "vllm:num_requests_waiting") == 0
    assert 'vllm:cache_config_info{block_size="16"' in after
    # TTFT is in simulated seconds, whatever the time scale: on an idle worker, exactly the
    # duration of the steps the cost model charges (a cold prefill, then a cached one).
    cost = build_cost_model("h200-llama3-8b")
    hit = (prompt - 1) // 16 * 16
    expected = cost.step_s([(0, prompt)], []) + cost.step_s([(hit, prompt)], [])
    assert delta("vllm:time_to_first_token_seconds_sum") == pytest.approx(expected, rel=1e-9)


def test_tokenize_and_render_agree_with_usage(url: str) -> None:
    body = chat_body("tokenize me")
    toks = httpx.post(f"{url}/tokenize", json=body).json()
    render = httpx.post(f"{url}/v1/chat/completions/render", json=body).json()
    usage = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 1}).json()["usage"]
    assert toks["count"] == len(toks["tokens"]) == usage["prompt_tokens"] == len(render["token_ids"])
    assert toks["tokens"] == render["token_ids"]
    assert toks["max_model_len"] > 0
    # Token ids sent back as a completions prompt are the same bytes, so the cache hits.
    out = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": toks["tokens"], "max_tokens": 1}).json()
    assert out["usage"]["prompt_tokens"] == toks["count"]


def test_probes_other_routers_make_at_start_up(url: str) -> None:
    models = httpx.get(f"{url}/v1/models").json()["data"]
    assert models[0]["owned_by"] == "vllm"  # smg's backend detection
    info = httpx.get(f"{url}/server_info").json()
    assert info["model_id"] == MODEL and info["dp_size"] == 1 and info["tp_size"] == 1
    assert httpx.get(f"{url}/get_server_info").json() == info
    model_info = httpx.get(f"{url}/model_info").json()
    assert model_info["is_generation"] is True and model_info["architectures"]
    load = httpx.get(f"{url}/get_load").json()
    assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 0
    assert httpx.get(f"{url}/kv_event_sources").status_code == 404  # no --kv-events here


def test_non_ascii_token_ids_round_trip(url: str) -> None:
    text = "Grüße aus Köln, 世界 — ça va? " * 8
    toks = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
    assert any(t >= 2**31 for t in toks) and all(0 <= t < 2**32 for t in toks)
    back = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": toks}).json()["prompt"]
    assert back.encode() == text.encode()[: len(toks) * 4]
    first = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1}).json()
    again = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": toks, "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"] == len(toks)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(toks) - 1) // 16 * 16


async def test_async_cluster_context_manager() -> None:
    async with SimCluster(workers=1, time_scale=0.002, pool=False) as c, httpx.AsyncClient() as client:
        r = await client.post(f"{c.worker_urls['w0']}/v1/completions", json={"model": MODEL, "prompt": "x" * 64})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32
    assert c.proc is None
