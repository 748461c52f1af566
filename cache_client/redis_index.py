"""The shared prefix index: router replicas keep one view of the workers' caches in Redis.

Design (see docs/redis.md for the operator's view):

* Layout. Every key of a deployment starts with `{PREFIX}` (`--redis-prefix`), a Redis
  Cluster hash tag: the whole index lives in one slot, so each script call touches one node
  and stays atomic. Per location (worker or `POOL`): a sorted set of prefix keys scored by
  last use (server time in µs, strictly increasing per location: the LRU order and the TTL
  clock at once), a hash of the tokens each key is charged, and a small meta hash (tokens
  used, last score, capacity). See `lua/index.lua`.
* Round trips. A lookup is one EVALSHA of `lua/index.lua` (whole chain, every location);
  lookups that arrive while two calls are in flight share the next call. Writes never
  wait: `record`/`evict`/`drop_location`/`set_capacity` update a local mirror (a
  `MemoryIndex`) and queue an op; a background task sends queued ops in batches, and a
  lookup call carries the ops still queued, so a replica reads its own writes without an
  extra round trip.
* Outage. A lookup waits at most the lookup budget. A failed call, or three lookups in a
  row over budget, marks the backend down (logged once): lookups then answer from the
  mirror, writes queue up (bounded), and a probe reconnects in the background. When Redis
  answers again within budget (logged once) the queue is replayed; if Redis lost its data
  (its epoch token changed) or the queue overflowed, the replica pushes its whole mirror.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import struct
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cache_client.base import EMPTY_VIEW, IndexObserver, IndexView
from cache_client.memory import DEFAULT_CAPACITY_TOKENS, MemoryIndex
from cache_client.redact import exc_summary
from cache_client.redis_conn import (
    DEFAULT_LOOKUP_BUDGET_S,
    REDIS_ERRORS,
    RedisBackend,
    Script,
    parse_redis_url,
)
from normalizer.prefix import PrefixKey

log = logging.getLogger("kvroute.redis")

DEFAULT_TTL_S = 3600.0
_KEY_MASK = (1 << 64) - 1
_MAX_CHARGE = (1 << 32) - 1

INDEX_SCRIPT = Script("cache_client", "lua/index.lua")


@dataclass(frozen=True)
class RedisIndexSettings:
    """What `RedisIndex.from_settings` needs to know about the deployment's Redis index."""

    url: str
    """See `redis_conn.parse_redis_url`."""
    prefix: str = "kvroute"
    """Every key starts with `{prefix}` (a Redis Cluster hash tag: one slot per deployment)."""
    ttl_s: float = DEFAULT_TTL_S
    """Entries not used for this long expire."""
    lookup_budget_ms: float = DEFAULT_LOOKUP_BUDGET_S * 1e3
    """Longest a lookup waits for Redis before answering from the replica's local view."""
    default_capacity_tokens: int = DEFAULT_CAPACITY_TOKENS
    """Capacity model of a location no `set_capacity` has bounded yet."""


@dataclass(frozen=True)
class RedisOptions:
    """The `redis` section of the router's config: whether (and how) the index and the load
    board are shared with the other replicas through Redis."""

    url: str | None = None
    """See `redis_conn.parse_redis_url`. None: no Redis, each replica keeps its own index."""
    prefix: str = "kvroute"
    """Key prefix (and Redis Cluster hash tag) of this deployment's index."""
    ttl_s: float = DEFAULT_TTL_S
    """Index entries not used for this long expire."""
    lookup_budget_ms: float = DEFAULT_LOOKUP_BUDGET_S * 1e3
    """Longest a lookup waits for Redis before routing on the replica's local view."""

    def index_settings(self, default_capacity_tokens: int) -> RedisIndexSettings:
        if not self.url:
            raise ValueError("no --redis URL configured")
        return RedisIndexSettings(self.url, self.prefix, self.ttl_s, self.lookup_budget_ms, default_capacity_tokens)


# -- the index -------------------------------------------------------------------------------
def _pack_keys(keys: Sequence[PrefixKey]) -> bytes:
    return struct.pack(f">{len(keys)}Q", *[k & _KEY_MASK for k in keys])


def _pack_charges(key_tokens: Sequence[int]) -> bytes:
    return struct.pack(f">{len(key_tokens)}I", *[min(max(int(t), 1), _MAX_CHARGE) for t in key_tokens])


def _unpack_depths(packed: bytes) -> dict[str, int]:
    """A lookup script answer: per location, 2-byte name length, name, 4-byte depth."""
    depths = {}
    at, end = 0, len(packed)
    while at < end:
        (size,) = _U16.unpack_from(packed, at)
        name = packed[at + 2 : at + 2 + size].decode()
        (depths[name],) = _U32.unpack_from(packed, at + 2 + size)
        at += 6 + size
    return depths


_EXPIRED: Any = object()


def _settle_riders(riders: list[Rider], replies: BaseException | Sequence[Any]) -> None:
    for i, (_, _, _, fut) in enumerate(riders):
        if fut.done():
            continue
        reply = replies if isinstance(replies, BaseException) else replies[i]
        if isinstance(reply, BaseException):
            fut.set_exception(reply)
            fut.exception()  # retrieved here: a rider whose caller stopped waiting logs nothing
        else:
            fut.set_result(reply)


def _expire_soon(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
    # One more loop turn first: a reply that arrived in the turn the timer fired in is
    # still being handed up through the client's callbacks.
    loop.call_soon(_expire, fut)


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(_EXPIRED)


_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")

Op = tuple[Any, ...]
Rider = tuple[Script, str, Sequence[Any], asyncio.Future]
"""A script call riding in a lookup call's round trip: script, key, args, its reply's future."""


def _op_keys(op: Op) -> int:
    kind = op[0]
    if kind == "R":
        return len(op[3]) // 8
    if kind == "E":
        return len(op[2]) // 8
    return 1


class _Mirror(MemoryIndex):
    """What this replica recorded itself: the fallback view, and what it pushes to a Redis
    that lost its data."""

    def snapshot(self) -> list[tuple[str, list[tuple[PrefixKey, int]]]]:
        """Per location, its keys from least to most recently used, with their charges."""
        return [(name, list(loc.lru.items())) for name, loc in self._locations.items()]


class RedisIndex:
    """`PrefixIndex` on Redis, shared by every replica using the same prefix."""

    def __init__(
        self,
        backend: RedisBackend,
        *,
        prefix: str = "kvroute",
        ttl_s: float = DEFAULT_TTL_S,
        default_capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
        flush_delay_s: float = 0.001,
        max_batch_ops: int = 256,
        max_batch_keys: int = 1024,
        backlog_limit: int = 50_000,
        piggyback_ops: int = 32,
        max_lookup_calls: int = 2,
        max_lookups_per_call: int = 64,
        observer: IndexObserver | None = None,
    ) -> None:
        self._backend = backend
        self.tag = "{" + prefix + "}"
        self._locs_key = self.tag + ":locs"
        self._ttl_us = int(ttl_s * 1e6)
        self._default_capacity = int(default_capacity_tokens)
        # Every call offers a never-used epoch token: if it gets installed, Redis had no
        # index at that instant, even if this replica installed the previous one.
        self._epoch_base = secrets.token_hex(6)
        self._epoch_calls = 0
        self._epoch: bytes | None = None
        self._mirror = _Mirror(default_capacity_tokens)
        self._caps: dict[str, int] = {}
        self._init_write_queue(flush_delay_s, max_batch_ops, max_batch_keys, backlog_limit, piggyback_ops)
        self._init_lookup_batches(max_lookup_calls, max_lookups_per_call)
        self.stats = {
            "remote_lookups": 0, "fallback_lookups": 0, "lookup_calls": 0, "dropped_ops": 0, "resyncs": 0,
            "unsettled_writes": 0,
        }  # fmt: skip
        backend.probe = self._probe
        backend.on_up.append(self._on_up)
        if observer is not None:
            backend.observe(observer)

    def _init_write_queue(
        self, flush_delay_s: float, max_batch_ops: int, max_batch_keys: int, backlog_limit: int, piggyback_ops: int
    ) -> None:
        """The writes waiting for the flusher, which sends them in batches (or rides them on
        a lookup call, `piggyback_ops` at most), and how far they are written."""
        self._pending: deque[Op] = deque()
        # Ops ever queued, and of those the ones written (or given up: dropped, or folded into
        # a resync); `written()` waits for the second to reach the first.
        self._queued = 0
        self._settled = 0
        self._settle_waiters: deque[tuple[int, asyncio.Future]] = deque()
        self._flush_delay_s = flush_delay_s
        self._max_batch_ops = max_batch_ops
        self._max_batch_keys = max_batch_keys
        self._backlog_limit = backlog_limit
        self._piggyback_ops = piggyback_ops
        self._overflowed = False
        self._resync_needed = False
        self._resyncing = False
        self._wake: asyncio.Event | None = None
        self._flusher: asyncio.Task | None = None

    def _init_lookup_batches(self, max_lookup_calls: int, max_lookups_per_call: int) -> None:
        """The lookups waiting for a call (at most `max_lookup_calls` in flight, each
        carrying up to `max_lookups_per_call`)."""
        self._lookups: deque[tuple[bytes, asyncio.Future]] = deque()
        self._riders: deque[Rider] = deque()
        """Other script calls (the tenant limits') waiting to ride in the next lookup call."""
        self._lookup_calls = 0
        self._max_lookup_calls = max_lookup_calls
        self._max_lookups_per_call = max_lookups_per_call

    @classmethod
    def from_settings(cls, settings: RedisIndexSettings, observer: IndexObserver | None = None) -> RedisIndex:
        """An index on its own connection (`index.backend`, which others may share: the
        router's load board does). Connects on the first call in the app's loop, or at
        `connect` (the router calls it at startup: router/services.py, `connect_shared`)."""
        backend = RedisBackend(parse_redis_url(settings.url), budget_s=settings.lookup_budget_ms / 1e3)
        return cls(
            backend,
            prefix=settings.prefix,
            ttl_s=settings.ttl_s,
            default_capacity_tokens=settings.default_capacity_tokens,
            observer=observer,
        )

    @property
    def backend(self) -> RedisBackend:
        return self._backend

    @property
    def mirror(self) -> MemoryIndex:
        return self._mirror

    async def connect(self, timeout_s: float = 10.0) -> bool:
        """Wait until Redis answers (or `timeout_s` passes: False). Without it the index
        starts on first use, and that first lookup misses its budget while connecting."""
        self._start()
        return await self._backend.connect(timeout_s)

    # -- background machinery --------------------------------------------------------------
    def _start(self) -> None:
        if self._flusher is None and not self._backend.closed:
            self._backend.start()
            self._wake = asyncio.Event()
            self._flusher = self._backend.spawn(self._flush_loop())

    def _kick(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # not serving yet: the first call in the app's loop sends it
        self._start()
        if self._wake is not None and self._backend.up:
            self._wake.set()

    def _queue(self, op: Op) -> None:
        self._pending.append(op)
        self._queued += 1
        if len(self._pending) > self._backlog_limit:
            # The mirror still has it: the replica pushes its whole view when Redis is back.
            self._pending.popleft()
            self.stats["dropped_ops"] += 1
            self._overflowed = True
            self._settle(1)
        self._kick()

    def _settle(self, ops: int) -> None:
        """`ops` more queued ops are written or given up: wake whoever waited for them."""
        self._settled += ops
        self._wake_waiters(self._settled)

    def _wake_waiters(self, through: float) -> None:
        """End the `written()` waits for marks up to `through` (all of them, on a failure:
        nothing queued is coming soon)."""
        waiters = self._settle_waiters
        while waiters and waiters[0][0] <= through:
            _, fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    def _take(self, limit: int) -> list[Op]:
        """Up to `limit` queued ops, and no more keys than one short script run should touch
        (Redis runs scripts one at a time: a long one delays every replica's lookups)."""
        ops: list[Op] = []
        keys = 0
        pending = self._pending
        while pending and len(ops) < limit and keys < self._max_batch_keys:
            op = pending.popleft()
            ops.append(op)
            keys += _op_keys(op)
        return ops

    def _requeue(self, ops: list[Op]) -> None:
        # Replaying an op is harmless (a record refreshes recency, the others are idempotent).
        self._pending.extendleft(reversed(ops))
        while len(self._pending) > self._backlog_limit:
            self._pending.pop()
            self.stats["dropped_ops"] += 1
            self._overflowed = True
            self._settle(1)

    def _on_up(self) -> None:
        if self._overflowed:
            self._overflowed = False
            self._resync_needed = True
        self._kick()

    def _seen_epoch(self, epoch: bytes) -> None:
        if self._epoch is None:
            self._epoch = epoch
        elif epoch != self._epoch:
            self._epoch = epoch
            log.warning("redis index lost its data (new epoch); pushing this replica's view")
            self._resync_needed = True
            self._kick()

    def _args(self, ops: Iterable[Op], query: str = "", chains: Sequence[bytes] = ()) -> list[Any]:
        self._epoch_calls += 1
        candidate = f"{self._epoch_base}-{self._epoch_calls}"
        args: list[Any] = [self.tag, self._ttl_us, self._default_capacity, candidate, query, len(chains), *chains]
        for op in ops:
            args.extend(op)
        return args

    async def _call(self, ops: Iterable[Op], query: str = "", chains: Sequence[bytes] = ()) -> list[Any]:
        result = await self._backend.script(INDEX_SCRIPT, self._locs_key, self._args(ops, query, chains))
        self._seen_epoch(result[0])
        return result

    async def _call_with_riders(self, ops: list[Op], chains: Sequence[bytes], riders: list[Rider]) -> list[Any]:
        """A lookup call, with the riders' script calls pipelined behind it: one round trip."""
        if not riders:
            return await self._call(ops, "L", chains)
        calls = [(INDEX_SCRIPT, self._locs_key, self._args(ops, "L", chains))]
        calls += [(script, key, args) for script, key, args, _ in riders]
        try:
            replies = await self._backend.scripts(calls)
        except BaseException as exc:
            _settle_riders(riders, exc)
            raise
        _settle_riders(riders, replies[1:])
        if isinstance(replies[0], BaseException):
            raise replies[0]
        self._seen_epoch(replies[0][0])
        return replies[0]

    # -- riders ------------------------------------------------------------------------------
    def ride(self, script: Script, key: str, args: Sequence[Any]) -> asyncio.Future:
        """Queue a script call (`key` in this index's hash tag) to ride in the round trip of
        the next lookup call; its future gets the reply, or the exception raised. Whoever
        did not look anything up after queueing sends it alone with `send_riders`."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._riders.append((script, key, args, fut))
        return fut

    def send_riders(self) -> None:
        """Send the riders still waiting for a lookup call, in a call of their own."""
        if self._riders:
            riders = list(self._riders)
            self._riders.clear()
            if self._backend.up:
                self._backend.spawn(self._riders_alone(riders))
            else:
                _settle_riders(riders, ConnectionError("redis is unreachable"))

    async def _riders_alone(self, riders: list[Rider]) -> None:
        try:
            replies = await self._backend.scripts([(script, key, args) for script, key, args, _ in riders])
        except Exception as exc:
            if not isinstance(exc, REDIS_ERRORS):
                log.error("redis rider call failed unexpectedly: %s", exc_summary(exc))
            _settle_riders(riders, exc)
            self._backend.failed(exc)
            return
        _settle_riders(riders, replies)

    async def _probe(self) -> Any:
        return await self._call(())

    async def _flush_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._flush_delay_s:
                # Lets the records of concurrent requests gather into one call.
                await asyncio.sleep(self._flush_delay_s)
            await self._drain()

    async def _drain(self) -> bool:
        """Send what is queued; False if Redis failed meanwhile."""
        while self._backend.up and (self._pending or self._resync_needed):
            if self._resync_needed:
                if not await self._resync():
                    return False
                continue
            ops = self._take(self._max_batch_ops)
            try:
                await self._call(ops)
                self._settle(len(ops))
            except Exception as exc:
                if not isinstance(exc, REDIS_ERRORS):
                    log.error("redis index write failed unexpectedly: %s", exc_summary(exc))
                self._requeue(ops)
                self._backend.failed(exc)
                self._wake_waiters(math.inf)
                return False
        return self._backend.up

    async def _resync(self) -> bool:
        self._resync_needed = False
        self._resyncing = True
        self.stats["resyncs"] += 1
        # Copied at once: records keep changing the mirror while the batches are sent. What
        # was queued is in the mirror too.
        self._settle(len(self._pending))  # folded into the push (lookups use the mirror meanwhile)
        self._pending.clear()
        batches: list[list[Op]] = [[]]
        size = 0
        for name, cap in self._caps.items():
            batches[-1].append(("C", name, cap))
        step = self._max_batch_keys
        for name, entries in self._mirror.snapshot():
            for start in range(0, len(entries), step):
                chunk = entries[start : start + step]
                # The script inserts tail first: reversed, the oldest key goes in first.
                chunk.reverse()
                keys = [k for k, _ in chunk]
                batches[-1].append(("R", name, str(self._caps.get(name, "")), _pack_keys(keys),
                                    _pack_charges([c for _, c in chunk])))
                size += len(chunk)
                if size >= step:
                    batches.append([])
                    size = 0
        try:
            for batch in batches:
                if batch:
                    await self._call(batch)
            return True
        except Exception as exc:
            if not isinstance(exc, REDIS_ERRORS):
                log.error("redis index resync failed unexpectedly: %s", exc_summary(exc))
            self._resync_needed = True
            self._backend.failed(exc)
            return False
        finally:
            self._resyncing = False

    # -- lookups -----------------------------------------------------------------------------
    # At most `max_lookup_calls` lookup calls are in flight; lookups arriving meanwhile wait
    # for the next call and share it. One connection per call, however many requests are
    # in flight: no burst of connection setups (several round trips each) right when the
    # router is busiest, and fewer, larger script runs for Redis.
    def _send_lookups(self) -> None:
        batch: list[tuple[bytes, asyncio.Future]] = []
        while self._lookups and len(batch) < self._max_lookups_per_call:
            chain, fut = self._lookups.popleft()
            if not fut.done():  # its caller gave up waiting
                batch.append((chain, fut))
        if not batch:
            return
        # Writes still queued ride along: this replica reads its own writes, at no extra trip.
        ops = self._take(self._piggyback_ops) if len(self._pending) <= self._piggyback_ops else []
        riders = list(self._riders)
        self._riders.clear()
        self._lookup_calls += 1
        self._backend.spawn(self._lookup_call(batch, ops, riders))

    async def _lookup_call(
        self, batch: list[tuple[bytes, asyncio.Future]], ops: list[Op], riders: list[Rider] | None = None
    ) -> None:
        views: list[IndexView | None] = [None] * len(batch)
        t0 = time.perf_counter()
        try:
            result = await self._call_with_riders(ops, [chain for chain, _ in batch], riders or [])
            self._settle(len(ops))
            self.stats["lookup_calls"] += 1
            for i, packed in enumerate(result[1:]):
                views[i] = IndexView(_unpack_depths(packed))
            if time.perf_counter() - t0 <= self._backend.budget_s:
                self._backend.succeeded()
        except Exception as exc:  # never fails a request: its lookup falls back to the mirror
            if not isinstance(exc, REDIS_ERRORS):
                log.error("redis index lookup failed unexpectedly: %s", exc_summary(exc))
            self._requeue(ops)
            self._backend.failed(exc)
            self._wake_waiters(math.inf)
        finally:
            self._lookup_calls -= 1
        for (_, fut), view in zip(batch, views, strict=True):
            if not fut.done():
                fut.set_result(view)
        if self._backend.up:
            while self._lookups and self._lookup_calls < self._max_lookup_calls:
                self._send_lookups()
        else:
            while self._lookups:
                _, fut = self._lookups.popleft()
                if not fut.done():
                    fut.set_result(None)

    async def lookup(self, keys: Sequence[PrefixKey]) -> IndexView:
        if not keys:
            return EMPTY_VIEW
        self._start()
        if not self._backend.up or self._resyncing or len(self._lookups) > 8 * self._max_lookups_per_call:
            self.stats["fallback_lookups"] += 1
            return self._mirror.lookup_sync(keys)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._lookups.append((_pack_keys(keys), fut))
        if self._lookup_calls < self._max_lookup_calls:
            self._send_lookups()
        # The timer resolves the future instead of cancelling anything: the call goes on
        # (its piggybacked writes still land), only this request stops waiting for it.
        timer = loop.call_later(self._backend.budget_s, _expire_soon, loop, fut)
        try:
            view = await fut
        finally:
            timer.cancel()
        if view is _EXPIRED:
            self._backend.over_budget()
        elif view is not None:
            self.stats["remote_lookups"] += 1
            return view
        self.stats["fallback_lookups"] += 1
        return self._mirror.lookup_sync(keys)

    # -- PrefixIndex writes (never wait) -------------------------------------------------------
    async def record(self, location: str, keys: Sequence[PrefixKey], key_tokens: Sequence[int]) -> None:
        self._mirror.record_sync(location, keys, key_tokens)
        self._queue(("R", location, str(self._caps.get(location, "")), _pack_keys(keys), _pack_charges(key_tokens)))

    async def written(self) -> None:
        """Waits at most the lookup budget: a slow Redis delays an answer's end no more than
        it may delay a lookup. An op that rode a lookup call settles when that call returns,
        so two calls ending out of order can end the wait a call early (rare, and harmless:
        the earlier call was sent first)."""
        mark = self._queued
        if self._settled >= mark or not self._backend.up:
            return
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._settle_waiters.append((mark, fut))
        try:
            await asyncio.wait_for(fut, self._backend.budget_s)
        except TimeoutError:
            # The answer ends before its write is in Redis: another replica's lookup of the
            # next turn may not see it yet.
            self.stats["unsettled_writes"] += 1

    async def evict(self, location: str, keys: Sequence[PrefixKey]) -> None:
        await self._mirror.evict(location, keys)
        self._queue(("E", location, _pack_keys(keys)))

    async def drop_location(self, location: str) -> None:
        await self._mirror.drop_location(location)
        self._caps.pop(location, None)
        self._queue(("D", location))

    def set_capacity(self, location: str, tokens: int) -> None:
        tokens = max(int(tokens), 1)
        self._mirror.set_capacity(location, tokens)
        self._caps[location] = tokens
        self._queue(("C", location, tokens))

    def push_mirror(self) -> None:
        """Push this replica's whole view to Redis (in the background, as after Redis lost
        its data): it now writes what another replica wrote until it stopped, and its mirror
        holds what nobody wrote meanwhile (`KvEventIngestor.follow`)."""
        self._resync_needed = True
        self._kick()

    async def flush(self) -> bool:
        """Send every queued write now. True if Redis took them all."""
        self._start()
        if not self._backend.up:
            return False
        return await self._drain()

    async def usage(self) -> Mapping[str, int]:
        if self._backend.up and not self._resyncing:
            try:
                if await self.flush():
                    result = await self._call((), "U")
                    return {result[i].decode(): int(result[i + 1]) for i in range(1, len(result), 2)}
            except REDIS_ERRORS as exc:
                self._backend.failed(exc)
        return self._mirror.usage_sync()

    async def close(self) -> None:
        if self._backend.closed:
            return
        if self._backend.up and (self._pending or self._resync_needed):
            with contextlib.suppress(*REDIS_ERRORS):
                await asyncio.wait_for(self._drain(), timeout=1.0)
        await self._backend.close()
