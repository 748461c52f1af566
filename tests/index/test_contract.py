"""One contract, every backend: MemoryIndex, RedisIndex on the real Redis, and RedisIndex on
a real three-node Redis Cluster must give the same answers to the same operations.

The Redis variants run as a single replica with its writes buffered exactly as in
production (a lookup or usage query carries the queued writes along), against a unique key
prefix that is deleted afterwards.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_client import POOL, MemoryIndex, PrefixIndex
from cache_client.redis_conn import RedisBackend, parse_redis_url
from cache_client.redis_index import RedisIndex
from tests.support.system_redis import SYSTEM_REDIS, delete_prefix

MakeIndex = Callable[[int], Awaitable[PrefixIndex]]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("redis-cluster", marks=[pytest.mark.redis, pytest.mark.slow])])
async def make_index(request) -> AsyncIterator[MakeIndex]:
    made: list[tuple[PrefixIndex, str | None, str | None]] = []
    url = {"redis": SYSTEM_REDIS, "redis-cluster": None}.get(request.param)
    if request.param == "redis-cluster":
        url = request.getfixturevalue("redis_cluster").url

    async def make(default_capacity: int = 2_000_000) -> PrefixIndex:
        if request.param == "memory":
            index: PrefixIndex = MemoryIndex(default_capacity)
            made.append((index, None, None))
            return index
        assert url is not None
        prefix = f"test-contract-{uuid.uuid4().hex[:12]}"
        rindex = RedisIndex(RedisBackend(parse_redis_url(url), budget_s=1.0), prefix=prefix,
                            default_capacity_tokens=default_capacity)
        made.append((rindex, url, rindex.tag))
        assert await rindex.connect()
        return rindex

    yield make
    for index, made_url, tag in made:
        if isinstance(index, RedisIndex):
            # A test that read from the fallback would pass vacuously.
            assert index.stats["fallback_lookups"] == 0
            assert index.backend.up
        await index.close()
        if made_url is not None and tag is not None:
            delete_prefix(made_url, tag)


async def test_depth_is_the_longest_leading_run_per_location(make_index: MakeIndex) -> None:
    index = await make_index()
    assert (await index.lookup([1, 2, 3])).depths == {}
    await index.record("a", [1, 2, 3], [10, 10, 10])
    await index.record("b", [1, 2], [10, 10])
    await index.record(POOL, [1, 2, 3, 4], [10, 10, 10, 10])
    assert (await index.lookup([1, 2, 3, 4, 5])).depths == {"a": 3, "b": 2, POOL: 4}
    assert (await index.lookup([1, 2])).depths == {"a": 2, "b": 2, POOL: 2}
    assert (await index.lookup([1, 7, 3])).depths == {"a": 1, "b": 1, POOL: 1}
    assert (await index.lookup([9, 1])).depths == {}
    assert (await index.lookup([])).depths == {}


async def test_a_key_without_its_head_does_not_count(make_index: MakeIndex) -> None:
    index = await make_index()
    await index.record("c", [7, 8, 9], [1, 1, 1])
    await index.evict("c", [8])
    assert (await index.lookup([7, 8, 9])).depths == {"c": 1}
    await index.evict("c", [7])
    assert (await index.lookup([7, 8, 9])).depths == {}
    assert (await index.lookup([9])).depths == {"c": 1}


async def test_full_64_bit_keys(make_index: MakeIndex) -> None:
    index = await make_index()
    chain = [2**64 - 1, 0, 2**63, 12345678901234567890]
    await index.record("w", chain, [1, 1, 1, 1])
    assert (await index.lookup(chain)).depths == {"w": 4}
    assert (await index.lookup([2**64 - 2])).depths == {}


async def test_long_chains_are_looked_up_whole(make_index: MakeIndex) -> None:
    # Longer than one ZMSCORE batch of the lookup script (32 keys).
    index = await make_index()
    chain = list(range(1000, 1100))
    await index.record("w", chain, [1] * 100)
    await index.record("v", chain[:70], [1] * 70)
    assert (await index.lookup(chain)).depths == {"w": 100, "v": 70}
    await index.evict("w", [chain[64]])
    assert (await index.lookup(chain)).depths == {"w": 64, "v": 70}


async def test_capacity_evicts_least_recent_tail_first(make_index: MakeIndex) -> None:
    index = await make_index()
    index.set_capacity("w", 30)
    await index.record("w", [1, 2], [10, 10])  # conversation A
    await index.record("w", [5, 6], [10, 10])  # conversation B: 40 tokens > 30
    # A was least recent; its tail (key 2) goes before its head (key 1).
    assert (await index.lookup([1, 2])).depth("w") == 1
    assert (await index.lookup([5, 6])).depth("w") == 2
    assert (await index.usage())["w"] == 30
    # Touching A's head makes it recent again: B's tail is next.
    await index.record("w", [1], [10])
    await index.record("w", [9], [10])
    assert (await index.lookup([5, 6])).depth("w") == 1
    assert (await index.lookup([1])).depth("w") == 1
    assert (await index.lookup([9])).depth("w") == 1
    assert (await index.usage())["w"] == 30


async def test_one_oversized_chain_keeps_only_its_head(make_index: MakeIndex) -> None:
    index = await make_index()
    index.set_capacity("w", 25)
    await index.record("w", [1, 2, 3, 4], [10, 10, 10, 10])
    assert (await index.lookup([1, 2, 3, 4])).depths == {"w": 2}
    assert (await index.usage()) == {"w": 20}


async def test_charges_at_least_one_token_and_keeps_the_first_charge(make_index: MakeIndex) -> None:
    index = await make_index()
    await index.record("w", [1, 2, 3], [0, 5, 0])
    assert (await index.usage()) == {"w": 7}
    # Re-recording a held key refreshes its recency but does not recharge it.
    await index.record("w", [1, 2], [100, 100])
    assert (await index.usage()) == {"w": 7}


async def test_evict_and_unknown_locations(make_index: MakeIndex) -> None:
    index = await make_index()
    await index.record("w", [1, 2, 3], [4, 5, 6])
    await index.evict("w", [3, 99])
    assert (await index.usage()) == {"w": 9}
    assert (await index.lookup([1, 2, 3])).depths == {"w": 2}
    await index.evict("nobody", [1])
    await index.drop_location("nobody")
    assert (await index.usage()) == {"w": 9}


async def test_set_capacity_creates_the_location_and_applies_on_next_record(make_index: MakeIndex) -> None:
    index = await make_index(default_capacity=1000)
    index.set_capacity("empty", 50)
    assert (await index.usage()) == {"empty": 0}
    await index.record("w", [1, 2, 3], [10, 10, 10])
    index.set_capacity("w", 15)
    # Shrinking alone evicts nothing...
    assert (await index.usage())["w"] == 30
    assert (await index.lookup([1, 2, 3])).depths == {"w": 3}
    # ...the next record trims to the new bound.
    await index.record("w", [4], [1])
    assert (await index.usage())["w"] == 11
    assert (await index.lookup([1, 2, 3])).depths == {"w": 1}
    assert (await index.lookup([4])).depths == {"w": 1}


async def test_drop_location_forgets_entries_and_capacity(make_index: MakeIndex) -> None:
    index = await make_index(default_capacity=100)
    index.set_capacity("a", 20)
    await index.record("a", [1, 2], [10, 10])
    await index.record("b", [1], [10])
    await index.drop_location("a")
    assert (await index.lookup([1, 2])).depths == {"b": 1}
    assert (await index.usage()) == {"b": 10}
    # Back with the default capacity (100), not the 20 set before the drop.
    await index.record("a", [5, 6, 7, 8, 9], [10, 10, 10, 10, 10])
    assert (await index.usage())["a"] == 50
    assert (await index.lookup([5, 6, 7, 8, 9])).depth("a") == 5


async def test_default_capacity_bounds_new_locations(make_index: MakeIndex) -> None:
    index = await make_index(default_capacity=25)
    await index.record("w", [1, 2, 3], [10, 10, 10])
    assert (await index.usage()) == {"w": 20}
    assert (await index.lookup([1, 2, 3])).depths == {"w": 2}


# -- the same random operation sequences, compared step by step -------------------------------
KEYS = st.integers(min_value=0, max_value=11)
LOCATIONS = st.sampled_from(["a", "b", POOL])
OPS = st.one_of(
    st.tuples(st.just("record"), LOCATIONS, st.lists(st.tuples(KEYS, st.integers(0, 9)), min_size=0, max_size=6)),
    st.tuples(st.just("evict"), LOCATIONS, st.lists(KEYS, max_size=4)),
    st.tuples(st.just("drop"), LOCATIONS),
    st.tuples(st.just("capacity"), LOCATIONS, st.integers(0, 40)),
)
PROBES = [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9, 10, 11], [0, 4, 7], [3, 2, 1, 0]]


async def _apply(index: PrefixIndex, op: tuple) -> None:
    if op[0] == "record":
        await index.record(op[1], [k for k, _ in op[2]], [t for _, t in op[2]])
    elif op[0] == "evict":
        await index.evict(op[1], op[2])
    elif op[0] == "drop":
        await index.drop_location(op[1])
    else:
        index.set_capacity(op[1], op[2])


async def _compare(ops: list[tuple], url: str) -> None:
    memory = MemoryIndex(30)
    prefix = f"test-contract-prop-{uuid.uuid4().hex[:12]}"
    rindex = RedisIndex(RedisBackend(parse_redis_url(url), budget_s=1.0), prefix=prefix, default_capacity_tokens=30)
    try:
        assert await rindex.connect()
        for step, op in enumerate(ops):
            await _apply(memory, op)
            await _apply(rindex, op)
            for probe in PROBES:
                want = (await memory.lookup(probe)).depths
                got = (await rindex.lookup(probe)).depths
                assert got == want, f"step {step} {op}: lookup {probe}"
            assert dict(await rindex.usage()) == dict(await memory.usage()), f"step {step} {op}: usage"
        assert rindex.stats["fallback_lookups"] == 0
    finally:
        await rindex.close()
        delete_prefix(url, rindex.tag)


@pytest.mark.redis
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=1, max_size=25))
def test_random_operation_sequences_agree_with_memory_index(ops: list[tuple]) -> None:
    asyncio.run(_compare(ops, SYSTEM_REDIS))
