"""A trace window replayed offline on the simulator's own engines by a scheduler that sees
everything: what this fleet allows routing, as a reference beside the trace's floors.

The ideal floor (`traces.ideal_ttft_floor`) prices each request's new blocks on an idle
engine, and its queued form (`traces.queued_floor`) serves those prefills from one queue,
one at a time, with nothing else in the engines' steps. Neither has decodes, KV limits or
batching, so neither says whether a router could reach, say, 1.5× the floor on this fleet
at this speed. This replay does, as far as a strong scheduler can show it:

* the fleet is `workers` copies of `loadtests.sim.engine.Engine` with the run's KV, step
  budget and cost model, and the LMCache pool (`loadtests.sim.pool.ChunkStore`) when the
  replay has one: every step, batch, decode, preemption and pool load as the simulated
  workers run them, on a simulated clock (no HTTP, no wall time, a few seconds of CPU);
* requests arrive at their trace times into one central queue, ordered by arrival plus
  their predicted prefill (the order of kvroute's prefill queue);
* late binding with exact state: at each of its step boundaries (and whenever it idles), an
  engine takes work while fewer than `mark_tokens` prompt tokens remain to compute on it.
  Of the first `LOOKAHEAD` queued requests it takes the one whose order key plus its prefill
  there (its cached blocks, the pool's) is least, among those no other engine would finish
  sooner counting what that engine has left to prefill; an idle engine takes one anyway.

It is a reference, not a bound: a router sees neither step boundaries nor the engines'
caches exactly, and learns of progress only at first bytes; and no scheduler here is proven
optimal. It answers "how close could routing get", the floor "how close to no queueing".
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtests.benchmark.harness import percentile
from loadtests.sim.costs import CostModel
from loadtests.sim.engine import BLOCK_SIZE, BlockHasher, Engine, Seq, Step
from loadtests.sim.pool import CHUNK_TOKENS, ChunkStore, chunk_keys
from loadtests.sim.worker import DEFAULT_MODEL
from normalizer.tokens import CHARS_PER_TOKEN

MARK_TOKENS = 512
"""Prompt tokens left on an engine below which it takes more: about one decode-dominated
step's worth of prefill, so that a step seldom runs short of work while as little as
possible is committed early (offline sweeps of 256–8,192 on both Mooncake traces: 256–512
best, 8,192, one full step, 11–33% above it)."""
LOOKAHEAD = 8
"""Queued requests an engine chooses among: enough to take a request its cache suits."""


@dataclass(eq=False)
class _Request:
    seq: Seq
    """Its `arrival` is the request's trace time."""
    chunk_keys: list[int]


@dataclass
class _Fleet:
    cost: CostModel
    engines: list[Engine]
    pool: ChunkStore | None
    mark_tokens: int
    queue: list[tuple[float, int]] = field(default_factory=list)
    """A heap of (arrival + predicted prefill, request index)."""
    step_end: list[float | None] = field(default_factory=list)
    """Per engine: when its step in flight ends, None while it idles."""

    def __post_init__(self) -> None:
        self.step_end = [None] * len(self.engines)

    def pool_run(self, req: _Request) -> int:
        """Leading prompt tokens the pool holds now (without touching its LRU)."""
        if self.pool is None:
            return 0
        return min(self.pool.held(req.chunk_keys) * CHUNK_TOKENS, req.seq.prompt_len - 1)

    def prefill_s(self, engine: Engine, req: _Request) -> float:
        """The request's prefill on `engine` now: its cached blocks there or the pool's run."""
        seq = req.seq
        gpu = engine.blocks.cached_run(seq.block_hashes, (seq.prompt_len - 1) // BLOCK_SIZE) * BLOCK_SIZE
        start = max(gpu, self.pool_run(req))
        return self.cost.prefill_s(start, seq.prompt_len) + (self.cost.pool_load_s(start - gpu) if start > gpu else 0.0)

    def left_tokens(self, engine: Engine) -> int:
        """Prompt tokens still to compute on `engine` (waiting, and running prefills)."""
        waiting = sum(s.prompt_len - s.pool_hit_tokens for s in engine.waiting)
        return waiting + sum(s.prompt_len - s.num_computed for s in engine.running if s.num_computed < s.prompt_len)

    def left_s(self, engine: Engine) -> float:
        left = self.left_tokens(engine)
        return self.cost.prefill_s(0, left) if left else 0.0

    def submit(self, engine: Engine, req: _Request) -> None:
        seq = req.seq
        if self.pool is not None:
            seq.pool_hit_tokens = self.pool.lookup(req.chunk_keys) * CHUNK_TOKENS
            seq.pool_keys = req.chunk_keys
        engine.add(seq)

    def take(self, i: int, requests: Sequence[_Request]) -> None:
        """Engine i takes work from the queue while it has less than the mark left."""
        engine = self.engines[i]
        while self.queue and self.left_tokens(engine) < self.mark_tokens and len(engine.seqs) < engine.max_num_seqs:
            choice = self._choose(i, requests)
            if choice is None:
                return
            self.queue.remove(choice)
            heapq.heapify(self.queue)
            self.submit(engine, requests[choice[1]])

    def _choose(self, i: int, requests: Sequence[_Request]) -> tuple[float, int] | None:
        """Of the first queued requests, the one engine i serves soonest after its order, of
        those no other engine would finish sooner; any of them if engine i idles."""
        engine = self.engines[i]
        others = [e for e in self.engines if e is not engine]
        left = {id(e): self.left_s(e) for e in self.engines}
        head = heapq.nsmallest(LOOKAHEAD, self.queue)
        options = []
        for entry in head:
            req = requests[entry[1]]
            here = left[id(engine)] + self.prefill_s(engine, req)
            if all(here <= left[id(o)] + self.prefill_s(o, req) + 1e-9 for o in others):
                options.append((entry[0] + here, entry))
        if not options and self.step_end[i] is None and not engine.has_work():
            options = [(entry[0] + self.prefill_s(engine, requests[entry[1]]), entry) for entry in head]
        return min(options)[1] if options else None

    def start(self, i: int, now: float) -> None:
        engine = self.engines[i]
        if self.step_end[i] is None and engine.has_work():
            step = engine.schedule()
            if step is not None:
                self.step_end[i] = now + step.duration

    def finish(self, i: int, now: float) -> None:
        engine = self.engines[i]
        step = engine.in_step
        assert isinstance(step, Step)
        engine.complete(step, now)
        self.step_end[i] = None
        if self.pool is not None:
            for seq, first, end in engine.pool_stores(step):
                self.pool.store(seq.pool_keys[first:end])


def late_binding_replay(
    prompts: Sequence[tuple[float, bytes, int]],
    cost: CostModel,
    workers: int,
    kv_capacity_tokens: int,
    pool_capacity_tokens: int,
    max_batched_tokens: int,
    mark_tokens: int = MARK_TOKENS,
) -> dict[str, Any]:
    """Replay `prompts` — (sent seconds, prompt bytes, output tokens), in send order — on a
    fleet of simulated engines fed late from one queue (see the module docstring); with a
    pool when `pool_capacity_tokens` > 0. Returns the TTFT summary, the engines' hit ratio,
    preemptions and their busy time held for KV."""
    hasher = BlockHasher(DEFAULT_MODEL.encode())
    requests = [
        _Request(
            Seq(id=str(i), prompt_len=len(data) // CHARS_PER_TOKEN, max_tokens=max(out, 1), block_hashes=hasher.hashes(data), arrival=sent),
            chunk_keys(data, DEFAULT_MODEL) if pool_capacity_tokens > 0 else [],
        )
        for i, (sent, data, out) in enumerate(prompts)
    ]
    engines = [
        Engine(cost, kv_capacity_tokens, max_batched_tokens, pool_chunk_tokens=CHUNK_TOKENS, has_pool=pool_capacity_tokens > 0)
        for _ in range(workers)
    ]
    fleet = _Fleet(cost, engines, ChunkStore(pool_capacity_tokens) if pool_capacity_tokens > 0 else None, mark_tokens)
    _run(fleet, requests)
    return _summary(fleet, requests, mark_tokens)


def _run(fleet: _Fleet, requests: Sequence[_Request]) -> None:
    """The event loop on the simulated clock: arrivals and step ends, in time order."""
    n, i = len(requests), 0
    while True:
        arrival = requests[i].seq.arrival if i < n else float("inf")
        ends = [(t, k) for k, t in enumerate(fleet.step_end) if t is not None]
        end, k = min(ends) if ends else (float("inf"), -1)
        if arrival == end == float("inf"):
            if fleet.queue:
                raise RuntimeError("requests left queued with every engine idle")
            return
        if arrival <= end:
            _arrive(fleet, requests, i, arrival)
            i += 1
        else:
            fleet.finish(k, end)
            fleet.take(k, requests)
            fleet.start(k, end)


def _arrive(fleet: _Fleet, requests: Sequence[_Request], i: int, now: float) -> None:
    req = requests[i]
    best_s = min(fleet.prefill_s(e, req) for e in fleet.engines)
    heapq.heappush(fleet.queue, (req.seq.arrival + best_s, i))
    for k, end in enumerate(fleet.step_end):
        if end is None:
            fleet.take(k, requests)
            fleet.start(k, now)


def _summary(fleet: _Fleet, requests: Sequence[_Request], mark_tokens: int) -> dict[str, Any]:
    ttfts = [r.seq.first_token_at - r.seq.arrival for r in requests if r.seq.first_token_at is not None]
    prompt = sum(r.seq.prompt_len for r in requests)
    cached = sum(r.seq.gpu_hit_tokens + r.seq.pool_loaded_tokens for r in requests)
    busy = sum(e.counters.busy_s for e in fleet.engines)
    return {
        "mark_tokens": mark_tokens,
        "pool": fleet.pool is not None,
        "requests": len(ttfts),
        "mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "p99_s": percentile(ttfts, 99),
        "worker_hit_ratio": cached / prompt if prompt else None,
        "preemptions": sum(e.counters.preemptions for e in fleet.engines),
        "kv_held_share": sum(e.counters.kv_held_s for e in fleet.engines) / busy if busy else None,
    }
