"""Sticky sessions: consistent hashing of a session id, with bounded loads.

The session id is the `x-session-id` header, else the body's `user`. Requests without one
hash their first prefix key (model, tools and system prompt), which is the best stand-in
for a conversation the router has without an index.

With a session id, its ring home holds the conversation: the recent-count cap does not
move it off that worker while the worker's queues are negligible (`bounded.within_bounds`).
Without one, every request of a group hashes alike and is spread by the caps as before.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import ClassVar

from cache_client.base import IndexView
from router.cost import CostModel
from router.policies.bounded import DEFAULT_LOAD_FACTOR, within_bounds
from router.routing import RouteDecision, RouteRequest, WorkerLoad

VIRTUAL_NODES = 64


def _hash(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "big")


class SessionPolicy:
    name: ClassVar[str] = "session"
    uses_index: ClassVar[bool] = False

    def __init__(self, load_factor: float = DEFAULT_LOAD_FACTOR) -> None:
        self._load_factor = load_factor
        self._ring_for: tuple[str, ...] = ()
        self._ring: list[tuple[int, str]] = []
        self._points: list[int] = []

    def _ring_of(self, names: tuple[str, ...]) -> tuple[list[tuple[int, str]], list[int]]:
        if names != self._ring_for:
            self._ring = sorted((_hash(f"{n}#{v}"), n) for n in names for v in range(VIRTUAL_NODES))
            self._points = [p for p, _ in self._ring]
            self._ring_for = names
        return self._ring, self._points

    def choose(
        self, request: RouteRequest, view: IndexView, loads: Sequence[WorkerLoad], cost: CostModel
    ) -> RouteDecision:
        key = request.session_key or (str(request.chain.keys[0]) if request.chain.keys else "")
        ring, points = self._ring_of(tuple(sorted(w.name for w in loads)))
        start = bisect.bisect(points, _hash(key))
        order: list[str] = []
        for i in range(len(ring)):
            name = ring[(start + i) % len(ring)][1]
            if name not in order:
                order.append(name)
        home = order[0]
        homes = (home,) if request.session_key else ()
        eligible = {w.name for w in within_bounds(loads, self._load_factor, homes=homes, quiet_prefill_s=cost.step_s)}
        chosen = next(n for n in order if n in eligible)
        reason = "session" if chosen == home else "overload"
        return RouteDecision(chosen, reason, ranking=tuple(n for n in order if n != chosen))
