"""The Redis-backed shared index, measured: `python -m loadtests.measure.bench_index --out DIR`.

    python -m loadtests.measure.bench_index --out DIR [--parts lookup,memory,replicas,outage]
        [--conversations N] [--turns T] [--outage-s S]

Parts (each writes its section of DIR/bench_index.json; docs/redis.md summarizes them):

* lookup   — the time `index.lookup(chain)` adds to a routing decision: RedisIndex (one
             EVALSHA on a loopback Redis) against MemoryIndex, same content (8 workers plus
             the pool, 20,000 conversations), same chains (next turns of known
             conversations and new ones), under uvloop like the router. Sequential lookups
             (the added median is the acceptance figure: ≤ 0.5 ms) and 32 concurrent ones.
* long     — the same for 32k-token prompts, as the estimate chain keys them (one key per
             64-token block, restarting at each message) beside one key per message (the
             chain before block keys): a single-message prompt and a 40-message conversation,
             each looked up after its previous version was recorded on one worker and the
             pool, in the lookup part's populated index; chain hashing timed too.
* media    — building the prefix chain of an agent conversation that adds one 300 KB
             screenshot (a PNG data URL) per turn, 20 turns: time and key count with media
             as one element each (each image a digest and its model's tokens) beside the
             same body read as text (every base64 byte a quarter token, as before media had
             keys) and beside the conversation without its images.
* memory   — Redis memory per million indexed prefix blocks (one block = one key held by one
             location): INFO used_memory before and after recording 1,000,000 blocks, plus
             MEMORY USAGE of one location's structures.
* replicas — affinity (turns 2+ on the worker of turn 1, from x-kvroute-worker) of the same
             multi-turn workload through: one router; four `kvroute serve` replicas sharing
             one Redis, each turn sent to a replica at random; the same four replicas with
             per-replica in-memory indexes. Acceptance: shared ≥ 0.95 × single.
* outage   — four replicas sharing one Redis under a load of several hundred requests; Redis
             is killed (SIGKILL: its data is gone) for --outage-s seconds and restarted.
             Failed requests (acceptance: 0), and affinity before, during and after.

Every Redis here is our own `redis-server` on a free loopback port (loadtests/e2e/replicas.py);
workers are the simulator (`loadtests.sim.cluster.SimCluster`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from cache_client.base import POOL, PrefixIndex
from cache_client.memory import MemoryIndex
from cache_client.redis_conn import RedisBackend, parse_redis_url
from cache_client.redis_index import RedisIndex
from loadtests.e2e.replicas import (
    ConversationLoad,
    RedisServer,
    RouterReplicas,
    affinity,
    summarize,
)
from loadtests.support.processes import stop_children_on_signals
from loadtests.support.routerproc import RouterProcess
from normalizer.prefix import chat_segments, prefix_chain
from router.chain import EstimateChainBuilder

WORKERS = [f"w{i}" for i in range(8)]


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _us(values: Sequence[float]) -> dict[str, float]:
    return {
        "median_us": round(statistics.median(values) * 1e6, 1),
        "p90_us": round(_pct(values, 0.90) * 1e6, 1),
        "p99_us": round(_pct(values, 0.99) * 1e6, 1),
        "mean_us": round(statistics.fmean(values) * 1e6, 1),
        "n": len(values),
    }


# -- (a) lookup latency ---------------------------------------------------------------------------
def _population(rng: random.Random, conversations: int) -> list[tuple[str, list[int], list[int]]]:
    """(worker, chain, per-key tokens): 50 agent groups sharing a system prompt and tools
    (the first two keys), each conversation 2..40 messages deep."""
    heads = [[rng.getrandbits(64), rng.getrandbits(64)] for _ in range(50)]
    out = []
    for _ in range(conversations):
        head = heads[rng.randrange(len(heads))]
        chain = head + [rng.getrandbits(64) for _ in range(rng.randrange(0, 38))]
        tokens = [800, 2000] + [rng.randrange(20, 600) for _ in range(len(chain) - 2)]
        out.append((rng.choice(WORKERS), chain, tokens))
    return out


async def _fill(index: PrefixIndex, population: list[tuple[str, list[int], list[int]]]) -> None:
    for name in [*WORKERS, POOL]:
        index.set_capacity(name, 10**12)  # nothing evicted: every lookup sees the full population
    for worker, chain, tokens in population:
        await index.record(worker, chain, tokens)
        await index.record(POOL, chain, tokens)


async def _time_lookups(index: PrefixIndex, chains: list[list[int]], concurrency: int) -> list[float]:
    times: list[float] = []
    it = iter(chains)

    async def client() -> None:
        for chain in it:
            t0 = time.perf_counter()
            await index.lookup(chain)
            times.append(time.perf_counter() - t0)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return times


async def bench_lookup(url: str, conversations: int = 20_000, lookups: int = 20_000) -> dict[str, Any]:
    rng = random.Random(42)
    population = _population(rng, conversations)
    chains = []
    for _ in range(lookups):
        if rng.random() < 0.7:  # the next turn of a known conversation
            _, chain, _ = population[rng.randrange(len(population))]
            chains.append([*chain, rng.getrandbits(64), rng.getrandbits(64)])
        else:  # a new conversation of a known group
            _, chain, _ = population[rng.randrange(len(population))]
            chains.append(chain[:2] + [rng.getrandbits(64) for _ in range(rng.randrange(1, 6))])
    memory = MemoryIndex()
    # The budget is set out of reach here: this measures what a Redis lookup costs, every one
    # of them (with the router's 5 ms budget, the slowest would fall back to the local view
    # on a starved machine and be timed as memory lookups). `over_5ms` counts those.
    redis_index = RedisIndex(RedisBackend(parse_redis_url(url), budget_s=10.0), prefix=f"bench-{uuid.uuid4().hex[:8]}")
    assert await redis_index.connect(), "redis did not answer"
    await _fill(memory, population)
    await _fill(redis_index, population)
    assert await redis_index.flush()
    out: dict[str, Any] = {"conversations": conversations, "lookups": lookups,
                           "mean_chain_keys": round(statistics.fmean(len(c) for c in chains), 1),
                           "locations": len(WORKERS) + 1}
    for concurrency in (1, 8, 32):
        runs: dict[str, list[float]] = {"memory": [], "redis": []}
        # Alternating halves, so that drift in the machine's load hits both alike.
        half = len(chains) // 2
        for part in (chains[:half], chains[half:]):
            for name, index in (("memory", memory), ("redis", redis_index)):
                await _time_lookups(index, part[:500], concurrency)  # warm-up
                runs[name] += await _time_lookups(index, part, concurrency)
        mem, red = _us(runs["memory"]), _us(runs["redis"])
        out[f"concurrency_{concurrency}"] = {
            "memory": mem,
            "redis": red,
            "redis_over_5ms": sum(t > 0.005 for t in runs["redis"]),
            "added_median_us": round(red["median_us"] - mem["median_us"], 1),
            "added_p99_us": round(red["p99_us"] - mem["p99_us"], 1),
        }
    # Sanity: the two answer alike, and no Redis lookup fell back to the local view.
    for chain in chains[:2000]:
        assert (await memory.lookup(chain)).depths == (await redis_index.lookup(chain)).depths
    out["redis_stats"] = dict(redis_index.stats)
    out["acceptance_added_median_le_500us"] = out["concurrency_1"]["added_median_us"] <= 500
    await redis_index.close()
    return out


# -- (a') 32k-token prompts: blocks against one key per message ---------------------------------
def _long_bodies(rng: random.Random, n: int) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(shape, previous request, request) pairs of ~32k estimated tokens."""
    words = ["the", "of", "contract", "party", "shall", "agree", "terms", "notice", "payment", "section", "clause", "data"]

    def text(chars: int) -> str:
        out, size = [], 0
        while size < chars:
            w = rng.choice(words)
            out.append(w)
            size += len(w) + 1
        return " ".join(out)

    pairs = []
    for i in range(n):
        if i % 2 == 0:  # one user message: a document, then a question (RAG, trace replay)
            doc = text(127_000)
            prev = {"model": "m", "messages": [{"role": "user", "content": doc + " Question: " + text(200)}]}
            cur = {"model": "m", "messages": [{"role": "user", "content": doc + " Question: " + text(200)}]}
            pairs.append(("one_message", prev, cur))
        else:  # a conversation of 40 messages, ~800 tokens each
            msgs = [{"role": ("user", "assistant")[k % 2], "content": text(3_200)} for k in range(40)]
            prev = {"model": "m", "messages": msgs[:38]}
            cur = {"model": "m", "messages": msgs}
            pairs.append(("forty_messages", prev, cur))
    return pairs


def _message_chain(body: dict[str, Any]) -> list[int]:
    """One key per message: the estimate chain before block keys."""
    return list(prefix_chain("m", chat_segments(body)).keys)


async def bench_long_prompt(url: str, conversations: int = 20_000, prompts: int = 40, repeats: int = 25) -> dict[str, Any]:
    rng = random.Random(43)
    population = _population(rng, conversations)
    pairs = _long_bodies(rng, prompts)
    builder = EstimateChainBuilder()
    keyings = {"blocks": lambda b: list(builder.build(b, "chat").keys), "one_key_per_message": _message_chain}
    memory = MemoryIndex()
    redis_index = RedisIndex(RedisBackend(parse_redis_url(url), budget_s=10.0), prefix=f"bench-{uuid.uuid4().hex[:8]}")
    assert await redis_index.connect(), "redis did not answer"
    await _fill(memory, population)
    await _fill(redis_index, population)
    out: dict[str, Any] = {"conversations": conversations, "prompts": prompts, "lookups_per_prompt": repeats}
    for keying, keys_of in keyings.items():
        for shape in ("one_message", "forty_messages"):
            chosen = [(p, c) for s, p, c in pairs if s == shape]
            chains, build_s = [], []
            for prev, cur in chosen:
                t0 = time.perf_counter()
                chain = keys_of(cur)
                build_s.append(time.perf_counter() - t0)
                old = keys_of(prev)
                worker = rng.choice(WORKERS)
                for index in (memory, redis_index):
                    await index.record(worker, old, [1] * len(old))
                    await index.record(POOL, old, [1] * len(old))
                chains.append(chain)
            assert await redis_index.flush()
            runs: dict[str, list[float]] = {"memory": [], "redis": []}
            calls0, remote0 = redis_index.stats["lookup_calls"], redis_index.stats["remote_lookups"]
            for _ in range(repeats):
                for name, index in (("memory", memory), ("redis", redis_index)):
                    runs[name] += await _time_lookups(index, chains, 1)
            depths = [max((await memory.lookup(c)).depths.values(), default=0) for c in chains]
            out[f"{keying}/{shape}"] = {
                "keys": round(statistics.fmean(len(c) for c in chains), 1),
                "mean_depth_found": round(statistics.fmean(depths), 1),
                "chain_build": _us(build_s),
                "memory_lookup": _us(runs["memory"]),
                "redis_lookup": _us(runs["redis"]),
                # Sequential lookups: each is its own EVALSHA, the whole chain in one argument.
                "redis_calls_per_lookup": (redis_index.stats["lookup_calls"] - calls0)
                / max(redis_index.stats["remote_lookups"] - remote0, 1),
            }
    for _, _, body in pairs[:4]:
        chain = keyings["blocks"](body)
        assert (await memory.lookup(chain)).depths == (await redis_index.lookup(chain)).depths
    out["redis_stats"] = dict(redis_index.stats)
    await redis_index.close()
    return out


# -- (b) memory per million blocks ----------------------------------------------------------------
async def bench_memory(server: RedisServer, blocks: int = 1_000_000, chain_keys: int = 32) -> dict[str, Any]:
    client = server.client()
    client.flushall()
    before = int(client.info("memory")["used_memory"])
    prefix = "mem"
    index = RedisIndex(RedisBackend(parse_redis_url(server.url), budget_s=1.0), prefix=prefix)
    assert await index.connect()
    rng = random.Random(7)
    for name in WORKERS:
        index.set_capacity(name, 10**12)
    t0 = time.perf_counter()
    for i in range(blocks // chain_keys):
        chain = [rng.getrandbits(64) for _ in range(chain_keys)]
        await index.record(WORKERS[i % len(WORKERS)], chain, [16] * chain_keys)
        if i % 500 == 0:
            await index.flush()
    assert await index.flush()
    load_s = time.perf_counter() - t0
    after = int(client.info("memory")["used_memory"])
    usage = await index.usage()
    held = sum(usage.values()) // 16
    tag = index.tag
    per_structure = {
        "zset_recency_bytes": client.memory_usage(f"{tag}:z:w0", samples=0),
        "hash_charges_bytes": client.memory_usage(f"{tag}:c:w0", samples=0),
        "hash_meta_bytes": client.memory_usage(f"{tag}:m:w0", samples=0),
        "blocks_in_w0": client.zcard(f"{tag}:z:w0"),
    }
    # A location's charges are usually all alike (one KV block each in precise mode), but the
    # hash has to be there for estimate mode's uneven segments; this shows what it costs.
    delta = after - before
    await index.close()
    client.flushall()
    client.close()
    return {
        "blocks": held,
        "locations": len(WORKERS),
        "used_memory_delta_bytes": delta,
        "bytes_per_block": round(delta / held, 1),
        "mib_per_million_blocks": round(delta / held * 1e6 / 2**20, 1),
        "per_structure_for_one_location": {
            **per_structure,
            "bytes_per_block_zset": round(per_structure["zset_recency_bytes"] / per_structure["blocks_in_w0"], 1),
            "bytes_per_block_hash": round(per_structure["hash_charges_bytes"] / per_structure["blocks_in_w0"], 1),
        },
        "load_seconds": round(load_s, 2),
        "load_blocks_per_s": round(held / load_s),
    }


# -- (c) multi-replica affinity ---------------------------------------------------------------------
def lookups_over_budget(metrics_texts: Sequence[str], budget_s: float = 0.005) -> dict[str, int]:
    """From the replicas' kvroute_index_lookup_seconds histograms: lookups, and those that
    took longer than the budget. An upper bound on the lookups answered from the local
    view: a reply that arrives while the event loop is busy elsewhere also takes longer,
    yet is used."""
    total = within = 0
    for text in metrics_texts:
        for line in text.splitlines():
            if line.startswith("kvroute_index_lookup_seconds_count"):
                total += int(float(line.split()[-1]))
            elif line.startswith(f'kvroute_index_lookup_seconds_bucket{{le="{budget_s:g}"}}'):
                within += int(float(line.split()[-1]))
    return {"lookups": total, "over_5ms": total - within}



def _screenshot_conversation(turns: int, image_bytes: int) -> dict[str, Any]:
    from loadtests.benchmark.screens import SCREEN_SIZES, screenshot_part

    messages: list[dict[str, Any]] = [{"role": "system", "content": "You operate a web browser for the user. " * 30}]
    for t in range(turns):
        w, h = SCREEN_SIZES[t % len(SCREEN_SIZES)]
        messages.append({"role": "user", "content": [
            {"type": "text", "text": f"Step {t}: the page after your last action."}, screenshot_part(w, h, image_bytes, t),
        ]})  # fmt: skip
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f'{{"action": "click", "element": {t}}}'})
    return {"model": "Qwen/Qwen2.5-VL-7B-Instruct", "messages": messages}


def bench_media(turns: int = 20, image_bytes: int = 300_000, repeats: int = 30) -> dict[str, Any]:
    from normalizer.media import MediaReader
    from normalizer.prefix import chat_prompt, segment_blocks

    body = _screenshot_conversation(turns, image_bytes)
    text_only = {**body, "messages": [
        {**m, "content": [p for p in m["content"] if p["type"] == "text"]} if isinstance(m["content"], list) else m
        for m in body["messages"]
    ]}  # fmt: skip
    builder = EstimateChainBuilder(MediaReader())

    def as_text(b: dict[str, Any]) -> Any:  # media parts rendered as their JSON text
        blocks, reply = segment_blocks(*chat_prompt(b, None))
        return prefix_chain(b["model"], blocks, reply or None)

    def timed(build: Any, b: dict[str, Any]) -> dict[str, Any]:
        build(b)  # warm
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            chain = build(b)
            times.append(time.perf_counter() - t0)
        return {"keys": len(chain.keys), "tokens": chain.total_tokens, "build": _us(times)}

    media = timed(lambda b: builder.build(b, "chat"), body)
    return {
        "turns": turns,
        "image_bytes": image_bytes,
        "body_bytes": len(orjson.dumps(body)),
        "as_media": media,
        "as_text": timed(as_text, body),
        "without_images": timed(lambda b: builder.build(b, "chat"), text_only),
        "media_ms_per_image": media["build"]["median_us"] / 1e3 / turns,
    }


def _sim(workers: int, time_scale: float):
    from loadtests.sim.cluster import SimCluster

    return SimCluster(workers=workers, time_scale=time_scale)


def _load(urls: Sequence[str], args: argparse.Namespace, seed: int) -> ConversationLoad:
    return ConversationLoad(list(urls), conversations=args.conversations, turns=args.turns,
                            arrival_rate=args.arrival_rate, think_s=args.think_s, seed=seed)


def bench_replicas(args: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"workers": args.workers, "replicas": 4, "conversations": args.conversations,
                           "turns": args.turns, "arrival_rate_per_s": args.arrival_rate}
    for repeat in range(args.repeats):
        seed = 100 + repeat
        runs: dict[str, Any] = {}
        # A fresh simulated cluster per configuration: no cache carried over between them.
        with _sim(args.workers, args.time_scale) as cluster, RouterProcess(cluster.worker_urls) as router:
            load = _load([router.url], args, seed)
            asyncio.run(load.run())
            runs["single_router"] = summarize(load.results)
        with _sim(args.workers, args.time_scale) as cluster, RedisServer() as server, RouterReplicas(
            cluster.worker_urls, 4, server.url, f"bench-{uuid.uuid4().hex[:6]}",
            log_dir=os.path.join(log_dir, f"shared{repeat}"),
        ) as replicas:
            load = _load(replicas.urls, args, seed)
            asyncio.run(load.run())
            runs["four_replicas_shared_redis"] = summarize(load.results)
            runs["four_replicas_shared_redis"]["index_lookups"] = lookups_over_budget(
                [r.metrics() for r in replicas.routers])
        with _sim(args.workers, args.time_scale) as cluster, RouterReplicas(cluster.worker_urls, 4, None) as replicas:
            load = _load(replicas.urls, args, seed)
            asyncio.run(load.run())
            runs["four_replicas_memory_each"] = summarize(load.results)
        single = runs["single_router"]["affinity"]
        runs["shared_over_single"] = round(runs["four_replicas_shared_redis"]["affinity"] / single, 4)
        runs["memory_each_over_single"] = round(runs["four_replicas_memory_each"]["affinity"] / single, 4)
        out[f"repeat_{repeat}"] = runs
    ratios = [out[f"repeat_{r}"]["shared_over_single"] for r in range(args.repeats)]
    out["shared_over_single_min"] = min(ratios)
    out["acceptance_shared_ge_0.95_single"] = min(ratios) >= 0.95
    return out


# -- (d) Redis outage under load ------------------------------------------------------------------------
def bench_outage(args: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    down_at, up_at = args.outage_start_s, args.outage_start_s + args.outage_s
    logs = os.path.join(log_dir, "outage")
    os.makedirs(logs, exist_ok=True)
    events: dict[str, float] = {}
    with _sim(args.workers, args.time_scale) as cluster, RedisServer() as server, RouterReplicas(
        cluster.worker_urls, 4, server.url, f"bench-outage-{uuid.uuid4().hex[:6]}", log_dir=logs,
    ) as replicas:
        load = ConversationLoad(replicas.urls, conversations=args.outage_conversations, turns=args.turns,
                                arrival_rate=args.outage_conversations / (up_at + 15.0), think_s=args.think_s,
                                seed=7)

        def chaos(t0: float) -> None:
            time.sleep(max(0.0, down_at - (time.monotonic() - t0)))
            server.kill()
            events["killed_at_s"] = round(time.monotonic() - t0, 2)
            time.sleep(max(0.0, up_at - (time.monotonic() - t0)))
            server.start()
            events["restarted_at_s"] = round(time.monotonic() - t0, 2)

        t0 = time.monotonic()
        thread = threading.Thread(target=chaos, args=(t0,), daemon=True)
        thread.start()
        asyncio.run(load.run())
        thread.join()
        events["load_ended_at_s"] = round(time.monotonic() - t0, 2)
        gauges = [r.metrics() for r in replicas.routers]
        lookups = lookups_over_budget(gauges)
    logged = ""
    for name in sorted(os.listdir(logs)):
        with open(os.path.join(logs, name), encoding="utf-8", errors="replace") as fh:
            logged += fh.read()
    res = load.results
    end = max(r.started for r in res) + 1
    killed, restarted = events["killed_at_s"], events["restarted_at_s"]
    return {
        "replicas": 4,
        "outage": {"mode": "SIGKILL (data lost), restarted empty on the same port", **events},
        "overall": summarize(res),
        "failed_requests": sum(r.error is not None for r in res),
        "acceptance_zero_failed": all(r.error is None for r in res),
        "turns_sent": {
            "before": affinity(res, (0, killed)),
            "during": affinity(res, (killed, restarted)),
            "after": affinity(res, (restarted, end)),
        },
        "conversations_started": {
            "before": affinity(res, conversations_from=(0, killed)),
            "during": affinity(res, conversations_from=(killed, restarted)),
            "after": affinity(res, conversations_from=(restarted, end)),
        },
        "log_lines": {
            "down": logged.count("redis index down"),
            "up_again": logged.count("redis index up again"),
            "lost_data_resync": logged.count("lost its data"),
        },
        "backend_up_at_end": [("kvroute_index_backend_up 1" in g) for g in gauges],
        "index_lookups": lookups,
    }


# -- driver ---------------------------------------------------------------------------------------------
def _environment() -> dict[str, Any]:
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "redis_server": version,
        "note": "shared 2-core machine: other work ran alongside; timings include that noise",
    }


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.measure.bench_index", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--parts", default="lookup,long,media,memory,replicas,outage")
    p.add_argument("--workers", type=int, default=4, help="simulated workers (replicas, outage)")
    p.add_argument("--time-scale", type=float, default=0.05)
    p.add_argument("--conversations", type=int, default=120)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--arrival-rate", type=float, default=6.0, help="conversations started per second")
    p.add_argument("--think-s", type=float, default=0.3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--outage-conversations", type=int, default=200)
    p.add_argument("--outage-start-s", type=float, default=10.0)
    p.add_argument("--outage-s", type=float, default=10.0)
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench_index.json"
    results: dict[str, Any] = orjson.loads(path.read_bytes()) if path.exists() else {}
    results["environment"] = _environment()
    log_dir = tempfile.mkdtemp(prefix="kvroute-bench-index-")

    def save() -> None:
        path.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))

    def part(name: str, run) -> None:
        before = [round(x, 2) for x in os.getloadavg()]
        t0 = time.monotonic()
        results[name] = run()
        results[name]["machine"] = {"loadavg_before": before, "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                                    "seconds": round(time.monotonic() - t0, 1)}
        save()
        print(f"{name}:", orjson.dumps(results[name]).decode(), flush=True)

    with stop_children_on_signals():
        if "lookup" in parts:
            import uvloop

            with RedisServer() as server:
                part("lookup", lambda: uvloop.run(bench_lookup(server.url)))  # uvloop, as the router runs
        if "long" in parts:
            import uvloop

            with RedisServer() as server:
                part("long", lambda: uvloop.run(bench_long_prompt(server.url)))
        if "media" in parts:
            part("media", bench_media)
        if "memory" in parts:
            with RedisServer() as server:
                part("memory", lambda: asyncio.run(bench_memory(server)))
        if "replicas" in parts:
            part("replicas", lambda: bench_replicas(args, log_dir))
        if "outage" in parts:
            part("outage", lambda: bench_outage(args, log_dir))
    print(f"wrote {path} (router logs in {log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
