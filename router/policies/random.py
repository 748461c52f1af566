"""Uniform random choice: the baseline a cache-unaware load balancer gives.

With a `seed` (`--random-seed`) the choice is keyed instead: a hash of the seed and the
request's prefix chain picks the worker. Every distinct request still lands on a uniformly
random worker, independently of the others, but the same request lands on the same worker
in every run with that seed, whatever order requests arrive in. Benchmarks comparing two
runs (the same conversations through `/v1/chat/completions` and `/v1/responses`, whose
chains are equal) then see the same placements on both sides — common random numbers —
instead of two independent draws of the baseline's noise. Without a seed, each request
gets a fresh pseudo-random choice.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from cache_client.base import IndexView
from router.cost import CostModel
from router.routing import RouteDecision, RouteRequest, WorkerLoad, rank_rest

_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: every input bit moves every output bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


class RandomPolicy:
    name: ClassVar[str] = "random"
    uses_index: ClassVar[bool] = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self._keyed_seed = None if seed is None else _mix64(seed & _MASK)

    def choose(
        self, request: RouteRequest, view: IndexView, loads: Sequence[WorkerLoad], cost: CostModel
    ) -> RouteDecision:
        keys = request.chain.keys
        if self._keyed_seed is None or not keys:
            worker = self._rng.choice(loads).name
        else:
            names = sorted(w.name for w in loads)
            worker = names[_mix64(self._keyed_seed ^ keys[-1] ^ request.chain.total_tokens) % len(names)]
        return RouteDecision(worker, "random", ranking=rank_rest(worker, loads))
