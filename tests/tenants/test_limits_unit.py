"""The tenant limits' arithmetic and the fair wait queue's order: pure logic, a clock passed in."""

from __future__ import annotations

import asyncio

import pytest

from router.proxy.fair import FairQueue, FifoQueue, Flow
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
