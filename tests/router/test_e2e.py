"""End to end through the official openai SDK: router in front of simulated vLLM workers."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from loadtests.measure.affinity import SHARED_SYSTEM, own_system, run_conversations, shared_system
from loadtests.sim.cluster import SimCluster
from loadtests.sim.engine import BLOCK_SIZE
from loadtests.support.routerproc import RouterProcess
from normalizer.tokens import CHARS_PER_TOKEN
from router.workers import parse_vllm_gauges

MODEL = "sim-llama3-8b"

pytestmark = pytest.mark.sim_cluster(workers=3, time_scale=0.02)


def test_conversations_stay_on_their_worker_and_load_spreads(cluster) -> None:
    with RouterProcess(cluster.worker_urls, policy="cache_aware") as router:
        result = asyncio.run(run_conversations(router.url, own_system))
    assert sum(result.served.values()) == 80
    assert result.affinity >= 0.95, result
    assert result.max_over_mean <= 1.5, result


def test_shared_system_prompt_does_not_pile_onto_one_worker(cluster) -> None:
    with RouterProcess(cluster.worker_urls, policy="cache_aware") as router:
        result = asyncio.run(run_conversations(router.url, shared_system))
    # Piling would put all 80 turns on the worker holding the prompt. The cap is 1.5x the
    # mean of decayed recent counts (0.5 of 3 workers) plus one request, scaled by the
    # worker's learned speed once there is one (a few percent either way on identical
    # workers), so a worker may end a turn or two past 40 of 80 (41 seen in CI): no pile.
    assert result.max_share <= 0.55, result
    assert result.reasons.get("gpu_hit", 0) >= 60, result
    # No continuing turn prefills the shared prompt again: every one lands on a worker
    # holding it (the simulator counts CHARS_PER_TOKEN bytes a token, cached in blocks).
    assert min(result.later_cached) >= len(SHARED_SYSTEM) // CHARS_PER_TOKEN // BLOCK_SIZE * BLOCK_SIZE, result
    # Conversations stay while the router sees no queue. The 20 send their turns in
    # lockstep, and on a CPU shared with other tests the requests overlap and queue in the
    # router's view: the policy then moves a turn that gains more than an engine step
    # elsewhere, recomputing only the conversation's own turns (above). Measured: 1.0
    # unloaded and 0.90-1.0 beside 8 CPU hogs here; 0.77 once in CI; at the simulator's
    # real speed, where the same bursts queue without contention, 0.85-1.0, and 0.60-0.90
    # beside the hogs. A policy that lost conversations would be near 1/3 (random).
    assert result.affinity >= 0.6, result


def _payloads(lines: list[str]) -> list[dict | str]:
    out: list[dict | str] = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            out.append(data)
            continue
        chunk = json.loads(data)
        chunk.pop("id", None)  # request ids and timestamps differ per request by design
        chunk.pop("created", None)
        out.append(chunk)
    return out


def test_streaming_payloads_equal_the_workers_own(cluster) -> None:
    body = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 12,
        "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Tell me a story."}],
    }
    with RouterProcess(cluster.worker_urls, policy="cache_aware") as router:
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            worker = r.headers["x-kvroute-worker"]
            via_router = list(r.iter_lines())
    with httpx.stream("POST", cluster.worker_urls[worker] + "/v1/chat/completions", json=body) as r:
        direct = list(r.iter_lines())
    a, b = _payloads(via_router), _payloads(direct)
    assert len(a) > 5 and a[-1] == "[DONE]"
    # Usage differs only in cached tokens: the direct request hit the cache the first one filled.
    for chunk in (a[-2], b[-2]):
        chunk["usage"].pop("prompt_tokens_details", None)
    assert a == b


def test_sdk_chat_streaming_and_tool_calls(cluster) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    with RouterProcess(cluster.worker_urls, policy="cache_aware") as router:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
        models = [m.id for m in client.models.list().data]
        assert models == [MODEL]

        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert reply.choices[0].message.content
        assert reply.usage.completion_tokens == 5

        text = "".join(
            (c.choices[0].delta.content or "")
            for c in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=7, stream=True)
            if c.choices
        )
        assert text == reply.choices[0].message.content or len(text) > 0

        call = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools, tool_choice="required"
        )
        tool_call = call.choices[0].message.tool_calls[0]
        assert call.choices[0].finish_reason == "tool_calls"
        assert tool_call.function.name == "get_weather"
        assert "city" in json.loads(tool_call.function.arguments)

        streamed = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools, tool_choice="required", stream=True
        )
        args = "".join(
            tc.function.arguments or "" for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])
        )
        assert "city" in json.loads(args)

        completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
        assert completion.choices[0].text

        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        assert err.value.body["code"] == "model_not_found"


def test_only_workers_serving_the_model_are_candidates() -> None:
    with SimCluster(workers=1, time_scale=0.01, model="model-a") as a, SimCluster(workers=1, time_scale=0.01, model="model-b") as b:
        workers = {"a0": a.worker_urls["w0"], "b0": b.worker_urls["w0"]}
        with RouterProcess(workers, policy="round_robin") as router:
            models = httpx.get(router.url + "/v1/models").json()["data"]
            assert sorted(m["id"] for m in models) == ["model-a", "model-b"]
            for _ in range(4):
                r = httpx.post(router.url + "/v1/chat/completions", json={"model": "model-b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
                assert r.status_code == 200 and r.headers["x-kvroute-worker"] == "b0"


def test_scraped_engine_queue_steers_least_loaded() -> None:
    """Load that reaches a worker around the router shows up through its /metrics."""
    with SimCluster(workers=2, time_scale=1.0) as c:
        args = ["--scrape-metrics", "--health-interval-s", "0.2"]
        with RouterProcess(c.worker_urls, policy="least_loaded", extra_args=args) as router:
            busy = c.worker_urls["w0"]

            async def flood() -> list[str]:
                async with httpx.AsyncClient(timeout=60) as client:
                    body = {"model": MODEL, "messages": [{"role": "user", "content": "long " * 30_000}], "max_tokens": 1}
                    tasks = [asyncio.create_task(client.post(busy + "/v1/chat/completions", json=body)) for _ in range(12)]
                    deadline = asyncio.get_running_loop().time() + 30
                    while asyncio.get_running_loop().time() < deadline:
                        gauges = parse_vllm_gauges((await client.get(busy + "/metrics")).text)
                        if gauges.get("vllm:num_requests_waiting", 0) >= 2:
                            break
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(1.0)  # several health rounds (0.2 s) scrape the queue
                    picks = []
                    for _ in range(4):
                        r = await client.post(router.url + "/v1/chat/completions",
                                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                        picks.append(r.headers["x-kvroute-worker"])
                    for t in tasks:
                        t.cancel()
                    return picks

            picks = asyncio.run(flood())
    assert picks == ["w1"] * 4
