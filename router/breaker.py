"""Per-worker circuit breakers and passive outlier detection.

Active health checks (`Fleet.check`) only see `/health`; a worker can pass them while every
inference request fails (engine error, out of memory), hangs or crawls. Two passive
mechanisms watch real traffic instead:

* `CircuitBreaker` (one per worker): `failure_threshold` consecutive failures open it; an
  open worker gets no new requests for `open_s` (doubling after every failed probe, up to
  `max_open_s`); then it is half-open and admits `half_open_probes` requests at a time; the
  first success closes it, a failure opens it again. Failures are errors before the first
  byte (connect errors, 5xx, first-byte timeouts) and streams broken after it; answers the
  client caused (4xx) and client disconnects count as neither.
* `OutlierDetector` (one per fleet, Envoy-style): every `interval_s` it compares the
  workers' error rates and times to first byte over the last interval, and ejects (opens
  the breaker of) a worker whose error rate is above `error_rate`, or which is more than
  `latency_factor` times slower than the fleet's median, for `ejection_s` × its
  consecutive ejections. It never ejects more than `max_ejected_fraction` of the serving
  workers, so a fleet-wide slowdown does not empty the fleet.

  Slowness is judged only on answers to requests sent while the worker had no queue
  (nothing of the router's awaiting a first byte there, no request waiting in its engine),
  and, where the policy predicted their time to first byte (`cache_aware`: the prefill the
  worker lacks, its running requests), as observed ÷ predicted over the interval; without
  predictions (cache-blind policies) as the raw time. A busy worker is slow because of its
  queue, and the policy already sends it less. Ejecting it for that takes capacity away
  at the moment the fleet is shortest of it and moves every conversation it held: in
  `seed` at 9.99 sessions/s, the busiest worker ejected for 30 s in each of two runs
  (4.4 s mean time to first byte against a fleet median of 0.64 s; in the second run 10×
  its predicted time, the engine queueing for KV space the router's model does not see).
  An engine that is slow with nothing queued, one that crawls, is still ejected.

The hot path touches a breaker twice per attempt (`begin`, then `success`/`failure`): a
state check and a few attribute updates, no clock read while closed except `success`'s
latency sum, which the caller passes in.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from cache_client.redact import exc_summary
from router.aio import cancel_and_wait

log = logging.getLogger("kvroute.breaker")

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failure_threshold: int = 5
    """Consecutive failures that open the breaker (0: never open on failures)."""
    open_s: float = 5.0
    """First open period; doubles after each failed half-open probe."""
    max_open_s: float = 60.0
    half_open_probes: int = 1
    """Requests let through at once while half-open."""


class CircuitBreaker:
    __slots__ = (
        "_clock", "ejections", "failures", "open_until", "probes", "settings", "state", "trips",
        "win_expected_s", "win_failed", "win_latency_n", "win_latency_s", "win_ok", "win_predicted_observed_s",
        "worker",
    )  # fmt: skip

    def __init__(
        self, settings: BreakerSettings | None = None, worker: str = "", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings or BreakerSettings()
        self.worker = worker
        self._clock = clock
        self.state = CLOSED
        self.failures = 0
        """Consecutive failures."""
        self.trips = 0
        """Times opened since it was last closed (sets the next open period)."""
        self.ejections = 0
        """Consecutive outlier ejections (reset by an interval without one)."""
        self.open_until = 0.0
        self.probes = 0
        # The outlier detector's window, reset every interval.
        self.win_ok = 0
        self.win_failed = 0
        self.win_latency_s = 0.0
        self.win_latency_n = 0
        self.win_expected_s = 0.0
        """Σ predicted time to first byte of the requests that had a prediction ..."""
        self.win_predicted_observed_s = 0.0
        """... and Σ their observed times (their ratio: how much slower than expected)."""

    # -- admission ----------------------------------------------------------------------
    def admits(self) -> bool:
        """Whether the worker may be offered to the policy now (no slot is claimed)."""
        if self.state is CLOSED:
            return True
        if self.state is OPEN:
            if self._clock() < self.open_until:
                return False
            self.state = HALF_OPEN
            self.probes = 0
            log.info("worker %s: circuit half-open, probing", self.worker)
        return self.probes < self.settings.half_open_probes

    def begin(self) -> bool:
        """An attempt is about to be sent: False if the breaker refuses it (no probe slot)."""
        if self.state is CLOSED:
            return True
        if not self.admits():
            return False
        self.probes += 1
        return True

    # -- outcomes -----------------------------------------------------------------------
    def success(self) -> None:
        """An answer's first byte came (its time, if judged, goes to `timed`)."""
        self.win_ok += 1
        self.failures = 0
        if self.state is not CLOSED:
            log.info("worker %s: circuit closed (probe succeeded)", self.worker)
            self.state = CLOSED
            self.trips = 0
            self.probes = 0
            # The failures that opened it were dealt with; judging the worker's next
            # interval on them would eject it right after it came back.
            self.reset_window()

    def timed(self, latency_s: float, expected_s: float | None = None) -> None:
        """A time to first byte for the outlier detector's window (`expected_s`: the
        policy's prediction for it, if it made one)."""
        self.win_latency_s += latency_s
        self.win_latency_n += 1
        if expected_s is not None and expected_s > 0:
            self.win_expected_s += expected_s
            self.win_predicted_observed_s += latency_s

    def failure(self, why: str = "failure") -> None:
        self.win_failed += 1
        self.failures += 1
        if self.state is HALF_OPEN:
            self._open(self._backoff(), f"probe failed: {why}")
        elif self.state is CLOSED and 0 < self.settings.failure_threshold <= self.failures:
            self._open(self._backoff(), f"{self.failures} consecutive failures, last: {why}")

    def abandon(self) -> None:
        """The attempt ended without a verdict (client gone): give its probe slot back."""
        if self.state is HALF_OPEN and self.probes > 0:
            self.probes -= 1

    # -- transitions --------------------------------------------------------------------
    def _backoff(self) -> float:
        s = self.settings
        return min(s.open_s * (2.0 ** self.trips), s.max_open_s)

    def _open(self, duration_s: float, why: str) -> None:
        self.state = OPEN
        self.trips += 1
        self.probes = 0
        self.open_until = self._clock() + duration_s
        log.warning("worker %s: circuit open for %.1fs (%s)", self.worker, duration_s, why)

    def eject(self, duration_s: float, why: str) -> None:
        """Open the breaker for `duration_s` (outlier detection)."""
        self.ejections += 1
        self.state = OPEN
        self.probes = 0
        self.open_until = self._clock() + duration_s
        log.warning("worker %s: ejected for %.1fs (%s)", self.worker, duration_s, why)

    def probe_now(self) -> None:
        """The worker came back (its health check passes again): probe it at once, and
        forget the failures of its previous life."""
        self.reset_window()
        if self.state is OPEN:
            self.open_until = self._clock()

    def reset_window(self) -> None:
        self.win_ok = self.win_failed = self.win_latency_n = 0
        self.win_latency_s = self.win_expected_s = self.win_predicted_observed_s = 0.0

    def slowness(self) -> float | None:
        """Observed ÷ predicted time to first byte over the window (None: nothing predicted)."""
        return self.win_predicted_observed_s / self.win_expected_s if self.win_expected_s > 0 else None


# -- outlier detection ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutlierSettings:
    interval_s: float = 10.0
    min_requests: int = 20
    """Requests a worker must have answered in the interval to be judged."""
    error_rate: float = 0.5
    """Eject a worker whose failure fraction in the interval exceeds this (>= 1: off)."""
    latency_factor: float = 5.0
    """Eject a worker whose mean time to first byte exceeds this × the fleet median (0: off)."""
    latency_min_s: float = 0.25
    """... and exceeds the median by at least this much (tiny latencies are noise)."""
    ejection_s: float = 30.0
    """Ejection time per consecutive ejection."""
    max_ejection_s: float = 300.0
    max_ejected_fraction: float = 0.5


class _Member(Protocol):
    name: str
    breaker: CircuitBreaker

    @property
    def serving(self) -> bool: ...


MIN_LATENCY_SAMPLES = 5
"""Timed answers (sent to a worker with no queue) a worker needs in an interval to be judged
slow: fewer say little, and a busy worker has few."""


def _median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if len(values) >= 3 else None


def _slow_outliers(judged: list[_Member], s: OutlierSettings) -> list[tuple[float, _Member, str]]:
    """Workers more than `latency_factor` × slower than the fleet's median, and at least
    `latency_min_s` slower in mean time to first byte, over at least MIN_LATENCY_SAMPLES
    answers sent while they had no queue. Slower is observed ÷ predicted time when every
    judged worker's answers carried predictions, else the raw mean time to first byte."""
    timed = [m for m in judged if m.breaker.win_latency_n >= MIN_LATENCY_SAMPLES]
    means = {id(m): m.breaker.win_latency_s / m.breaker.win_latency_n for m in timed}
    mean_median = _median(list(means.values()))
    ratios = {id(m): m.breaker.slowness() for m in timed}
    relative = all(r is not None for r in ratios.values())
    slowness: dict[int, float] = ratios if relative else means  # type: ignore[assignment]
    median = _median(list(slowness.values()))
    if median is None or mean_median is None:
        return []
    found = []
    for m in timed:
        value, mean = slowness[id(m)], means[id(m)]
        if value > s.latency_factor * median and mean - mean_median >= s.latency_min_s:
            what = (
                f"time to first byte {value:.1f}x its predicted vs fleet median {median:.1f}x (mean {mean:.3f}s)"
                if relative else f"mean time to first byte {mean:.3f}s vs fleet median {median:.3f}s"
            )
            found.append((value / median if median > 0 else math.inf, m, what))
    return found


class OutlierDetector:
    def __init__(self, members: Callable[[], Iterable[_Member]], settings: OutlierSettings | None = None) -> None:
        self.settings = settings or OutlierSettings()
        self._members = members
        self._task: asyncio.Task | None = None
        self.ejected_total = 0

    def evaluate(self) -> list[str]:
        """Judge the interval that just ended, reset the windows; returns the ejected names."""
        s = self.settings
        members = list(self._members())
        serving = [m for m in members if m.serving]
        budget = math.floor(len(members) * s.max_ejected_fraction) - sum(
            1 for m in members if m.breaker.state is not CLOSED
        )
        judged = [m for m in serving if m.breaker.win_ok + m.breaker.win_failed >= s.min_requests]
        candidates: list[tuple[float, _Member, str]] = []
        for m in judged:
            b = m.breaker
            total = b.win_ok + b.win_failed
            rate = b.win_failed / total
            if s.error_rate < 1.0 and rate > s.error_rate:
                candidates.append((2.0 + rate, m, f"error rate {rate:.0%} over {total} requests"))
        erring = {id(c[1]) for c in candidates}
        if s.latency_factor > 0:
            candidates += _slow_outliers([m for m in judged if id(m) not in erring], s)
        ejected: list[str] = []
        for _, m, why in sorted(candidates, key=lambda c: c[0], reverse=True):
            if budget <= 0:
                log.warning("worker %s is an outlier (%s) but the ejection budget is spent", m.name, why)
                break
            duration = min(s.ejection_s * (m.breaker.ejections + 1), s.max_ejection_s)
            m.breaker.eject(duration, why)
            budget -= 1
            ejected.append(m.name)
        self.ejected_total += len(ejected)
        for m in members:
            if m.name not in ejected and m.breaker.state is CLOSED:
                m.breaker.ejections = 0
            m.breaker.reset_window()
        return ejected

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                self.evaluate()
            except Exception as exc:  # a bug here must not stop detection
                log.error("outlier evaluation failed: %s", exc_summary(exc))

    async def start(self) -> None:
        if self._task is None and self.settings.interval_s > 0:
            self._task = asyncio.create_task(self._loop(), name="kvroute-outliers")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
