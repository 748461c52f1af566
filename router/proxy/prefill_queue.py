"""Late binding at saturation: while every worker has a full engine step of prefill queued,
requests wait in the router, the one whose prefill ends soonest first, and are routed when a
worker frees.

An engine serves its waiting queue in arrival order, and a request routed to a busy worker
is committed there: if that worker's queue drains later than another's, or a short prompt
lands behind a 40k-token one, the request waits for work a central queue would have let it
skip. With `overload.prefill_queue_tokens` set (the engines' `max_num_batched_tokens`: one
step's prompt tokens), a request that finds every candidate worker with at least a full
step of predicted prefill queued (`WorkerLoad.queued_prefill_s` against the prefill of that
many tokens, priced by the worker's own cost model) waits here instead. A worker with less
still fills its next step with what it has, and short prefills batched into one step cost
about as much as one: holding those back would serialise them (measured on `seed`, where
new tokens per turn are short: a mark of one decode step, tried first, held nearly every
request and took the mean TTFT from 0.17 s to 1.38 s at 9.16 sessions/s).

Whenever a prefill leaves a worker's queue (a first byte, a released attempt), the waiter
first in order is woken and routed afresh: the policy then sees the loads of that moment,
and sends it to the freed worker or, if its cached prefix is worth the wait, to the busy
worker holding it. Order: arrival time plus the request's predicted prefill (its
decision at arrival), so shorter prefills go first, but none waits for later arrivals more
than its own prefill's length ahead (pure shortest-first lets a long prompt wait for every
short one that comes; docs/reliability.md gives the measurement that chose it).

Nothing is refused here: a request waits at most `queue_timeout_s`, and then is routed as
if the queue were off. Below saturation (some worker under the mark) no request waits, so
the hot path adds one comparison per candidate. Requests for different models queue apart:
a worker of one model freeing wakes no other model's waiter.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import ClassVar

from router.cost import CostModel
from router.routing import WorkerLoad


class PrefillQueue:
    enabled: ClassVar[bool] = True

    def __init__(self, step_tokens: int, cost: CostModel, max_wait_s: float) -> None:
        self.step_tokens = step_tokens
        """A worker with at least the prefill of this many tokens queued is busy."""
        self.cost = cost
        """The router's cost model, for workers without learned costs of their own."""
        self.max_wait_s = max_wait_s
        self._waiting: dict[str, list[tuple[float, int, asyncio.Future[bool]]]] = {}
        """Per model: a heap of (order key, sequence, waiter)."""
        self._handoffs: dict[str, int] = {}
        """Per model: waiters woken for a free worker that have not taken a ticket yet."""
        self._seq = itertools.count()
        self.free_workers: Callable[[str], int] = lambda model: 0
        """How many of `model`'s serving workers are not busy now (bound by the proxy)."""
        self.held = 0
        """Requests that have waited here (a counter for tests and metrics)."""

    @property
    def waiting(self) -> int:
        """Requests waiting now (a scan: read at scrape time only)."""
        return sum(1 for heap in self._waiting.values() for *_, fut in heap if not fut.done())

    def free(self, loads: Sequence[WorkerLoad]) -> int:
        """Workers with less than a full engine step of prefill queued."""
        tokens, cost = self.step_tokens, self.cost
        return sum(1 for w in loads if w.queued_prefill_s < (w.cost or cost).prefill_s(0, tokens))

    def must_wait(self, model: str, loads: Sequence[WorkerLoad]) -> bool:
        """A request of `model` whose candidates have `loads` waits: others wait already, or
        every worker not promised to a woken waiter is busy."""
        return bool(self._waiting.get(model)) or self.free(loads) <= self._handoffs.get(model, 0)

    async def wait(self, model: str, prefill_s: float) -> bool:
        """Wait for a turn (True: the caller holds one, and calls `end_turn` once it has taken
        a ticket or given up) or for `max_wait_s` (False: go on without one)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        heapq.heappush(self._waiting.setdefault(model, []), (loop.time() + prefill_s, next(self._seq), fut))
        self.held += 1
        self.kick(model)
        timer = loop.call_later(self.max_wait_s, _expire, fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result():
                self.end_turn(model)  # the client left holding a turn: the next one takes it
            else:
                fut.cancel()  # skipped when popped
            raise
        finally:
            timer.cancel()

    def end_turn(self, model: str) -> None:
        self._handoffs[model] = self._handoffs.get(model, 1) - 1
        self.kick(model)

    def kick(self, model: str | None = None) -> None:
        """A prefill left a worker's queue (or a turn ended): wake as many waiters as there
        are free workers not promised yet, first in order first."""
        models = (model,) if model is not None else tuple(self._waiting)
        for name in models:
            heap = self._waiting.get(name)
            if not heap:
                continue
            room = self.free_workers(name) - self._handoffs.get(name, 0)
            while room > 0 and heap:
                _, _, fut = heapq.heappop(heap)
                if fut.done():
                    continue  # gave up or left
                fut.set_result(True)
                self._handoffs[name] = self._handoffs.get(name, 0) + 1
                room -= 1
            if not heap:
                del self._waiting[name]


def _expire(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)  # skipped when popped (done)


class NoPrefillQueue(PrefillQueue):
    """The queue off (`prefill_queue_tokens` 0, the default): nobody waits."""

    enabled: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__(step_tokens=0, cost=CostModel(), max_wait_s=0.0)

    def must_wait(self, model: str, loads: Sequence[WorkerLoad]) -> bool:
        return False

    def kick(self, model: str | None = None) -> None:
        return None
