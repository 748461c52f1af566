"""The response-owner stores (cache_client/response_owners.py): the memory map's TTL and
bound, the Redis store under its own key prefix (shared by two stores, TTL set with EX,
cleaned up), and its fallback to the local map when Redis is unreachable."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest
import redis

from cache_client.redis_conn import RedisBackend, parse_redis_url
from cache_client.response_owners import MemoryResponseOwners, OwnerRecord, RedisResponseOwners
from tests.support.system_redis import SYSTEM_REDIS, delete_prefix


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_memory_owner_expires_after_its_ttl() -> None:
    clock = Clock()
    owners = MemoryResponseOwners(clock=clock)
    await owners.remember("resp_1", OwnerRecord("w1", 42), ttl_s=10.0)
    clock.now += 9.9
    assert await owners.owner("resp_1") == OwnerRecord("w1", 42)
    clock.now += 0.2
    assert await owners.owner("resp_1") is None
    assert len(owners) == 0  # an expired entry read is dropped


async def test_memory_owners_are_bounded_oldest_first_and_forget() -> None:
    owners = MemoryResponseOwners(max_entries=2)
    for i in range(3):
        await owners.remember(f"resp_{i}", OwnerRecord(f"w{i}"), ttl_s=60.0)
    assert len(owners) == 2
    assert await owners.owner("resp_0") is None
    assert await owners.owner("resp_2") == OwnerRecord("w2")
    await owners.forget("resp_2")
    assert await owners.owner("resp_2") is None


def test_record_round_trips_and_rejects_garbage() -> None:
    record = OwnerRecord("worker:with:colons", 1234)
    assert OwnerRecord.decode(record.encode()) == record
    assert OwnerRecord.decode(b"nonsense") is None
    assert OwnerRecord.decode(b"12:") is None


@pytest.fixture
async def backends() -> AsyncIterator[tuple[RedisBackend, RedisBackend, str]]:
    prefix = f"test-owners-{secrets.token_hex(4)}"
    a, b = (RedisBackend(parse_redis_url(SYSTEM_REDIS), budget_s=0.05) for _ in range(2))
    assert await a.connect() and await b.connect()
    try:
        yield a, b, prefix
    finally:
        await a.close()
        await b.close()
        delete_prefix(SYSTEM_REDIS, "{" + prefix + "}")


@pytest.mark.redis
async def test_redis_owners_are_shared_under_their_prefix_with_a_ttl(backends) -> None:
    a, b, prefix = backends
    mine, theirs = RedisResponseOwners(a, prefix), RedisResponseOwners(b, prefix)
    other = RedisResponseOwners(b, prefix + "-other")
    await mine.remember("resp_x", OwnerRecord("w2", 77), ttl_s=120.0)
    assert await theirs.owner("resp_x") == OwnerRecord("w2", 77)
    assert await other.owner("resp_x") is None  # another deployment's prefix sees nothing
    client = redis.Redis.from_url(SYSTEM_REDIS)
    with client:
        key = "{" + prefix + "}:resp:resp_x"
        assert client.get(key) == b"77:w2"
        assert 0 < client.ttl(key) <= 120
    await theirs.forget("resp_x")
    assert await mine.owner("resp_x") is None
    assert theirs.stats["fallback"] == 0


async def test_redis_unreachable_falls_back_to_the_local_map() -> None:
    # Nothing listens on port 1: every call fails, none raises.
    backend = RedisBackend(parse_redis_url("redis://127.0.0.1:1/0"), connect_timeout_s=0.05)
    owners = RedisResponseOwners(backend, "test-owners-down")
    try:
        await owners.remember("resp_y", OwnerRecord("w1", 5), ttl_s=60.0)
        assert await owners.owner("resp_y") == OwnerRecord("w1", 5)
        assert await owners.owner("resp_unknown") is None
        await owners.forget("resp_y")
        assert await owners.owner("resp_y") is None
        assert owners.stats["remote"] == 0 and owners.stats["fallback"] >= 4
    finally:
        await backend.close()


@pytest.mark.redis
async def test_owners_stay_shared_while_the_index_has_marked_redis_slow(backends) -> None:
    # Lookups over the index's budget mark the backend down (a latency verdict); Redis still
    # answers, so an owner recorded by one replica must still be found by another.
    a, b, prefix = backends
    for backend in (a, b):
        for _ in range(backend.slow_limit):
            backend.over_budget()
        assert not backend.up
    mine, theirs = RedisResponseOwners(a, prefix), RedisResponseOwners(b, prefix)
    await mine.remember("resp_slow", OwnerRecord("w3", 12), ttl_s=60.0)
    assert await theirs.owner("resp_slow") == OwnerRecord("w3", 12)
    assert theirs.stats["fallback"] == 0
