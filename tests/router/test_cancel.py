"""Client disconnects: the router closes its upstream request at once, so the engine aborts
the request and frees its KV blocks, and the router's in-flight counts return to zero.

The simulated workers count the aborts they notice (`aborted` in `/sim/state`). Each case
sends a request that would take seconds, drops the client, and expects the worker to see
the abort long before the request could have finished. (The median delay is measured in
loadtests/e2e/faults.py.)
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

MODEL = "sim-llama3-8b"
LONG_OUTPUT = 400  # ~8 s at time scale 4
BIG_PROMPT = "lorem ipsum " * 5000  # ~15k tokens: seconds of prefill at time scale 4

pytestmark = [pytest.mark.sim_cluster(workers=2, time_scale=4.0, pool=False),
              pytest.mark.router_process(policy="least_loaded")]


def aborted(cluster) -> int:
    return sum(httpx.get(u + "/sim/state", timeout=5).json()["aborted"] for u in cluster.worker_urls.values())


def wait_for_abort(cluster, before: int, limit_s: float = 3.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if aborted(cluster) > before:
            return time.monotonic() - t0
        time.sleep(0.005)
    raise AssertionError(f"no worker noticed the disconnect within {limit_s} s")


def router_inflight(router) -> float:
    text = router.metrics()
    return sum(float(v) for v in re.findall(r'^kvroute_worker_inflight\{worker="[^"]+"\} (\S+)$', text, re.M))


def wait_inflight_zero(router, limit_s: float = 2.0) -> None:
    t0 = time.monotonic()
    while router_inflight(router) != 0:
        assert time.monotonic() - t0 < limit_s, router.metrics()
        time.sleep(0.02)


def body(stream: bool, prompt: str = "tell me a long story", max_tokens: int = LONG_OUTPUT) -> dict:
    return {"model": MODEL, "stream": stream, "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}]}


def test_stream_dropped_after_first_chunk_aborts_upstream(router, cluster) -> None:
    before = aborted(cluster)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", router.url + "/v1/chat/completions", json=body(True)) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            # leaving the block closes the connection with the body unread
    assert wait_for_abort(cluster, before) < 3.0
    wait_inflight_zero(router)


def test_stream_dropped_during_prefill_aborts_upstream(router, cluster) -> None:
    before = aborted(cluster)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/chat/completions", json=body(True, BIG_PROMPT), timeout=httpx.Timeout(10, read=0.3))
    wait_for_abort(cluster, before)
    wait_inflight_zero(router)


def test_non_streaming_request_dropped_aborts_upstream(router, cluster) -> None:
    before = aborted(cluster)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/chat/completions", json=body(False), timeout=httpx.Timeout(10, read=0.5))
    wait_for_abort(cluster, before)
    wait_inflight_zero(router)


def test_many_concurrent_drops_leave_nothing_in_flight(router, cluster) -> None:
    import asyncio

    async def drop_one(client: httpx.AsyncClient, i: int) -> None:
        async with client.stream("POST", router.url + "/v1/chat/completions", json=body(True, f"story {i}")) as resp:
            async for _ in resp.aiter_lines():
                break

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100)) as client:
            await asyncio.gather(*(drop_one(client, i) for i in range(40)))

    before = aborted(cluster)
    asyncio.run(main())
    t0 = time.monotonic()
    while aborted(cluster) < before + 40:
        assert time.monotonic() - t0 < 5.0, (aborted(cluster) - before, "of 40 aborts seen")
        time.sleep(0.02)
    wait_inflight_zero(router)
    states = [httpx.get(u + "/sim/state").json() for u in cluster.worker_urls.values()]
    assert sum(s["running"] + s["waiting"] for s in states) == 0  # KV blocks freed
    assert "kvroute_client_disconnects_total 0" not in router.metrics()
