"""Each worker in turn."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import ClassVar

from cache_client.base import IndexView
from router.cost import CostModel
from router.routing import RouteDecision, RouteRequest, WorkerLoad, rank_rest


class RoundRobinPolicy:
    name: ClassVar[str] = "round_robin"
    uses_index: ClassVar[bool] = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(
        self, request: RouteRequest, view: IndexView, loads: Sequence[WorkerLoad], cost: CostModel
    ) -> RouteDecision:
        # Sorting by name keeps the rotation stable while workers come and go.
        ordered = sorted(loads, key=lambda w: w.name)
        worker = ordered[next(self._counter) % len(ordered)].name
        return RouteDecision(worker, "round_robin", ranking=rank_rest(worker, loads))
