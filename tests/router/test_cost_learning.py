"""Cost learning end to end: a router in front of simulated workers of different
speeds learns each one's cost from its answers; `--cost-learning off` keeps the static ones.
Ratios only, with wide margins: no timing thresholds (CI machines are busy)."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from loadtests.benchmark.harness import parse_prometheus
from loadtests.support.routerproc import RouterProcess

TOKEN = "admin-token-for-tests-cost"
AUTH = {"authorization": "Bearer " + TOKEN}

pytestmark = [
    pytest.mark.sim_cluster(workers=2, time_scale=0.5, pool=False, speeds=[1.0, 0.5]),
    pytest.mark.router_process(policy="round_robin", env={"KVROUTE_ADMIN_TOKEN": TOKEN}),
]


def send(client: httpx.Client, model: str, rng: random.Random, n: int) -> None:
    """`n` streamed chats of 1k-12k new tokens each, one at a time (no queue)."""
    for _ in range(n):
        words = rng.randint(250, 3000)  # a word of 16 bytes ~ 4 estimated tokens
        text = " ".join(f"w{rng.randrange(10**12):012d}" for _ in range(words))
        body = {
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2,
            "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            for _ in resp.iter_bytes():
                pass


def learned(client: httpx.Client) -> dict[str, dict[str, float]]:
    parsed = parse_prometheus(client.get("/metrics").text)
    out: dict[str, dict[str, float]] = {}
    for labels, value in parsed.get("kvroute_cost_coefficient", []):
        out.setdefault(labels["worker"], {})[labels["coefficient"]] = value
    for labels, value in parsed.get("kvroute_cost_observations_total", []):
        out.setdefault(labels["worker"], {})["observations"] = value
    return out


def test_a_half_speed_worker_learns_twice_the_cost(router: Any, cluster: Any) -> None:
    with httpx.Client(base_url=router.url, trust_env=False, timeout=60) as client:
        send(client, cluster.model, random.Random(15), 48)
        costs = learned(client)
        assert costs["w0"]["observations"] >= 20 and costs["w1"]["observations"] >= 20

        def per_token(w: str) -> float:
            return costs[w]["prefill_base_s"] + costs[w]["prefill_ctx_s"] * 4096

        assert 1.4 < per_token("w1") / per_token("w0") < 2.8
        probe = {"model": cluster.model, "messages": [{"role": "user", "content": "probe"}]}
        route = client.post("/debug/route", json=probe, headers=AUTH).json()
        assert route["cost_learning"] is True


def test_agent_api_streams_teach_the_costs_too(cluster: Any) -> None:
    """The Agents SDK streams `/v1/responses` (opened by `response.created` before any
    prefill: timed at its first output item) and Anthropic clients `/v1/messages` (usage as
    `cache_read_input_tokens`): a fleet serving only those learns each worker's cost."""
    import anthropic
    import openai

    rng = random.Random(17)

    def prompt() -> str:
        return " ".join(f"w{rng.randrange(10**12):012d}" for _ in range(rng.randint(250, 3000)))

    with RouterProcess(cluster.worker_urls, "round_robin") as r:
        oai = openai.OpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0)
        claude = anthropic.Anthropic(base_url=r.url, api_key="unused", max_retries=0)
        for _ in range(24):
            events = list(oai.responses.create(model=cluster.model, input=prompt(), max_output_tokens=2, stream=True))
            assert events[-1].type == "response.completed"
            with claude.messages.stream(model=cluster.model, max_tokens=2, messages=[{"role": "user", "content": prompt()}]) as stream:
                assert stream.get_final_message().usage.output_tokens >= 1
        with httpx.Client(base_url=r.url, trust_env=False, timeout=60) as client:
            costs = learned(client)
    assert costs["w0"]["observations"] >= 20 and costs["w1"]["observations"] >= 20

    def per_token(w: str) -> float:
        return costs[w]["prefill_base_s"] + costs[w]["prefill_ctx_s"] * 4096

    # Timed from the Responses stream's first byte instead, both would look alike and cheap.
    assert 1.4 < per_token("w1") / per_token("w0") < 2.8


def test_cost_learning_off_keeps_the_static_costs(cluster: Any) -> None:
    with RouterProcess(cluster.worker_urls, "cache_aware", ["--cost-learning", "off"], env={"KVROUTE_ADMIN_TOKEN": TOKEN}) as r:
        with httpx.Client(base_url=r.url, trust_env=False, timeout=60) as client:
            send(client, cluster.model, random.Random(16), 16)
            assert learned(client) == {}
            probe = {"model": cluster.model, "messages": [{"role": "user", "content": "probe"}]}
            route = client.post("/debug/route", json=probe, headers=AUTH).json()
            assert route["cost_learning"] is False
            assert {c["cost_source"] for c in route["candidates"]} == {"configured"}
            # cache_aware prices its candidates: its prediction error is measured either way.
            assert "kvroute_ttft_prediction_error_log2_bucket" in client.get("/metrics").text
