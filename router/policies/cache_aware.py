"""Cache-aware routing: the lowest predicted time to first token, under bounded loads.

For each candidate: predicted TTFT = the prefill work already queued on it + the requests
running on it × their share of each batch step + the prefill of the prompt tokens it does
not hold (tokens held in the shared pool are charged their PCIe copy instead). Like
NVIDIA Dynamo's KV router, cache overlap and load are weighed in one currency, so a long
cached conversation stays on its worker unless that worker's queue costs more than
recomputing the conversation elsewhere.

Hot prefixes: a system prompt shared by every session is cached on whichever worker served
it first and would make that worker the cheapest for everyone. Bounded loads cap each
worker's share; spilled requests compute the prefix once on another worker, which then
holds it too — the hot prefix is replicated exactly as far as load requires, while each
conversation's own turns still follow its longer cached prefix. A conversation leaves the
worker holding most of its prefix only for a predicted gain of more than one engine step
(`CostModel.step_s`): smaller differences are noise in the router's view of the queues, and
moving duplicates the conversation's KV on a second worker.

A conversation's home is a worker holding the prompt of its previous turn (the chain's
`reply_depth`): while that worker's queues are negligible the recent-count cap does not
move the conversation (`bounded.within_bounds`), however much of the recent traffic is the
conversation's own. New sessions on a hot prefix have no home and are spread as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from cache_client.base import POOL, IndexView
from router.cost import CostModel
from router.policies.bounded import DEFAULT_LOAD_FACTOR, within_bounds
from router.routing import RouteDecision, RouteRequest, WorkerLoad


class CacheAwarePolicy:
    name: ClassVar[str] = "cache_aware"
    uses_index: ClassVar[bool] = True

    def __init__(self, load_factor: float = DEFAULT_LOAD_FACTOR) -> None:
        self._load_factor = load_factor

    def choose(
        self, request: RouteRequest, view: IndexView, loads: Sequence[WorkerLoad], cost: CostModel
    ) -> RouteDecision:
        chain = request.chain
        total = chain.total_tokens
        pool = chain.tokens_at_depth(view.depth(POOL))
        homes = {w.name for w in loads if chain.reply_depth and view.depth(w.name) >= chain.reply_depth}
        eligible = {w.name for w in within_bounds(loads, self._load_factor, homes=homes, quiet_prefill_s=cost.step_s)}

        gpu_of = {w.name: chain.tokens_at_depth(view.depth(w.name)) for w in loads}
        most_cached = max(gpu_of.values())
        # (score, recent load, name, gpu-cached tokens, reused tokens, prefill seconds)
        scored = []
        for w in loads:
            gpu = gpu_of[w.name]
            reuse = max(gpu, pool)
            prefill = cost.pool_load_s(pool - gpu) + cost.prefill_s(reuse, total)
            ttft = w.queued_prefill_s + w.inflight * cost.inflight_penalty_s + prefill
            # Hysteresis: leaving the worker that holds most of the prefix must win a step.
            score = ttft + (cost.step_s if gpu < most_cached else 0.0)
            scored.append((score, w.recent, w.name, gpu, reuse, prefill))
        scored.sort()

        best_unbounded = scored[0]
        chosen = next(s for s in scored if s[2] in eligible)
        _, _, name, gpu, reuse, prefill = chosen
        if chosen is not best_unbounded and best_unbounded[4] > reuse:
            reason = "overload"
        elif gpu > 0 and gpu >= pool:
            reason = "gpu_hit"
        elif pool > gpu:
            reason = "pool_hit"
        else:
            reason = "miss"
        ranking = tuple(s[2] for s in scored if s is not chosen and s[2] in eligible) + tuple(
            s[2] for s in scored if s[2] not in eligible
        )
        return RouteDecision(name, reason, cached_tokens=reuse, prefill_s=prefill, ranking=ranking)
