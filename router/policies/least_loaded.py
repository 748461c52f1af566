"""Fewest requests in flight; ties go to the worker used least recently."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from cache_client.base import IndexView
from router.cost import CostModel
from router.routing import RouteDecision, RouteRequest, WorkerLoad, rank_rest


class LeastLoadedPolicy:
    name: ClassVar[str] = "least_loaded"
    uses_index: ClassVar[bool] = False

    def choose(
        self, request: RouteRequest, view: IndexView, loads: Sequence[WorkerLoad], cost: CostModel
    ) -> RouteDecision:
        best = min(loads, key=lambda w: (w.inflight + w.engine_waiting, w.recent, w.name))
        return RouteDecision(best.name, "least_loaded", ranking=rank_rest(best.name, loads))
