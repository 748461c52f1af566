"""The simulated LMCache pool: chunk keys, LRU store, and its HTTP service."""

from __future__ import annotations

import httpx
import pytest

from loadtests.sim.cluster import SimCluster
from loadtests.sim.pool import CHUNK_TOKENS, ChunkStore, chunk_keys

pytestmark = pytest.mark.sim_cluster(workers=1, time_scale=0.01, pool=True, pool_capacity_tokens=8 * CHUNK_TOKENS)


def test_chunk_keys_chain_over_full_chunks_only() -> None:
    a = b"a" * (CHUNK_TOKENS * 4 * 3 + 100)
    keys = chunk_keys(a, "m")
    assert len(keys) == 3
    # A different first chunk changes every later key (the chain covers the whole prefix).
    b = b"b" + a[1:]
    assert not set(chunk_keys(b, "m")) & set(keys)
    # A different suffix leaves the shared chunks' keys alone.
    assert chunk_keys(a[: CHUNK_TOKENS * 8] + b"x" * 4000, "m")[:2] == keys[:2]
    assert chunk_keys(a, "other-model") != keys


def test_lookup_counts_the_leading_run_and_touches_it() -> None:
    store = ChunkStore(capacity_tokens=4 * CHUNK_TOKENS)
    store.store([1, 2, 3])
    assert store.lookup([1, 2, 3, 4]) == 3
    assert store.lookup([2, 3]) == 2
    assert store.lookup([9, 1]) == 0
    store.store([10, 11])  # capacity 4 chunks: the least recently used goes
    assert len(store.lru) == 4
    assert store.lookup([1]) == 0  # the [2, 3] lookup left 1 as the least recently used
    assert store.lookup([2, 3]) == 2 and store.lookup([10, 11]) == 2
    assert store.stats()["evicted_chunks"] == 1


def test_store_evicts_a_chain_tail_before_its_head() -> None:
    store = ChunkStore(capacity_tokens=3 * CHUNK_TOKENS)
    store.store([1, 2, 3])
    store.store([7])
    assert store.lookup([1, 2, 3]) == 2  # chunk 3 (the tail) went first


@pytest.fixture(scope="module")
def pool_url(cluster: SimCluster) -> str:
    assert cluster.pool_url is not None
    return cluster.pool_url


def test_pool_http_service(pool_url: str) -> None:
    assert httpx.get(f"{pool_url}/health").status_code == 200
    assert httpx.post(f"{pool_url}/store", json={"keys": [5, 6, 7]}).json() == {"stored": 3}
    assert httpx.post(f"{pool_url}/lookup", json={"keys": [5, 6, 8]}).json() == {"hits": 2}
    stats = httpx.get(f"{pool_url}/stats").json()
    assert stats["chunks"] == 3 and stats["capacity_chunks"] == 8
    assert "lmcache:num_hit_chunks_total 2" in httpx.get(f"{pool_url}/metrics").text
    r = httpx.post(f"{pool_url}/lookup", json={"keys": "nope"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert httpx.post(f"{pool_url}/clear").json() == {"cleared": 3}
