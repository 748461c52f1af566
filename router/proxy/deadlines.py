"""Timeouts for requests in flight, enforced by one sweeper instead of a timer per chunk.

Relaying a stream touches each chunk once; arming and cancelling an asyncio timer per
chunk would cost more than the relay itself. Each flight instead carries a deadline that
the relay moves forward (a float store), and a single task sweeps all flights a few times
a second, cancelling the ones past due with the reason recorded.
"""

from __future__ import annotations

import asyncio
import math

from router.aio import cancel_and_wait


class Flight:
    __slots__ = ("deadline", "expired", "task", "total_deadline")

    def __init__(self, task: asyncio.Task, deadline: float, total_deadline: float) -> None:
        self.task = task
        self.deadline = deadline
        self.total_deadline = total_deadline
        self.expired: str | None = None

    def extend(self, until: float) -> None:
        self.deadline = min(until, self.total_deadline)


class Deadlines:
    def __init__(self, resolution_s: float = 0.1) -> None:
        self._flights: set[Flight] = set()
        self._resolution = resolution_s
        self._task: asyncio.Task | None = None

    def track(self, timeout_s: float, total_s: float | None) -> Flight:
        loop = asyncio.get_running_loop()
        now = loop.time()
        total = now + total_s if total_s else math.inf
        flight = Flight(asyncio.current_task(), min(now + timeout_s, total), total)  # type: ignore[arg-type]
        self._flights.add(flight)
        if self._task is None:
            self._task = loop.create_task(self._sweep(), name="kvroute-deadlines")
        return flight

    def done(self, flight: Flight) -> None:
        self._flights.discard(flight)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._resolution)
            now = loop.time()
            for flight in [f for f in self._flights if f.deadline <= now]:
                self._flights.discard(flight)
                flight.expired = "total" if flight.total_deadline <= now else "timeout"
                flight.task.cancel()

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
