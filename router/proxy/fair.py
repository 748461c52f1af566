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
import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol


class Flow(NamedTuple):
    """Whose request: a tenant's name (or "" without one) and its weight."""

    name: str
    weight: float = 1.0


NO_FLOW = Flow("")

Waiter = asyncio.Future


class WaitQueue(Protocol):
    def push(self, fut: Waiter, flow: Flow, *, front: bool = False) -> None: ...
    def pop(self, *, skip_first: bool = False, allow: Callable[[str], bool] | None = None) -> Waiter | None: ...
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

    def pop(self, *, skip_first: bool = False, allow: Callable[[str], bool] | None = None) -> Waiter | None:
        # `allow` is ignored: FIFO waiters have no flows (no slot reservation without tenants).
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

    def backlogged(self) -> list[str]:
        """The flows with a live waiter."""
        return [name for name, live in self._live.items() if live and self._queues[name]]

    def _next_flow(self, allow: Callable[[str], bool] | None = None) -> str | None:
        """The backlogged flow with the lowest counter (ties: the one with fewer waiting, so
        a light flow is not kept behind a heavy one's backlog at equal counters), among those
        `allow` lets take a slot."""
        best: str | None = None
        best_key = (0.0, 0)
        for name, live in self._live.items():
            if not live or not self._queues[name]:
                continue
            if allow is not None and not allow(name):
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

    def pop(self, *, skip_first: bool = False, allow: Callable[[str], bool] | None = None) -> Waiter | None:
        """The head of the lowest-counter flow (`allow`: only flows it lets take a slot)."""
        skipped: tuple[str, Waiter] | None = None
        found: Waiter | None = None
        while (name := self._next_flow(allow)) is not None:
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


# -- slot reservation for tenants below their fair share ----------------------------------------
def reserved_slots(
    name: str, inflight: Mapping[str, int], weights: Mapping[str, float], demand: Mapping[str, float], total: int
) -> int:
    """How many of the fleet's free slots flow `name` may not take (0: it may take any).

    `weights`: the active flows' weights (`name`'s included); `inflight`: slots each holds;
    `demand`: each flow's recent average of slots held; `total`: the fleet's slots. With one
    active flow nothing is reserved (work-conserving FIFO). A flow below its weighted share
    of `total` is never held back. A flow at or over its share leaves free, for each other
    flow below its share, the slots it is likely to need soon: by Little's law the arrivals
    of one service time, i.e. its average in flight, rounded up, + 1 (for the variance),
    capped by how far it is below its share.
    """
    if len(weights) <= 1:
        return 0
    weight_sum = sum(weights.values())
    if weight_sum <= 0 or inflight.get(name, 0) < total * weights.get(name, 0.0) / weight_sum:
        return 0
    reserve = 0
    for other, weight in weights.items():
        if other == name:
            continue
        shortfall = total * weight / weight_sum - inflight.get(other, 0)
        if shortfall > 0:
            reserve += min(math.ceil(demand.get(other, 0.0)) + 1, math.ceil(shortfall))
    return reserve


def may_take_slot(
    name: str, free: int, inflight: Mapping[str, int], weights: Mapping[str, float], demand: Mapping[str, float],
    total: int,
) -> bool:
    """Flow `name` may take one of `free` slots (see `reserved_slots`)."""
    return free > reserved_slots(name, inflight, weights, demand, total)


def below_share(name: str, inflight: Mapping[str, int], weights: Mapping[str, float], total: int) -> bool:
    """Flow `name` holds fewer than its weighted share of the fleet's `total` slots while
    other flows are active (`weights`: the active flows', `name`'s included). Alone, no
    flow is below a share: there is nobody to be fair to."""
    if len(weights) <= 1:
        return False
    weight_sum = sum(weights.values())
    return weight_sum > 0 and inflight.get(name, 0) < total * weights.get(name, 0.0) / weight_sum


class Activity:
    """Which flows are active and their recent demand: the inputs of `reserved_slots`.

    A flow is active while it has a request waiting or in flight, and for `window_s` after
    its last one. Its demand is a time-weighted moving average of its slots in flight
    (time constant `tau_s`). Pure bookkeeping: the caller passes the clock (`now`).
    """

    def __init__(self, window_s: float = 5.0, tau_s: float = 5.0) -> None:
        self.window_s = window_s
        self.tau_s = tau_s
        self.inflight: dict[str, int] = {}
        self.waiting: dict[str, int] = {}
        self.weights: dict[str, float] = {}
        self._demand: dict[str, float] = {}
        self._updated: dict[str, float] = {}
        self._seen: dict[str, float] = {}
        self._since: dict[str, float] = {}
        """When each flow last became active (it had not been for `window_s`)."""

    def _advance(self, name: str, now: float) -> None:
        last = self._updated.get(name)
        held = self.inflight.get(name, 0)
        if last is None:
            self._demand[name] = float(held)
        elif now > last:
            alpha = 1.0 - math.exp(-(now - last) / self.tau_s)
            self._demand[name] += alpha * (held - self._demand[name])
        self._updated[name] = now

    def seen(self, flow: Flow, now: float) -> None:
        """A request of `flow` arrived."""
        name = flow.name
        if not self._is_active(name, now):
            self._since[name] = now
        self.weights[name] = flow.weight
        self._advance(name, now)
        self._seen[name] = now

    def _is_active(self, name: str, now: float) -> bool:
        return bool(self.inflight.get(name) or self.waiting.get(name)) or self._seen.get(name, -math.inf) >= now - self.window_s

    def took(self, flow: Flow, now: float) -> None:
        self.seen(flow, now)
        self.inflight[flow.name] = self.inflight.get(flow.name, 0) + 1

    def gave_back(self, flow: Flow, now: float) -> None:
        self.seen(flow, now)
        self.inflight[flow.name] = max(0, self.inflight.get(flow.name, 0) - 1)

    def queued(self, flow: Flow, delta: int) -> None:
        self.waiting[flow.name] = max(0, self.waiting.get(flow.name, 0) + delta)

    def active(self, now: float) -> dict[str, float]:
        """The active flows' weights."""
        return {name: weight for name, weight in self.weights.items() if self._is_active(name, now)}

    def _active_with(self, flow: Flow, now: float) -> dict[str, float]:
        """The active flows' weights, `flow`'s included (the one asking counts as active)."""
        weights = self.active(now)
        weights.setdefault(flow.name, flow.weight)
        return weights

    def demand(self, now: float) -> dict[str, float]:
        for name in self._demand:
            self._advance(name, now)
        return dict(self._demand)

    def light(self, flow: Flow, total: int, now: float, active: dict[str, float] | None = None) -> bool:
        """`flow` has been active for `window_s` and its requests in flight and waiting are
        fewer than its weighted share of `total` slots while another flow is active. A flow
        that has just arrived is not light yet: a burst's first requests hold fewer slots
        than its share too, and must not take the privileges of the steady flows it comes
        upon. (A request waiting a moment does not end it: a light tenant's arrival queues
        for an instant whenever the others have waiters a free slot is handed to, and the
        others' requests sent in that instant would skip the rules that keep them apart.)"""
        name = flow.name
        if now - self._since.get(name, now) < self.window_s:
            return False
        weights = self._active_with(flow, now) if active is None else {name: flow.weight, **active}
        wanted = {name: self.inflight.get(name, 0) + self.waiting.get(name, 0)}
        return below_share(name, wanted, weights, total)

    def may_take(self, flow: Flow, free: int, total: int, now: float) -> bool:
        weights = self._active_with(flow, now)
        if len(weights) <= 1:
            return free > 0
        return may_take_slot(flow.name, free, self.inflight, weights, self.demand(now), total)
