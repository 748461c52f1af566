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
import hashlib
import logging
import os
import secrets
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

from redis.exceptions import NoScriptError, RedisError

from cache_client.base import EMPTY_VIEW, IndexView
from cache_client.memory import DEFAULT_CAPACITY_TOKENS, MemoryIndex
from normalizer.prefix import PrefixKey
from router.redact import exc_summary

log = logging.getLogger("kvroute.redis")

DEFAULT_TTL_S = 3600.0
DEFAULT_LOOKUP_BUDGET_S = 0.005
_KEY_MASK = (1 << 64) - 1
_MAX_CHARGE = (1 << 32) - 1
# What a call to Redis can raise when Redis is away, slow or confused; anything else is a bug.
REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)


# -- URLs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RedisSettings:
    url: str
    """A URL redis-py understands (redis:// or rediss://), cluster markers removed."""
    cluster: bool = False
    nodes: tuple[tuple[str, int], ...] = ()
    """Cluster startup nodes (the URL's host list)."""

    def display(self) -> str:
        """The URL without credentials, for logs."""
        scheme, rest = self.url.split("://", 1)
        # Credentials can sit before the host and in the query (redis-py takes both).
        host = rest.split("?", 1)[0].rsplit("@", 1)[-1]
        return f"{scheme}{'+cluster' if self.cluster else ''}://{host}"


def _split_host(item: str) -> tuple[str, int]:
    if item.startswith("["):
        host, _, port = item[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise ValueError(f"no host in {item!r}")
    return host, int(port) if port else 6379


_TRUE = frozenset({"1", "true", "yes", "on"})


def parse_redis_url(url: str) -> RedisSettings:
    """`redis://[user:pass@]host:port/db`, `rediss://...` (TLS), and for Redis Cluster
    `redis+cluster://[user:pass@]host:port[,host:port...]` (or `rediss+cluster://`), or any
    of the single-node forms with `?cluster=true`. Other query options go to redis-py."""
    if "://" not in url:
        raise ValueError(f"not a Redis URL: {url!r} (expected redis://HOST:PORT/DB)")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    cluster = scheme.endswith("+cluster")
    base = scheme.removesuffix("+cluster")
    if base not in ("redis", "rediss"):
        raise ValueError(f"unsupported Redis URL scheme {scheme!r}")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    params = []
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k == "cluster":
            cluster = cluster or v.lower() in _TRUE
        else:
            params.append((k, v))
    nodes = tuple(_split_host(unquote(h)) for h in hosts.split(",") if h)
    if not nodes:
        raise ValueError(f"no host in Redis URL {scheme}://…")
    if len(nodes) > 1 and not cluster:
        raise ValueError("several hosts are only meaningful for a Redis Cluster URL")
    db = path.strip("/")
    if cluster and db not in ("", "0"):
        raise ValueError("Redis Cluster has only database 0")
    host, port = nodes[0]
    host_part = f"[{host}]" if ":" in host else host
    rebuilt = f"{base}://{userinfo}{at}{host_part}:{port}{slash}{path}"
    if params:
        rebuilt += "?" + urlencode(params)
    return RedisSettings(rebuilt, cluster, nodes if cluster else ())


# -- scripts and the connection --------------------------------------------------------------
class Script:
    """A Lua script run by EVALSHA, loaded with EVAL on a node that does not know it yet
    (first call, Redis restarted, cluster failover)."""

    def __init__(self, name: str) -> None:
        self.source = resources.files("cache_client").joinpath("lua", name).read_text(encoding="utf-8")
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


INDEX_SCRIPT = Script("index.lua")
LOADS_SCRIPT = Script("loads.lua")


def make_client(settings: RedisSettings, socket_timeout_s: float, connect_timeout_s: float) -> Any:
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    # One immediate retry: a pooled connection that died with a Redis restart fails its
    # next command once. Anything longer is the outage logic's job, not redis-py's.
    common: dict[str, Any] = dict(
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 1),
        decode_responses=False,
    )
    if settings.cluster:
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        nodes = [ClusterNode(h, p) for h, p in settings.nodes]
        return RedisCluster.from_url(settings.url, startup_nodes=nodes, **common)
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(settings.url, **common)


class RedisBackend:
    """A replica's Redis client plus its opinion of whether Redis is usable right now.

    Shared by the index and the load board. States: connecting (from the first use until a
    call answers within budget), up, down. Only "up" sends lookups to Redis; a background
    probe moves "connecting" and "down" to "up", so the first lookups after a start or an
    outage never pay for connection setup.
    """

    def __init__(
        self,
        settings: RedisSettings,
        *,
        budget_s: float = DEFAULT_LOOKUP_BUDGET_S,
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 0.5,
        probe_interval_s: float = 0.25,
        slow_limit: int = 3,
        warm_connections: int = 4,
        client_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.settings = settings
        self.budget_s = budget_s
        self.probe_interval_s = probe_interval_s
        self.slow_limit = slow_limit
        self.warm_connections = warm_connections
        self._factory = client_factory or (lambda: make_client(settings, socket_timeout_s, connect_timeout_s))
        self._client: Any = None
        self.up = False
        self.connecting = True
        self.transitions = 0
        """How many times the backend went down or came back (tests and benchmarks read it)."""
        self._slow = 0
        self._down_at = 0.0
        self._gauge: Any = None
        self._probe_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._up_event: asyncio.Event | None = None
        self.probe: Callable[[], Awaitable[Any]] = self._ping
        self.on_up: list[Callable[[], None]] = []
        self.on_close: list[Callable[[], Awaitable[None]]] = []
        self.closed = False

    # -- the client ------------------------------------------------------------------------
    def client(self) -> Any:
        if self._client is None:
            self._client = self._factory()
        return self._client

    async def script(self, script: Script, key: str, args: Sequence[Any]) -> Any:
        client = self.client()
        try:
            return await client.execute_command("EVALSHA", script.sha, 1, key, *args)
        except NoScriptError:
            return await client.execute_command("EVAL", script.source, 1, key, *args)

    async def _ping(self) -> Any:
        return await self.client().execute_command("PING")

    # -- health ----------------------------------------------------------------------------
    def start(self) -> None:
        """Begin connecting (from inside the event loop; later calls do nothing)."""
        if self._probe_task is None and not self.closed:
            self._probe_task = self.spawn(self._probe_loop(first_delay=0.0))

    async def connect(self, timeout_s: float = 10.0) -> bool:
        """Start, and wait until Redis answers within budget (True) or the timeout passes."""
        self.start()
        if self._up_event is None:
            self._up_event = asyncio.Event()
        if not self.up:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._up_event.wait(), timeout_s)
        return self.up

    def bind_gauge(self, gauge: Any) -> None:
        self._gauge = gauge
        gauge.set(value=1.0 if self.up else 0.0)

    def succeeded(self) -> None:
        self._slow = 0

    def over_budget(self) -> None:
        self._slow += 1
        if self._slow >= self.slow_limit:
            self.failed(f"{self._slow} lookups in a row over the {self.budget_s * 1e3:g} ms budget")

    def failed(self, why: BaseException | str) -> None:
        if not self.up or self.closed:
            if self.connecting and not self.closed:
                self._first_failure(why)
            return
        self.up = False
        self.transitions += 1
        self._slow = 0
        self._down_at = time.monotonic()
        if self._up_event is not None:
            self._up_event.clear()
        log.warning("redis index down (%s, %s): routing on this replica's local view until it answers again",
                    self.settings.display(), _reason(why))
        if self._gauge is not None:
            self._gauge.set(value=0.0)
        # Start the next attempt from fresh connections instead of draining stale ones.
        old, self._client = self._client, None
        if old is not None:
            self.spawn(_close_client(old))
        self._probe_task = self.spawn(self._probe_loop(first_delay=self.probe_interval_s))

    def _first_failure(self, why: BaseException | str) -> None:
        self.connecting = False
        self.transitions += 1
        self._down_at = time.monotonic()
        log.warning("redis index down (%s, %s): routing on this replica's local view until it answers",
                    self.settings.display(), _reason(why))

    def _mark_up(self) -> None:
        if self.up or self.closed:
            return
        self.up = True
        self._slow = 0
        if self.connecting:
            self.connecting = False
            log.info("redis index connected (%s)", self.settings.display())
        else:
            self.transitions += 1
            # Same level as the "down" line, so that whoever sees one also sees the other.
            log.warning("redis index up again after %.1f s (%s): resuming the shared view",
                     time.monotonic() - self._down_at, self.settings.display())
        if self._gauge is not None:
            self._gauge.set(value=1.0)
        if self._up_event is not None:
            self._up_event.set()
        for callback in self.on_up:
            callback()

    async def _probe_loop(self, first_delay: float) -> None:
        delay = first_delay
        while not self.up and not self.closed:
            await asyncio.sleep(delay)
            delay = self.probe_interval_s
            try:
                # Open the connections the next lookups will use (connecting costs several
                # round trips), then require one more call to answer within budget.
                await self._warm_up()
                t0 = time.perf_counter()
                await asyncio.wait_for(self.probe(), timeout=1.0)
                if time.perf_counter() - t0 <= self.budget_s:
                    self._mark_up()
            except Exception as exc:
                if not isinstance(exc, REDIS_ERRORS):
                    log.error("redis probe failed unexpectedly: %s", exc_summary(exc))
                if self.connecting:
                    self._first_failure(exc)
                old, self._client = self._client, None
                if old is not None:
                    await _close_client(old)

    async def _warm_up(self) -> None:
        """`warm_connections` probes at once (each on a connection of its own); raises the
        first failure, or TimeoutError if they take more than a second."""
        tasks = [asyncio.ensure_future(self.probe()) for _ in range(max(self.warm_connections, 1))]
        try:
            done, pending = await asyncio.wait(tasks, timeout=1.0)
        finally:
            for task in tasks:
                task.cancel()
        failures = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
        if failures:
            raise failures[0]
        if pending:
            raise asyncio.TimeoutError("redis probe timed out")

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        """A background task the backend keeps a reference to and cancels at close."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close(self) -> None:
        if self.closed:
            return
        for callback in self.on_close:
            with contextlib.suppress(*REDIS_ERRORS):
                await asyncio.wait_for(callback(), timeout=1.0)
        self.closed = True
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._client is not None:
            await _close_client(self._client)
            self._client = None


def _reason(why: BaseException | str) -> str:
    return why if isinstance(why, str) else f"{type(why).__name__}: {why}"


async def _close_client(client: Any) -> None:
    with contextlib.suppress(Exception):
        await client.aclose()


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
        self._pending: deque[Op] = deque()
        self._flush_delay_s = flush_delay_s
        self._max_batch_ops = max_batch_ops
        self._max_batch_keys = max_batch_keys
        self._backlog_limit = backlog_limit
        self._piggyback_ops = piggyback_ops
        self._lookups: deque[tuple[bytes, asyncio.Future]] = deque()
        self._lookup_calls = 0
        self._max_lookup_calls = max_lookup_calls
        self._max_lookups_per_call = max_lookups_per_call
        self._overflowed = False
        self._resync_needed = False
        self._resyncing = False
        self._wake: asyncio.Event | None = None
        self._flusher: asyncio.Task | None = None
        self.stats = {"remote_lookups": 0, "fallback_lookups": 0, "lookup_calls": 0, "dropped_ops": 0, "resyncs": 0}
        backend.probe = self._probe
        backend.on_up.append(self._on_up)

    @property
    def backend(self) -> RedisBackend:
        return self._backend

    @property
    def mirror(self) -> MemoryIndex:
        return self._mirror

    def bind_metrics(self, metrics: Any) -> None:
        """Called by the app with its RouterMetrics: the index reports `kvroute_index_backend_up`."""
        self._backend.bind_gauge(metrics.index_backend_up)

    async def connect(self, timeout_s: float = 10.0) -> bool:
        """Wait until Redis answers (the app does not need this: it starts on first use)."""
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
        if len(self._pending) > self._backlog_limit:
            # The mirror still has it: the replica pushes its whole view when Redis is back.
            self._pending.popleft()
            self.stats["dropped_ops"] += 1
            self._overflowed = True
        self._kick()

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

    async def _call(self, ops: Iterable[Op], query: str = "", chains: Sequence[bytes] = ()) -> list[Any]:
        self._epoch_calls += 1
        candidate = f"{self._epoch_base}-{self._epoch_calls}"
        args: list[Any] = [self.tag, self._ttl_us, self._default_capacity, candidate, query, len(chains), *chains]
        for op in ops:
            args.extend(op)
        result = await self._backend.script(INDEX_SCRIPT, self._locs_key, args)
        self._seen_epoch(result[0])
        return result

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
            except Exception as exc:
                if not isinstance(exc, REDIS_ERRORS):
                    log.error("redis index write failed unexpectedly: %s", exc_summary(exc))
                self._requeue(ops)
                self._backend.failed(exc)
                return False
        return self._backend.up

    async def _resync(self) -> bool:
        self._resync_needed = False
        self._resyncing = True
        self.stats["resyncs"] += 1
        # Copied at once: records keep changing the mirror while the batches are sent. What
        # was queued is in the mirror too.
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
        self._lookup_calls += 1
        self._backend.spawn(self._lookup_call(batch, ops))

    async def _lookup_call(self, batch: list[tuple[bytes, asyncio.Future]], ops: list[Op]) -> None:
        views: list[IndexView | None] = [None] * len(batch)
        t0 = time.perf_counter()
        try:
            result = await self._call(ops, "L", [chain for chain, _ in batch])
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


# -- wiring ------------------------------------------------------------------------------------
def connect_redis(config: Any) -> dict[str, Any]:
    """The `--redis` components for `build_app`: `index` (RedisIndex) and `loads`
    (RedisLoadBoard), sharing one client. Connects lazily, on the first call in the app's loop."""
    from cache_client.redis_load import RedisLoadBoard

    settings = parse_redis_url(config.redis)
    budget_s = float(getattr(config, "redis_lookup_budget_ms", DEFAULT_LOOKUP_BUDGET_S * 1e3)) / 1e3
    backend = RedisBackend(settings, budget_s=budget_s)
    index = RedisIndex(
        backend,
        prefix=config.redis_prefix,
        ttl_s=float(getattr(config, "redis_ttl_s", DEFAULT_TTL_S)),
        default_capacity_tokens=config.kv_capacity_tokens,
    )
    loads = RedisLoadBoard(
        backend, prefix=config.redis_prefix, half_life_s=config.recent_half_life_s,
        replica_id=f"{os.uname().nodename}:{os.getpid()}:{secrets.token_hex(3)}",
    )
    log.info("index and loads shared through %s, prefix %s", settings.display(), index.tag)
    return {"index": index, "loads": loads}
