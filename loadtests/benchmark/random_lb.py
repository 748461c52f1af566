"""What a random load balancer reuses, and so how many sessions it can serve.

The incident's baseline is a random load balancer over vLLM workers with prefix caching.
Such a fleet is not cache-blind: a conversation that visited a worker a few turns ago may
still find its older prefix there, if that worker's KV cache has not evicted it since. How
much survives depends on how many other conversations pass through the worker in between,
so on the arrival rate. This module replays the reference sample of a scenario on the
zero-load timeline with uniform random placement and one LRU prefix cache per worker, and
finds the arrival rate at which a random load balancer's prefill work fills the fleet: the
capacity the scenario's `load` is a fraction of (see `loadtests.benchmark.workload.derive_rates`).

Approximations (each favours the random balancer, so its capacity is if anything
overstated and the scenario load understated):

* the group's shared system prompt and tools are cached on every worker (they are hot);
* a worker's cache is an LRU of conversations, each holding the prefix its last request on
  that worker left (prompt + generated tokens); eviction trims the least recently used
  conversation from its tail, as vLLM frees a sequence's last blocks first;
* requests are placed at their zero-load send times; under load sessions stretch, more run
  at once and less survives;
* the KV of running sequences does not take cache space.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from loadtests.sim.costs import CostModel

STEADY_AFTER_SESSIONS = 200
"""Sessions whose requests are not counted: the fleet's caches fill while they arrive."""
COUNTED_SESSIONS = 1600


@dataclass(frozen=True)
class SessionShape:
    """Token counts of one reference session and its zero-load send times."""

    shared: int
    prompts: tuple[int, ...]
    outputs: tuple[int, ...]
    send_s: tuple[float, ...]
    """Seconds after the session's arrival at which each request is sent."""


@dataclass(frozen=True)
class RandomReuse:
    rate_per_s: float
    reused_fraction: float
    """Prompt tokens found in the chosen worker's cache (shared prefix included) ÷ prompt tokens."""
    prefill_s_per_session: float


class _WorkerCache:
    __slots__ = ("capacity", "lru", "used")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, int] = OrderedDict()
        self.used = 0

    def cached(self, conv: int) -> int:
        return self.lru.get(conv, 0)

    def put(self, conv: int, tokens: int) -> None:
        self.used += tokens - self.lru.pop(conv, 0)
        self.lru[conv] = tokens
        while self.used > self.capacity and self.lru:
            oldest, held = next(iter(self.lru.items()))
            trim = min(held, self.used - self.capacity)
            if trim == held:
                del self.lru[oldest]
            else:
                self.lru[oldest] = held - trim
            self.used -= trim


def replay_random(
    shapes: Sequence[SessionShape],
    rate_per_s: float,
    workers: int,
    kv_capacity_tokens: int,
    cost: CostModel,
    seed: int = 0,
) -> RandomReuse:
    rng = random.Random(f"random-lb:{seed}")
    caches = [_WorkerCache(kv_capacity_tokens) for _ in range(workers)]
    events: list[tuple[float, int, int]] = []  # (send time, conversation, request index)
    t = 0.0
    total_sessions = STEADY_AFTER_SESSIONS + COUNTED_SESSIONS
    for conv in range(total_sessions):
        t += rng.expovariate(rate_per_s)
        shape = shapes[conv % len(shapes)]
        for i, send in enumerate(shape.send_s):
            events.append((t + send, conv, i))
    heapq.heapify(events)
    prompt_total = reused_total = 0
    prefill = 0.0
    while events:
        _, conv, i = heapq.heappop(events)
        shape = shapes[conv % len(shapes)]
        prompt = shape.prompts[i]
        cache = caches[rng.randrange(workers)]
        reused = min(max(cache.cached(conv), shape.shared), prompt)
        cache.put(conv, prompt + shape.outputs[i])
        if conv >= STEADY_AFTER_SESSIONS:
            prompt_total += prompt
            reused_total += reused
            prefill += cost.prefill_s(reused, prompt)
    return RandomReuse(rate_per_s, reused_total / max(prompt_total, 1), prefill / COUNTED_SESSIONS)


def random_lb_capacity(
    shapes: Sequence[SessionShape],
    workers: int,
    kv_capacity_tokens: int,
    cost: CostModel,
    low: float,
    high: float,
    iterations: int = 12,
) -> RandomReuse:
    """The arrival rate λ at which a random balancer's prefill work fills the fleet:
    λ × prefill seconds per session(λ) = workers (one second of prefill per GPU per
    second). Prefill per session grows with λ (more conversations compete for each cache),
    so the balance point is unique; found by bisection between `low` (the cache-blind
    capacity) and `high` (the capacity with ideal reuse)."""
    best = replay_random(shapes, low, workers, kv_capacity_tokens, cost)
    for _ in range(iterations):
        mid = (low + high) / 2
        at = replay_random(shapes, mid, workers, kv_capacity_tokens, cost)
        if mid * at.prefill_s_per_session <= workers:
            low, best = mid, at
        else:
            high = mid
    return best
