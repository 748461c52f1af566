"""RedisIndex beyond the shared contract: URLs, several replicas sharing one view, one round
trip per lookup, writes that never wait, TTL, and key layout (hash tags, prefixes)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from cache_client.redis_conn import RedisBackend, RedisSettings, make_client, parse_redis_url
from cache_client.redis_index import RedisIndex
from loadtests.e2e.replicas import RedisServer
from router.app import build_app
from router.config_loader import flat_config
from router.metrics import RouterMetrics
from router.services import redis_components
from router.workers import WorkerSpec
from tests.support.system_redis import SYSTEM_REDIS, delete_prefix
from tests.support.upstream import RecordingUpstream
from tests.support.wait import wait_for_async

# -- URLs (no server needed) -----------------------------------------------------------------


def test_plain_tls_and_password_urls_pass_through() -> None:
    assert parse_redis_url("redis://127.0.0.1:6379/2") == RedisSettings("redis://127.0.0.1:6379/2")
    s = parse_redis_url("rediss://:s3cret@cache.internal:6380/1?ssl_cert_reqs=none")
    assert s == RedisSettings("rediss://:s3cret@cache.internal:6380/1?ssl_cert_reqs=none")
    assert "s3cret" not in s.display()
    assert parse_redis_url("redis://localhost").url == "redis://localhost:6379"


def test_cluster_urls() -> None:
    s = parse_redis_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7001")
    assert s.cluster and s.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert s.url == "redis://10.0.0.1:7000"
    q = parse_redis_url("rediss://user:p%40ss@[::1]:7000/0?cluster=true&socket_keepalive=true")
    assert q.cluster and q.nodes == (("::1", 7000),)
    assert q.url == "rediss://user:p%40ss@[::1]:7000/0?socket_keepalive=true"
    assert "p%40ss" not in q.display() and q.display().startswith("rediss+cluster://")
    assert not parse_redis_url("redis://h:1?cluster=false").cluster


@pytest.mark.parametrize(
    "url",
    ["http://h:1", "127.0.0.1:6379", "redis+cluster://h:1/3", "redis://a:1,b:2", "redis://:pw@/0"],
)
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_redis_url(url)


def test_connect_redis_builds_index_and_load_board_from_the_config() -> None:
    config = flat_config(redis="redis://127.0.0.1:6379/0", redis_prefix="dep-a", redis_lookup_budget_ms=7.0)
    parts = redis_components(config)
    index, loads = parts["index"], parts["loads"]
    assert isinstance(index, RedisIndex) and index.tag == "{dep-a}"
    assert index.backend.budget_s == pytest.approx(0.007)
    # One client, one health state for both.
    assert loads._backend is index.backend


# -- against the real Redis ------------------------------------------------------------------


class CountingClient:
    """A real client that counts the commands sent through it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.commands: list[str] = []

    async def execute_command(self, *args: Any) -> Any:
        self.commands.append(str(args[0]))
        return await self.inner.execute_command(*args)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture
async def replicas() -> AsyncIterator[Callable[..., Awaitable[RedisIndex]]]:
    prefix = f"test-ri-{uuid.uuid4().hex[:12]}"
    made: list[RedisIndex] = []

    async def make(**kwargs: Any) -> RedisIndex:
        backend_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in ("client_factory", "budget_s")}
        backend_kw.setdefault("budget_s", 1.0)
        index = RedisIndex(RedisBackend(parse_redis_url(SYSTEM_REDIS), **backend_kw),
                           prefix=kwargs.pop("prefix", prefix), **kwargs)
        made.append(index)
        assert await index.connect()
        return index

    yield make
    for index in made:
        await index.close()
        delete_prefix(SYSTEM_REDIS, index.tag)


@pytest.mark.redis
async def test_replicas_share_one_view_through_background_flushes(replicas) -> None:
    a, b = await replicas(), await replicas()
    await a.record("w1", [1, 2, 3], [10, 10, 10])
    await a.record("w2", [1, 2], [10, 10])

    # No explicit flush: the background flusher delivers A's writes to B.
    async def b_sees() -> bool:
        return (await b.lookup([1, 2, 3])).depths == {"w1": 3, "w2": 2}

    await wait_for_async(b_sees)
    await b.evict("w1", [2])
    await b.flush()
    assert (await a.lookup([1, 2, 3])).depths == {"w1": 1, "w2": 2}


@pytest.mark.redis
async def test_every_replica_agrees_on_what_a_worker_evicted(replicas) -> None:
    # The capacity model lives in Redis: B's records push A's conversation out of w's LRU,
    # and A sees it although A never recorded anything after.
    a, b = await replicas(default_capacity_tokens=1000), await replicas(default_capacity_tokens=1000)
    a.set_capacity("w", 40)
    await a.record("w", [1, 2], [10, 10])
    await a.flush()
    await b.record("w", [5, 6, 7], [10, 10, 10])
    await b.flush()
    assert (await a.lookup([1, 2])).depths == {"w": 1}
    assert (await a.usage()) == {"w": 40}
    # A's own local mirror knows nothing of B's traffic: only Redis gives the shared answer.
    assert a.mirror.lookup_sync([1, 2]).depths == {"w": 2}


@pytest.mark.redis
async def test_prefixes_keep_deployments_apart(replicas) -> None:
    a = await replicas(prefix=f"test-ri-a-{uuid.uuid4().hex[:8]}")
    b = await replicas(prefix=f"test-ri-b-{uuid.uuid4().hex[:8]}")
    await a.record("w", [1, 2], [1, 1])
    await a.flush()
    assert (await b.lookup([1, 2])).depths == {}
    assert (await b.usage()) == {}
    client = aioredis.Redis.from_url(SYSTEM_REDIS)
    keys = [k.decode() async for k in client.scan_iter(match=a.tag.replace("{", "\\{").replace("}", "\\}") + ":*")]
    await client.aclose()
    # Every key carries the deployment's hash tag: one Redis Cluster slot per deployment.
    assert keys and all(k.startswith(a.tag + ":") for k in keys)


@pytest.mark.redis
async def test_a_lookup_is_one_round_trip_and_carries_queued_writes(replicas) -> None:
    counting: list[CountingClient] = []

    def factory() -> CountingClient:
        client = CountingClient(make_client(parse_redis_url(SYSTEM_REDIS), 1.0, 0.5))
        counting.append(client)
        return client

    # The background flusher is held back, so every write must ride along with a lookup.
    index = await replicas(client_factory=factory, flush_delay_s=60.0)
    await index.lookup([1])  # connect, load the script
    sent = counting[0].commands
    sent.clear()
    await index.record("w1", list(range(100)), [5] * 100)
    await index.record("w2", list(range(40)), [5] * 40)
    await index.record("__pool__", list(range(60)), [5] * 60)
    assert sent == []
    view = await index.lookup(list(range(100)))
    assert view.depths == {"w1": 100, "w2": 40, "__pool__": 60}
    assert sent == ["EVALSHA"]
    await index.lookup(list(range(50)))
    assert sent == ["EVALSHA", "EVALSHA"]


@pytest.mark.redis
async def test_written_returns_once_other_replicas_can_read_the_writes(replicas) -> None:
    # A's background flusher is held back: only `written()` can get its record out in time.
    a, b = await replicas(flush_delay_s=0.5), await replicas()
    await a.record("w1", [1, 2, 3], [10, 10, 10])
    assert (await b.lookup([1, 2, 3])).depths == {}  # not yet sent
    await a.written()
    assert (await b.lookup([1, 2, 3])).depths == {"w1": 3}
    # Nothing queued: no wait, no call.
    calls = a.stats["lookup_calls"]
    await asyncio.wait_for(a.written(), 0.05)
    assert a.stats["lookup_calls"] == calls


@pytest.mark.redis
async def test_written_waits_no_longer_than_the_lookup_budget_for_a_hung_redis() -> None:
    with RedisServer() as server:
        settings = parse_redis_url(server.url)
        backend = RedisBackend(settings, budget_s=0.05, client_factory=lambda: make_client(settings, 30.0, 30.0))
        index = RedisIndex(backend, prefix="hang-written")
        try:
            assert await index.connect()
            server.pause()
            await index.record("w", [1, 2], [4, 4])
            # Bounded by the 50 ms budget, far below the 30 s socket timeout.
            await asyncio.wait_for(index.written(), 5.0)
        finally:
            server.resume()
            await index.close()


@pytest.mark.redis
@pytest.mark.parametrize("stream", [False, True])
async def test_a_next_turn_at_once_through_another_router_finds_its_worker(replicas, stream: bool) -> None:
    """The answer's last byte leaves only once its routing record is in Redis: a client
    that sends its next turn at once, through another replica, is routed to its cache."""
    a_index, b_index = await replicas(flush_delay_s=0.5), await replicas()  # A's flusher held back
    turn = {"model": "rec-model", "stream": stream, "max_tokens": 8, "messages": [
        {"role": "system", "content": "You review pull requests. " * 60},
        {"role": "user", "content": "Review the first diff. " * 30},
    ]}
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(RecordingUpstream()) for _ in range(4)]
        config = flat_config(workers=[WorkerSpec(f"w{i}", w.url) for i, w in enumerate(workers)], policy="cache_aware")
        a, b = build_app(config, index=a_index), build_app(config, index=b_index)
        async with a.lifespan(a.api), b.lifespan(b.api):
            async with (httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://a") as to_a,
                        httpx.AsyncClient(transport=httpx.ASGITransport(app=b), base_url="http://b") as to_b):
                first = await to_a.post("/v1/chat/completions", json=turn)
                assert first.status_code == 200, first.text
                turn["messages"] += [{"role": "assistant", "content": "ok"},
                                     {"role": "user", "content": "Now the second diff. " * 30}]
                second = await to_b.post("/v1/chat/completions", json=turn)
    assert second.status_code == 200, second.text
    assert second.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    assert second.headers["x-kvroute-route-reason"] == "gpu_hit"


class BlackHole:
    """A TCP server that accepts connections and never answers: a hung Redis."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> BlackHole:
        self.server = await asyncio.start_server(self._swallow, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _swallow(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            pass

    async def __aexit__(self, *exc: Any) -> None:
        assert self.server is not None
        self.server.close()


@pytest.mark.redis
async def test_writes_never_wait_and_lookups_keep_to_the_budget_when_redis_hangs() -> None:
    with RedisServer() as server:
        settings = parse_redis_url(server.url)
        backend = RedisBackend(settings, budget_s=0.02, client_factory=lambda: make_client(settings, 30.0, 30.0))
        metrics = RouterMetrics()
        index = RedisIndex(backend, prefix="hang", observer=metrics)
        assert metrics.index_backend_up.get() == 0.0  # not connected yet
        try:
            assert await index.connect()
            assert metrics.index_backend_up.get() == 1.0
            await index.record("w", [1, 2, 3], [4, 4, 4])
            assert (await index.lookup([1, 2, 3])).depths == {"w": 3}
            server.pause()  # SIGSTOP: connections stay open, nothing answers
            # record() completes without ever suspending: there is no I/O to wait for.
            coro = index.record("w", [1, 2, 3, 4], [4, 4, 4, 4])
            with pytest.raises(StopIteration):
                coro.send(None)
            loop = asyncio.get_running_loop()
            for _ in range(3):
                t0 = loop.time()
                assert (await index.lookup([1, 2, 3, 4, 5])).depths == {"w": 4}
                # Far below the 30 s socket timeout: the budget, not the socket, bounds it.
                assert loop.time() - t0 < 5.0
            # Three lookups in a row over budget: the backend is down and says so.
            assert not backend.up
            assert metrics.index_backend_up.get() == 0.0
            assert index.stats["fallback_lookups"] == 3
            # Down: lookups no longer even try Redis.
            calls = index.stats["lookup_calls"]
            assert (await index.lookup([1])).depths == {"w": 1}
            assert index.stats["lookup_calls"] == calls
        finally:
            server.resume()
            await index.close()


@pytest.mark.redis
async def test_a_redis_that_never_answers_is_never_waited_for() -> None:
    async with BlackHole() as hole:
        settings = parse_redis_url(f"redis://127.0.0.1:{hole.port}/0")
        backend = RedisBackend(settings, budget_s=0.02, client_factory=lambda: make_client(settings, 30.0, 30.0))
        index = RedisIndex(backend, prefix="never-written")
        try:
            assert not await index.connect(timeout_s=2.0)
            await index.record("w", [1, 2], [4, 4])
            # Still connecting, or given up on: either way the local view answers at once.
            assert (await index.lookup([1, 2, 3])).depths == {"w": 2}
            assert index.stats["remote_lookups"] == 0 and index.stats["lookup_calls"] == 0
            assert not backend.up and not backend.connecting
        finally:
            await index.close()


@pytest.mark.redis
async def test_entries_expire_after_the_ttl(replicas) -> None:
    index = await replicas(ttl_s=1.0)
    await index.record("w", [1, 2], [10, 10])
    await index.flush()
    await asyncio.sleep(0.6)
    await index.record("w", [3], [7])
    await index.flush()
    assert (await index.lookup([1, 2])).depths == {"w": 2}
    await asyncio.sleep(0.6)
    # [1, 2] is 1.2 s old, [3] 0.6 s: only [3] is still held, and only it is charged.
    assert (await index.lookup([1, 2])).depths == {}
    assert (await index.lookup([3])).depths == {"w": 1}
    assert (await index.usage()) == {"w": 7}
    await asyncio.sleep(1.1)
    assert (await index.usage()) == {}
    client = aioredis.Redis.from_url(SYSTEM_REDIS)
    left = [k async for k in client.scan_iter(match=index.tag.replace("{", "\\{").replace("}", "\\}") + ":[zcm]:*")]
    await client.aclose()
    assert left == []  # the keys themselves expired: nothing piles up in Redis


@pytest.mark.redis
async def test_tls_password_and_database_from_the_url() -> None:
    with RedisServer(password="s3cret", tls=True) as server:
        url = server.url.replace("/0?", "/3?")  # rediss://:s3cret@127.0.0.1:PORT/3?ssl_ca_certs=...
        parts = redis_components(flat_config(redis=url, redis_prefix="tls"))
        index = parts["index"]
        try:
            assert await index.connect()
            await index.record("w", [1, 2], [3, 3])
            assert (await index.lookup([1, 2])).depths == {"w": 2}
            assert await parts["loads"].sync()
        finally:
            await index.close()
        with server.client() as c:
            c.select(3)
            assert c.exists("{tls}:z:w") == 1
            c.select(0)
            assert c.dbsize() == 0


@pytest.mark.redis
async def test_a_wrong_password_is_an_outage_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    with RedisServer(password="right") as server:
        url = server.url.replace(":right@", ":wrong@")
        index = redis_components(flat_config(redis=url, redis_prefix="auth"))["index"]
        try:
            assert not await index.connect(timeout_s=1.0)
            await index.record("w", [1], [1])
            assert (await index.lookup([1])).depths == {"w": 1}
            assert any("AuthenticationError" in r.getMessage() for r in caplog.records)
            # The password never reaches the log.
            assert not any("wrong" in r.getMessage() for r in caplog.records)
        finally:
            await index.close()


@pytest.mark.redis
async def test_one_replica_writes_the_kv_events_and_another_takes_over_when_it_leaves(replicas) -> None:
    """Precise mode with replicas: each receives every worker's KV events; one writes them
    to Redis, the others keep them in their own view, and when the writer leaves the next
    one pushes its view, events it received while not writing included."""
    from cache_client.kv_events import KvEvent, KvEventIngestor, KvEventSource
    from router.load.redis import RedisLoadBoard
    from router.services import event_writer_election

    replicas_, ingestors, boards = [], [], []
    for replica_id in ("r0", "r1"):
        index = await replicas()
        board = RedisLoadBoard(index.backend, prefix=index.tag[1:-1], replica_id=replica_id)
        ingestor = KvEventIngestor(index)
        follow = event_writer_election(index, board)
        assert follow is not None
        ingestor.follow(*follow)
        replicas_.append(index)
        ingestors.append(ingestor)
        boards.append(board)
    reader = await replicas()  # a third replica, routing only: what Redis holds
    for board in boards:
        assert await board.sync()
    assert [b.writes_events for b in boards] == [True, False]  # the smallest live id writes

    source = KvEventSource("w1", "tcp://127.0.0.1:1")
    await ingestors[1].apply(source, [KvEvent("stored", (11, 12), block_size=16)])
    await replicas_[1].flush()
    # The follower kept it to itself: Redis does not have it, its own view does.
    assert (await reader.lookup([11, 12])).depths == {}
    assert replicas_[1].mirror.lookup_sync([11, 12]).depths == {"w1": 2}
    # Both receive the next batch; the writer's copy reaches Redis.
    for ingestor in ingestors:
        await ingestor.apply(source, [KvEvent("stored", (21, 22, 23), block_size=16)])
    await replicas_[0].flush()
    assert (await reader.lookup([21, 22, 23])).depths == {"w1": 3}
    await ingestors[1].apply(source, [KvEvent("removed", (22,))])
    await replicas_[1].flush()
    assert (await reader.lookup([21, 22, 23])).depths == {"w1": 3}  # nobody wrote the eviction

    # The writer leaves (its registry entry goes; a crashed one's lease runs out): at its
    # next sync r1 writes, and pushes its view first.
    await boards[0]._leave()
    assert await boards[1].sync()
    assert boards[1].writes_events
    await ingestors[1].apply(source, [KvEvent("stored", (31,), block_size=16)])

    async def pushed() -> bool:
        await replicas_[1].flush()
        view = await reader.lookup([11, 12])
        return view.depths == {"w1": 2} and (await reader.lookup([31])).depths == {"w1": 1}

    await wait_for_async(pushed)
    assert replicas_[1].stats["resyncs"] == 1
