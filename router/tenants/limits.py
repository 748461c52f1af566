"""Per-tenant limits: the pure arithmetic, and the per-replica limiter used without Redis.

Three limits per tenant (`TenantLimits`), each a check before a request is forwarded:

* `requests_per_s`: a token bucket of one second's worth of requests (at least 1), refilled
  continuously. Over a long run the accepted rate is the limit; a burst may take one
  second's worth at once.
* `tokens_per_min`: a bucket of one minute's worth of tokens, refilled continuously. A
  request needs its estimated prompt tokens (at most the bucket's size, so a prompt larger
  than a minute's budget is not refused forever) and is charged them on admission; its
  generated tokens are charged when the answer ends (usage), so the bucket may go into
  debt and then refuses until it has refilled. Checked before, debited after.
* `concurrent`: requests in flight, released on every end path.

A request is admitted only if every limit allows it, and then charged on all of them at
once (`LocalLimits.admit` here, `limits.lua` in Redis with the same arithmetic); a refusal
charges nothing. The refusal names the first limit that said no and when to retry.

`share` divides every limit: a replica that cannot reach Redis enforces limit ÷ replicas
locally, so the fleet as a whole stays near the limit (router/tenants/enforce.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from router.tenants.model import TenantLimits

RATE = "requests_per_s"
TOKENS = "tokens_per_min"
CONCURRENT = "concurrent"
REASONS = {RATE: "rate", TOKENS: "tokens", CONCURRENT: "concurrent"}
"""Limit name -> the `reason` label of the per-tenant 429 metric."""


class Verdict(NamedTuple):
    limit: str | None
    """The limit that refused (RATE, TOKENS, CONCURRENT), or None: admitted."""
    retry_after_s: float = 0.0


ADMITTED = Verdict(None)


@dataclass(slots=True)
class Bucket:
    """A token bucket: `level` units at time `at` (seconds), `rate` units/s up to `size`."""

    size: float
    rate: float
    level: float
    at: float

    @classmethod
    def full(cls, size: float, rate: float, now: float) -> Bucket:
        return cls(size, rate, size, now)

    def refill(self, now: float) -> float:
        if now > self.at:
            self.level = min(self.size, self.level + (now - self.at) * self.rate)
            self.at = now
        return self.level

    def wait_for(self, need: float, now: float) -> float:
        """Seconds until `need` units are available (0: now)."""
        missing = need - self.refill(now)
        return 0.0 if missing <= 0 else missing / self.rate


def rate_bucket_size(requests_per_s: float) -> float:
    """One second's worth of requests, at least one (a limit below 1/s still admits one)."""
    return max(requests_per_s, 1.0)


def token_need(prompt_tokens: int, tokens_per_min: float) -> float:
    """What the token bucket must hold to admit a prompt: all of it, capped at the bucket's
    size (a prompt larger than a minute's budget waits for a full bucket, not forever)."""
    return float(min(max(prompt_tokens, 0), tokens_per_min))


def retry_after(seconds: float) -> int:
    """The `Retry-After` header's whole seconds: rounded up, at least 1."""
    return max(1, math.ceil(seconds - 1e-9))


def shared(limits: TenantLimits, share: float) -> TenantLimits:
    """`limits` scaled by `share` (1 / replicas): a replica's part while Redis is away.
    Concurrency stays at least 1 so that a tenant is never locked out entirely."""
    if share >= 1.0:
        return limits
    return TenantLimits(
        requests_per_s=None if limits.requests_per_s is None else limits.requests_per_s * share,
        tokens_per_min=None if limits.tokens_per_min is None else max(1, int(limits.tokens_per_min * share)),
        concurrent=None if limits.concurrent is None else max(1, int(limits.concurrent * share)),
    )


def any_limit(limits: TenantLimits) -> bool:
    return limits.requests_per_s is not None or limits.tokens_per_min is not None or limits.concurrent is not None


class _TenantState:
    __slots__ = ("inflight", "rate", "tokens")

    def __init__(self) -> None:
        self.rate: Bucket | None = None
        self.tokens: Bucket | None = None
        self.inflight = 0


class LocalLimits:
    """Every tenant's limits in this process (no I/O; `now` is passed in, in seconds).

    Buckets are (re)built when a tenant's limits change (a reload) and start full."""

    def __init__(self) -> None:
        self._state: dict[str, _TenantState] = {}

    def _of(self, name: str) -> _TenantState:
        state = self._state.get(name)
        if state is None:
            state = self._state[name] = _TenantState()
        return state

    def admit(self, name: str, limits: TenantLimits, prompt_tokens: int, now: float) -> Verdict:
        state = self._of(name)
        rate = tokens = None
        if limits.requests_per_s is not None:
            rate = state.rate = _fit(state.rate, rate_bucket_size(limits.requests_per_s), limits.requests_per_s, now)
            if (wait := rate.wait_for(1.0, now)) > 0:
                return Verdict(RATE, wait)
        need = 0.0
        if limits.tokens_per_min is not None:
            tpm = float(limits.tokens_per_min)
            tokens = state.tokens = _fit(state.tokens, tpm, tpm / 60.0, now)
            need = token_need(prompt_tokens, tpm)
            if (wait := tokens.wait_for(need, now)) > 0:
                return Verdict(TOKENS, wait)
        if limits.concurrent is not None and state.inflight >= limits.concurrent:
            return Verdict(CONCURRENT, 1.0)
        # Every limit allows it: charge them all.
        if rate is not None:
            rate.level -= 1.0
        if tokens is not None:
            tokens.level -= max(prompt_tokens, 0)
        state.inflight += 1
        return ADMITTED

    def debit(self, name: str, tokens: int, now: float) -> None:
        """Charge tokens learnt after admission (generated ones): the bucket may go into debt,
        down to one bucket's worth (beyond, one huge answer would lock the tenant out for
        minutes)."""
        bucket = self._of(name).tokens
        if bucket is not None and tokens > 0:
            bucket.refill(now)
            bucket.level = max(bucket.level - tokens, -bucket.size)

    def release(self, name: str) -> None:
        state = self._state.get(name)
        if state is not None and state.inflight > 0:
            state.inflight -= 1

    def inflight(self, name: str) -> int:
        state = self._state.get(name)
        return state.inflight if state is not None else 0


def _fit(bucket: Bucket | None, size: float, rate: float, now: float) -> Bucket:
    """The bucket for these limits: the existing one, or a full new one if they changed."""
    if bucket is None or bucket.size != size or bucket.rate != rate:
        return Bucket.full(size, rate, now)
    return bucket
