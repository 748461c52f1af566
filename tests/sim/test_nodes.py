"""A multi-node simulated fleet: one pool per node, disk and remote tiers, their costs and
per-tier counters, and the topology the router is given."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtests.sim.cluster import SimCluster, node_flags, topology
from loadtests.sim.costs import DISK, POOL, REMOTE, build_cost_model
from loadtests.sim.engine import Engine, Seq, block_hashes_of
from loadtests.sim.pool import CHUNK_TOKENS, ChunkStore, NodeStore
from normalizer.prefix import chat_segments
from router.cost import CostModel as RouterCostModel
from tests.support.wait import wait_for

MODEL = "sim-llama3-8b"
TIERS = ("gpu", POOL, DISK, REMOTE)
COST = build_cost_model("h200-llama3-8b")


def chat(content: str, max_tokens: int = 1) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


def prompt_tokens(body: dict[str, Any]) -> int:
    return len(b"".join(chat_segments(body))) // 4


def metrics(url: str) -> dict[str, float]:
    """Every sample of a worker's /metrics, keyed by its name (and its tier, if it has one)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        labels, value = rest.rsplit("} ", 1)
        if 'tier="' in labels:
            name += ":" + labels.split('tier="', 1)[1].split('"', 1)[0]
        out.setdefault(name, float(value))
    return out


def tiers(url: str) -> dict[str, float]:
    m = metrics(url)
    return {t: m[f"kvroute_sim:cached_tokens_total:{t}"] for t in TIERS}


def ttft_sum(url: str) -> float:
    return metrics(url)["vllm:time_to_first_token_seconds_sum"]


def serve(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float], float]:
    """Send one request; its body, the tier counters' increase and its TTFT (simulated)."""
    before, t0 = tiers(url), ttft_sum(url)
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    after = tiers(url)
    return r.json(), {t: after[t] - before[t] for t in TIERS}, ttft_sum(url) - t0


def pool_stats(cluster: SimCluster, node: str) -> dict[str, Any]:
    return httpx.get(f"{cluster.pool_urls[node]}/stats").json()


def assert_tiers_add_up(url: str) -> None:
    """gpu + pool + disk + remote = every prompt token not recomputed."""
    m = metrics(url)
    by_tier = sum(m[f"kvroute_sim:cached_tokens_total:{t}"] for t in TIERS)
    assert by_tier == m["vllm:prefix_cache_hits_total"] + m["vllm:external_prefix_cache_hits_total"]


# -- pure parts ------------------------------------------------------------------------------


def test_topology_splits_workers_in_order() -> None:
    assert topology(8, 2) == {"n0": ["w0", "w1", "w2", "w3"], "n1": ["w4", "w5", "w6", "w7"]}
    assert topology(3, 1) == {"n0": ["w0", "w1", "w2"]}
    assert node_flags(topology(4, 2)) == ["--node", "n0=w0,w1", "--node", "n1=w2,w3"]
    with pytest.raises(ValueError, match="evenly"):
        topology(7, 2)
    with pytest.raises(ValueError, match="evenly"):
        SimCluster(workers=3, nodes=2)
    with pytest.raises(ValueError, match="pool"):
        SimCluster(workers=2, pool=False, remote_capacity_tokens=1000)


def test_tier_costs_follow_the_routers_defaults() -> None:
    kv = COST.kv_bytes_per_token_per_gpu
    assert COST.disk_load_s(1) == pytest.approx(kv / 7.0e9 + COST.pool_load_s(1))
    assert COST.remote_load_s(1) == pytest.approx(kv * 8 / 100e9 + COST.pool_load_s(1))
    router = RouterCostModel()
    assert COST.disk_load_s(1) == pytest.approx(router.disk_load_s_per_token, rel=0.01)
    assert COST.remote_load_s(1) == pytest.approx(router.remote_load_s_per_token, rel=0.01)
    # Under TP each GPU loads its share, as it does from the pool.
    tp8 = build_cost_model("h200-qwen2.5-72b-tp8")
    assert tp8.disk_load_s(1) == pytest.approx(tp8.kv_bytes_per_token / 8 / 7.0e9 + tp8.pool_load_s(1))


def test_node_store_loads_in_lmcaches_order_and_promotes_into_its_pool() -> None:
    remote = ChunkStore(100 * CHUNK_TOKENS)
    a = NodeStore(ChunkStore(100 * CHUNK_TOKENS), ChunkStore(100 * CHUNK_TOKENS), remote, node="n0")
    b = NodeStore(ChunkStore(100 * CHUNK_TOKENS), ChunkStore(100 * CHUNK_TOKENS), remote, node="n1")
    a.store([1, 2, 3])
    assert a.disk is not None and a.disk.held([1, 2, 3]) == 3 and remote.held([1, 2, 3]) == 3
    assert a.lookup([1, 2, 3, 4]) == [(POOL, 3)]
    # n1 reaches none of n0's pool or disk, only the remote tier; what it loads is promoted.
    assert b.lookup([1, 2, 3]) == [(REMOTE, 3)]
    assert b.pool.held([1, 2, 3]) == 3 and b.lookup([1, 2, 3]) == [(POOL, 3)]
    # Out of n0's pool, on its disk and remote: LMCache asks its disk first (even where the
    # network is the faster of the two at the default bandwidths).
    a.pool.clear()
    assert a.lookup([1, 2]) == [(DISK, 2)]
    a.pool.clear()
    assert a.disk is not None
    a.disk.clear()
    assert a.lookup([1, 2, 3]) == [(REMOTE, 3)]
    assert a.lookup([1, 2, 3]) == [(POOL, 3)]
    assert a.stats()["loaded_chunks"] == {POOL: 6, DISK: 2, REMOTE: 3}
    # Mixed: the run continues across tiers, chunk by chunk.
    a.store([10, 11, 12])
    a.pool.lru.pop(11)
    a.disk.lru.pop(11)
    assert a.lookup([10, 11, 12, 13]) == [(POOL, 1), (REMOTE, 1), (POOL, 1)]


def test_node_store_without_write_through_and_bounded_tiers() -> None:
    remote = ChunkStore(2 * CHUNK_TOKENS)
    a = NodeStore(ChunkStore(CHUNK_TOKENS), ChunkStore(2 * CHUNK_TOKENS), remote, remote_write_through=False)
    a.store([1, 2, 3])
    assert len(remote.lru) == 0  # not written through: something else fills it
    assert list(a.pool.lru) == [1]  # one chunk: the LRU keeps the head of the chain
    assert a.disk is not None and list(a.disk.lru) == [2, 1]
    remote.store([3])
    assert a.lookup([1, 2, 3, 4]) == [(POOL, 1), (DISK, 1), (REMOTE, 1)]


def test_engine_charges_each_tier_its_cost() -> None:
    data = b"tiers " * 700  # 1050 tokens: 4 full chunks
    s = Seq(
        id="r", prompt_len=len(data) // 4, max_tokens=1, block_hashes=block_hashes_of(data), arrival=0.0,
        pool_hit_tokens=1024, pool_runs=[(POOL, 256), (REMOTE, 512), (DISK, 256)],
    )  # fmt: skip
    engine = Engine(COST, capacity_tokens=100_000, has_pool=True)
    engine.add(s)
    step = engine.schedule()
    assert step is not None
    assert (step.pool_tokens, step.remote_tokens, step.disk_tokens) == (256, 512, 256)
    assert step.duration == COST.step_s([(1024, s.prompt_len)], [], 256, 256, 512)
    expected_load = COST.pool_load_s(256) + COST.remote_load_s(512) + COST.disk_load_s(256)
    assert step.duration - COST.step_s([(1024, s.prompt_len)], []) == pytest.approx(expected_load)
    assert engine.counters.tier_hits == {POOL: 256, DISK: 256, REMOTE: 512}
    assert engine.counters.external_hits == 1024 and s.tier_loaded_tokens == {POOL: 256, REMOTE: 512, DISK: 256}


def test_print_topology() -> None:
    cmd = [sys.executable, "-m", "router.cli", "sim-cluster", "--workers", "8", "--nodes", "2", "--print-topology"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "--node n0=w0,w1,w2,w3 --node n1=w4,w5,w6,w7\n"
    bad = subprocess.run([*cmd[:5], "7", *cmd[6:]], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "divisible" in bad.stderr


# -- two nodes, a small pool and a disk tier under it ---------------------------------------


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[SimCluster]:
    with SimCluster(
        workers=4, nodes=2, time_scale=0.01, pool_capacity_tokens=16 * CHUNK_TOKENS, disk_capacity_tokens=1_000_000
    ) as c:
        yield c


def wait_stored(cluster: SimCluster, node: str, before: int, chunks: int) -> None:
    """Until the node's pool has taken `chunks` new chunks since it had stored `before`."""
    wait_for(lambda: pool_stats(cluster, node)["stored_chunks"] >= before + chunks)


def test_workers_are_split_over_nodes(two_nodes: SimCluster) -> None:
    c = two_nodes
    assert c.topology == {"n0": ["w0", "w1"], "n1": ["w2", "w3"]}
    assert c.node_of == {"w0": "n0", "w1": "n0", "w2": "n1", "w3": "n1"}
    assert c.router_node_args() == ["--node", "n0=w0,w1", "--node", "n1=w2,w3"]
    assert len(set(c.pool_urls.values())) == 2 and c.pool_url == c.pool_urls["n0"]
    for worker, url in c.worker_urls.items():
        state = httpx.get(f"{url}/sim/state").json()
        assert state["node"] == c.node_of[worker] and state["pool"] == c.pool_urls[c.node_of[worker]]
    for node in ("n0", "n1"):
        stats = pool_stats(c, node)
        assert stats["node"] == node and stats["capacity_chunks"] == 16 and "remote" not in stats


def test_a_prefix_is_a_pool_hit_on_its_node_and_a_recompute_on_the_other(two_nodes: SimCluster) -> None:
    c = two_nodes
    w0, w1, w2 = (c.worker_urls[w] for w in ("w0", "w1", "w2"))
    body = chat("node-local " * 600)
    prompt = prompt_tokens(body)
    hit = prompt // CHUNK_TOKENS * CHUNK_TOKENS
    assert 4 * CHUNK_TOKENS <= hit < prompt
    before = pool_stats(c, "n0")["stored_chunks"]
    first, _, _ = serve(w0, body)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_stored(c, "n0", before, hit // CHUNK_TOKENS)
    same_node, grew, ttft = serve(w1, body)
    assert same_node["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    assert grew == {"gpu": 0, POOL: hit, DISK: 0, REMOTE: 0}
    assert ttft == pytest.approx(COST.step_s([(hit, prompt)], [], pool_tokens=hit), rel=1e-9)
    other_node, grew, ttft = serve(w2, body)
    assert other_node["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert grew == dict.fromkeys(TIERS, 0)
    assert ttft == pytest.approx(COST.step_s([(0, prompt)], []), rel=1e-9)
    for url in (w0, w1, w2):
        assert_tiers_add_up(url)


def test_disk_serves_what_the_pool_evicted(two_nodes: SimCluster) -> None:
    c = two_nodes
    w0, w1 = c.worker_urls["w0"], c.worker_urls["w1"]
    body = chat("spill-to-disk " * 450)
    prompt = prompt_tokens(body)
    chunks = prompt // CHUNK_TOKENS
    hit = chunks * CHUNK_TOKENS
    assert chunks >= 4
    stored = pool_stats(c, "n0")["stored_chunks"]
    serve(w0, body)
    wait_stored(c, "n0", stored, chunks)
    # Enough other prompts through n0's 16-chunk pool to push every chunk of the first out.
    for i in range(-(-16 // chunks) + 1):
        filler = chat(f"filler-{i} " * 600)
        stored = pool_stats(c, "n0")["stored_chunks"]
        serve(w0, filler)
        wait_stored(c, "n0", stored, prompt_tokens(filler) // CHUNK_TOKENS)
    wait_for(lambda: pool_stats(c, "n0")["evicted_chunks"] >= chunks)
    on_disk, grew, ttft = serve(w1, body)
    assert on_disk["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    assert grew == {"gpu": 0, POOL: 0, DISK: hit, REMOTE: 0}
    assert ttft == pytest.approx(COST.step_s([(hit, prompt)], [], disk_tokens=hit), rel=1e-9)
    assert ttft > COST.step_s([(hit, prompt)], [], pool_tokens=hit)
    # What came from disk was promoted into the pool: the next load on n0 is a pool hit.
    assert httpx.post(f"{w0}/reset_prefix_cache").status_code == 200
    _, grew, _ = serve(w0, body)
    assert grew == {"gpu": 0, POOL: hit, DISK: 0, REMOTE: 0}
    assert pool_stats(c, "n0")["loaded_chunks"][DISK] >= chunks
    for url in (w0, w1):
        assert_tiers_add_up(url)


# -- two nodes and a remote tier -------------------------------------------------------------


def test_remote_tier_serves_the_other_node() -> None:
    with SimCluster(workers=4, nodes=2, time_scale=0.01, remote_capacity_tokens=1_000_000, pool_in_process=True) as c:
        w0, w1, w2, w3 = (c.worker_urls[f"w{i}"] for i in range(4))
        body = chat("remote " * 9000)
        prompt = prompt_tokens(body)
        hit = prompt // CHUNK_TOKENS * CHUNK_TOKENS
        assert hit >= 60 * CHUNK_TOKENS
        _, _, recompute = serve(w0, body)
        # Written through: n1's server sees the chunks n0's worker computed.
        wait_for(lambda: pool_stats(c, "n1")["remote"]["chunks"] == hit // CHUNK_TOKENS)
        _, grew, pool_hit = serve(w1, body)
        assert grew == {"gpu": 0, POOL: hit, DISK: 0, REMOTE: 0}
        out, grew, remote_hit = serve(w2, body)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
        assert grew == {"gpu": 0, POOL: 0, DISK: 0, REMOTE: hit}
        assert remote_hit == pytest.approx(COST.step_s([(hit, prompt)], [], remote_tokens=hit), rel=1e-9)
        assert pool_hit < remote_hit < recompute
        # n1's pool now holds what w2 loaded from remote: its other worker hits its pool.
        _, grew, _ = serve(w3, body)
        assert grew == {"gpu": 0, POOL: hit, DISK: 0, REMOTE: 0}
        for url in (w0, w1, w2, w3):
            assert_tiers_add_up(url)


def test_one_node_is_the_shared_pool_as_before() -> None:
    with SimCluster(workers=2, time_scale=0.01) as c:
        assert c.topology == {"n0": ["w0", "w1"]} and c.pool_urls == {"n0": c.pool_url}
        assert c.pool_url == f"http://127.0.0.1:{c.base_port + 2}"
        body = chat("one node " * 400)
        hit = prompt_tokens(body) // CHUNK_TOKENS * CHUNK_TOKENS
        serve(c.worker_urls["w0"], body)
        wait_for(lambda: httpx.get(f"{c.pool_url}/stats").json()["chunks"] >= hit // CHUNK_TOKENS)
        assert httpx.post(f"{c.pool_url}/lookup", json={"keys": [1]}).json() == {"hits": 0}
        _, grew, _ = serve(c.worker_urls["w1"], body)
        assert grew == {"gpu": 0, POOL: hit, DISK: 0, REMOTE: 0}
        assert "node" not in httpx.get(f"{c.pool_url}/stats").json()
