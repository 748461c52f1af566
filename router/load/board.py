"""Per-worker load as the router sees it: requests in flight, queued prefill, recent traffic.

`LoadBoard` is the interface; `LocalLoadBoard` keeps the counts in this process. A shared
implementation (Redis, for several router replicas) keeps a local snapshot that it syncs in
the background, so reading loads never costs a network round trip on the hot path.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from router.cost import CostModel
from router.routing import WorkerLoad

DEFAULT_RECENT_HALF_LIFE_S = 30.0


@dataclass(slots=True)
class Ticket:
    """One request's claim on a worker; released exactly once."""

    worker: str
    prefill_s: float
    started: float
    first_byte: bool = False
    done: bool = False
    modelled_s: float | None = None
    """The predicted time to its first token, excluding lag (None: not tracked for lag)."""


class LoadBoard(Protocol):
    costs: dict[str, CostModel]

    def snapshot(self, names: Iterable[str]) -> list[WorkerLoad]: ...
    def acquire(self, worker: str, prefill_s: float, modelled_s: float | None = None) -> Ticket: ...
    def first_byte(self, ticket: Ticket) -> None: ...
    def release(self, ticket: Ticket) -> None: ...
    def inflight(self, worker: str) -> int: ...
    def forget(self, worker: str) -> None: ...


class _Counts:
    __slots__ = ("engine_waiting", "inflight", "pending", "prefilling", "queued_prefill_s", "recent", "recent_at")

    def __init__(self) -> None:
        self.inflight = 0
        self.prefilling = 0
        self.queued_prefill_s = 0.0
        self.recent = 0.0
        self.recent_at = 0.0
        self.engine_waiting = 0
        self.pending: OrderedDict[int, Ticket] = OrderedDict()
        """Tracked tickets awaiting their first token, oldest first."""

    def lag_s(self, now: float) -> float:
        """How far behind its prediction the oldest tracked request awaiting its first token
        is: in an engine that serves its queue in order, every request sent after it waits
        at least that much longer than predicted too."""
        if not self.pending:
            return 0.0
        oldest = next(iter(self.pending.values()))
        return max(now - oldest.started - (oldest.modelled_s or 0.0), 0.0)


class LocalLoadBoard:
    def __init__(self, half_life_s: float = DEFAULT_RECENT_HALF_LIFE_S, clock=time.monotonic) -> None:
        self._decay = math.log(2) / half_life_s
        self._clock = clock
        self._counts: dict[str, _Counts] = {}
        self.costs: dict[str, CostModel] = {}
        """Each worker's learned cost model (router/calibration.py keeps it up to date):
        the load view carries it to the policy."""

    def _get(self, worker: str) -> _Counts:
        c = self._counts.get(worker)
        if c is None:
            c = self._counts[worker] = _Counts()
        return c

    def _recent(self, c: _Counts, now: float) -> float:
        return c.recent * math.exp(-self._decay * (now - c.recent_at)) if c.recent else 0.0

    def snapshot(self, names: Iterable[str]) -> list[WorkerLoad]:
        now = self._clock()
        costs = self.costs
        out = []
        for name in names:
            c = self._get(name)
            queued = max(c.queued_prefill_s, 0.0)
            out.append(WorkerLoad(
                name, c.inflight, queued, self._recent(c, now), c.engine_waiting, costs.get(name), c.prefilling,
                c.lag_s(now),
            ))  # fmt: skip
        return out

    def acquire(self, worker: str, prefill_s: float, modelled_s: float | None = None) -> Ticket:
        """`modelled_s`: the policy's predicted time to first token there, for a streamed
        request (its first byte is its first token); None leaves the request out of `lag_s`
        (a whole answer's first byte comes after its decode)."""
        now = self._clock()
        c = self._get(worker)
        c.inflight += 1
        c.prefilling += 1
        c.queued_prefill_s += prefill_s
        c.recent = self._recent(c, now) + 1.0
        c.recent_at = now
        ticket = Ticket(worker, prefill_s, now, modelled_s=modelled_s)
        if modelled_s is not None:
            c.pending[id(ticket)] = ticket
        return ticket

    def first_byte(self, ticket: Ticket) -> None:
        if ticket.first_byte or ticket.done:
            return
        ticket.first_byte = True
        c = self._counts.get(ticket.worker)
        if c is not None:  # a worker forgotten meanwhile starts from zero
            c.queued_prefill_s -= ticket.prefill_s
            c.prefilling -= 1
            if ticket.modelled_s is not None:
                c.pending.pop(id(ticket), None)

    def release(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        self.first_byte(ticket)
        ticket.done = True
        c = self._counts.get(ticket.worker)
        if c is not None:
            c.inflight -= 1

    def inflight(self, worker: str) -> int:
        c = self._counts.get(worker)
        return c.inflight if c else 0

    def set_engine_waiting(self, worker: str, waiting: int) -> None:
        self._get(worker).engine_waiting = waiting

    def forget(self, worker: str) -> None:
        self._counts.pop(worker, None)
        self.costs.pop(worker, None)
