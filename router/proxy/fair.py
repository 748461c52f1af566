"""The admission wait queue's order: FIFO, or weighted fair share of tokens between tenants.

`Admission` (admission.py) hands each freed worker slot to the waiter its queue names.
Without tenants that is `FifoQueue`: arrival order, exactly as before tenants existed.

With tenants it is `FairQueue`, a virtual token counter (Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024): each flow (tenant) has a counter of the tokens it was
served divided by its weight (`charge`, for every request served, queued or not: prompt
tokens when it is sent, generated tokens when it ends). A freed slot goes to the head of
the backlogged flow with the lowest counter, so under overload each tenant gets service in
proportion to its weight, whatever the others send. A flow that becomes backlogged is
lifted to the lowest counter among the backlogged flows: being idle banks no credit to
burst with later, and a flow that keeps sending is never starved by one that returns.

When the queue is full, `make_room` refuses the newest waiter of the flow holding the most
places (unless that is the arriving request's own flow): a burst fills the queue with its
own requests and pays for it with its own 429s, not the other tenants'.

Pure bookkeeping: no clock, no I/O; futures are only compared for `done()`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import NamedTuple, Protocol


class Flow(NamedTuple):
    """Whose request: a tenant's name (or "" without one) and its weight."""

    name: str
    weight: float = 1.0


NO_FLOW = Flow("")

Waiter = asyncio.Future


class WaitQueue(Protocol):
    def push(self, fut: Waiter, flow: Flow, *, front: bool = False) -> None: ...
    def pop(self, *, skip_first: bool = False) -> Waiter | None: ...
    def left(self, flow: Flow) -> None: ...
    def make_room(self, flow: Flow) -> Waiter | None: ...
    def charge(self, flow: Flow, tokens: int) -> None: ...
    def compact(self) -> None: ...
    def __len__(self) -> int: ...


class FifoQueue:
    """Arrival order (`front`: a woken waiter that found no usable slot goes back first)."""

    def __init__(self) -> None:
        self._waiters: deque[Waiter] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    def push(self, fut: Waiter, flow: Flow, *, front: bool = False) -> None:
        if front:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)

    def pop(self, *, skip_first: bool = False) -> Waiter | None:
        skipped: Waiter | None = None
        found: Waiter | None = None
        while self._waiters:
            fut = self._waiters.popleft()
            if fut.done():
                continue
            if skip_first and skipped is None:
                skipped = fut
                continue
            found = fut
            break
        if skipped is not None:
            self._waiters.appendleft(skipped)
        return found

    def left(self, flow: Flow) -> None:
        return None

    def make_room(self, flow: Flow) -> Waiter | None:
        return None  # FIFO: a full queue refuses the newcomer

    def charge(self, flow: Flow, tokens: int) -> None:
        return None

    def compact(self) -> None:
        self._waiters = deque(f for f in self._waiters if not f.done())


class FairQueue:
    """Per-flow FIFO queues served by lowest virtual token counter (see the module doc)."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[Waiter]] = {}
        self._live: dict[str, int] = {}
        """Waiters of each flow still waiting (the deques also hold finished ones until popped)."""
        self.counters: dict[str, float] = {}
        """Tokens served per flow, divided by its weight."""

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def queued(self, flow: Flow) -> int:
        return self._live.get(flow.name, 0)

    def push(self, fut: Waiter, flow: Flow, *, front: bool = False) -> None:
        name = flow.name
        if not self._live.get(name):
            self._lift(name)
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = deque()
        if front:
            queue.appendleft(fut)
        else:
            queue.append(fut)
        self._live[name] = self._live.get(name, 0) + 1

    def _lift(self, name: str) -> None:
        """A flow joining the backlog starts no lower than the least-served backlogged flow."""
        backlogged = [
            self.counters.get(n, 0.0) for n, live in self._live.items() if live and n != name and self._queues[n]
        ]
        if backlogged:
            self.counters[name] = max(self.counters.get(name, 0.0), min(backlogged))

    def _next_flow(self) -> str | None:
        """The backlogged flow with the lowest counter (ties: the one with fewer waiting, so
        a light flow is not kept behind a heavy one's backlog at equal counters)."""
        best: str | None = None
        best_key = (0.0, 0)
        for name, live in self._live.items():
            if not live or not self._queues[name]:
                continue
            key = (self.counters.get(name, 0.0), live)
            if best is None or key < best_key:
                best, best_key = name, key
        return best

    def _pop_head(self, name: str) -> Waiter | None:
        # A finished waiter popped here still calls `left` when it resumes: only the live
        # one found is counted out.
        queue = self._queues[name]
        while queue:
            fut = queue.popleft()
            if not fut.done():
                self._live[name] -= 1
                return fut
        return None

    def pop(self, *, skip_first: bool = False) -> Waiter | None:
        skipped: tuple[str, Waiter] | None = None
        found: Waiter | None = None
        while (name := self._next_flow()) is not None:
            fut = self._pop_head(name)
            if fut is None:
                continue
            if skip_first and skipped is None:
                skipped = (name, fut)
                continue
            found = fut
            break
        if skipped is not None:
            name, fut = skipped
            self._queues[name].appendleft(fut)
            self._live[name] += 1
        return found

    def left(self, flow: Flow) -> None:
        """A waiter of `flow` gave up (expired, refused or cancelled) before it was popped."""
        live = self._live.get(flow.name, 0)
        if live > 0:
            self._live[flow.name] = live - 1

    def make_room(self, flow: Flow) -> Waiter | None:
        """The newest live waiter of the flow with the most places, if that is another flow
        holding more places than `flow` would after joining; None: refuse the newcomer."""
        heaviest = max(self._live, key=self._live.__getitem__, default=None)
        if heaviest is None or heaviest == flow.name or self._live[heaviest] <= self._live.get(flow.name, 0) + 1:
            return None
        queue = self._queues[heaviest]
        for fut in reversed(queue):
            if not fut.done():
                return fut
        return None

    def charge(self, flow: Flow, tokens: int) -> None:
        if tokens > 0:
            self.counters[flow.name] = self.counters.get(flow.name, 0.0) + tokens / flow.weight

    def compact(self) -> None:
        for name, queue in self._queues.items():
            self._queues[name] = deque(f for f in queue if not f.done())
