"""Per-tenant limits and the fair-share queue end to end: `kvroute serve --tenants FILE`
processes in front of a recording upstream on loopback, sharing the system Redis (own key
prefix, removed after) or a Redis of their own that the test stops.

Counts and order only, no timing thresholds: limits are chosen so that a test's requests
all fall within one refill period however slow the machine is.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtests.e2e.replicas import RedisServer
from loadtests.support.routerproc import RouterProcess
from tests.support.system_redis import SYSTEM_REDIS, delete_prefix
from tests.support.upstream import RecordingUpstream, UpstreamBehaviour

pytestmark = [pytest.mark.slow]

TENANTS = """\
tenants:
  slow: {keys: [sk-slow], limits: {requests_per_s: 0.1}}
  pair: {keys: [sk-pair], limits: {requests_per_s: 0.2}}
  thrifty: {keys: [sk-thrifty], limits: {tokens_per_min: 100}}
  chatty: {keys: [sk-chatty], limits: {tokens_per_min: 100}}
  single: {keys: [sk-single], limits: {concurrent: 1}}
  free: {keys: [sk-free]}
  heavy: {keys: [sk-heavy]}
  light: {keys: [sk-light]}
"""
MODEL = "rec-model"


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("limits") / "tenants.yaml"
    path.write_text(TENANTS)
    return path


@pytest.fixture
def prefix() -> Iterator[str]:
    p = f"test-lim-{uuid.uuid4().hex[:10]}"
    yield p
    delete_prefix(SYSTEM_REDIS, "{" + p + "}")


def chat(url: str, key: str, content: str = "hi", timeout: float = 30.0) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout,
                      headers={"authorization": f"Bearer {key}"})


def messages(url: str, key: str) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(url + "/v1/messages", json=body, timeout=30, headers={"x-api-key": key})


def assert_limited(resp: httpx.Response, limit: str) -> str:
    """A 429 with Retry-After whose message names `limit`; returns the message."""
    assert resp.status_code == 429, resp.text
    assert int(resp.headers["retry-after"]) >= 1
    body = resp.json()
    if "type" in body:  # Anthropic's shape
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
        message = body["error"]["message"]
    else:
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "rate_limit_exceeded"
        message = body["error"]["message"]
    assert limit in message
    return message


def test_over_each_limit_429_in_the_endpoints_shape(tenants_file: Path) -> None:
    with RecordingUpstream() as up, RouterProcess({"w": up.url}, extra_args=["--tenants", str(tenants_file)]) as r:
        # requests_per_s 0.1: a bucket of one, refilled in 10 s.
        assert chat(r.url, "sk-slow").status_code == 200
        message = assert_limited(chat(r.url, "sk-slow"), "requests_per_s")
        assert "slow" in message and "sk-" not in message
        assert_limited(messages(r.url, "sk-slow"), "requests_per_s")
        # tokens_per_min 100: a ~200-token prompt is admitted on a full bucket (capped at
        # its size) and leaves it in debt for over a minute.
        assert chat(r.url, "sk-thrifty", "word " * 400).status_code == 200
        assert_limited(chat(r.url, "sk-thrifty"), "tokens_per_min")
        resp = chat(r.url, "sk-thrifty")
        assert_limited(resp, "tokens_per_min")
        assert int(resp.headers["retry-after"]) >= 30
        # Another tenant is not affected.
        assert [chat(r.url, "sk-free").status_code for _ in range(5)] == [200] * 5
        metrics = r.metrics()
    assert 'kvroute_tenant_rejected_total{tenant="slow",reason="rate"} 2' in metrics
    assert 'kvroute_tenant_rejected_total{tenant="thrifty",reason="tokens"} 2' in metrics
    assert 'tenant="free",reason=' not in metrics


def test_a_stream_without_usage_is_charged_its_generated_tokens(tenants_file: Path) -> None:
    """A chat stream carries usage only if its client asks for it: without it, the
    tenant's token limit is charged the stream's token events, not nothing."""
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    auth = {"authorization": "Bearer sk-chatty"}
    behaviour = UpstreamBehaviour(chunks=150)  # 150 content events, no usage
    with RecordingUpstream(behaviour=behaviour) as up, RouterProcess({"w": up.url}, extra_args=["--tenants", str(tenants_file)]) as r:
        with httpx.stream("POST", r.url + "/v1/chat/completions", json=body, headers=auth, timeout=30) as resp:
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line.startswith("data: {")]
        assert len(events) == 150 and not any('"usage"' in e for e in events)  # relayed as sent
        # 150 generated tokens against a bucket of 100: the tenant is in debt.
        assert_limited(chat(r.url, "sk-chatty"), "tokens_per_min")
        metrics = r.metrics()
    assert 'kvroute_tenant_generated_tokens_total{tenant="chatty"} 150' in metrics


def in_flight_then_disconnect(url: str, key: str, up: RecordingUpstream) -> None:
    """A request that reaches the worker, then its client leaves before the answer."""
    seen = len(up.received)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            task = asyncio.ensure_future(client.post(url + "/v1/chat/completions", json=body,
                                                     headers={"authorization": f"Bearer {key}"}))
            while len(up.received) == seen:
                await asyncio.sleep(0.02)
            # In flight: the tenant's one slot is taken, on every replica.
            assert_limited(chat(url, key), "concurrent")
            task.cancel()  # the client disconnects
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(run())


def eventually_ok(url: str, key: str, deadline_s: float = 20.0) -> int:
    """Sends until one is admitted; returns how many 429s came first (a release is async)."""
    refused = 0
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        resp = chat(url, key)
        if resp.status_code == 200:
            return refused
        assert_limited(resp, "concurrent")
        refused += 1
        time.sleep(0.05)
    raise AssertionError("the tenant's concurrency slot was never released")


@pytest.mark.redis
def test_concurrent_released_on_client_disconnect_across_replicas(tenants_file: Path, prefix: str) -> None:
    # The worker answers after 2 s: long enough for the client to leave while it works.
    slow = UpstreamBehaviour(first_byte_delay_s=2.0)
    args = ["--tenants", str(tenants_file), "--redis", SYSTEM_REDIS, "--redis-prefix", prefix,
            "--redis-lookup-budget-ms", "200"]
    with RecordingUpstream(behaviour=slow) as up, \
            RouterProcess({"w": up.url}, extra_args=args) as r1, RouterProcess({"w": up.url}, extra_args=args) as r2:
        in_flight_then_disconnect(r1.url, "sk-single", up)
        # Freed on disconnect, in Redis: the other replica admits the tenant's next request
        # (the slot would otherwise stay taken for the 600 s lease).
        eventually_ok(r2.url, "sk-single")
        assert 'tenant="single",reason="concurrent"' in r1.metrics()


@pytest.mark.redis
def test_limit_shared_across_replicas_through_redis(tenants_file: Path, prefix: str) -> None:
    args = ["--tenants", str(tenants_file), "--redis", SYSTEM_REDIS, "--redis-prefix", prefix,
            "--redis-lookup-budget-ms", "200"]
    with RecordingUpstream() as up, \
            RouterProcess({"w": up.url}, extra_args=args) as r1, RouterProcess({"w": up.url}, extra_args=args) as r2:
        # Each replica alone would admit one request per 10 s; together they admit one.
        statuses = [chat(url, "sk-slow").status_code for url in (r1.url, r2.url, r1.url, r2.url)]
        assert statuses == [200, 429, 429, 429]


@pytest.mark.redis
def test_redis_outage_falls_back_to_the_local_share(tenants_file: Path) -> None:
    prefix = f"test-lim-{uuid.uuid4().hex[:10]}"
    with RedisServer() as redis_server, RecordingUpstream() as up:
        args = ["--tenants", str(tenants_file), "--redis", redis_server.url, "--redis-prefix", prefix,
                "--redis-lookup-budget-ms", "200", "--tenant-replicas", "2"]
        with RouterProcess({"w": up.url}, extra_args=args) as r1, RouterProcess({"w": up.url}, extra_args=args) as r2:
            assert chat(r1.url, "sk-free").status_code == 200
            redis_server.kill()
            # 0.2 requests/s shared by 2 replicas: each admits its share, one per 10 s.
            statuses = {url: [chat(url, "sk-pair").status_code for _ in range(3)] for url in (r1.url, r2.url)}
            free = [chat(url, "sk-free").status_code for url in (r1.url, r2.url) for _ in range(5)]
            redis_server.start()
    # No request failed because Redis was away; the limit held (per replica, its share).
    assert statuses == {r1.url: [200, 429, 429], r2.url: [200, 429, 429]}
    assert free == [200] * 10


def _send(client: httpx.AsyncClient, url: str, key: str, tag: str) -> asyncio.Future:
    """A chat request from the tenant holding `key`, tagged so the upstream's order shows it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": tag}]}
    return asyncio.ensure_future(client.post(url + "/v1/chat/completions", json=body,
                                             headers={"authorization": f"Bearer {key}"}))


def test_fair_queue_serves_a_light_tenant_ahead_of_a_heavy_backlog(tenants_file: Path) -> None:
    # One worker slot, 0.3 s a request: the heavy tenant's burst queues behind it.
    args = ["--tenants", str(tenants_file), "--max-inflight-per-worker", "1", "--queue-size", "50",
            "--queue-timeout-s", "60"]
    with RecordingUpstream(behaviour=UpstreamBehaviour(first_byte_delay_s=0.3)) as up, \
            RouterProcess({"w": up.url}, extra_args=args) as r:

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=20)) as client:
                def send(key: str, tag: str) -> asyncio.Future:
                    return _send(client, r.url, key, tag)

                heavy = [send("sk-heavy", f"heavy-{i}") for i in range(8)]
                while "kvroute_queue_depth 7" not in r.metrics():
                    await asyncio.sleep(0.02)
                light = send("sk-light", "light-0")
                return await asyncio.gather(*heavy, light)

        responses = asyncio.run(run())
        assert [resp.status_code for resp in responses] == [200] * 9
        order = [rec.body.decode() for rec in up.received]
        position = next(i for i, body in enumerate(order) if "light-0" in body)
        # FIFO would serve it last (9th); the fair queue at the next free slot, or the one after.
        assert position <= 2, order


def test_light_tenant_finds_a_reserved_slot_while_a_heavy_one_saturates(tenants_file: Path) -> None:
    # One worker, 4 slots, 3 s a request. The light tenant has a request in flight (it is
    # active); the heavy one then sends 8: it takes its share (2) and no more than leaves
    # the light tenant's reservation (1) free, so the light tenant's next request is sent
    # at once, not at the next slot to free (which would be after 3 heavy requests).
    args = ["--tenants", str(tenants_file), "--max-inflight-per-worker", "4", "--queue-size", "50",
            "--queue-timeout-s", "120"]
    with RecordingUpstream(behaviour=UpstreamBehaviour(first_byte_delay_s=3.0)) as up, \
            RouterProcess({"w": up.url}, extra_args=args) as r:

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=20)) as client:
                def send(key: str, tag: str) -> asyncio.Future:
                    return _send(client, r.url, key, tag)

                first = send("sk-light", "light-0")
                while not any(b"light-0" in rec.body for rec in up.received):
                    await asyncio.sleep(0.02)
                heavy = [send("sk-heavy", f"heavy-{i}") for i in range(8)]
                while "kvroute_queue_depth 6" not in r.metrics():
                    await asyncio.sleep(0.02)
                light = send("sk-light", "light-1")
                return await asyncio.gather(first, *heavy, light)

        responses = asyncio.run(run())
        metrics = r.metrics()
    assert [resp.status_code for resp in responses] == [200] * 10
    order = [rec.body.decode() for rec in up.received]
    position = next(i for i, body in enumerate(order) if "light-1" in body)
    assert sum("heavy-" in body for body in order[:position]) == 2, order
    # It never queued (only queued requests are counted in the wait histogram).
    assert 'kvroute_tenant_queue_wait_seconds_count{tenant="light"}' not in metrics
