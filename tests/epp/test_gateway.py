"""Conversations through a real Envoy and `kvroute epp` in front of simulated vLLM workers:
multi-turn chats stay on their worker (the cache-aware decision, with the index the picker
keeps from what it routed), stored Responses chain on their owner, and what the picker
observes of the streams feeds the same metrics and cost model as the proxy's."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from loadtests.benchmark.envoy import EnvoyPicker
from loadtests.benchmark.harness import metric_sum, parse_prometheus
from loadtests.sim.cluster import SimCluster
from tests.epp.support import require_envoy

pytestmark = [pytest.mark.slow, pytest.mark.sim_cluster(workers=4, time_scale=0.05, pool=False)]

MODEL = "sim-llama3-8b"


@pytest.fixture(scope="module")
def gateway(cluster: SimCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvoyPicker]:
    require_envoy()
    log = tmp_path_factory.mktemp("gw") / "gateway.log"
    with EnvoyPicker(cluster.worker_urls, "cache_aware", log_path=str(log)) as gw:
        yield gw


def turn(client: httpx.Client, url: str, history: list[dict[str, str]], stream: bool = True) -> tuple[str, str, str]:
    """One turn: (worker, route reason, the reply's text)."""
    body = {"model": MODEL, "messages": history, "max_tokens": 12, "stream": stream}
    if not stream:
        r = client.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.headers["x-kvroute-worker"], r.headers["x-kvroute-route-reason"], r.json()["choices"][0]["message"]["content"]
    text = []
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = orjson.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
        return r.headers["x-kvroute-worker"], r.headers["x-kvroute-route-reason"], "".join(text)


def test_multi_turn_conversations_stay_on_their_worker(gateway: EnvoyPicker) -> None:
    homes: dict[int, str] = {}
    with httpx.Client(timeout=30, trust_env=False) as client:
        histories = {
            c: [{"role": "system", "content": f"You are assistant number {c}. " * 30}, {"role": "user", "content": f"hello {c}"}]
            for c in range(6)
        }
        for t in range(4):
            for c, history in histories.items():
                worker, reason, reply = turn(client, gateway.url, history, stream=t % 2 == 0)
                if t == 0:
                    homes[c] = worker
                else:
                    assert worker == homes[c], (c, t, reason)
                    assert reason == "gpu_hit"
                history += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"and then {t}?"}]
    assert len(set(homes.values())) > 1  # new conversations spread


def test_stored_responses_chain_on_their_owner(gateway: EnvoyPicker) -> None:
    with httpx.Client(timeout=30, trust_env=False) as client:
        for stream in (False, True):
            previous, owner = None, None
            for i in range(3):
                body: dict[str, object] = {"model": MODEL, "input": f"step {i} of a stored chain", "max_output_tokens": 8}
                if previous is not None:
                    body["previous_response_id"] = previous
                if stream:
                    body["stream"] = True
                    with client.stream("POST", gateway.url + "/v1/responses", json=body) as r:
                        assert r.status_code == 200
                        text = "".join(r.iter_text())
                        worker = r.headers["x-kvroute-worker"]
                    found = re.search(r'"response":\s*\{"id":\s*"([^"]+)"', text)
                    assert found, text[:300]
                    previous = found.group(1)
                else:
                    r = client.post(gateway.url + "/v1/responses", json=body)
                    assert r.status_code == 200, r.text
                    worker, previous = r.headers["x-kvroute-worker"], r.json()["id"]
                owner = owner or worker
                assert worker == owner
        # The owner answers by id through the gateway too; an unknown id is the proxy's 404.
        got = client.get(f"{gateway.url}/v1/responses/{previous}")
        assert got.status_code == 200 and got.headers["x-kvroute-worker"] == owner
        missing = client.get(gateway.url + "/v1/responses/resp_nobody_has_this")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "response_not_found"


def test_what_the_picker_observes_feeds_the_proxys_metrics(gateway: EnvoyPicker) -> None:
    with httpx.Client(timeout=30, trust_env=False) as client:
        for i in range(4):
            turn(client, gateway.url, [{"role": "user", "content": f"measure me {i}"}], stream=True)
    parsed = parse_prometheus(gateway.metrics())
    assert metric_sum(parsed, "kvroute_ttft_seconds_count") >= 4
    assert metric_sum(parsed, "kvroute_cost_observations_total") >= 4  # first-token times taught the cost model
    assert metric_sum(parsed, "kvroute_requests_total", status="200") >= 4
    assert metric_sum(parsed, "kvroute_worker_inflight") == 0  # every ticket ended with its stream


def test_logs_say_nothing_alarming(gateway: EnvoyPicker) -> None:
    assert gateway.picker.log_path is not None
    text = Path(gateway.picker.log_path).read_text()
    assert "internal error" not in text and "Traceback" not in text
