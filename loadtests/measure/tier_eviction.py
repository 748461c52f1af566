"""A long conversation evicted from its node, continued on another node: loaded from the
remote tier at network cost, or recomputed where there is none.

    python -m loadtests.measure.tier_eviction [--tokens 30000] [--time-scale 1.0] [--out FILE]

Two simulated nodes of two workers (`kvroute sim-cluster --nodes 2`), each node with a
small pool, kvroute in front told the topology, the same fleet run twice: with a remote
tier every node reads (`--remote-capacity-tokens`) and without. In each:

1. node n1 is drained, and the conversation's first turn goes to a worker of n0: its
   prefix is then on that GPU, in n0's pool and (written through) in the remote tier;
2. other conversations, through the router, overflow n0's GPUs and pool (both in the
   simulator and in the router's LRU model of them, sized alike), so n0 no longer holds it;
3. n1 is back, and the conversation's next turn is sent. With the remote tier it goes to
   an n1 worker as a `remote_hit` and loads its history over the network; without, it is
   recomputed.

The report gives, per fleet, the turn's worker, node, route reason, the router's predicted
TTFT (`/debug/route` just before), its TTFT (simulated seconds: wall ÷ time scale) and the
tokens the worker served from each tier. JSON on stdout (and to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.benchmark.harness import TIER_COUNTER, TIERS, metric_sum, parse_prometheus
from loadtests.benchmark.workload import MODEL
from loadtests.sim.cluster import SimCluster
from loadtests.support.routerproc import RouterProcess
from normalizer.tokens import CHARS_PER_TOKEN

ADMIN = "tier-eviction-admin-token"
GPU_TOKENS = 48_000
"""Each simulated worker's KV (and the router's model of it): small, so a few long
conversations overflow it."""
POOL_TOKENS = 64_000
"""Each node's pool."""
REMOTE_TOKENS = 2_000_000
FILLERS = 12
FILLER_TOKENS = 12_000


def _text(tokens: int, seed: int) -> str:
    words = f"conversation {seed} says this again and again. "
    return (words * (tokens * CHARS_PER_TOKEN // len(words) + 1))[: tokens * CHARS_PER_TOKEN]


def _body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True}


async def _turn(client: httpx.AsyncClient, url: str, body: dict[str, Any], session: str) -> dict[str, Any]:
    """One streamed turn: its worker, route reason and wall seconds to the first chunk."""
    started = time.monotonic()
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers={"x-session-id": session}) as r:
        r.raise_for_status()
        ttft = None
        async for _ in r.aiter_bytes():
            if ttft is None:
                ttft = time.monotonic() - started
        return {"worker": r.headers["x-kvroute-worker"], "reason": r.headers["x-kvroute-route-reason"], "wall_ttft_s": ttft}


async def _admin(client: httpx.AsyncClient, url: str, action: str, workers: list[str]) -> None:
    for w in workers:
        (await client.post(f"{url}/admin/workers/{w}/{action}", headers={"authorization": f"Bearer {ADMIN}"})).raise_for_status()


async def _tier_tokens(client: httpx.AsyncClient, worker_url: str) -> dict[str, float]:
    parsed = parse_prometheus((await client.get(worker_url + "/metrics")).text)
    return {tier: metric_sum(parsed, TIER_COUNTER, tier=tier) for tier in TIERS}


async def run_fleet(remote: bool, tokens: int, time_scale: float) -> dict[str, Any]:
    tiers = ["--remote-capacity-tokens", str(REMOTE_TOKENS)] if remote else []
    cluster = SimCluster(
        workers=4, nodes=2, time_scale=time_scale, kv_capacity_tokens=GPU_TOKENS, pool_capacity_tokens=POOL_TOKENS,
        pool_in_process=True, extra_args=tiers,
    )  # fmt: skip
    await asyncio.to_thread(cluster.start)
    try:
        args = [
            "--kv-capacity-tokens", str(GPU_TOKENS), "--pool-capacity-tokens", str(POOL_TOKENS),
            "--admin-token", ADMIN, *cluster.router_node_args(), *tiers,
        ]  # fmt: skip
        router = RouterProcess(cluster.worker_urls, "cache_aware", args)
        await asyncio.to_thread(router.start)
        try:
            return await _scenario(cluster, router.url, tokens, time_scale)
        finally:
            await asyncio.to_thread(router.stop)
    finally:
        await asyncio.to_thread(cluster.stop)


async def _scenario(cluster: SimCluster, url: str, tokens: int, time_scale: float) -> dict[str, Any]:
    n0, n1 = cluster.topology["n0"], cluster.topology["n1"]
    history = [{"role": "system", "content": _text(tokens, 0)}, {"role": "user", "content": "Where were we?"}]
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        await _admin(client, url, "drain", n1)
        first = await _turn(client, url, _body(history), "long")
        for i in range(FILLERS):  # overflow n0's GPUs and pool with other conversations
            await _turn(client, url, _body([{"role": "user", "content": _text(FILLER_TOKENS, i + 1)}]), f"filler-{i}")
        await _admin(client, url, "undrain", n1)
        history += [{"role": "assistant", "content": "We were planning the trip."}, {"role": "user", "content": "Go on."}]
        body = _body(history)
        explained = await client.post(url + "/debug/route", json=body, headers={"authorization": f"Bearer {ADMIN}"})
        explained.raise_for_status()
        why = explained.json()
        before = {w: await _tier_tokens(client, u) for w, u in cluster.worker_urls.items()}
        turn = await _turn(client, url, body, "long")
        after = await _tier_tokens(client, cluster.worker_urls[turn["worker"]])
    served = {t: after[t] - before[turn["worker"]][t] for t in TIERS}
    return {
        "first_turn_worker": first["worker"],
        "worker": turn["worker"],
        "node": cluster.node_of[turn["worker"]],
        "reason": turn["reason"],
        "prompt_tokens": why["prompt_tokens"],
        "predicted_ttft_s": why["chosen"].get("predicted_ttft_s"),
        "ttft_s": turn["wall_ttft_s"] / time_scale,
        "served_tokens_by_tier": served,
        "first_turn_on_n0": first["worker"] in n0,
        "continued_on_n1": turn["worker"] in n1,
    }


async def main(tokens: int, time_scale: float) -> dict[str, Any]:
    fleets = {"remote": await run_fleet(True, tokens, time_scale), "no_remote": await run_fleet(False, tokens, time_scale)}
    remote, none = fleets["remote"]["ttft_s"], fleets["no_remote"]["ttft_s"]
    return {"tokens": tokens, "time_scale": time_scale, **fleets, "remote_over_recompute_ttft": remote / none if none else None}


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.measure.tier_eviction", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=30_000, help="the conversation's history, in tokens")
    p.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per simulated second")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    report = asyncio.run(main(args.tokens, args.time_scale))
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
