"""The Redis backend on a real three-master Redis Cluster started by the test: one slot per
deployment (its `{prefix}` hash tag), so several deployments spread over the nodes while
each script call stays on one node. (The index contract also runs on a cluster: see
test_contract.py.)"""

from __future__ import annotations

import uuid

import pytest
from redis.crc import key_slot

from cache_client.redis_index import RedisIndex
from loadtests.e2e.replicas import RedisClusterNodes
from router.config_loader import flat_config
from router.load.redis import RedisLoadBoard
from router.services import redis_components

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def prefixes_on_distinct_nodes(cluster: RedisClusterNodes, n: int) -> list[tuple[str, int]]:
    """`n` deployment prefixes whose slots are served by `n` different masters."""
    chosen: dict[int, str] = {}
    while len(chosen) < n:
        prefix = f"test-cl-{uuid.uuid4().hex[:8]}"
        port = cluster.node_for_slot(key_slot(("{" + prefix + "}").encode()))
        chosen.setdefault(port, prefix)
    return [(p, port) for port, p in chosen.items()]


def keys_per_node(cluster: RedisClusterNodes, prefix: str) -> dict[int, list[bytes]]:
    out = {}
    for server in cluster.servers:
        with server.client() as c:
            out[server.port] = list(c.scan_iter(match="{" + prefix + "}*", count=1000))
    return out


async def test_deployments_spread_over_nodes_and_each_stays_in_one_slot(redis_cluster: RedisClusterNodes) -> None:
    deployments = prefixes_on_distinct_nodes(redis_cluster, 2)
    built = []
    for i, (prefix, port) in enumerate(deployments):
        # Both URL forms; the first names only a node that does not serve the slot, so
        # the client has to follow the cluster's redirection.
        other = next(p for p in redis_cluster.ports if p != port)
        url = (f"redis+cluster://127.0.0.1:{other}" if i == 0
               else f"redis://127.0.0.1:{redis_cluster.ports[0]}/0?cluster=true")
        parts = redis_components(flat_config(redis=url, redis_prefix=prefix, kv_capacity_tokens=100))
        assert parts["index"].backend.settings.cluster
        assert await parts["index"].connect()
        built.append((prefix, port, parts["index"], parts["loads"]))
    try:
        for n, (_, _, index, loads) in enumerate(built):
            index.set_capacity("w0", 30)
            await index.record("w0", [1, 2, 3, 4], [10, 10, 10, 10])
            await index.record("w1", [1, 2], [1, 1])
            assert (await index.lookup([1, 2, 3, 4])).depths == {"w0": 3, "w1": 2}
            assert await index.usage() == {"w0": 30, "w1": 2}
            loads.acquire("w1", 0.5 + n)
            assert await loads.sync()
            assert index.stats["fallback_lookups"] == 0
        # A second replica of deployment 0 sees its view, and not deployment 1's load.
        prefix0 = built[0][0]
        twin = redis_components(flat_config(redis=redis_cluster.url, redis_prefix=prefix0))
        twin_index: RedisIndex = twin["index"]
        twin_loads: RedisLoadBoard = twin["loads"]
        assert await twin_index.connect()
        assert (await twin_index.lookup([1, 2, 3])).depths == {"w0": 3, "w1": 2}
        assert await twin_loads.sync()
        assert twin_loads.inflight("w1") == 1
        assert twin_loads.snapshot(["w1"])[0].queued_prefill_s == pytest.approx(0.5)
        await twin_index.close()

        for prefix, port, _, _ in built:
            per_node = keys_per_node(redis_cluster, prefix)
            # Index and load-board keys alike: all on the one master serving the tag's slot.
            assert per_node[port], prefix
            assert all(not keys for p, keys in per_node.items() if p != port)
            slots = {key_slot(k) for k in per_node[port]}
            assert slots == {key_slot(("{" + prefix + "}").encode())}
    finally:
        for prefix, _, index, _ in built:
            await index.close()
            for server in redis_cluster.servers:
                with server.client() as c:
                    for key in c.scan_iter(match="{" + prefix + "}*"):
                        c.delete(key)

