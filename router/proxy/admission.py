"""Overload: per-worker in-flight limits and a bounded, time-limited wait for a slot.

Without limits the router forwards everything and the engines queue it: latency grows
without bound and so does the router's memory (every waiting request holds its body and a
connection). With `max_inflight_per_worker` set, a request whose candidates are all at the
limit waits in a FIFO queue for a slot; the queue holds at most `queue_size` requests, each
for at most `queue_timeout_s`. Beyond that the router answers 429 with `Retry-After` at
once, which costs next to nothing and tells well-behaved clients (the OpenAI SDKs retry
429s) when to come back. With no worker serving at all the answer stays 503. Without
`max_inflight_per_worker`, `NoAdmission` stands in: every worker always has room, so the
handler asks the same questions either way and never checks for a missing admission.

Fairness: while anyone waits, new arrivals queue behind them instead of grabbing the next
free slot, and a slot that frees is handed to the head of the queue (`_handoffs` counts
slots promised to woken waiters that have not claimed them yet). Which waiter is the head
is the wait queue's business: `FifoQueue` (arrival order, the behaviour without tenants),
or with tenants `FairQueue` (router/proxy/fair.py: weighted fair share of tokens), so one
tenant's burst cannot starve the others.

Slot reservation (with the fair queue only): while more than one tenant is active, a tenant
holding at least its weighted share of the fleet's slots may not take the last free slots
that the other active tenants below their share are likely to need soon (`reserved_slots`
in fair.py; `Activity` keeps the counts). Such a tenant's request waits even with a slot
free; a light tenant arriving takes that slot at once, not queued behind it (`busy(flow)`).
Every release hands out as many free slots as the rule lets the waiters take, so held-back
waiters are woken as soon as it no longer holds them (a tenant held back holds slots, whose
releases re-evaluate it: no hang), and the queue timeout still answers 429 + Retry-After.
Slots are counted across the serving workers (`bind_slots`), whatever their models.

Light tenants (fair queue only): a tenant that has been active for a while and whose
requests in flight and waiting are fewer than its weighted share of the slots while another
tenant is active (`Activity.light`). The reservation finds it a slot; but a prefill that
shares engine steps with another one takes about twice as long, a prefill that arrives
behind another one waits for it, and the engine's scheduler does not know tenants. So the
admission keeps the other tenants' prefills away from a light tenant's:
* while a light tenant's request awaits its first byte on a worker, no other tenant's
  request is sent there (`mark`): a burst's requests arrive at every slot that frees, and
  would join the prefill;
* while a light tenant's weighted share of the fleet is a worker or more, the others'
  requests may not take the last worker with no prefill in flight: its next request finds
  a worker whose engine steps hold no other prefill, as it would alone, even while its
  previous one still prefills. A burst's first requests, which come upon every worker at
  once, are what this keeps from one of them;
* meanwhile the others send a worker one prefill at a time: the next waits in the router
  until the previous one's first byte, not in the engine's queue. A worker then frees of
  prefills as soon as the one it runs ends (the rule above keeps it for the light tenant
  from there), and a light tenant's request that finds no such worker waits behind one
  prefill, not a queue of them. The engine loses little: a prefill costs the same steps
  whether it queued there or came a moment later;
* a light tenant's request whose worker (the policy's choice) has a prefill in flight
  goes to one with none, or else behind the fewest prefills, the current one begun first
  (`light_order`): it waits for them all, and the one begun first ends first. Only to a
  worker where its own prefill costs no more than the wait (a cached prefix is not
  recomputed for longer than the queue it avoids);
* a light tenant's request may go one over the per-worker limit to a worker with no
  prefill in flight (`room_for`): the free slot that let it in may be on a busy one.
None of these starve the others: a tenant whom the light tenants' prefills keep from every
worker is kept from none (nor from the last clean one when it is the only worker left to
it), and the slot reservation is unchanged. Each holds a request back by one prefill at
most; their end (`unmark`) wakes the waiters. A whole (non-streamed) answer's first byte
comes after its decode, so its prefill counts as over when the cost model expected it to
end (`Attempt.mark`).
(Measured with a steady tenant beside a burst at 5× the fleet's capacity.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import ClassVar

from router.cost import CostModel
from router.errors import RouterError
from router.proxy.fair import NO_FLOW, Activity, FairQueue, FifoQueue, Flow, WaitQueue
from router.proxy.prefill_queue import NoPrefillQueue, PrefillQueue


class Admission:
    limits_inflight: ClassVar[bool] = True
    """False for `NoAdmission`: the handler then skips `room_for` and `released` (calls
    that could only say yes and do nothing, a few per request on the hot path)."""

    def __init__(
        self, per_worker: int, queue_size: int = 1024, queue_timeout_s: float = 10.0, retry_after_s: int = 1
    ) -> None:
        self.per_worker = per_worker
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self._waiters: WaitQueue = FifoQueue()
        self._queued = 0
        self._handoffs = 0
        self.rejected_full = 0
        self.rejected_timeout = 0
        self.activity: Activity | None = None
        """With the fair queue: the tenants' slots in flight and recent demand, for the slot
        reservation (`reserved_slots` in fair.py). None: no reservation (FIFO, as before)."""
        self.slots: Callable[[], tuple[int, int]] = lambda: (0, 0)
        """(free, total) slots across the serving workers (the proxy's, `bind_slots`)."""
        self._guarded: dict[str, dict[str, int]] = {}
        """Per worker, per tenant: light tenants' requests awaiting their first byte there."""
        self._prefilling: dict[str, int] = {}
        """Per worker: the other (not light) tenants' requests awaiting their first byte."""
        self._prefill_since: dict[str, float] = {}
        """Per worker with a prefill in flight: when the one its engine runs now began (the
        first mark, or the last unmark that left others: engines prefill in arrival order)."""

    def use_queue(self, queue: WaitQueue) -> None:
        """Serve waiters in `queue`'s order (before the first request); a fair queue also
        reserves slots for tenants below their share."""
        self._waiters = queue
        if isinstance(queue, FairQueue):
            self.activity = Activity()

    def bind_slots(self, slots: Callable[[], tuple[int, int]]) -> None:
        self.slots = slots

    # -- slot reservation and light tenants (fair queue only) -------------------------------
    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def arrived(self, flow: Flow) -> None:
        if self.activity is not None:
            self.activity.seen(flow, self._now())

    def took(self, flow: Flow) -> None:
        """A request of `flow` took a slot."""
        if self.activity is not None:
            self.activity.took(flow, self._now())

    def gave_back(self, flow: Flow) -> None:
        """A request of `flow` gave its slot back (call before `released`)."""
        if self.activity is not None:
            self.activity.gave_back(flow, self._now())

    def may_take(self, flow: Flow, *, holding_turn: bool = False) -> bool:
        """`flow` may take a free slot: there is one the reservation leaves it. Slots promised
        to woken waiters (but this request's own, `holding_turn`) are not free."""
        activity = self.activity
        if activity is None:
            return True
        free, total = self.slots()
        free -= self._handoffs - (1 if holding_turn else 0)
        return activity.may_take(flow, free, total, self._now())

    def light(self, flow: Flow) -> bool:
        """`flow` is a light tenant now (`Activity.light`): it keeps the others' prefills off
        the workers it prefills on."""
        activity = self.activity
        return activity is not None and activity.light(flow, self.slots()[1], self._now())

    def room_for(self, worker: str, inflight: int, flow: Flow = NO_FLOW, *, light: bool = False) -> bool:
        """A request of `flow` may go to `worker`, which has `inflight` requests: the worker
        is under its limit and keeps no prefill from it. A light tenant's request may go one
        over the limit to a worker with no prefill in flight: the slot the reservation left
        it may be on a worker whose engine is busy prefilling (it was let in by `may_take`,
        so the fleet as a whole has a slot free)."""
        activity = self.activity
        if activity is None:
            return inflight < self.per_worker
        clean = not self._prefill_in_flight(worker)
        if inflight >= self.per_worker + (1 if light and clean else 0):
            return False
        guards = self._guarded.get(worker)
        guarded_from_flow = bool(guards) and guards.keys() != {flow.name}
        stacking = not light and worker in self._prefilling
        if not (guarded_from_flow or clean or stacking):
            return True  # taking it keeps no worker from the light tenants
        # The fleet's slots are a scan of the workers: counted once per call, and only here.
        total, now = self.slots()[1], self._now()
        usable = self._workers(total) - self._guarded_from(flow)
        if usable < 1:
            return True  # never starved: the light tenants' guards hold every worker
        if guarded_from_flow:
            return False
        if not self._keeps_workers_for_light(flow, total, now):
            return True
        if stacking:
            return False
        # A clean worker is kept only if `flow` still has another one to prefill on.
        return not (self._last_clean_worker(total) and usable > 1)

    def _workers(self, total: int) -> int:
        """Workers in a fleet of `total` slots."""
        return total // self.per_worker if self.per_worker else 0

    def _guarded_from(self, flow: Flow) -> int:
        """Workers where another tenant's light prefill is in flight (kept from `flow`)."""
        return sum(1 for guards in self._guarded.values() if guards.keys() != {flow.name})

    def _last_clean_worker(self, total: int) -> bool:
        """At most one worker has no tenant's prefill in flight. A light tenant's prefill
        counts: its next request must find a worker of its own, as it would alone."""
        return self._workers(total) - len(self._prefilling.keys() | self._guarded.keys()) <= 1

    def _keeps_workers_for_light(self, flow: Flow, total: int, now: float) -> bool:
        """Another tenant is light and its weighted share of the fleet is a worker or more:
        the last worker with no prefill in flight is kept for it, and the others prefill one
        request at a time per worker. (A share smaller than one worker would not pay for
        keeping one: with ten tenants on four workers, none is.)"""
        activity = self.activity
        assert activity is not None
        workers = self._workers(total)
        weights = activity.active(now)
        weight_sum = sum(weights.values())
        return any(
            name != flow.name and workers * weight >= weight_sum and activity.light(Flow(name, weight), total, now, weights)
            for name, weight in weights.items()
        )

    def light_order(
        self, ranking: list[str], no_dearer: Callable[[], Collection[str] | None] = lambda: None
    ) -> list[str]:
        """Where a light tenant's request should try (the policy's `ranking`, best first):
        as ranked if the first has no prefill in flight; else the workers with none first
        (in ranked order), then the others by how many prefills they have in flight and how
        long the current one has run. A request sent behind prefills waits for all of them;
        of single ones, the one begun first ends first. `no_dearer()`: the workers where
        its own prefill costs no more than its prefill and queue on the first (the others,
        which would recompute a cached prefix for longer than the wait, keep their places
        after these); None: every worker (a policy that prices nothing)."""
        if not ranking or not self._prefill_in_flight(ranking[0]):
            return ranking
        movable = no_dearer()
        never = float("inf")

        def place(name: str) -> tuple[int, int, float]:
            if movable is not None and name not in movable:
                return (1, 0, 0.0)  # after the others, in ranked order
            return (0, self._in_flight(name), self._prefill_since.get(name, never))

        return sorted(ranking, key=place)

    def _prefill_in_flight(self, worker: str) -> bool:
        """Some tenant's request awaits its first byte on `worker` (it is not clean)."""
        return worker in self._prefilling or worker in self._guarded

    def _in_flight(self, worker: str) -> int:
        """Prefills in flight on `worker`, light tenants' and the others'."""
        guards = self._guarded.get(worker)
        return self._prefilling.get(worker, 0) + (sum(guards.values()) if guards else 0)

    def mark(self, worker: str, flow: Flow, *, light: bool) -> None:
        """A tenant's request was sent to `worker`; its prefill is in flight until `unmark`."""
        if not self._prefill_in_flight(worker):
            self._prefill_since[worker] = self._now()
        if light:
            guards = self._guarded.setdefault(worker, {})
            guards[flow.name] = guards.get(flow.name, 0) + 1
        else:
            self._prefilling[worker] = self._prefilling.get(worker, 0) + 1

    def unmark(self, worker: str, flow: Flow, *, light: bool) -> None:
        """That request's first byte came (or it ended): waiters kept off may go now."""
        counts = self._guarded.get(worker, {}) if light else self._prefilling
        key = flow.name if light else worker
        left = counts.pop(key, 0) - 1
        if left > 0:
            counts[key] = left
        elif light and not counts:
            self._guarded.pop(worker, None)
        if self._prefill_in_flight(worker):
            self._prefill_since[worker] = self._now()  # the next one in its engine begins
        else:
            self._prefill_since.pop(worker, None)
        if left <= 0:
            self.released()

    def _allowed(self, name: str) -> bool:
        assert self.activity is not None
        return self.may_take(Flow(name, self.activity.weights.get(name, 1.0)))

    def _reserving(self) -> bool:
        activity = self.activity
        return activity is not None and len(activity.active(self._now())) > 1

    @property
    def queued(self) -> int:
        return self._queued

    def busy(self, flow: Flow = NO_FLOW) -> bool:
        """Someone is ahead of a new arrival of `flow`: it must queue rather than take a free
        slot. With the reservation, waiters held back by it are not ahead of a tenant the
        held-back slots are reserved for: that one takes a free slot at once."""
        if self._queued == 0 and self._handoffs == 0:
            return False
        if self.activity is None or not self._reserving():
            return True
        # Slots promised to woken waiters are not free to this one (`may_take`).
        assert isinstance(self._waiters, FairQueue)
        return any(self._allowed(name) for name in self._waiters.backlogged()) or not self.may_take(flow)

    def _overloaded(self, why: str) -> RouterError:
        return RouterError(
            429,
            f"The router is at capacity ({why}); retry after {self.retry_after_s} s.",
            "overloaded",
            retry_after=self.retry_after_s,
        )

    def charge(self, flow: Flow, tokens: int) -> None:
        """`flow` was served `tokens` (the fair queue's counters; FIFO ignores it)."""
        self._waiters.charge(flow, tokens)

    async def wait(
        self, deadline: float, *, requeue: bool = False, pass_on: bool = False, flow: Flow = NO_FLOW,
        held_back: bool = False,
    ) -> None:
        """Wait until a slot frees up and is handed to this request (`flow`: whose it is).

        On return the caller holds a handoff: it must call `end_turn()` once it has taken a
        slot or given up, or call `wait(requeue=True)` if it found no slot it could use
        (it goes back to the head of the queue; `pass_on`: a slot is free that it cannot
        use, e.g. on another model's worker, so the next waiter is woken for it; with
        `held_back`, the slot is reserved for other tenants: it goes to a waiter the
        reservation lets take it, never back to this flow's). Raises
        RouterError(429) when the queue is full or `deadline` (loop time) passes first.
        """
        if self._queued >= self.queue_size and not requeue:
            self._make_room(flow)
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0:
            if requeue:
                self._handoffs -= 1
            self.rejected_timeout += 1
            raise self._overloaded("no slot freed in time")
        fut: asyncio.Future[bool | None] = loop.create_future()
        self._enqueue(fut, flow, requeue=requeue, pass_on=pass_on, held_back=held_back)
        await self._await_turn(fut, flow, remaining)
        if fut.result() is None:
            self.rejected_full += 1
            raise self._overloaded("queue full")
        if not _handed(fut):
            self.rejected_timeout += 1
            raise self._overloaded("no slot freed in time")

    def _make_room(self, flow: Flow) -> None:
        """The queue is full: a fair queue makes room by refusing the newest waiter of the
        flow holding the most places, unless that is `flow` itself (then, as always with
        FIFO, this request is refused)."""
        victim = self._waiters.make_room(flow)
        if victim is None:
            self.rejected_full += 1
            raise self._overloaded("queue full")
        victim.set_result(None)

    def _enqueue(
        self, fut: asyncio.Future[bool | None], flow: Flow, *, requeue: bool, pass_on: bool, held_back: bool
    ) -> None:
        """`fut` joins the queue (at its head when `requeue`d); the slots it may take now are
        handed out now (see `wait` for `pass_on` and `held_back`)."""
        if len(self._waiters) > 2 * self.queue_size + 16:
            # Futures that expired or were cancelled stay until popped; drop them now and
            # then so that the queue stays bounded even if no slot frees for a long time.
            self._waiters.compact()
        self._queued += 1
        self._waiters.push(fut, flow, front=requeue)
        if self.activity is not None:
            self.activity.queued(flow, 1)
            if not requeue:
                # Free slots the rule lets waiters take (this one's or others': e.g. a light
                # tenant's request taking a slot ended a reservation) are handed out now, not
                # at the next release.
                self.released()
        if requeue:
            self._handoffs -= 1
            if pass_on:
                self.released(skip_first=not held_back)

    async def _await_turn(self, fut: asyncio.Future[bool | None], flow: Flow, timeout_s: float) -> None:
        """Until `fut` is settled: a slot handed over (True), the timeout (False), or evicted
        to make room (None). A waiter not handed a slot leaves the queue here."""
        timer = asyncio.get_running_loop().call_later(timeout_s, _expire, fut)
        try:
            await fut
        except asyncio.CancelledError:
            # The client left while queued. A slot handed to it meanwhile goes to the next.
            if _handed(fut):
                self._handoffs -= 1
                self.released()
            raise
        finally:
            timer.cancel()
            if self.activity is not None:
                self.activity.queued(flow, -1)
            if not _handed(fut):
                # Leaves the queue here (expired, evicted or cancelled); released() skips it.
                if not fut.done():
                    fut.cancel()
                self._queued -= 1
                self._waiters.left(flow)

    def end_turn(self) -> None:
        """The woken request took its slot, or gave up."""
        self._handoffs -= 1

    def released(self, *, skip_first: bool = False) -> None:
        """A slot freed up: hand it to the next live waiter (or the one after: `skip_first`).

        With the fair queue, to as many waiters as there are free slots the reservation lets
        them take (slots it held back and no longer does, e.g. the light tenant went idle,
        go to the waiters now, not one per later release)."""
        if self.activity is None:
            fut = self._waiters.pop(skip_first=skip_first)
            if fut is not None:
                self._queued -= 1
                self._handoffs += 1
                fut.set_result(True)
            return
        while (fut := self._waiters.pop(skip_first=skip_first, allow=self._allowed)) is not None:
            self._queued -= 1
            self._handoffs += 1
            fut.set_result(True)


class NoAdmission(Admission):
    """No in-flight limits: there is always room, nobody ever queues, nothing to hand over."""

    limits_inflight: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__(per_worker=0, queue_size=0, queue_timeout_s=0.0)

    def room_for(self, worker: str, inflight: int, flow: Flow = NO_FLOW, *, light: bool = False) -> bool:
        return True

    def busy(self, flow: Flow = NO_FLOW) -> bool:
        return False

    async def wait(
        self, deadline: float, *, requeue: bool = False, pass_on: bool = False, flow: Flow = NO_FLOW,
        held_back: bool = False,
    ) -> None:
        return None  # a slot is always free

    def charge(self, flow: Flow, tokens: int) -> None:
        return None

    def end_turn(self) -> None:
        return None

    def released(self, *, skip_first: bool = False) -> None:
        return None


def _handed(fut: asyncio.Future[bool | None]) -> bool:
    return fut.done() and not fut.cancelled() and fut.result() is True


def _expire(fut: asyncio.Future[bool | None]) -> None:
    if not fut.done():
        fut.set_result(False)


@dataclass(frozen=True)
class AdmissionSettings:
    """The `overload` section of the router's config."""

    max_inflight_per_worker: int = 0
    """Requests in flight to one worker before new ones wait (0: no limit)."""
    queue_size: int = 1024
    """Requests that may wait for a slot; beyond, 429."""
    queue_timeout_s: float = 10.0
    retry_after_s: int = 1
    prefill_queue_tokens: int = 0
    """The engines' `max_num_batched_tokens`, to hold requests in the router while every
    worker has a full step of prefill queued, routed as workers free, earliest arrival +
    predicted prefill first (router/proxy/prefill_queue.py; 0: off)."""

    def admission(self, *, fair: bool = False) -> Admission:
        """Per-worker in-flight limits and the wait queue, or none (`max_inflight_per_worker` 0).
        `fair` (tenants configured): waiters are served by weighted fair share, not FIFO."""
        if self.max_inflight_per_worker <= 0:
            return NoAdmission()
        admission = Admission(self.max_inflight_per_worker, self.queue_size, self.queue_timeout_s, self.retry_after_s)
        if fair:
            admission.use_queue(FairQueue())
        return admission

    def prefill_queue(self, cost: CostModel) -> PrefillQueue:
        """The prefill queue (`cost` prices a step's tokens on workers without costs of their
        own), or none. A request waits in it at most `queue_timeout_s`."""
        if self.prefill_queue_tokens <= 0:
            return NoPrefillQueue()
        return PrefillQueue(self.prefill_queue_tokens, cost, self.queue_timeout_s)
