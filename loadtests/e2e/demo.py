"""`kvroute demo`: a simulated cluster, the router, and a short multi-turn agent workload.

It starts a small simulated vLLM cluster (H200 / Llama-3-8B costs, prefix caching, a
shared CPU pool), then for each policy a fresh cluster and router, drives the same agent
sessions through the router with streaming requests, and prints time to first token (in
simulated seconds) side by side. Nothing but this package is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import httpx
import orjson

from loadtests.sim.cluster import SimCluster
from loadtests.support.processes import stop_children_on_signals
from loadtests.support.routerproc import RouterProcess

MODEL = "sim-llama3-8b"
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file from the repository.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite and return its output.",
     "parameters": {"type": "object", "properties": {"target": {"type": "string"}, "verbose": {"type": "boolean"}}}}},
]


@dataclass(frozen=True)
class DemoSettings:
    workers: int = 4
    sessions: int = 32
    turns: int = 8
    time_scale: float = 0.25
    """Real seconds per simulated second. Small values amplify this machine's own HTTP and
    JSON overheads (1 ms real = 1/time_scale ms simulated), so the demo stays near 1/4."""
    pool: bool = False
    """Give the workers a shared LMCache-like CPU pool (off: plain vLLM prefix caching, the
    incident's baseline)."""
    think_s: float = 2.0
    """Simulated seconds a session thinks (runs its tool) between turns."""
    arrival_s: float = 0.75
    """Simulated seconds between session starts."""
    seed: int = 7


def _system_prompt(group: int) -> str:
    rules = " ".join(f"Rule {i}: keep changes small, tested and reviewed ({group})." for i in range(60))
    return f"You are coding agent team {group}. {rules}"


def _tool_result(rng: random.Random, kb: int) -> str:
    words = ["def", "return", "assert", "self", "import", "value", "test", "passed", "error", "line"]
    return " ".join(rng.choice(words) for _ in range(kb * 180))


async def _session(client: httpx.AsyncClient, url: str, s: DemoSettings, sid: int, ttfts: list[list[float]]) -> None:
    rng = random.Random(s.seed * 1000 + sid)
    await asyncio.sleep(sid * s.arrival_s * s.time_scale)
    messages: list[dict] = [{"role": "system", "content": _system_prompt(sid % 2)}]
    for turn in range(s.turns):
        messages.append({"role": "user", "content": f"Session {sid} step {turn}: " + _tool_result(rng, 1)})
        body = {"model": MODEL, "messages": messages, "tools": TOOLS, "stream": True, "max_tokens": 24}
        start = time.perf_counter()
        first = None
        text = []
        async with client.stream("POST", url + "/v1/chat/completions", content=orjson.dumps(body),
                                 headers={"content-type": "application/json"}) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter() - start
                delta = orjson.loads(line[6:])["choices"]
                if delta:
                    text.append(delta[0]["delta"].get("content") or "")
        ttfts[turn].append((first or 0.0) / s.time_scale)
        messages.append({"role": "assistant", "content": "".join(text)})
        messages.append({"role": "user", "content": "Tool output:\n" + _tool_result(rng, 10)})
        await asyncio.sleep(s.think_s * s.time_scale)


async def _drive(url: str, s: DemoSettings) -> list[list[float]]:
    ttfts: list[list[float]] = [[] for _ in range(s.turns)]
    limits = httpx.Limits(max_connections=s.sessions * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as client:
        await asyncio.gather(*(_session(client, url, s, i, ttfts) for i in range(s.sessions)))
    return ttfts


def _hit_ratio(worker_urls: dict[str, str]) -> float:
    queries = hits = 0.0
    for url in worker_urls.values():
        for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
            name, _, value = line.rpartition(" ")
            metric = name.split("{")[0]
            if metric == "vllm:prefix_cache_queries_total":
                queries += float(value)
            elif metric in ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total"):
                hits += float(value)
    return hits / queries if queries else 0.0


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_policy(policy: str, s: DemoSettings) -> dict:
    # The workload replays scripted replies sized by max_tokens (as `kvroute bench` does): a
    # simulated tool call on "auto" would cut its generations short.
    with SimCluster(
        workers=s.workers, time_scale=s.time_scale, pool=s.pool, extra_args=["--auto-tool-calls", "text"]
    ) as cluster:
        extra = ["--pool-capacity-tokens", "50000000"] if cluster.pool_url else []
        with RouterProcess(cluster.worker_urls, policy=policy, extra_args=extra) as router:
            ttfts = asyncio.run(_drive(router.url, s))
        hit = _hit_ratio(cluster.worker_urls)
    flat = [t for turn in ttfts for t in turn]
    return {
        "policy": policy,
        "requests": len(flat),
        "ttft_mean_s": statistics.fmean(flat),
        "ttft_p50_s": _p(flat, 0.5),
        "ttft_p99_s": _p(flat, 0.99),
        "ttft_by_turn_s": [statistics.fmean(t) for t in ttfts],
        "worker_hit_ratio": hit,
    }


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvroute demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=DemoSettings.workers)
    p.add_argument("--sessions", type=int, default=DemoSettings.sessions)
    p.add_argument("--turns", type=int, default=DemoSettings.turns)
    p.add_argument("--time-scale", type=float, default=DemoSettings.time_scale)
    p.add_argument("--policies", default="random,cache_aware")
    p.add_argument("--pool", action="store_true", help="workers share a CPU pool (LMCache-like)")
    p.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = p.parse_args(argv)
    s = DemoSettings(workers=args.workers, sessions=args.sessions, turns=args.turns, time_scale=args.time_scale,
                     pool=args.pool)
    pool = "a shared CPU pool" if s.pool else "no shared pool"
    print(f"kvroute demo: {s.workers} simulated H200 workers (Llama-3-8B costs), {pool}, "
          f"{s.sessions} agent sessions x {s.turns} turns, time scale {s.time_scale}")
    results = []
    with stop_children_on_signals():
        for policy in args.policies.split(","):
            print(f"  running {policy} ...", flush=True)
            results.append(run_policy(policy, s))
    print()
    print(f"{'policy':<14}{'requests':>9}{'TTFT mean':>11}{'p50':>9}{'p99':>9}{'cache hits':>12}   mean TTFT by turn (s)")
    for r in results:
        turns = " ".join(f"{t:.2f}" for t in r["ttft_by_turn_s"])
        print(f"{r['policy']:<14}{r['requests']:>9}{r['ttft_mean_s']:>10.3f}s{r['ttft_p50_s']:>8.3f}s"
              f"{r['ttft_p99_s']:>8.3f}s{r['worker_hit_ratio']:>11.0%}   {turns}")
    if len(results) >= 2 and results[-1]["ttft_mean_s"] > 0:
        print(f"\nmean TTFT {results[0]['policy']} / {results[-1]['policy']}: "
              f"{results[0]['ttft_mean_s'] / results[-1]['ttft_mean_s']:.1f}x   (times in simulated seconds)")
    if args.json:
        print(orjson.dumps(results).decode())
    return 0
