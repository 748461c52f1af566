"""Nodes and tiers: each node's pool and disk serve its own workers, the remote tier every
worker; a candidate is priced by the cheapest copy it can actually load (pure logic here,
then the router in process: what it records where, what /debug/route shows)."""

from __future__ import annotations

import httpx
import pytest

from cache_client.base import POOL, IndexView, key_tokens_of
from cache_client.kv_events import KvEvent, KvEventIngestor, KvEventSource
from cache_client.memory import MemoryIndex
from cache_client.tiers import DEFAULT_NODE, REMOTE, Tiers, disk_location, pool_location
from normalizer import chat_segments, prefix_chain
from normalizer.prefix import PrefixKey
from router.app import build_app
from router.config_loader import flat_config, load_config
from router.cost import CostModel, CostSettings, Held, Reuse
from router.policies import make_policy
from router.routing import RouteRequest, WorkerLoad
from router.workers import WorkerSpec
from tests.support.upstream import RecordingUpstream

COST = CostModel()
TOKEN = "admin-topology-1234"


def chain(*contents: str):
    body = {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}
    return prefix_chain("m", chat_segments(body))


def fleet(nodes: dict[str, list[str]], **state: dict) -> list[WorkerLoad]:
    return [WorkerLoad(w, node=node, **state.get(w, {})) for node, names in nodes.items() for w in names]


TWO_NODES = {"n0": ["a0", "a1"], "n1": ["b0", "b1"]}
SATURATED_N0 = {w: {"inflight": 8, "queued_prefill_s": 0.8, "prefilling": 2} for w in TWO_NODES["n0"]}


# -- the cost model's plan -----------------------------------------------------------------
def test_a_fleet_without_slower_tiers_prices_the_pool_as_before() -> None:
    """One pool: reuse the longer of GPU and pool, copy the difference (the old formula)."""
    plan, seconds = COST.reuse(Held(gpu=1000, pool=6000), 9000)
    assert plan == Reuse(gpu=1000, pool=5000)
    assert seconds == pytest.approx(COST.pool_load_s(5000) + COST.prefill_s(6000, 9000))
    assert COST.reuse(Held(gpu=4000, pool=2000), 9000) == (Reuse(gpu=4000), COST.prefill_s(4000, 9000))
    assert COST.reuse(Held(), 9000) == (Reuse(), COST.prefill_s(0, 9000))


def test_each_run_is_copied_from_the_first_tier_lmcache_asks() -> None:
    """The pool holds the head, the disk more, the remote tier more still: LMCache loads the
    head from the pool, the next run from the disk, the rest from remote."""
    plan, seconds = COST.reuse(Held(gpu=0, pool=2000, disk=10_000, remote=30_000), 30_000)
    assert plan == Reuse(gpu=0, pool=2000, disk=8000, remote=20_000)
    expected = (
        2000 * COST.pool_load_s_per_token + 8000 * COST.disk_load_s_per_token + 20_000 * COST.remote_load_s_per_token
    )
    assert seconds == pytest.approx(expected)
    assert plan.tier == "remote" and plan.tokens == 30_000 and plan.copied == 30_000
    # A run both the disk and the remote tier hold comes from the disk, slower as it is.
    assert COST.disk_load_s_per_token > COST.remote_load_s_per_token
    assert COST.reuse(Held(disk=20_000, remote=20_000), 30_000)[0] == Reuse(disk=20_000)
    # What the GPU holds is kept; copies start after it.
    assert COST.reuse(Held(gpu=5000, pool=4000, remote=9000), 10_000)[0] == Reuse(gpu=5000, remote=4000)


def test_the_engine_loads_what_it_finds_even_where_recomputing_were_cheaper() -> None:
    """vLLM's connector loads every token LMCache finds: the prediction follows it."""
    slow = CostModel(remote_load_s_per_token=200e-6)  # ten times a token's prefill
    plan, seconds = slow.reuse(Held(remote=4000), 4096)
    assert plan == Reuse(remote=4000) and seconds == pytest.approx(0.8 + slow.prefill_s(4000, 4096))


def test_tier_costs_derive_from_bandwidths_and_explicit_ones_are_held_fixed() -> None:
    s = CostSettings()
    # Llama-3-8B bf16: 128 KiB a token; 7 GB/s NVMe, 100 Gb/s network, then the 2.4 µs copy.
    assert s.value("disk_load_us") == pytest.approx(131072 / 7e3 + 2.4)
    assert s.value("remote_load_us") == pytest.approx(131072 * 8 / 100e3 + 2.4)
    assert CostSettings(remote_gbps=400).model().remote_load_s_per_token == pytest.approx((131072 * 8 / 400e3 + 2.4) * 1e-6)
    assert CostSettings(kv_bytes_per_token=327_680).value("disk_load_us") > s.value("disk_load_us")
    assert s.fixed() == frozenset()
    assert CostSettings(remote_gbps=25).fixed() == {"remote_load_s_per_token"}
    assert CostSettings(disk_load_us=30.0).fixed() == {"disk_load_s_per_token"}
    with pytest.raises(ValueError):
        CostSettings(remote_gbps=0)


# -- the decision ------------------------------------------------------------------------
def test_another_nodes_pool_is_a_recompute() -> None:
    """A prefix held only in n0's pool while both n0 workers are saturated: n1's candidates
    are priced as a recompute (tier none), n0's as pool copies."""
    c = chain("x" * 40_000, "y" * 40)
    view = IndexView({pool_location("n0"): 2})
    d = make_policy("cache_aware").choose(RouteRequest(c), view, fleet(TWO_NODES, **SATURATED_N0), COST)
    by = {s.worker: s for s in d.scores}
    for w in TWO_NODES["n0"]:
        assert by[w].reuse == Reuse(pool=c.tokens_at_depth(2))
    for w in TWO_NODES["n1"]:
        assert by[w].reuse == Reuse() and by[w].prefill_s == pytest.approx(COST.prefill_s(0, c.total_tokens))
    # The n0 queues cost more than n1's recompute: n1 takes it, and says it passed a copy over.
    assert d.worker in TWO_NODES["n1"] and d.reason == "overload" and d.cached_tokens == 0


def test_the_remote_tier_prices_a_copy_for_every_node() -> None:
    c = chain("x" * 40_000, "y" * 40)
    held = c.tokens_at_depth(2)
    view = IndexView({pool_location("n0"): 2, REMOTE: 2})
    d = make_policy("cache_aware").choose(RouteRequest(c), view, fleet(TWO_NODES, **SATURATED_N0), COST)
    by = {s.worker: s for s in d.scores}
    assert by["b0"].reuse == Reuse(remote=held) and by["a0"].reuse == Reuse(pool=held)
    expected = COST.remote_load_s_per_token * held + COST.prefill_s(held, c.total_tokens)
    assert by["b0"].prefill_s == pytest.approx(expected)
    assert d.worker in TWO_NODES["n1"] and (d.reason, d.cached_tokens) == ("remote_hit", held)


def test_a_nodes_disk_serves_its_own_workers_only() -> None:
    c = chain("x" * 120_000, "y" * 40)
    held = c.tokens_at_depth(2)
    view = IndexView({disk_location("n1"): 2})
    d = make_policy("cache_aware").choose(RouteRequest(c), view, fleet(TWO_NODES), COST)
    by = {s.worker: s for s in d.scores}
    assert by["b1"].reuse == Reuse(disk=held) and by["a1"].reuse == Reuse()
    assert d.worker in TWO_NODES["n1"] and d.reason == "disk_hit"


def test_without_nodes_the_one_pool_serves_every_worker() -> None:
    """A fleet given no nodes is one node whose pool is the old shared `POOL`."""
    assert pool_location(DEFAULT_NODE) == POOL
    c = chain("x" * 8000, "y" * 40)
    d = make_policy("cache_aware").choose(
        RouteRequest(c), IndexView({POOL: 2}), [WorkerLoad("a"), WorkerLoad("b")], COST
    )
    assert all(s.reuse == Reuse(pool=c.tokens_at_depth(2)) for s in d.scores)
    assert d.reason == "pool_hit"


def test_tiers_say_where_a_served_prompt_is_written() -> None:
    assert Tiers().written("w0", "n0") == ("w0",)
    assert Tiers(pool_capacity_tokens=10).written("w0", "n0") == ("w0", pool_location("n0"))
    every = Tiers(10, 20, 30)
    assert every.written("w0", "n1") == ("w0", "__pool__:n1", "__disk__:n1", REMOTE)
    assert Tiers(10, 0, 30, remote_write_through=False).written("w0", "n1") == ("w0", "__pool__:n1")
    assert every.capacities("n1") == [("__pool__:n1", 10), ("__disk__:n1", 20), (REMOTE, 30)]


# -- configuration -----------------------------------------------------------------------
def test_nodes_come_from_flags_the_environment_and_yaml(tmp_path) -> None:
    argv = ["--worker", "w0=http://h:1", "--worker", "w1=http://h:2", "--node", "n0=w0", "--node", "n1=w1,w2"]
    assert load_config(argv, {}).nodes == {"w0": "n0", "w1": "n1", "w2": "n1"}
    assert load_config([], {"KVROUTE_NODES": "n0=w0,w1;n1=w2"}).nodes == {"w0": "n0", "w1": "n0", "w2": "n1"}
    path = tmp_path / "kvroute.yaml"
    path.write_text(
        "workers:\n  - {name: w0, url: 'http://h:1', node: n0}\n  - {name: w1, url: 'http://h:2'}\n"
        "nodes: {n1: [w1]}\npool_capacity_tokens: 1000\ndisk_capacity_tokens: 5000\nremote_gbps: 25\n"
    )
    config = load_config(["--config", str(path)], {})
    assert [w.node for w in config.workers] == ["n0", None] and config.nodes == {"w1": "n1"}
    assert (config.index.pool_capacity_tokens, config.index.disk_capacity_tokens) == (1000, 5000)
    assert config.cost.remote_gbps == 25
    with pytest.raises(SystemExit, match="two nodes"):
        load_config(["--node", "n0=w0", "--node", "n1=w0"], {})
    with pytest.raises(SystemExit, match="NODE=W1"):
        load_config(["--node", "w0"], {})


async def test_cpu_kv_events_land_in_the_publishing_workers_node_pool() -> None:
    index = MemoryIndex()
    nodes = {"w1": "n0", "w2": "n1"}
    ing = KvEventIngestor(index, pool_of=lambda w: pool_location(nodes[w]))
    stored = KvEvent("stored", (11, 12), block_size=16, medium="CPU")
    await ing.apply(KvEventSource("w2", "tcp://127.0.0.1:1"), [stored])
    keys = [PrefixKey(11), PrefixKey(12)]
    assert (await index.lookup(keys)).depths == {"__pool__:n1": 2}
    await ing.apply(KvEventSource("w1", "tcp://127.0.0.1:2"), [KvEvent("removed", (11, 12), medium="CPU")])
    assert (await index.lookup(keys)).depths == {"__pool__:n1": 2}  # n0's pool held none
    # Without a topology, every worker's CPU events describe the one pool.
    one = MemoryIndex()
    await KvEventIngestor(one).apply(KvEventSource("w1", "tcp://127.0.0.1:1"), [stored])
    assert (await one.lookup(keys)).depths == {POOL: 2}


# -- the router in process ---------------------------------------------------------------
async def test_the_router_records_on_the_serving_workers_node_and_debug_route_names_tiers() -> None:
    index = MemoryIndex(1_000_000)
    body = {"model": "rec-model", "messages": [{"role": "user", "content": "Plan a long trip, day by day. " * 200}]}
    with RecordingUpstream() as a0, RecordingUpstream() as b0:
        config = flat_config(
            workers=[WorkerSpec("a0", a0.url), WorkerSpec("b0", b0.url, node="n1")], nodes={"n0": ["a0"]},
            policy="cache_aware", admin_token=TOKEN, pool_capacity_tokens=50_000, remote_capacity_tokens=90_000,
            remote_write_through=False,
        )
        app = build_app(config, index=index)
        async with app.lifespan(app.api):
            assert {w.name: w.node for w in app.fleet} == {"a0": "n0", "b0": "n1"}
            # Each node's pool got its capacity model, and so did the remote tier.
            assert index._locations["__pool__:n0"].capacity == 50_000
            assert index._locations["__pool__:n1"].capacity == 50_000
            assert index._locations[REMOTE].capacity == 90_000
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
                resp = await client.post("/v1/chat/completions", json=body, headers={"x-session-id": "s"})
                assert resp.status_code == 200, resp.text
                served = resp.headers["x-kvroute-worker"]
                node = {"a0": "n0", "b0": "n1"}[served]
                other = ({"n0", "n1"} - {node}).pop()
                chain = app.chains.build(app.proxy.canonical(body, "chat"), "chat")
                view = await index.lookup(chain.keys)
                n = len(chain.keys)
                assert view.depth(served) == n and view.depth(pool_location(node)) == n
                # Not the other node's pool; not the remote tier (not written through).
                assert view.depth(pool_location(other)) == 0 and view.depth(REMOTE) == 0
                # The remote tier filled by someone else (as KV events would say).
                await index.record(REMOTE, chain.keys, key_tokens_of(chain.cum_tokens))
                why = await client.post("/debug/route", json=body, headers={"authorization": f"Bearer {TOKEN}"})
                assert why.status_code == 200, why.text
                rows = {row["worker"]: row for row in why.json()["candidates"]}
                assert rows[served]["tier"] == "gpu" and rows[served]["node"] == node
                stranger = next(w for w in rows if w != served)
                assert rows[stranger]["tier"] == "remote" and rows[stranger]["cached_tokens_remote"] == chain.total_tokens
                assert rows[stranger]["cached_tokens_pool"] == 0
                # The conversation's worker drained: the other takes it, copying from remote.
                app.fleet.drain(served)
                resp = await client.post("/v1/chat/completions", json=body, headers={"x-session-id": "s"})
                assert (resp.headers["x-kvroute-worker"], resp.headers["x-kvroute-route-reason"]) == (stranger, "remote_hit")
                metrics = (await client.get("/metrics")).text
            assert f'kvroute_predicted_copied_tokens_total{{tier="remote"}} {chain.total_tokens}' in metrics
            assert 'tier="pool"' not in metrics
