"""Per-tenant limits, enforced across every router replica through Redis.

Per request of a tenant with limits: one call of `limits.lua`, which checks the tenant's
request and token buckets and its requests in flight, and charges them all or none,
atomically. The call rides in the round trip of the request's index lookup
(`RedisIndex.ride`, a pipeline), so a request pays no extra trip for its limits; a request
that looks nothing up (no index policy, a pinned Responses request) sends it alone.
What is learnt later (generated tokens, a request's end) is queued and rides with the next
check, or goes out on its own after `flush_delay_s`: never on the request's path.

While Redis is unreachable (the shared `RedisBackend` is down, or the check does not
answer within its budget: `CHECK_BUDGET_S`, or the index's lookup budget where that is
longer, since the check rides the lookup's own call) each replica enforces its share of
every limit locally, the limit ÷ the number of replicas (`replicas()`: the live replicas
the load board saw last, or the `tenant_replicas` setting), so no request fails because
Redis is away and the fleet as a whole stays near the limit. Requests admitted either way
are released the same way.

Without Redis (one replica) the local limiter holds the whole limit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cache_client.redact import exc_summary
from cache_client.redis_conn import REDIS_ERRORS, Script
from router.errors import RouterError
from router.tenants.limits import (
    CONCURRENT,
    RATE,
    TOKENS,
    LocalLimits,
    Verdict,
    any_limit,
    retry_after,
    shared,
)
from router.tenants.model import Tenant, TenantLimits

if TYPE_CHECKING:
    from cache_client.redis_index import RedisIndex

log = logging.getLogger("kvroute.tenants")

LIMITS_SCRIPT = Script("router.tenants", "limits.lua")
_CODES = {1: RATE, 2: TOKENS, 3: CONCURRENT}
_MAX_QUEUED_OPS = 60_000
"""Releases and debits kept for Redis while it is away; beyond, the oldest are dropped
(a dropped release frees its slot when its lease ends)."""
CHECK_BUDGET_S = 0.05
"""Longest a limit check waits for Redis before the local share decides: ten times the
index's default lookup budget, since a verdict that admits or refuses is worth more wait
than a routing hint. Never shorter than the index's configured lookup budget: an operator
who gave a slow Redis 200 ms for its lookups gave it that for the check riding in them."""


@dataclass(slots=True)
class Grant:
    """An admitted request's hold on its tenant's limits, given back by `TenantLimiter.finish`."""

    tenant: str
    id: str
    remote: bool
    """Charged in Redis (else in this replica's local limiter)."""
    limits: TenantLimits


@dataclass(slots=True)
class Pending:
    tenant: Tenant
    id: str
    prompt_tokens: int
    reply: asyncio.Future | None
    """The Redis check's reply (None: checked locally)."""
    ops: list[Any]
    """Releases and debits that rode along (queued again if the call fails)."""


class OverLimit(RouterError):
    """429: a tenant over one of its limits (`limit`: RATE, TOKENS or CONCURRENT)."""

    def __init__(self, tenant: Tenant, limit: str, wait_s: float) -> None:
        # The tenant's own name and figures only: nothing of another tenant's.
        value = getattr(tenant.limits, limit)
        what = {RATE: "requests per second", TOKENS: "tokens per minute", CONCURRENT: "concurrent requests"}[limit]
        seconds = retry_after(wait_s)
        super().__init__(
            429,
            f"Tenant '{tenant.name}' is over its limit of {value:g} {what} ({limit}); retry after {seconds} s.",
            "rate_limit_exceeded",
            retry_after=seconds,
        )
        self.limit = limit


class TenantLimiter:
    def __init__(
        self,
        index: RedisIndex | None = None,
        *,
        prefix: str = "kvroute",
        replicas: Callable[[], int] = lambda: 1,
        lease_s: float = 600.0,
        budget_s: float = CHECK_BUDGET_S,
        flush_delay_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._index = index
        self._tag = "{" + prefix + "}"
        self._key = self._tag + ":tl"
        self._replicas = replicas
        self._lease_ms = int(lease_s * 1000)
        self._budget_s = max(budget_s, index.backend.budget_s) if index is not None else budget_s
        self._flush_delay_s = flush_delay_s
        self._clock = clock
        self.local = LocalLimits()
        self._id_base = secrets.token_hex(5)
        self._ids = itertools.count()
        self._ops: list[Any] = []
        self._flush_at: asyncio.TimerHandle | None = None
        self.stats = {"remote": 0, "local": 0, "flushes": 0}
        if index is not None:
            index.backend.on_up.append(self._schedule_flush)
            index.backend.on_close.append(self.close)

    @staticmethod
    def applies(tenant: Tenant | None) -> bool:
        return tenant is not None and any_limit(tenant.limits)

    # -- admission -----------------------------------------------------------------------------
    def begin(self, tenant: Tenant, prompt_tokens: int) -> Pending:
        """Queue the tenant's check (to ride in the next index lookup); `settle` awaits it."""
        rid = f"{self._id_base}:{next(self._ids)}"
        index = self._index
        if index is None or not index.backend.up:
            return Pending(tenant, rid, prompt_tokens, None, [])
        limits = tenant.limits
        ops, self._ops = self._ops, []
        args = [self._tag, self._lease_ms, *ops, "A", tenant.name, rid, _opt(limits.requests_per_s),
                _opt(limits.tokens_per_min), _opt(limits.concurrent), max(int(prompt_tokens), 0)]
        return Pending(tenant, rid, prompt_tokens, index.ride(LIMITS_SCRIPT, self._key, args), ops)

    async def settle(self, pending: Pending) -> Grant:
        """The check's outcome: a `Grant`, or RouterError(429) naming the limit."""
        tenant = pending.tenant
        if pending.reply is not None:
            verdict = await self._remote(pending)
            if verdict is not None:
                self.stats["remote"] += 1
                if verdict.limit is not None:
                    raise OverLimit(tenant, verdict.limit, verdict.retry_after_s)
                return Grant(tenant.name, pending.id, True, tenant.limits)
        self.stats["local"] += 1
        share = 1.0 if self._index is None else 1.0 / max(self._replicas(), 1)
        verdict = self.local.admit(tenant.name, shared(tenant.limits, share), pending.prompt_tokens, self._clock())
        if verdict.limit is not None:
            raise OverLimit(tenant, verdict.limit, verdict.retry_after_s)
        return Grant(tenant.name, pending.id, False, tenant.limits)

    async def _remote(self, pending: Pending) -> Verdict | None:
        """Redis's verdict, or None if it did not answer in time (then: the local share)."""
        assert self._index is not None and pending.reply is not None
        self._index.send_riders()  # still queued if this request looked nothing up
        try:
            reply = await asyncio.wait_for(asyncio.shield(pending.reply), self._budget_s)
            code, wait_ms = int(reply[0][0]), int(reply[0][1])
        except (asyncio.TimeoutError, *REDIS_ERRORS) as exc:
            if not isinstance(exc, asyncio.TimeoutError):
                self._requeue(pending.ops)  # the call failed: nothing it carried was applied
            return None
        except Exception as exc:  # a script error is a bug: say so, and limit locally
            log.error("tenant limits script failed: %s", exc_summary(exc))
            self._requeue(pending.ops)
            return None
        return Verdict(_CODES[code], wait_ms / 1000) if code else Verdict(None)

    # -- after the answer ----------------------------------------------------------------------
    def finish(self, grant: Grant, generated_tokens: int = 0) -> None:
        """The request ended, whichever way: charge its generated tokens, free its slot."""
        limits = grant.limits
        if not grant.remote:
            if generated_tokens > 0:
                self.local.debit(grant.tenant, generated_tokens, self._clock())
            self.local.release(grant.tenant)
            return
        if limits.tokens_per_min is not None and generated_tokens > 0:
            self._ops += ["D", grant.tenant, int(generated_tokens)]
        if limits.concurrent is not None:
            self._ops += ["R", grant.tenant, grant.id]
        self._schedule_flush()

    def _requeue(self, ops: list[Any]) -> None:
        if ops:
            self._ops[:0] = ops
            if len(self._ops) > _MAX_QUEUED_OPS:
                del self._ops[: len(self._ops) - _MAX_QUEUED_OPS]

    def _schedule_flush(self) -> None:
        if self._flush_at is not None or not self._ops:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._flush_at = loop.call_later(self._flush_delay_s, self._flush)

    def _flush(self) -> None:
        """Send the queued releases and debits that no check took along."""
        self._flush_at = None
        index = self._index
        if not self._ops or index is None or not index.backend.up:
            return  # kept: the next check, or Redis coming back (on_up), sends them
        ops, self._ops = self._ops, []
        index.backend.spawn(self._send(ops))

    async def _send(self, ops: list[Any]) -> None:
        assert self._index is not None
        backend = self._index.backend
        try:
            await backend.script(LIMITS_SCRIPT, self._key, [self._tag, self._lease_ms, *ops])
            self.stats["flushes"] += 1
        except Exception as exc:
            if not isinstance(exc, REDIS_ERRORS):
                log.error("tenant limits release failed unexpectedly: %s", exc_summary(exc))
            self._requeue(ops)
            backend.failed(exc)

    async def close(self) -> None:
        """Send what is still queued (a stopping replica frees its tenants' slots)."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        if self._ops and self._index is not None and self._index.backend.up:
            ops, self._ops = self._ops, []
            await self._send(ops)


def _opt(value: float | int | None) -> str:
    return "" if value is None else repr(value) if isinstance(value, float) else str(value)
