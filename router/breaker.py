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
  workers' error rates and mean time to first byte over the last interval, and ejects (opens
  the breaker of) a worker whose error rate is above `error_rate`, or whose latency is more
  than `latency_factor` times the fleet's median, for `ejection_s` × its consecutive
  ejections. It never ejects more than `max_ejected_fraction` of the serving workers, so a
  fleet-wide slowdown does not empty the fleet.

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
        "win_failed", "win_latency_n", "win_latency_s", "win_ok", "worker",
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
    def success(self, latency_s: float | None = None) -> None:
        self.win_ok += 1
        if latency_s is not None:
            self.win_latency_s += latency_s
            self.win_latency_n += 1
        self.failures = 0
        if self.state is not CLOSED:
            log.info("worker %s: circuit closed (probe succeeded)", self.worker)
            self.state = CLOSED
            self.trips = 0
            self.probes = 0
            # The failures that opened it were dealt with; judging the worker's next
            # interval on them would eject it right after it came back.
            self.reset_window()

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
        self.win_latency_s = 0.0


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
        latencies = sorted(
            m.breaker.win_latency_s / m.breaker.win_latency_n for m in judged if m.breaker.win_latency_n
        )
        median = latencies[len(latencies) // 2] if len(latencies) >= 3 else None
        candidates: list[tuple[float, _Member, str]] = []
        for m in judged:
            b = m.breaker
            total = b.win_ok + b.win_failed
            rate = b.win_failed / total
            if s.error_rate < 1.0 and rate > s.error_rate:
                candidates.append((2.0 + rate, m, f"error rate {rate:.0%} over {total} requests"))
                continue
            if median is not None and s.latency_factor > 0 and b.win_latency_n:
                mean = b.win_latency_s / b.win_latency_n
                if mean > s.latency_factor * median and mean - median >= s.latency_min_s:
                    candidates.append((mean / median if median > 0 else math.inf, m, f"mean time to first byte {mean:.3f}s vs fleet median {median:.3f}s"))
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
