"""RedisLoadBoard against the real Redis: every replica's in-flight requests, queued prefill
and recent traffic count everywhere; a replica that stops heartbeating stops counting."""

from __future__ import annotations

import asyncio
import math
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from cache_client.redis_conn import RedisBackend, parse_redis_url
from loadtests.e2e.replicas import RedisServer
from router.load import LocalLoadBoard
from router.load.redis import RedisLoadBoard
from tests.support.system_redis import SYSTEM_REDIS
from tests.support.wait import wait_for_async

pytestmark = pytest.mark.redis


@pytest.fixture
async def boards() -> AsyncIterator[Callable[..., RedisLoadBoard]]:
    prefix = f"test-lb-{uuid.uuid4().hex[:12]}"
    made: list[RedisLoadBoard] = []

    def make(url: str = SYSTEM_REDIS, **kwargs: Any) -> RedisLoadBoard:
        board = RedisLoadBoard(RedisBackend(parse_redis_url(url), budget_s=1.0), prefix=prefix,
                               replica_id=f"r{len(made)}", **kwargs)
        made.append(board)
        return board

    yield make
    for board in made:
        await board._backend.close()
    client = aioredis.Redis.from_url(SYSTEM_REDIS)
    # Braces are not glob characters in Redis patterns: the tag matches literally.
    async for key in client.scan_iter(match="{" + prefix + "}*"):
        await client.delete(key)
    left = [k async for k in client.scan_iter(match="{" + prefix + "}*")]
    await client.aclose()
    assert left == []


def loads_of(board: RedisLoadBoard, *names: str) -> dict[str, tuple[int, float, float]]:
    return {w.name: (w.inflight, w.queued_prefill_s, w.recent) for w in board.snapshot(names)}


async def test_replicas_see_each_others_requests(boards) -> None:
    a, b = boards(), boards()
    ta = [a.acquire("w0", 0.5) for _ in range(3)]
    tb = b.acquire("w1", 0.25)
    # Local changes count at once, remote ones after a sync.
    assert loads_of(b, "w0", "w1")["w0"][0] == 0 and b.inflight("w1") == 1
    assert await a.sync() and await b.sync()
    got = loads_of(b, "w0", "w1")
    assert got["w0"][0] == 3 and got["w0"][1] == pytest.approx(1.5)
    assert got["w1"][0] == 1 and got["w1"][1] == pytest.approx(0.25)
    assert [w.prefilling for w in b.snapshot(["w0", "w1"])] == [3, 1]  # none has a first byte yet
    assert b.inflight("w0") == 3 and b.local_inflight("w0") == 0
    # The other direction, after a's next sync.
    assert await a.sync()
    assert a.inflight("w1") == 1 and a.inflight("w0") == 3

    a.first_byte(ta[0])
    a.release(ta[1])
    assert await a.sync() and await b.sync()
    got = loads_of(b, "w0")
    assert got["w0"][0] == 2 and got["w0"][1] == pytest.approx(0.5)
    assert b.snapshot(["w0"])[0].prefilling == 1  # one answering, one released, one waiting
    for t in ta:
        a.release(t)
    b.release(tb)
    assert await a.sync() and await b.sync()
    assert loads_of(b, "w0", "w1") == {"w0": (0, 0.0, pytest.approx(3.0, rel=0.01)),
                                       "w1": (0, 0.0, pytest.approx(1.0, rel=0.01))}


async def test_recent_traffic_is_the_sum_over_replicas(boards) -> None:
    a, b = boards(half_life_s=30.0), boards(half_life_s=30.0)
    local = LocalLoadBoard(half_life_s=30.0)
    for _ in range(10):
        a.release(a.acquire("w", 0.0))
        local.release(local.acquire("w", 0.0))
    for _ in range(5):
        b.release(b.acquire("w", 0.0))
        local.release(local.acquire("w", 0.0))
    assert await a.sync() and await b.sync()
    # What a single router that saw all 15 requests would count.
    want = local.snapshot(["w"])[0].recent
    assert loads_of(b, "w")["w"][2] == pytest.approx(want, rel=0.01)
    assert want == pytest.approx(15.0, rel=0.01)


CRASHING_REPLICA = """
import asyncio, sys
from cache_client.redis_conn import RedisBackend, parse_redis_url
from router.load.redis import RedisLoadBoard

async def main():
    board = RedisLoadBoard(RedisBackend(parse_redis_url(sys.argv[1])), prefix=sys.argv[2],
                           replica_id="doomed", lease_s=1.0)
    board.acquire("w", 1.0)
    board.acquire("w", 1.0)
    assert await board.sync()
    print("SYNCED", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_a_replica_that_crashes_stops_counting_when_its_lease_expires(boards) -> None:
    b = boards(lease_s=1.0)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CRASHING_REPLICA, SYSTEM_REDIS, b._tag.strip("{}"),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"SYNCED"  # type: ignore[union-attr]
        assert await b.sync()
        assert b.inflight("w") == 2
        proc.kill()  # SIGKILL: no goodbye, its two requests stay "in flight" in Redis
        await proc.wait()
        assert await b.sync()
        assert b.inflight("w") == 2
        await asyncio.sleep(1.3)
        assert await b.sync()
        assert b.inflight("w") == 0 and loads_of(b, "w")["w"] == (0, 0.0, 0.0)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_background_sync_and_clean_leave(boards) -> None:
    a, b = boards(sync_interval_s=0.02), boards(sync_interval_s=0.02)
    a.acquire("w", 0.1)
    b.snapshot(["w"])  # starts b's background sync
    await wait_for_async(lambda: b.inflight("w") == 1)
    assert a.syncs > 0 and b.syncs > 0
    # Closing leaves at once instead of waiting out the lease.
    await a._backend.close()
    await wait_for_async(lambda: b.inflight("w") == 0)


async def test_without_redis_each_replica_counts_its_own_and_drops_stale_remote_counts(boards) -> None:
    with RedisServer() as server:
        a, b = boards(server.url, lease_s=0.3), boards(server.url, lease_s=0.3, sync_interval_s=0.02)
        a.acquire("w", 0.2)
        assert await a.sync() and await b.sync()
        assert b.inflight("w") == 1
        server.kill()
        b.acquire("w", 0.1)
        b.snapshot(["w"])  # starts the background loop
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not b._backend.up and b.inflight("w") == 1:
                break
        # Redis is gone: b cannot know whether a still runs; after a lease, only its own count.
        assert not b._backend.up
        assert b.inflight("w") == 1 and math.isclose(loads_of(b, "w")["w"][1], 0.1)


async def test_replicas_share_learned_costs(boards) -> None:
    """Cost-model statistics ride on the sync; a replica that has seen nothing
    of a worker prices it with what another replica learned."""
    from router.calibration import Calibrator, Dispatch
    from router.cost import CostSettings

    prior = CostSettings().model()
    a, b = boards(sync_interval_s=1.0), boards(sync_interval_s=1.0)
    for board in (a, b):
        board.calibrator = Calibrator(prior)
        board.costs = board.calibrator.costs
    for i in range(40):  # a worker 3x the prior's cost per token
        total = 1000 + 500 * i
        a.calibrator.observe(Dispatch("w0", total, 0, 0, 0.0, 0, 0, 0.1, None), 3 * prior.prefill_s(0, total), 0)
    assert "w0" in a.costs and "w0" not in b.costs
    assert await a.sync() and await b.sync()
    learned = b.snapshot(["w0"])[0].cost
    assert learned is not None
    assert learned.prefill_s(0, 8000) == pytest.approx(a.costs["w0"].prefill_s(0, 8000), rel=0.05)
    assert learned.prefill_s(0, 8000) > 2 * prior.prefill_s(0, 8000)


def _chain(prompt: str) -> Any:
    from router.chain import EstimateChainBuilder

    return EstimateChainBuilder().build({"model": "m", "prompt": prompt}, "completion")


async def test_replicas_share_where_the_prompts_they_sent_ended(boards) -> None:
    from cache_client.base import IndexView
    from cache_client.served_ends import ServedEnds

    a, b, c = boards(), boards(), boards()
    for board in (a, b, c):
        board.ends = ServedEnds()
        board.ends.share()
    first, later = _chain("a" * 2000), _chain("a" * 2000 + "b" * 500)
    view = IndexView({"w1": len(first) - 1})
    a.ends.record("w1", first)
    assert await b.sync() and await a.sync() and await b.sync()
    assert b.ends.lookup(later, view) == "w1"  # learned from a, through Redis
    assert a.ends.lookup(later, view) == "w1"  # its own, not received back twice
    # A replica that joins later reads what was appended before it came.
    assert await c.sync()
    assert c.ends.lookup(later, view) == "w1"
    # A sync that fails keeps the records for the next one.
    b.ends.record("w2", _chain("z" * 2000))

    async def unreachable(*args: Any) -> Any:
        raise redis_errors.ConnectionError("Redis went away")

    b._backend.script = unreachable  # type: ignore[method-assign]
    assert not await b.sync()
    assert len(b.ends.take_sent()) == 1


async def test_a_starting_router_connects_and_reads_the_other_replicas_before_its_first_request(
    redis_prefix: str,
) -> None:
    # A replica already serving has a request in flight on w0. A router starting beside it
    # must see that at its first decision: connected to Redis during startup, not by its
    # first lookup (which would miss its budget while connecting and route on its own view).
    from router.config_loader import flat_config
    from router.services import build_services, start_all, stop_all

    serving = RedisLoadBoard(RedisBackend(parse_redis_url(SYSTEM_REDIS), budget_s=1.0), prefix=redis_prefix,
                             replica_id="serving")
    serving.acquire("w0", 0.5)
    assert await serving.sync()
    config = flat_config(redis=SYSTEM_REDIS, redis_prefix=redis_prefix, redis_lookup_budget_ms=5,
                         workers=["w0=http://127.0.0.1:9", "w1=http://127.0.0.1:9"])
    services = build_services(config)
    assert not services.index.backend.up  # type: ignore[attr-defined]
    await start_all(services)
    try:
        assert services.index.backend.up  # type: ignore[attr-defined]
        assert [load.inflight for load in services.loads.snapshot(["w0", "w1"])] == [1, 0]
    finally:
        await stop_all(services.lifecycle)
        await serving._backend.close()


async def test_a_router_starts_without_redis_and_serves_on_its_own_view() -> None:
    from router.config_loader import flat_config
    from router.services import build_services, start_all, stop_all

    # Nothing listens on port 1: the start waits at most REDIS_STARTUP_WAIT_S, then serves.
    config = flat_config(redis="redis://127.0.0.1:1/0", workers=["w0=http://127.0.0.1:9"])
    services = build_services(config)
    await start_all(services)
    try:
        assert not services.index.backend.up  # type: ignore[attr-defined]
        assert [load.inflight for load in services.loads.snapshot(["w0"])] == [0]
    finally:
        await stop_all(services.lifecycle)
