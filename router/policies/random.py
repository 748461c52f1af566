"""Uniform random choice: the baseline a cache-unaware load balancer gives."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from cache_client.base import IndexView
from router.cost import CostModel
from router.routing import RouteDecision, RouteRequest, WorkerLoad, rank_rest


class RandomPolicy:
    name: ClassVar[str] = "random"
    uses_index: ClassVar[bool] = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(
        self, request: RouteRequest, view: IndexView, loads: Sequence[WorkerLoad], cost: CostModel
    ) -> RouteDecision:
        worker = self._rng.choice(loads).name
        return RouteDecision(worker, "random", ranking=rank_rest(worker, loads))
