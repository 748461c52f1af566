"""The one Protocol every routing policy implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

from cache_client.base import IndexView
from router.cost import CostModel
from router.routing import RouteDecision, RouteRequest, WorkerLoad


class Policy(Protocol):
    name: ClassVar[str]
    uses_index: ClassVar[bool]
    """Whether `choose` reads the index view (if not, the router skips the lookup)."""

    def choose(
        self,
        request: RouteRequest,
        view: IndexView,
        loads: Sequence[WorkerLoad],
        cost: CostModel,
    ) -> RouteDecision:
        """Pick one of `loads` (never empty; all healthy candidates serving the model)."""
        ...
