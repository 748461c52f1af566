"""MemoryIndex: longest leading run per location, LRU capacity model, dropping a worker."""

from __future__ import annotations

from cache_client import POOL, MemoryIndex


async def test_depth_is_longest_leading_run() -> None:
    index = MemoryIndex()
    await index.record("a", [1, 2, 3], [10, 10, 10])
    await index.record("b", [1, 2], [10, 10])
    await index.record(POOL, [1, 2, 3, 4], [10, 10, 10, 10])
    view = await index.lookup([1, 2, 3, 4, 5])
    assert view.depths == {"a": 3, "b": 2, POOL: 4}
    assert (await index.lookup([9, 1])).depths == {}
    # A key held without its predecessor does not count (prefix caches need the head).
    await index.record("c", [7, 8], [1, 1])
    await index.evict("c", [7])
    assert (await index.lookup([7, 8])).depth("c") == 0


async def test_capacity_evicts_least_recent_and_tail_first() -> None:
    index = MemoryIndex()
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


async def test_drop_location_forgets_everything() -> None:
    index = MemoryIndex()
    await index.record("a", [1, 2], [5, 5])
    await index.record("b", [1], [5])
    await index.drop_location("a")
    assert (await index.lookup([1, 2])).depths == {"b": 1}
    assert index.key_count() == 1
    await index.drop_location("b")
    assert index.key_count() == 0


async def test_memory_is_bounded_by_capacity() -> None:
    index = MemoryIndex(default_capacity_tokens=1000)
    for i in range(10_000):
        await index.record("w", [i * 3, i * 3 + 1, i * 3 + 2], [4, 4, 4])
    assert (await index.usage())["w"] <= 1000
    assert index.key_count() <= 250
