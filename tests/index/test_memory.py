"""MemoryIndex specifics. The behaviour it shares with the Redis backend (longest leading
run, LRU capacity model, eviction) is in tests/index/test_contract.py, run on both."""

from __future__ import annotations

from cache_client import MemoryIndex


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
