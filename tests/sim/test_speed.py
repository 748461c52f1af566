"""Per-worker speed: `sim-cluster --speeds`, and `POST /sim/speed` at runtime."""

from __future__ import annotations

import httpx
import pytest

from loadtests.sim.cluster import SimCluster

pytestmark = pytest.mark.sim_cluster(workers=2, time_scale=0.002, pool=False, speeds=[1.0, 0.5])


def busy_for_one_prompt(url: str, text: str) -> float:
    """Simulated engine seconds one uncached prompt of ~4k tokens costs this worker."""
    def busy() -> float:
        state = httpx.get(f"{url}/sim/state").json()
        return state["busy_s"]

    before = busy()
    body = {"model": "sim-llama3-8b", "prompt": text * 2000, "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
    return busy() - before


def test_speeds_scale_every_step_and_change_at_runtime(cluster: SimCluster) -> None:
    fast, slow = cluster.worker_urls["w0"], cluster.worker_urls["w1"]
    assert httpx.get(f"{slow}/sim/state").json()["speed"] == 0.5
    t_fast = busy_for_one_prompt(fast, "a b ")
    t_slow = busy_for_one_prompt(slow, "c d ")
    assert t_slow / t_fast == pytest.approx(2.0, rel=0.01)  # simulated time: exact

    r = httpx.post(f"{fast}/sim/speed", json={"speed": 0.25})
    assert r.status_code == 200 and r.json()["speed"] == 0.25
    assert busy_for_one_prompt(fast, "e f ") / t_fast == pytest.approx(4.0, rel=0.01)
    assert "vllm:request_prefill_time_seconds_sum" in httpx.get(f"{fast}/metrics").text

    for bad in ({"speed": 0}, {"speed": "x"}, {}):
        assert httpx.post(f"{fast}/sim/speed", json=bad).status_code == 400
