"""Request traces for `kvroute bench --trace FILE`: production traffic nobody here shaped.

    kvroute bench --trace ../shared/traces/mooncake_synthetic_trace.jsonl \
        [--trace-window START,MINUTES] [--trace-speed X] [--api chat|completions] ...

A trace line is `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}` (Mooncake's FAST'25 release): one hash id per 512-token block of the
prompt, equal ids meaning equal block content, so a shared run of leading ids is a
reusable prefix. No text is included, so each hash id becomes a fixed text block of 512
simulated tokens (`block_text`: 2,048 bytes, deterministic in the id, different ids
differing from their first byte), the prompt's last block cut to `input_length`. A
request is sent as one user message (`--api chat`, as trace replayers send them) or as a
prompt (`--api completions`), asking for exactly `output_length` tokens, at the trace's
time since the window's start divided by `--trace-speed`. Every request of the window is
measured; caches start cold. Requests longer than the simulated model's context (prompt,
chat template and output; the synthetic trace reaches 191k tokens, Llama-3-8B takes 128k)
are left out of the replay and of the bounds, and counted (`requests_over_context`).

What the trace allows at best (`trace_bounds`), reported beside each router's figures:

* ideal reuse: blocks seen earlier in the window ÷ all blocks (and the token-weighted
  ratio, which is what a worker's prefix-cache hit ratio counts);
* the same bounded by the fleet's KV capacity: one LRU over 512-token blocks holding as
  many tokens as every worker's KV together (plus the pool's, for routers run with it).
  No placement can keep more distinct blocks than the fleet holds, so a merged LRU bounds
  any router's reuse from above;
* the ideal TTFT floor: each request prefilling only the blocks the trace marks as new, on
  an idle worker, priced with the simulator's cost model (chunked prefill in steps of the
  engine's token budget, one step overhead each, as `loadtests.sim.engine` schedules it).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import heapq
import math
import os
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from loadtests.benchmark.harness import LoopLag, Progress, RequestRecord, RunOutcome, percentile
from loadtests.benchmark.harness import _stream_one as stream_one
from loadtests.benchmark.trace_replay import late_binding_replay
from loadtests.benchmark.workload import MODEL
from loadtests.sim.costs import CostModel
from loadtests.sim.worker import WorkerConfig
from normalizer.prefix import render_message
from normalizer.tokens import CHARS_PER_TOKEN
from router.aio import cancel_and_wait
from router.proxy.upstream import RawUpstreamClient

TRACE_BLOCK_TOKENS = 512
TRACE_BLOCK_BYTES = TRACE_BLOCK_TOKENS * CHARS_PER_TOKEN
GRACE_S = 60.0
"""Simulated seconds after the window's last request for requests in flight to finish."""
API_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
ENGINE_TOKEN_BUDGET = WorkerConfig("").max_num_batched_tokens
"""The simulated workers' per-step token budget (the bench starts them with the default)."""


def shared_dir() -> Path:
    """The shared data directory: `$KVROUTE_SHARED_DIR`, else `../shared` beside the clone
    (traces are read from there, never copied into the repository)."""
    env = os.environ.get("KVROUTE_SHARED_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    """Line number in the window (0-based)."""
    sent_s: float
    """Simulated seconds after the window's start."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    path: str
    requests: list[TraceRequest]
    start_min: float
    minutes: float | None
    speed: float
    api: str
    over_context: int = 0
    """Requests of the window left out: longer than the model's context."""
    grace_s: float = GRACE_S

    @property
    def window_s(self) -> float:
        """Simulated span of the window (its last request's time if no length was given)."""
        if self.minutes is not None:
            return self.minutes * 60.0 / self.speed
        return self.requests[-1].sent_s if self.requests else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        """Offered decode tokens per simulated second (what the harness must stream)."""
        return sum(r.output_length for r in self.requests) / max(self.window_s, 1.0)

    def body(self, req: TraceRequest) -> dict[str, Any]:
        text = prompt_text(req.hash_ids, req.input_length)
        body: dict[str, Any] = {"model": MODEL}
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        body.update({"stream": True, "stream_options": {"include_usage": True}, "max_tokens": req.output_length, "temperature": 0})
        return body


def parse_window(text: str | None) -> tuple[float, float | None]:
    """`START,MINUTES` (minutes from the trace's first timestamp) → (start, length or None)."""
    if not text:
        return 0.0, None
    start, _, minutes = text.partition(",")
    start_min, length = float(start), float(minutes) if minutes else None
    if start_min < 0 or (length is not None and length <= 0):
        raise ValueError(f"--trace-window {text!r}: START must be >= 0 and MINUTES > 0")
    return start_min, length


def load_trace(
    path: str | Path,
    start_min: float = 0.0,
    minutes: float | None = None,
    speed: float = 1.0,
    api: str = "chat",
    max_model_len: int | None = None,
) -> Trace:
    """The requests of the window [start, start + minutes) of the trace, in time order,
    without those that would not fit `max_model_len` tokens as sent."""
    if speed <= 0:
        raise ValueError("--trace-speed must be positive")
    if api not in API_PATHS:
        raise ValueError(f"--api must be one of {', '.join(API_PATHS)}")
    template = len(render_message({"role": "user", "content": ""})) // CHARS_PER_TOKEN if api == "chat" else 0
    requests: list[TraceRequest] = []
    over = 0
    first_ms: float | None = None
    with open(path, "rb") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = orjson.loads(line)
            ts = float(row["timestamp"])
            first_ms = ts if first_ms is None else first_ms
            offset_min = (ts - first_ms) / 60_000.0
            if offset_min < start_min:
                continue
            if minutes is not None and offset_min >= start_min + minutes:
                break  # the traces are in time order
            n_in, n_out = int(row["input_length"]), int(row["output_length"])
            if max_model_len is not None and n_in + template + n_out > max_model_len:
                over += 1
                continue
            sent_s = (offset_min - start_min) * 60.0 / speed
            ids = tuple(int(h) for h in row["hash_ids"])
            requests.append(TraceRequest(len(requests), sent_s, n_in, n_out, ids))
    return Trace(str(path), requests, start_min, minutes, speed, api, over)


def block_text(hash_id: int) -> str:
    """The 512 simulated tokens (2,048 ASCII bytes) standing for one hash id.

    A 64-byte digest of the id, repeated and base64-encoded: cheap enough to build each
    prompt when it is sent (a random generator seeded per block cost three times as much),
    and two ids' texts differ from the first byte, so only equal ids share a prefix.
    """
    digest = hashlib.blake2b(hash_id.to_bytes(8, "little", signed=True), digest_size=64).digest()
    return base64.b64encode(digest * (TRACE_BLOCK_BYTES * 3 // 4 // 64)).decode()


def prompt_text(hash_ids: Sequence[int], input_length: int) -> str:
    """The prompt of a trace request: one block per id, cut to `input_length` tokens."""
    return "".join(block_text(h) for h in hash_ids)[: input_length * CHARS_PER_TOKEN]


# -- what the trace allows at best -------------------------------------------------------------


def _leading_seen(ids: Sequence[int], seen: Any) -> int:
    n = 0
    while n < len(ids) and ids[n] in seen:
        n += 1
    return n


def ideal_reuse(requests: Sequence[TraceRequest], capacity_tokens: int | None = None) -> dict[str, float | None]:
    """Blocks (and tokens) whose block was seen earlier in the window, over all of them.

    With `capacity_tokens`, a block counts only if it is still in one LRU of that many
    tokens (512 per block) that every request's blocks go through, most recent last.
    """
    lru: OrderedDict[int, None] = OrderedDict()
    cap_blocks = None if capacity_tokens is None else max(capacity_tokens // TRACE_BLOCK_TOKENS, 1)
    blocks = reused_blocks = tokens = reused_tokens = 0
    for r in requests:
        n = _leading_seen(r.hash_ids, lru)
        blocks += len(r.hash_ids)
        reused_blocks += n
        tokens += r.input_length
        reused_tokens += min(n * TRACE_BLOCK_TOKENS, r.input_length)
        for h in r.hash_ids:
            lru[h] = None
            lru.move_to_end(h)
        while cap_blocks is not None and len(lru) > cap_blocks:
            lru.popitem(last=False)
    return {
        "blocks": reused_blocks / blocks if blocks else None,
        "tokens": reused_tokens / tokens if tokens else None,
    }


def ideal_ttft_s(cached_tokens: int, input_length: int, cost: CostModel, max_batched_tokens: int) -> float:
    """Prefill of input_length with cached_tokens held, on an idle simulated worker."""
    # Like vLLM, the engine recomputes at least the last token, in whole 16-token blocks.
    start = min(cached_tokens, (input_length - 1) // 16 * 16)
    ttft = 0.0
    while start < input_length:
        end = min(start + max_batched_tokens, input_length)
        ttft += cost.step_s([(start, end)], [])
        start = end
    return ttft


def _floors(requests: Sequence[TraceRequest], cost: CostModel, max_batched_tokens: int) -> list[float]:
    """Each request's ideal prefill: every block seen earlier in the window reused."""
    seen: set[int] = set()
    floors = []
    for r in requests:
        cached = _leading_seen(r.hash_ids, seen) * TRACE_BLOCK_TOKENS
        floors.append(ideal_ttft_s(cached, r.input_length, cost, max_batched_tokens))
        seen.update(r.hash_ids)
    return floors


def ideal_ttft_floor(requests: Sequence[TraceRequest], cost: CostModel, max_batched_tokens: int) -> dict[str, float | None]:
    return _floor_summary(_floors(requests, cost, max_batched_tokens))


def _floor_summary(floors: Sequence[float]) -> dict[str, float | None]:
    return {
        "mean_s": sum(floors) / len(floors) if floors else None,
        "p50_s": percentile(floors, 50),
        "p99_s": percentile(floors, 99),
    }


def queued_floor(
    requests: Sequence[TraceRequest], cost: CostModel, max_batched_tokens: int, workers: int
) -> dict[str, Any]:
    """The floor once the window's load queues it: each request's ideal prefill (perfect
    reuse on an idle engine, `ideal_ttft_floor`) served at its send time by `workers`
    engines fed from one queue, first come first served, by arrival + prefill (the order of
    kvroute's prefill queue) and shortest first.

    A reference, not a bound: the fleet as one work-conserving queue, any prefix reusable
    on any worker, each engine prefilling one request at a time with nothing else in its
    steps. A real engine differs both ways: decodes lengthen its steps, and it batches
    waiting prefills into one step, where short ones ride along almost free. What the
    reference shows is how much queueing the load itself adds to the floor at this speed,
    whatever the placement, on engines that serve prefills in order."""
    return _queued(requests, _floors(requests, cost, max_batched_tokens), workers)


def _queued(requests: Sequence[TraceRequest], floors: Sequence[float], workers: int) -> dict[str, Any]:
    """`queued_floor` from the requests' floors (`_floors`)."""
    sent = [r.sent_s for r in requests]
    floor_mean = sum(floors) / len(floors) if floors else None
    out: dict[str, Any] = {"workers": workers}
    for order, size_weight in (("fcfs", 0.0), ("arrival_plus_prefill", 1.0), ("shortest_first", None)):
        ttfts = _one_queue(sent, floors, workers, size_weight=size_weight)
        mean = sum(ttfts) / len(ttfts) if ttfts else None
        out[order] = {
            "mean_s": mean,
            "p99_s": percentile(ttfts, 99),
            "mean_over_floor": mean / floor_mean if mean is not None and floor_mean else None,
        }
    return out


def _one_queue(sent: Sequence[float], service: Sequence[float], servers: int, *, size_weight: float | None) -> list[float]:
    """Each job's time from arrival to the end of its service: `servers` servers, one queue,
    non-preemptive, served by arrival + `size_weight` × service (0: arrival order; 1: the
    router's prefill queue, router/proxy/prefill_queue.py; None: shortest service first),
    ties by arrival."""
    free_at = [0.0] * servers  # a heap: when each server is next free
    order = sorted(range(len(sent)), key=lambda i: sent[i])
    waiting: list[tuple[float, float, int]] = []
    done = [0.0] * len(sent)
    i = 0
    now = 0.0
    while i < len(order) or waiting:
        now = max(now, free_at[0])  # never back in time: what waits arrived by `now`
        if not waiting:
            now = max(now, sent[order[i]])
        while i < len(order) and sent[order[i]] <= now:
            j = order[i]
            key = service[j] if size_weight is None else sent[j] + size_weight * service[j]
            heapq.heappush(waiting, (key, sent[j], j))
            i += 1
        _, _, j = heapq.heappop(waiting)
        end = now + service[j]
        heapq.heapreplace(free_at, end)
        done[j] = end - sent[j]
    return done


RANDOM_LB_SEED = "trace-random-lb"


def random_lb_speed(
    trace: Trace,
    workers: int,
    kv_capacity_tokens: int,
    cost: CostModel,
    max_batched_tokens: int = ENGINE_TOKEN_BUDGET,
) -> dict[str, Any]:
    """The replay speed at which a random balancer's prefill work fills the fleet: a trace's
    `--trace-speed auto`, derived as a scenario's load is (`loadtests.benchmark.random_lb`).

    The window's requests, in order, each go to a uniformly random worker whose KV cache is
    an LRU of 512-token blocks (`kv_capacity_tokens` each); a request reuses the leading
    blocks that worker still holds and prefills the rest (`ideal_ttft_s`: chunked steps on
    an idle worker). With W the prefill seconds of the whole window and T its span at speed
    1, the fleet is full when W / (T / speed) = workers, so speed = workers × T / W. Unlike a
    scenario's conversations, whose sends follow their answers, a trace fixes the order of
    its requests, so what random placement reuses does not depend on the speed; the model
    favours random as `random_lb` does (running sequences take no cache space)."""
    if trace.speed != 1.0:
        raise ValueError("random_lb_speed takes the window at speed 1")
    rng = random.Random(RANDOM_LB_SEED)
    cap_blocks = max(kv_capacity_tokens // TRACE_BLOCK_TOKENS, 1)
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(workers)]
    prefill_s = 0.0
    reused = total = 0
    for r in trace.requests:
        cache = caches[rng.randrange(workers)]
        cached = min(_leading_seen(r.hash_ids, cache) * TRACE_BLOCK_TOKENS, r.input_length)
        prefill_s += ideal_ttft_s(cached, r.input_length, cost, max_batched_tokens)
        reused += cached
        total += r.input_length
        for h in r.hash_ids:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > cap_blocks:
            cache.popitem(last=False)
    span_s = trace.window_s
    return {
        "speed": workers * span_s / prefill_s if prefill_s > 0 else 1.0,
        "random_lb_reused_fraction": reused / total if total else None,
        "prefill_s_at_random_lb": prefill_s,
        "window_s_at_speed_1": span_s,
        "note": "random placement over per-worker LRU caches of 512-token blocks; the speed at which "
        "its prefill work fills the fleet (workers x window / prefill seconds)",
    }


def trace_bounds(
    trace: Trace,
    cost: CostModel,
    workers: int,
    kv_capacity_tokens: int,
    pool_capacity_tokens: int,
    max_batched_tokens: int = ENGINE_TOKEN_BUDGET,
) -> dict[str, Any]:
    """The trace's section of results.json: its window and what it allows at best."""
    reqs = trace.requests
    floors = _floors(reqs, cost, max_batched_tokens)  # for both the floor and its queued form
    return {
        "path": trace.path,
        "api": trace.api,
        "window_start_min": trace.start_min,
        "window_minutes": trace.minutes,
        "speed": trace.speed,
        "requests": len(reqs),
        "requests_over_context": trace.over_context,
        "window_s": trace.window_s,
        "arrival_rate_per_s": len(reqs) / max(trace.window_s, 1e-9),
        "mean_input_tokens": sum(r.input_length for r in reqs) / len(reqs) if reqs else None,
        "max_input_tokens": max((r.input_length for r in reqs), default=None),
        "mean_output_tokens": sum(r.output_length for r in reqs) / len(reqs) if reqs else None,
        "output_tokens_per_s": trace.output_tokens_per_s,
        "ideal_reuse": ideal_reuse(reqs),
        "ideal_reuse_fleet_kv": ideal_reuse(reqs, workers * kv_capacity_tokens),
        "ideal_reuse_fleet_kv_and_pool": ideal_reuse(reqs, workers * kv_capacity_tokens + pool_capacity_tokens),
        "ideal_ttft_floor": _floor_summary(floors),
        "queued_floor": _queued(reqs, floors, workers),
        "late_binding_replay": replay_references(trace, cost, workers, kv_capacity_tokens, pool_capacity_tokens, max_batched_tokens, floors),
        "capacity_bound": (
            "one LRU over 512-token blocks holding workers x per-worker KV tokens (plus the pool's "
            "capacity for routers run with it): an upper bound on any placement's reuse"
        ),
    }


def replay_references(
    trace: Trace,
    cost: CostModel,
    workers: int,
    kv_capacity_tokens: int,
    pool_capacity_tokens: int,
    max_batched_tokens: int,
    floors: Sequence[float],
) -> dict[str, Any]:
    """The window replayed offline by a late-binding scheduler that sees every engine's
    state (`loadtests.benchmark.trace_replay`), with the pool and without: how close to the floor
    this fleet lets routing get, decodes, KV and batching included."""
    prompts = replay_prompts(trace.requests)
    floor = sum(floors) / len(floors) if floors else None
    out: dict[str, Any] = {}
    for key, pool in (("pool", pool_capacity_tokens), ("no_pool", 0)):
        replay = late_binding_replay(prompts, cost, workers, kv_capacity_tokens, pool, max_batched_tokens)
        mean = replay["mean_s"]
        replay["mean_over_floor"] = mean / floor if mean is not None and floor else None
        out[key] = replay
    return out


def replay_prompts(requests: Sequence[TraceRequest]) -> list[tuple[float, bytes, int]]:
    """The window as `late_binding_replay` takes it: (sent seconds, prompt bytes, output tokens)."""
    return [(r.sent_s, prompt_text(r.hash_ids, r.input_length).encode(), r.output_length) for r in requests]


def trace_comparison(routers: dict[str, dict[str, Any]], bounds: dict[str, Any]) -> dict[str, Any]:
    """Each router's worker hit ratio against the bounds, and its TTFT against the floor."""
    out: dict[str, Any] = {}
    floor = bounds["ideal_ttft_floor"]["mean_s"]
    for key, r in routers.items():
        bound = bounds["ideal_reuse_fleet_kv_and_pool" if r["pool"] else "ideal_reuse_fleet_kv"]["tokens"]
        hit = r.get("worker_hit_ratio")
        out[f"{key}_worker_hit_minus_ideal_reuse"] = hit - bound if hit is not None and bound is not None else None
        mean = r.get("ttft_mean_s")
        out[f"{key}_ttft_mean_over_ideal_floor"] = mean / floor if mean is not None and floor else None
    return out


def markdown_lines(results: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The header of results.md for a trace run, and a table of the trace's bounds beside
    each router's figures."""
    t = results["scenario"]["trace"]
    floor = t["ideal_ttft_floor"]
    lines = [
        f"# kvroute bench: trace `{Path(t['path']).name}` ({t['api']})",
        "",
        f"{results['config']['workers']} simulated workers ({results['config']['profile']}), time scale "
        f"{results['config']['time_scale']}; window {t['window_start_min']} min + "
        f"{t['window_minutes'] if t['window_minutes'] is not None else 'all'} min at speed {t['speed']}: "
        f"{t['requests']} requests over {t['window_s']:.0f} simulated s ({t['arrival_rate_per_s']:.2f}/s; "
        f"{t['requests_over_context']} left out, longer than the model's context), "
        f"mean input {t['mean_input_tokens'] or 0:.0f} tokens, output {t['mean_output_tokens'] or 0:.0f}. "
        "All times are simulated seconds.",
        "",
        f"Ideal reuse (blocks seen before ÷ all blocks): {t['ideal_reuse']['blocks']:.3f} "
        f"(tokens {t['ideal_reuse']['tokens']:.3f}); bounded by the fleet's KV: "
        f"{t['ideal_reuse_fleet_kv']['tokens']:.3f}, with the pool: {t['ideal_reuse_fleet_kv_and_pool']['tokens']:.3f}. "
        f"Ideal TTFT floor (new blocks only, idle worker): mean {floor['mean_s']:.3f} s, p99 {floor['p99_s']:.3f} s.",
        "",
    ]
    queued = t.get("queued_floor")
    if queued:
        fcfs, sjf = queued["fcfs"], queued["shortest_first"]
        aged = queued["arrival_plus_prefill"]
        lines += [
            f"The floor's prefills queued on one queue of the {queued['workers']} workers (perfect reuse, each "
            f"engine one prefill at a time): first come first served mean {fcfs['mean_s']:.3f} s ({fcfs['mean_over_floor']:.2f}× "
            f"the floor), by arrival + prefill (the prefill queue's order) {aged['mean_s']:.3f} s "
            f"({aged['mean_over_floor']:.2f}×), shortest first {sjf['mean_s']:.3f} s ({sjf['mean_over_floor']:.2f}×).",
            "",
        ]
    replays = t.get("late_binding_replay")
    if replays:
        pool, bare = replays["pool"], replays["no_pool"]
        lines += [
            "The window replayed offline on these engines by a late-binding scheduler that sees their state "
            f"(loadtests/benchmark/trace_replay.py; decodes, KV and batching included): with the pool mean {pool['mean_s']:.3f} s "
            f"({pool['mean_over_floor']:.2f}× the floor), p99 {pool['p99_s']:.3f} s; without it {bare['mean_s']:.3f} s "
            f"({bare['mean_over_floor']:.2f}×), p99 {bare['p99_s']:.3f} s.",
            "",
        ]
    rows = ["| router | pool | worker hit | ideal reuse bound | TTFT mean ÷ floor |", "|---|---|---|---|---|"]
    for key, r in results["routers"].items():
        c = results["comparison"]
        gap, over = c.get(f"{key}_worker_hit_minus_ideal_reuse"), c.get(f"{key}_ttft_mean_over_ideal_floor")
        bound = t["ideal_reuse_fleet_kv_and_pool" if r["pool"] else "ideal_reuse_fleet_kv"]["tokens"]
        hit = r.get("worker_hit_ratio")
        rows.append(
            f"| {key} | {'yes' if r['pool'] else 'no'} | {hit if hit is None else f'{hit:.3f}'} | {bound:.3f}"
            f" ({'' if gap is None else f'{gap:+.3f}'}) | {'–' if over is None else f'{over:.2f}'} |"
        )
    return lines, rows


# -- the replay -----------------------------------------------------------------------------------


async def drive_trace(
    trace: Trace, base_url: str, time_scale: float, *, progress: Progress | None = None, record_gaps: bool = False
) -> RunOutcome:
    """Send every request of the window at its time, streamed; return their records (with
    `record_gaps`, also every gap between two streamed token events: `RunOutcome.itl_gaps_s`)."""
    loop = asyncio.get_running_loop()
    path = API_PATHS[trace.api]
    headers = [(b"content-type", b"application/json")]
    records: list[RequestRecord] = []
    gaps: list[float] | None = [] if record_gaps else None
    stop_at = [math.inf]
    lag = LoopLag()
    client = RawUpstreamClient(connect_timeout_s=30.0, keepalive_expiry_s=60.0)
    t0 = loop.time() + 0.05

    async def send(req: TraceRequest) -> None:
        await asyncio.sleep(max(t0 + req.sent_s * time_scale - loop.time(), 0.0))
        record = RequestRecord(req.index, 0, "trace", True, req.sent_s)
        records.append(record)
        payload = orjson.dumps(trace.body(req))
        await stream_one(client, base_url, path, payload, headers, record, t0, time_scale, stop_at, gaps=gaps)

    async def report() -> None:
        while progress is not None:
            await asyncio.sleep(0.5)
            ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
            sim_s = (loop.time() - t0) / time_scale
            progress({"sim_s": sim_s, "end_s": trace.window_s, "requests": len(records), "ttft_p50_s": percentile(ttfts, 50)})

    lag.start()
    reporter = asyncio.create_task(report())
    tasks = [asyncio.create_task(send(r)) for r in trace.requests]
    try:
        deadline = t0 + (trace.window_s + trace.grace_s) * time_scale
        _, pending = await asyncio.wait(tasks, timeout=max(deadline - loop.time(), 0.0)) if tasks else (set(), set())
        end = stop_at[0] = loop.time()
        await lag.stop()
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await cancel_and_wait(reporter)
        await client.aclose()
    records.sort(key=lambda r: r.session)
    failed = sum(1 for r in records if r.error is not None and not r.censored)
    return RunOutcome(
        records=records,
        sessions_started=len(records),
        sessions_completed=sum(1 for r in records if r.error is None and not r.censored),
        sessions_failed=failed,
        wall_s=end - t0,
        sim_s=(end - t0) / time_scale,
        window_s=trace.window_s,
        grace_expired=bool(pending),
        client_lag=lag.summary(),
        itl_gaps_s=[g / time_scale for g in gaps or ()],
    )
