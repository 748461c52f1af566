"""The tenant limits' arithmetic and the fair wait queue's order: pure logic, a clock passed in."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from router.cost import NO_REUSE
from router.proxy.admission import Admission
from router.proxy.fair import (
    Activity,
    FairQueue,
    FifoQueue,
    Flow,
    below_share,
    may_take_slot,
    reserved_slots,
)
from router.tenants.limits import CONCURRENT, RATE, TOKENS, LocalLimits, retry_after, shared
from router.tenants.model import TenantLimits


def admitted(limits: LocalLimits, lim: TenantLimits, n: int, now: float, prompt: int = 0) -> int:
    return sum(limits.admit("t", lim, prompt, now).limit is None for _ in range(n))


def test_rate_bucket_admits_one_seconds_worth_then_the_rate() -> None:
    lim = TenantLimits(requests_per_s=10)
    limits = LocalLimits()
    assert admitted(limits, lim, 50, now=0.0) == 10
    verdict = limits.admit("t", lim, 0, 0.0)
    assert verdict.limit == RATE and verdict.retry_after_s == pytest.approx(0.1)
    assert admitted(limits, lim, 50, now=0.5) == 5  # refilled at 10/s
    # Over a long run offered 5x the limit, the accepted rate is the limit (+ one burst).
    total = sum(admitted(limits, lim, 5, now=1.0 + i / 50) for i in range(60 * 50))
    assert 600 <= total <= 610


def test_rate_below_one_per_second_still_admits_one() -> None:
    limits = LocalLimits()
    lim = TenantLimits(requests_per_s=0.2)
    assert admitted(limits, lim, 3, now=0.0) == 1
    assert limits.admit("t", lim, 0, 1.0).retry_after_s == pytest.approx(4.0)
    assert retry_after(4.0) == 4 and retry_after(0.01) == 1 and retry_after(4.2) == 5


def test_tokens_checked_before_and_debited_after() -> None:
    limits = LocalLimits()
    lim = TenantLimits(tokens_per_min=600)  # 10 tokens/s
    assert limits.admit("t", lim, 400, 0.0).limit is None  # 600 -> 200
    verdict = limits.admit("t", lim, 300, 0.0)
    assert verdict.limit == TOKENS and verdict.retry_after_s == pytest.approx(10.0)
    limits.release("t")
    limits.debit("t", 500, 0.0)  # generated tokens, learnt at the end: 200 -> -300 (debt)
    assert limits.admit("t", lim, 1, 0.0).limit == TOKENS
    # A prompt larger than a minute's budget waits for a full bucket, not forever.
    assert limits.admit("t", lim, 10_000, 90.0).limit is None


def test_debt_is_bounded_to_one_bucket() -> None:
    limits = LocalLimits()
    lim = TenantLimits(tokens_per_min=600)
    limits.admit("t", lim, 0, 0.0)
    limits.debit("t", 10**9, 0.0)
    assert limits.admit("t", lim, 1, 0.0).retry_after_s == pytest.approx(60.1)


def test_concurrent_released_and_refusal_charges_nothing() -> None:
    limits = LocalLimits()
    lim = TenantLimits(requests_per_s=2, concurrent=1)
    assert limits.admit("t", lim, 0, 0.0).limit is None
    assert limits.admit("t", lim, 0, 0.0).limit == CONCURRENT
    # The concurrency refusal took no request token: after a release one is still there.
    limits.release("t")
    assert limits.admit("t", lim, 0, 0.0).limit is None
    assert limits.inflight("t") == 1
    limits.release("t")
    limits.release("t")  # a second release never goes below zero
    assert limits.inflight("t") == 0


def test_changed_limits_start_a_full_bucket() -> None:
    limits = LocalLimits()
    assert admitted(limits, TenantLimits(requests_per_s=1), 5, 0.0) == 1
    assert admitted(limits, TenantLimits(requests_per_s=3), 5, 0.0) == 3  # reloaded with a new limit


def test_shared_divides_every_limit_keeping_one_slot() -> None:
    lim = TenantLimits(requests_per_s=10, tokens_per_min=1000, concurrent=3)
    quarter = shared(lim, 0.25)
    assert quarter == TenantLimits(requests_per_s=2.5, tokens_per_min=250, concurrent=1)
    assert shared(lim, 1.0) is lim
    assert shared(TenantLimits(), 0.25) == TenantLimits()


# -- the wait queue's order ------------------------------------------------------------------
@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def waiters(loop: asyncio.AbstractEventLoop, queue: FairQueue | FifoQueue, flow: Flow, n: int) -> list[asyncio.Future]:
    futs = [loop.create_future() for _ in range(n)]
    for f in futs:
        queue.push(f, flow)
    return futs


def serve(queue: FairQueue, n: int, who: dict[asyncio.Future, str], tokens: int = 100) -> list[str]:
    """Pop `n` waiters, charging each its flow as the handler does when it is sent."""
    order = []
    for _ in range(n):
        fut = queue.pop()
        assert fut is not None
        name = who[fut]
        order.append(name)
        queue.charge(FLOWS[name], tokens)
    return order


FLOWS = {"heavy": Flow("heavy"), "light": Flow("light"), "gold": Flow("gold", 3.0)}


def test_fifo_is_arrival_order(loop) -> None:
    queue = FifoQueue()
    a, b = waiters(loop, queue, FLOWS["heavy"], 1)[0], waiters(loop, queue, FLOWS["light"], 1)[0]
    assert queue.pop() is a and queue.pop() is b and queue.pop() is None
    assert queue.make_room(FLOWS["light"]) is None


def test_light_flow_served_ahead_of_heavy_backlog(loop) -> None:
    queue = FairQueue()
    heavy = waiters(loop, queue, FLOWS["heavy"], 20)
    who = dict.fromkeys(heavy, "heavy")
    assert serve(queue, 3, who) == ["heavy"] * 3
    light = waiters(loop, queue, FLOWS["light"], 1)
    who.update(dict.fromkeys(light, "light"))
    # Lifted to the heavy flow's counter, and fewer waiting: served next, not after 17.
    assert serve(queue, 1, who) == ["light"]


def test_weights_share_service(loop) -> None:
    queue = FairQueue()
    who = dict.fromkeys(waiters(loop, queue, FLOWS["heavy"], 40), "heavy")
    who.update(dict.fromkeys(waiters(loop, queue, FLOWS["gold"], 40), "gold"))
    order = serve(queue, 40, who)
    assert order.count("gold") == 30 and order.count("heavy") == 10  # weight 3 : 1


def test_idle_flow_banks_no_credit(loop) -> None:
    queue = FairQueue()
    who = dict.fromkeys(waiters(loop, queue, FLOWS["heavy"], 30), "heavy")
    serve(queue, 20, who)  # the light flow was idle meanwhile
    who.update(dict.fromkeys(waiters(loop, queue, FLOWS["light"], 10), "light"))
    order = serve(queue, 10, who)
    # It is not owed 20 requests' worth: it alternates with the heavy flow from here on.
    assert 4 <= order.count("light") <= 6


def test_done_waiters_are_skipped_and_counted_out_once(loop) -> None:
    queue = FairQueue()
    a, b = waiters(loop, queue, FLOWS["heavy"], 2)
    a.set_result(False)  # expired: its owner calls left() when it resumes
    assert queue.pop() is b
    queue.left(FLOWS["heavy"])
    assert queue.queued(FLOWS["heavy"]) == 0 and queue.pop() is None
    c = waiters(loop, queue, FLOWS["heavy"], 1)[0]
    assert queue.queued(FLOWS["heavy"]) == 1 and queue.pop() is c


def test_skip_first_hands_the_second_and_keeps_the_first(loop) -> None:
    queue = FairQueue()
    a = waiters(loop, queue, FLOWS["heavy"], 1)[0]
    b = waiters(loop, queue, FLOWS["light"], 1)[0]
    queue.charge(FLOWS["light"], 10)
    assert queue.pop(skip_first=True) is b
    assert queue.pop() is a


def test_full_queue_refuses_the_heaviest_flows_newest(loop) -> None:
    queue = FairQueue()
    heavy = waiters(loop, queue, FLOWS["heavy"], 5)
    assert queue.make_room(FLOWS["heavy"]) is None  # its own flow: the newcomer is refused
    assert queue.make_room(FLOWS["light"]) is heavy[-1]
    waiters(loop, queue, FLOWS["light"], 2)
    assert queue.make_room(FLOWS["light"]) is heavy[-1]
    waiters(loop, queue, FLOWS["light"], 2)  # 5 vs 4: would be 5 vs 5 after joining
    assert queue.make_room(FLOWS["light"]) is None


def test_without_tenants_the_queue_stays_fifo() -> None:
    from router.config_loader import flat_config
    from router.proxy.admission import AdmissionSettings
    from router.services import build_services

    settings = AdmissionSettings(max_inflight_per_worker=2)
    assert isinstance(settings.admission()._waiters, FifoQueue)
    assert isinstance(settings.admission(fair=True)._waiters, FairQueue)
    services = build_services(flat_config(max_inflight_per_worker=2))
    assert isinstance(services.admission._waiters, FifoQueue) and services.proxy.limiter is None
    assert services.admission.activity is None  # no slot reservation without tenants


# -- the slot reservation for tenants below their fair share -----------------------------------
EQUAL = {"x": 1.0, "y": 1.0}


def test_one_active_tenant_never_reserves() -> None:
    for held in (0, 8, 16):
        assert reserved_slots("x", {"x": held}, {"x": 1.0}, {"x": 5.0}, 16) == 0
    assert may_take_slot("x", 1, {"x": 15}, {"x": 1.0}, {}, 16)
    assert not may_take_slot("x", 0, {"x": 16}, {"x": 1.0}, {}, 16)  # no free slot is no slot


def test_heavy_tenant_over_its_share_is_refused_the_last_slots() -> None:
    # 16 slots, two equal tenants: shares of 8. y holds 1 and averaged 2 in flight:
    # x (over its share) must leave ceil(2) + 1 = 3 free slots.
    inflight, demand = {"x": 12, "y": 1}, {"x": 12.0, "y": 2.0}
    assert reserved_slots("x", inflight, EQUAL, demand, 16) == 3
    assert [may_take_slot("x", free, inflight, EQUAL, demand, 16) for free in (1, 2, 3, 4)] == [False] * 3 + [True]
    # The reservation is capped by y's shortfall from its share (8 - 6 = 2).
    assert reserved_slots("x", {"x": 8, "y": 6}, EQUAL, {"y": 6.0}, 16) == 2
    # y at or over its share: nothing reserved for it.
    assert reserved_slots("x", {"x": 8, "y": 8}, EQUAL, {"y": 8.0}, 16) == 0


def test_tenant_below_its_share_may_take_any_free_slot() -> None:
    inflight, demand = {"x": 12, "y": 1}, {"x": 12.0, "y": 2.0}
    assert reserved_slots("y", inflight, EQUAL, demand, 16) == 0
    assert may_take_slot("y", 1, inflight, EQUAL, demand, 16)
    # x below its share (7 < 8) is not held back either, whatever y needs.
    assert may_take_slot("x", 1, {"x": 7, "y": 0}, EQUAL, {"y": 5.0}, 16)


def test_weights_set_the_shares() -> None:
    weights = {"gold": 3.0, "x": 1.0}  # 16 slots: gold 12, x 4
    assert reserved_slots("x", {"x": 4, "gold": 2}, weights, {"gold": 2.0}, 16) == 3
    assert reserved_slots("x", {"x": 3, "gold": 2}, weights, {"gold": 2.0}, 16) == 0  # below its 4
    assert reserved_slots("gold", {"gold": 11, "x": 0}, weights, {"x": 1.0}, 16) == 0  # below its 12
    assert reserved_slots("gold", {"gold": 12, "x": 0}, weights, {"x": 1.0}, 16) == 2
    # Several light tenants: each one's reservation adds up.
    three = {"x": 1.0, "y": 1.0, "z": 1.0}
    assert reserved_slots("x", {"x": 10, "y": 1, "z": 0}, three, {"y": 1.0, "z": 0.0}, 15) == 3


def test_activity_window_and_demand() -> None:
    act = Activity(window_s=5.0, tau_s=5.0)
    x, y = Flow("x"), Flow("y")
    for _ in range(12):
        act.took(x, 0.0)
    act.took(y, 0.0)
    act.took(y, 0.0)
    assert set(act.active(1.0)) == {"x", "y"}
    # y holds 2: an average of 2 after a while; x over its share must leave 3 free.
    assert not act.may_take(x, 3, 16, 20.0) and act.may_take(x, 4, 16, 20.0)
    assert act.may_take(y, 1, 16, 20.0)
    act.gave_back(y, 20.0)
    act.gave_back(y, 20.0)
    assert "y" in act.active(24.0)
    # y idle for longer than the window: x alone, work-conserving again.
    assert set(act.active(26.0)) == {"x"} and act.may_take(x, 1, 16, 26.0)
    # A waiting request keeps its tenant active.
    act.queued(y, 1)
    assert set(act.active(60.0)) == {"x", "y"}


def test_pop_only_hands_slots_to_flows_allowed(loop) -> None:
    queue = FairQueue()
    heavy = waiters(loop, queue, FLOWS["heavy"], 2)
    assert queue.pop(allow=lambda name: name != "heavy") is None
    light = waiters(loop, queue, FLOWS["light"], 1)
    queue.charge(FLOWS["light"], 1000)  # served more: still the only one allowed
    assert queue.pop(allow=lambda name: name != "heavy") is light[0]
    assert queue.backlogged() == ["heavy"] and queue.pop() is heavy[0]


def fair_admission(per_worker: int) -> Admission:
    """An admission with the fair queue whose flows are active only while waiting or in flight
    (no clock in these tests); bind its slots with `bind_slots`."""
    adm = Admission(per_worker=per_worker, queue_timeout_s=30.0)
    adm.use_queue(FairQueue())
    assert adm.activity is not None
    adm.activity.window_s = -1.0
    return adm


def test_admission_keeps_reserved_slots_for_the_light_tenant_then_wakes_the_heavy(loop) -> None:
    from router.errors import RouterError
    async def scenario() -> None:
        adm = fair_admission(per_worker=4)
        free = [16]
        adm.bind_slots(lambda: (free[0], 16))
        x, y = Flow("x"), Flow("y")

        def take(flow: Flow) -> None:
            adm.took(flow)
            free[0] -= 1

        def give_back(flow: Flow) -> None:
            adm.gave_back(flow)
            free[0] += 1
            adm.released()

        adm.arrived(y)
        take(y)
        taken = 0
        while not adm.busy(x) and adm.may_take(x):
            take(x)
            taken += 1
        # x took its share (8) and more, but left the light tenant's reservation free.
        assert 8 <= taken < 15 and 1 <= free[0] <= 7
        held = free[0]
        loop_ = asyncio.get_running_loop()
        waiting = asyncio.ensure_future(adm.wait(loop_.time() + 30.0, flow=x))
        expiring = asyncio.ensure_future(adm.wait(loop_.time() + 0.01, flow=x))
        await asyncio.sleep(0)
        assert adm.queued == 2 and not waiting.done()
        # y arrives: not behind x's waiters, it takes a reserved slot at once.
        adm.arrived(y)
        assert not adm.busy(y) and adm.may_take(y)
        take(y)
        # The queue timeout still answers a held-back waiter: 429 with Retry-After.
        with pytest.raises(RouterError) as err:
            await expiring
        assert err.value.status == 429 and err.value.retry_after == adm.retry_after_s
        assert not waiting.done() and free[0] == held - 1
        # y's requests end: x alone again, its waiter is handed a slot.
        give_back(y)
        give_back(y)
        await asyncio.wait_for(waiting, 5.0)
        adm.end_turn()
        assert adm.queued == 0 and not adm.busy(x)

    loop.run_until_complete(scenario())


def test_a_waiter_queued_beside_a_free_slot_it_may_take_is_handed_it_at_once(loop) -> None:
    async def scenario() -> None:
        adm = Admission(per_worker=4, queue_timeout_s=30.0)
        adm.use_queue(FairQueue())
        adm.bind_slots(lambda: (1, 16))  # one slot free (e.g. on a worker the ranking skipped)
        fut = asyncio.ensure_future(adm.wait(asyncio.get_running_loop().time() + 30.0, flow=Flow("x")))
        await asyncio.wait_for(fut, 5.0)
        assert adm.queued == 0 and adm.busy(Flow("x"))  # it holds the handoff until end_turn
        adm.end_turn()
        assert not adm.busy(Flow("x"))

    loop.run_until_complete(scenario())


def test_below_share_needs_another_active_flow() -> None:
    assert not below_share("y", {"y": 0}, {"y": 1.0}, 16)  # alone: nobody to be fair to
    assert below_share("y", {"x": 15, "y": 7}, EQUAL, 16)
    assert not below_share("y", {"x": 8, "y": 8}, EQUAL, 16)
    assert below_share("gold", {"gold": 11}, {"gold": 3.0, "x": 1.0}, 16)  # its share is 12
    assert not below_share("x", {"x": 4}, {"gold": 3.0, "x": 1.0}, 16)


def test_a_light_tenant_s_prefill_is_kept_apart(loop) -> None:
    async def scenario() -> None:
        adm = fair_admission(per_worker=2)
        adm.bind_slots(lambda: (0, 6))  # three workers, every slot taken
        x, y = Flow("x"), Flow("y")
        for _ in range(5):
            adm.took(x)
        adm.mark("w2", x, light=False)  # one of x's requests still prefilling, on w2
        adm.took(y)  # y's request, on w0
        adm.mark("w0", y, light=True)
        waiting = asyncio.ensure_future(adm.wait(asyncio.get_running_loop().time() + 30.0, flow=x))
        await asyncio.sleep(0)
        # y holds 1 of its share (3 of 6): light; x, backlogged and over its share, is not.
        assert adm.light(y) and not adm.light(x)
        # Slots free on w0 and w2 while y's request on w0 awaits its first byte: x may not
        # join that prefill, nor queue a second one behind its own on w2 (one at a time) ...
        assert not adm.room_for("w0", 1, x) and not adm.room_for("w2", 1, x)
        assert adm.room_for("w0", 1, y)  # (a tenant's own guard does not keep it off)
        # ... but not take w1, the last worker with no prefill, kept for y's next request.
        assert not adm.room_for("w1", 1, x)
        # y's next request may go one over the limit there (the fleet had a slot free for it
        # elsewhere, on a worker whose engine is prefilling), never two, and never onto a
        # worker with a prefill in flight.
        assert adm.room_for("w1", 2, y, light=True) and not adm.room_for("w1", 3, y, light=True)
        assert not adm.room_for("w2", 2, y, light=True) and not adm.room_for("w1", 2, y)
        # y's first byte wakes x's waiter (three slots free: one more than y's reservation).
        assert not waiting.done()
        adm.bind_slots(lambda: (3, 6))
        adm.unmark("w0", y, light=True)
        await asyncio.wait_for(waiting, 5.0)
        adm.end_turn()
        assert adm.room_for("w0", 1, x)
        # Once y holds its share it is no longer light.
        adm.took(y)
        adm.took(y)
        assert not adm.light(y)
        # A guard keeps others off whatever they hold (a burst held to less than its share of
        # slots by a light tenant's requests would otherwise join their prefills).
        adm.mark("w0", y, light=True)
        for _ in range(3):
            adm.gave_back(x)
        assert not adm.room_for("w0", 1, x)

    loop.run_until_complete(scenario())


def test_others_may_not_take_the_last_worker_free_of_their_prefills(loop) -> None:
    async def scenario() -> None:
        adm = fair_admission(per_worker=4)
        adm.bind_slots(lambda: (10, 12))  # three workers
        x, y = Flow("x"), Flow("y")
        for _ in range(6):  # x holds its share: y's guards keep it off
            adm.took(x)
        adm.mark("w0", x, light=False)
        assert adm.room_for("w1", 0, x)  # x alone: nobody to keep a worker for
        adm.took(y)
        adm.mark("w2", y, light=True)
        adm.mark("w1", x, light=False)
        # w0 and w1 prefill x's requests, w2 y's: x may not add to w2, nor a second prefill to
        # its own workers (it sends them one at a time while y is light) ...
        assert not adm.room_for("w0", 1, x) and not adm.room_for("w1", 1, x) and not adm.room_for("w2", 1, x)
        adm.unmark("w2", y, light=True)
        adm.gave_back(y)
        adm.took(y)  # (y still active, its prefill over)
        # ... nor to the last worker free of them, even unguarded; until one of its own ends.
        assert not adm.room_for("w2", 1, x)
        adm.unmark("w0", x, light=False)
        assert adm.room_for("w2", 1, x)
        # A light tenant's share smaller than a worker keeps none: with four tenants active
        # on three workers, y's is three quarters of one.
        adm.mark("w0", x, light=False)
        assert not adm.room_for("w2", 1, x)
        adm.took(Flow("z"))
        adm.took(Flow("v"))
        assert adm.light(y) and adm.room_for("w2", 1, x) and adm.room_for("w0", 1, x)

    loop.run_until_complete(scenario())


def test_light_tenants_never_keep_another_from_every_worker(loop) -> None:
    async def scenario() -> None:
        adm = fair_admission(per_worker=4)
        adm.bind_slots(lambda: (8, 12))  # three workers
        x, y = Flow("x"), Flow("y")
        for _ in range(3):
            adm.took(y)
        adm.took(x)
        adm.mark("w0", y, light=True)
        adm.mark("w1", y, light=True)
        assert adm.light(y)
        # w2 is the last worker free of prefills and the only one left to x: x may take it.
        assert adm.room_for("w2", 0, x) and not adm.room_for("w0", 1, x)
        adm.mark("w2", x, light=False)
        # y's third request joins x's prefill on w2 (y is light: nothing keeps it off). x,
        # kept from no worker by y's guards until now, would be kept from all three: it may
        # go to any of them rather than wait for y's prefills, however many y sends.
        adm.mark("w2", y, light=True)
        assert all(adm.room_for(w, 1, x) for w in ("w0", "w1", "w2"))
        adm.unmark("w1", y, light=True)
        assert adm.room_for("w1", 1, x) and not adm.room_for("w0", 1, x)

    loop.run_until_complete(scenario())


def test_a_light_request_goes_where_no_prefill_runs_or_where_one_began_first(loop) -> None:
    async def scenario() -> None:
        adm = fair_admission(per_worker=4)
        adm.bind_slots(lambda: (8, 16))
        x, y = Flow("x"), Flow("y")
        assert adm.light_order(["w0", "w1", "w2", "w3"]) == ["w0", "w1", "w2", "w3"]
        adm.mark("w2", x, light=False)
        await asyncio.sleep(0.01)
        adm.mark("w0", x, light=False)
        await asyncio.sleep(0.01)
        adm.mark("w1", y, light=True)
        # The policy's first choice runs no prefill: its ranking stands.
        assert adm.light_order(["w3", "w0", "w1", "w2"]) == ["w3", "w0", "w1", "w2"]
        # Else the workers running none first, then the others by when their prefill began.
        assert adm.light_order(["w0", "w1", "w2", "w3"]) == ["w3", "w2", "w0", "w1"]
        # A second prefill queued on w2 (y's, say): w2 goes last, it has two to wait for ...
        adm.mark("w2", y, light=True)
        assert adm.light_order(["w2", "w1", "w0"]) == ["w0", "w1", "w2"]
        # ... and once the first ends, the second has just begun.
        await asyncio.sleep(0.01)
        adm.unmark("w2", x, light=False)
        assert adm.light_order(["w2", "w1", "w0"]) == ["w0", "w1", "w2"]
        adm.unmark("w2", y, light=True)
        assert adm.light_order(["w0", "w2"]) == ["w2", "w0"]
        # Where its prefill would cost more than waiting on the first (a cached prefix
        # there, none elsewhere), a worker keeps its ranked place after the others.
        assert adm.light_order(["w0", "w3", "w2", "w1"], lambda: {"w0", "w1"}) == ["w0", "w1", "w3", "w2"]
        assert adm.light_order(["w1", "w3", "w2", "w0"], lambda: {"w0", "w1", "w2"}) == ["w2", "w0", "w1", "w3"]

    loop.run_until_complete(scenario())


def test_a_whole_answer_s_prefill_counts_as_over_when_it_was_predicted_to_end(loop) -> None:
    from types import SimpleNamespace

    from router.load.board import LocalLoadBoard
    from router.proxy.attempt import Attempt
    from router.proxy.prefill_queue import NoPrefillQueue
    from router.workers import Worker

    async def scenario() -> None:
        adm = fair_admission(per_worker=4)
        adm.bind_slots(lambda: (8, 8))
        proxy = SimpleNamespace(admission=adm, loads=LocalLoadBoard(), prefill_queue=NoPrefillQueue())
        whole = Attempt(proxy, Worker("w0", "http://w0.test"), "cache_hit", prefill_s=0.05)  # type: ignore[arg-type]
        streamed = Attempt(proxy, Worker("w1", "http://w1.test"), "cache_hit", prefill_s=0.05)  # type: ignore[arg-type]
        whole.mark(Flow("x"), light=False, stream=False)
        streamed.mark(Flow("x"), light=False, stream=True)
        assert adm._prefilling == {"w0": 1, "w1": 1}
        # Its first byte comes after its decode: the admission stops counting it as
        # prefilling at the predicted end of its prefill; a stream at its first byte (or
        # its end).
        await asyncio.sleep(0.2)
        assert adm._prefilling == {"w1": 1}
        whole.release()
        streamed.release()
        assert adm._prefilling == {}

    loop.run_until_complete(scenario())


def test_a_flow_just_arrived_is_not_light_yet() -> None:
    act = Activity(window_s=5.0)
    x, y = Flow("x"), Flow("y")
    act.seen(y, 0.0)
    act.took(y, 0.0)
    act.seen(x, 5.0)  # x's burst arrives after y has been active for 5 s
    assert act.light(y, 16, 5.0)
    assert not act.light(x, 16, 5.0)  # below its share, but its burst has just begun
    act.took(x, 9.0)
    assert act.light(x, 16, 10.0)  # active for 5 s
    # A request waiting a moment (a slot is being handed to it) does not end it; a backlog
    # that, with what it holds, reaches its share does.
    act.queued(x, 1)
    assert act.light(x, 16, 10.0)
    act.queued(x, 6)
    assert not act.light(x, 16, 10.0)  # 1 in flight + 7 waiting: its share of 16 slots


def test_token_events_count_a_vllm_chat_stream_s_tokens() -> None:
    from router.proxy.relay import token_events

    def event(delta: dict, finish: str | None = None) -> bytes:
        chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    # As vLLM streams chat: the role with empty content, a token an event, an empty finish.
    stream = event({"role": "assistant", "content": ""}) + b"".join(event({"content": f"t{i}"}) for i in range(7))
    stream += event({}, "stop") + b"data: [DONE]\n\n"
    assert token_events(stream) == 7
    # Read an event at a time, or several coalesced, the counts add up the same.
    pieces = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    assert sum(token_events(p) for p in pieces) == 7
    assert token_events(b"".join(pieces[:3])) + token_events(b"".join(pieces[3:])) == 7
    # Completions: a token an event, its text.
    text = b"".join(b'data: {"choices":[{"index":0,"text":"' + w + b'"}]}\n\n' for w in (b"a", b"b", b""))
    assert token_events(text) == 2


def test_no_dearer_names_the_workers_whose_prefill_costs_no_more_than_the_wait() -> None:
    from router.proxy.handler import _no_dearer
    from router.routing import CandidateScore, RouteDecision, WorkerLoad

    def score(worker: str, prefill_s: float, queued_s: float) -> CandidateScore:
        load = WorkerLoad(worker, inflight=1, queued_prefill_s=queued_s, prefilling=1 if queued_s else 0)
        return CandidateScore(prefill_s + queued_s, 0.0, worker, 0, NO_REUSE, prefill_s, prefill_s + queued_s, True, load)

    # The prefix is cached on w0, where one prefill of 0.2 s is queued: recomputing it all
    # on w1 (0.5 s) costs more than the wait; w2 holds part of it (0.25 s) and costs less.
    scores = (score("w0", 0.05, 0.2), score("w2", 0.25, 0.0), score("w1", 0.5, 0.0))
    decision = RouteDecision("w0", "gpu_hit", ranking=("w2", "w1"), scores=scores)
    assert _no_dearer(decision) == {"w0", "w2"}
    # A policy that prices nothing leaves every worker movable.
    assert _no_dearer(RouteDecision("w0", "random", ranking=("w1",))) is None
