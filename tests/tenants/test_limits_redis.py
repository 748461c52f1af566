"""The shared tenant limits against the real Redis: limits.lua's arithmetic (as the local
limiter's), one atomic verdict across replicas, and the check riding in the index lookup's
round trip. Own key prefix per test, removed after."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from cache_client.redis_conn import RedisBackend, make_client, parse_redis_url
from cache_client.redis_index import RedisIndex
from router.errors import RouterError
from router.tenants.enforce import CHECK_BUDGET_S, OverLimit, TenantLimiter
from router.tenants.limits import CONCURRENT, RATE, TOKENS
from router.tenants.model import Tenant, TenantLimits
from tests.support.system_redis import SYSTEM_REDIS, delete_prefix
from tests.support.wait import wait_for_async

pytestmark = [pytest.mark.redis]


@pytest.fixture
async def limiters() -> AsyncIterator[Callable[[], Awaitable[tuple[RedisIndex, TenantLimiter]]]]:
    prefix = f"test-tl-{uuid.uuid4().hex[:12]}"
    made: list[RedisIndex] = []

    async def make(
        client_factory: Callable[[], Any] | None = None, check_budget_s: float = 5.0
    ) -> tuple[RedisIndex, TenantLimiter]:
        backend = RedisBackend(parse_redis_url(SYSTEM_REDIS), budget_s=1.0, client_factory=client_factory)
        index = RedisIndex(backend, prefix=prefix)
        made.append(index)
        assert await index.connect()
        # A generous budget: a busy CI machine must not push checks to the local share.
        return index, TenantLimiter(index, prefix=prefix, budget_s=check_budget_s, flush_delay_s=0.0)

    yield make
    for index in made:
        await index.close()
    delete_prefix(SYSTEM_REDIS, "{" + prefix + "}")


async def check(limiter: TenantLimiter, tenant: Tenant, prompt: int = 0):
    try:
        return await limiter.settle(limiter.begin(tenant, prompt))
    except OverLimit as exc:
        return exc


async def test_one_rate_limit_across_replicas(limiters) -> None:
    tenant = Tenant("acme", ("k",), limits=TenantLimits(requests_per_s=0.5))  # a bucket of 1, 2 s to refill
    (_, a), (_, b) = await limiters(), await limiters()
    outcomes = [await check(x, tenant) for x in (a, b, a, b)]
    assert not isinstance(outcomes[0], RouterError)
    for refused in outcomes[1:]:
        assert isinstance(refused, OverLimit) and refused.limit == RATE and refused.retry_after >= 1
    assert a.stats["remote"] == 2 and b.stats["remote"] == 2 and a.stats["local"] == 0


async def test_tokens_debited_after_and_concurrency_released(limiters) -> None:
    _, limiter = await limiters()
    tenant = Tenant("acme", ("k",), limits=TenantLimits(tokens_per_min=600, concurrent=1))
    grant = await check(limiter, tenant, prompt=100)  # 600 -> 500
    refused = await check(limiter, tenant, prompt=10)
    assert isinstance(refused, OverLimit) and refused.limit == CONCURRENT
    limiter.finish(grant, generated_tokens=450)  # 500 -> 50, and the slot freed
    await wait_for_async(lambda: limiter.stats["flushes"] >= 1)
    refused = await check(limiter, tenant, prompt=100)
    assert isinstance(refused, OverLimit) and refused.limit == TOKENS
    assert refused.retry_after >= 4  # 50 missing at 10 tokens/s
    grant = await check(limiter, tenant, prompt=40)  # fits in what is left: the slot was released
    assert not isinstance(grant, RouterError) and grant.remote


async def test_the_check_rides_in_the_lookup_round_trip(limiters) -> None:
    index, limiter = await limiters()
    tenant = Tenant("acme", ("k",), limits=TenantLimits(requests_per_s=100))
    calls_before = index.stats["lookup_calls"]
    pending = limiter.begin(tenant, 10)
    await index.lookup([1, 2, 3])  # what the handler's decide() does meanwhile
    # Answered by the lookup's own call: settled before anything else was sent.
    assert pending.reply is not None and pending.reply.done()
    assert index.stats["lookup_calls"] == calls_before + 1
    assert not isinstance(await limiter.settle(pending), RouterError)
    # A request that looked nothing up sends its check alone.
    assert not isinstance(await check(limiter, tenant), RouterError)
    assert index.stats["lookup_calls"] == calls_before + 1 and limiter.stats["remote"] == 2


async def test_riding_works_on_a_redis_cluster(redis_cluster) -> None:
    # The limits' keys share the index's hash tag: the pipeline goes to one node.
    index = RedisIndex(RedisBackend(parse_redis_url(redis_cluster.url), budget_s=1.0), prefix="tl-cluster")
    try:
        assert await index.connect()
        limiter = TenantLimiter(index, prefix="tl-cluster", budget_s=5.0)
        tenant = Tenant("acme", ("k",), limits=TenantLimits(requests_per_s=0.5))
        pending = limiter.begin(tenant, 10)
        await index.lookup([1, 2, 3])
        assert pending.reply is not None and pending.reply.done()
        assert (await limiter.settle(pending)).remote
        refused = await check(limiter, tenant)
        assert isinstance(refused, OverLimit) and refused.limit == RATE
    finally:
        await index.close()


class SlowPipelines:
    """A real Redis client whose pipelines (lookups, and the checks riding in them) answer
    `delay_s` late, as a distant Redis would; its pings do not wait."""

    def __init__(self, client: Any, delay_s: float) -> None:
        self._client = client
        self._delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = self._client.pipeline(*args, **kwargs)
        execute = pipe.execute

        async def late(*a: Any, **kw: Any) -> Any:
            await asyncio.sleep(self._delay_s)
            return await execute(*a, **kw)

        pipe.execute = late
        return pipe


async def test_the_check_waits_as_long_as_the_configured_lookup_budget(limiters) -> None:
    # Redis answers in 0.1 s: over the check's own 50 ms, within the second the lookups were
    # given. The check must wait for it too, not limit on the local share.
    settings = parse_redis_url(SYSTEM_REDIS)
    _, limiter = await limiters(lambda: SlowPipelines(make_client(settings, 1.0, 0.5), 0.1), CHECK_BUDGET_S)
    assert CHECK_BUDGET_S < 0.1
    tenant = Tenant("acme", ("k",), limits=TenantLimits(requests_per_s=100))
    assert not isinstance(await check(limiter, tenant), RouterError)
    assert limiter.stats == {"remote": 1, "local": 0, "flushes": 0}
