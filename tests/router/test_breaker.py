"""Circuit breakers and outlier ejection: the state machine on a fake clock, the detector
on synthetic windows, and a breaker opening and closing in a real router."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx

from cache_client.base import EMPTY_VIEW
from loadtests.support.routerproc import RouterProcess
from normalizer.prefix import PrefixChain
from router.breaker import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    BreakerSettings,
    CircuitBreaker,
    OutlierDetector,
    OutlierSettings,
)
from router.cost import NO_REUSE
from router.proxy.handler import _expected_first_token_s
from router.routing import CandidateScore, Routed, RouteDecision, WorkerLoad
from tests.support.upstream import RecordingUpstream, UpstreamBehaviour


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def answered(breaker: CircuitBreaker, latency_s: float, expected_s: float | None = None) -> None:
    """A first byte `latency_s` after dispatch, judged against `expected_s`, as an attempt reports it."""
    breaker.success()
    breaker.timed(latency_s, expected_s)


def test_breaker_opens_probes_backs_off_and_closes() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerSettings(failure_threshold=3, open_s=2.0, max_open_s=5.0), "w", clock)
    for _ in range(2):
        assert b.begin()
        b.failure()
    b.success()  # a success resets the consecutive count
    for _ in range(3):
        assert b.begin()
        b.failure()
    assert b.state is OPEN and not b.admits() and not b.begin()
    clock.now += 2.0
    assert b.admits() and b.state is HALF_OPEN
    assert b.begin()  # the one probe
    assert not b.begin() and not b.admits()  # no second probe while it runs
    b.failure()  # failed probe: open again, twice as long
    assert b.state is OPEN
    clock.now += 3.9
    assert not b.admits()
    clock.now += 0.1
    assert b.begin()
    b.abandon()  # client left: the probe slot comes back
    assert b.begin()
    b.failure()
    clock.now += 4.9
    assert not b.admits()  # capped at max_open_s = 5
    clock.now += 0.1
    assert b.begin()
    b.success()
    assert b.state is CLOSED and b.trips == 0
    b.failure()
    b.failure()
    assert b.state is CLOSED  # the count restarted


def test_breaker_threshold_zero_never_opens_and_probe_now() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerSettings(failure_threshold=0), "w", clock)
    for _ in range(50):
        b.failure()
    assert b.state is CLOSED
    b = CircuitBreaker(BreakerSettings(failure_threshold=1, open_s=60), "w", clock)
    b.failure()
    assert not b.admits()
    b.probe_now()  # its health check passes again after a restart
    assert b.admits() and b.state is HALF_OPEN


@dataclass
class Member:
    name: str
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    healthy: bool = True

    @property
    def serving(self) -> bool:
        return self.healthy and self.breaker.admits()


def fleet_with(n: int, clock: Clock) -> list[Member]:
    return [Member(f"w{i}", CircuitBreaker(BreakerSettings(), f"w{i}", clock)) for i in range(n)]


def test_outliers_by_error_rate_and_latency_within_the_ejection_budget() -> None:
    clock = Clock()
    members = fleet_with(4, clock)
    det = OutlierDetector(lambda: members, OutlierSettings(min_requests=10, error_rate=0.5, latency_factor=4.0,
                                                           latency_min_s=0.1, ejection_s=10.0))
    for m in members:
        for _ in range(20):
            answered(m.breaker, 0.05)
    for _ in range(30):  # w1 fails 64% of its requests, never 5 in a row: its breaker stays closed
        for _ in range(3):
            members[1].breaker.failure()
        answered(members[1].breaker, 0.05)
    assert members[1].breaker.state is CLOSED
    for _ in range(20):
        answered(members[2].breaker, 2.0)  # w2 is slow: mean ~1 s against a median of 0.05 s
    assert sorted(det.evaluate()) == ["w1", "w2"]
    assert members[1].breaker.state is OPEN and members[2].breaker.state is OPEN
    assert all(m.breaker.win_ok == 0 for m in members)  # windows reset
    # A fifth... none: with 2 of 4 ejected the budget (50%) is spent.
    for m in (members[0], members[3]):
        for _ in range(20):
            m.breaker.failure()
            m.breaker.failures = 0
    assert det.evaluate() == []
    assert members[0].breaker.state is CLOSED
    # The ejection ends; a repeat offender is ejected for longer.
    clock.now += 10.0
    assert members[1].breaker.begin()
    members[1].breaker.success()
    for _ in range(20):
        members[1].breaker.failure()
        members[1].breaker.failures = 0
        answered(members[0].breaker, 0.05)
    assert det.evaluate() == ["w1"]
    assert members[1].breaker.open_until == clock.now + 20.0


def test_a_busy_worker_is_judged_against_its_predicted_wait_not_ejected() -> None:
    """Under load the worker with the longest queue answers 7x slower than the fleet's
    median, as the policy predicted when it sent each request there: not an outlier. A
    worker 10x slower than predicted (an engine that crawls) is."""
    clock = Clock()
    members = fleet_with(5, clock)
    det = OutlierDetector(lambda: members, OutlierSettings(min_requests=10, latency_factor=5.0, latency_min_s=0.25))
    for m in members:
        for _ in range(20):
            answered(m.breaker, 0.6, expected_s=0.4)  # 1.5x predicted: the fleet's usual error
    for _ in range(20):
        answered(members[2].breaker, 4.4, expected_s=3.0)  # a long queue, seen at dispatch
    assert det.evaluate() == []
    for m in members[:3] + members[4:]:
        for _ in range(20):
            answered(m.breaker, 0.6, expected_s=0.4)
    for _ in range(20):
        answered(members[3].breaker, 4.4, expected_s=0.3)  # nothing queued there explains it
    assert det.evaluate() == ["w3"]
    assert members[3].breaker.state is OPEN and members[2].breaker.state is CLOSED


def test_without_predictions_raw_latency_is_judged() -> None:
    """A cache-blind policy predicts nothing: the raw time to first byte decides, as before;
    and one worker without predictions in the window puts the whole fleet on raw times."""
    clock = Clock()
    members = fleet_with(4, clock)
    det = OutlierDetector(lambda: members, OutlierSettings(min_requests=10, latency_factor=5.0, latency_min_s=0.25))
    for m in members:
        for _ in range(20):
            answered(m.breaker, 0.1, expected_s=0.1 if m.name != "w0" else None)
    for _ in range(20):
        answered(members[1].breaker, 3.0, expected_s=3.0)
    assert det.evaluate() == ["w1"]


def test_too_few_requests_are_not_judged() -> None:
    clock = Clock()
    members = fleet_with(3, clock)
    det = OutlierDetector(lambda: members, OutlierSettings(min_requests=10))
    for _ in range(9):
        members[0].breaker.failure()
        members[0].breaker.failures = 0
    assert det.evaluate() == []


CHAT = {"model": "rec-model", "messages": [{"role": "user", "content": "hi"}]}


def test_breaker_takes_a_failing_worker_out_and_a_probe_brings_it_back() -> None:
    with RecordingUpstream(behaviour=UpstreamBehaviour(status=500)) as bad, RecordingUpstream() as good:
        args = ["--breaker-failures", "2", "--breaker-open-s", "1.0", "--outlier-interval-s", "0"]
        with RouterProcess({"bad": bad.url, "good": good.url}, policy="round_robin", extra_args=args) as r:
            for _ in range(10):
                resp = httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=10)
                assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == "good"
            assert len(bad.received) == 2  # then its circuit opened: no more traffic
            assert 'kvroute_worker_circuit_open{worker="bad"} 1' in r.metrics()
            assert 'kvroute_worker_healthy{worker="bad"} 1' in r.metrics()  # /health still passes
            bad.behaviour.status = 200  # it recovers
            time.sleep(1.1)
            served = set()
            for _ in range(6):
                resp = httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=10)
                assert resp.status_code == 200
                served.add(resp.headers["x-kvroute-worker"])
            assert served == {"bad", "good"}
            assert 'kvroute_worker_circuit_open{worker="bad"} 0' in r.metrics()


def test_only_answers_sent_to_a_worker_without_a_queue_are_timed() -> None:
    """The handler's side of the rule: an answer is judged against the policy's prediction
    if the worker had no queue when it was sent (nothing awaiting a first byte, nothing
    waiting in its engine), and not at all otherwise."""
    loads = (WorkerLoad("quiet"), WorkerLoad("queued", prefilling=1), WorkerLoad("engine", engine_waiting=2))
    scores = tuple(
        CandidateScore(1.0, 0.0, w.name, 0, NO_REUSE, 0.2, 0.3 + i, True, w) for i, w in enumerate(loads)
    )
    routed = Routed(RouteDecision("quiet", "miss", scores=scores), PrefixChain((), (), 0), EMPTY_VIEW, loads)
    assert _expected_first_token_s(routed, "quiet", stream=False)[0] == 0.3
    assert _expected_first_token_s(routed, "queued", stream=False)[0] is None
    assert _expected_first_token_s(routed, "engine", stream=False)[0] is None
    unscored = Routed(RouteDecision("quiet", "random"), PrefixChain((), (), 0), EMPTY_VIEW, loads)
    assert _expected_first_token_s(unscored, "quiet", stream=False)[0] == 0.0  # no prediction: the raw time is judged
