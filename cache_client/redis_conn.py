"""The Redis connection shared by the prefix index and the router's load board.

One place for what both need: URL parsing (`redis://`, `rediss://` for TLS, Redis Cluster
URLs), client construction, the Lua script runner, the errors that mean "Redis is away",
and `RedisBackend`, the client plus the replica's opinion of whether Redis is usable right
now (see docs/redis.md, "Outages").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

from redis.exceptions import NoScriptError, RedisError

from cache_client.base import IndexObserver
from cache_client.redact import exc_summary

log = logging.getLogger("kvroute.redis")

DEFAULT_LOOKUP_BUDGET_S = 0.005
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
    (first call, Redis restarted, cluster failover). `resource` is a path inside `package`."""

    def __init__(self, package: str, resource: str) -> None:
        self.source = resources.files(package).joinpath(resource).read_text(encoding="utf-8")
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()


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
        self._observer: IndexObserver | None = None
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

    async def scripts(self, calls: Sequence[tuple[Script, str, Sequence[Any]]]) -> list[Any]:
        """Several script calls in one round trip (a pipeline, not a transaction: each runs
        atomically on its own). Each reply is the script's answer or the error it raised;
        a connection failure raises. A script Redis does not know yet (first call, Redis
        restarted) is sent again with EVAL: one more trip, once."""
        pipe = self.client().pipeline(transaction=False)
        for script, key, args in calls:
            pipe.execute_command("EVALSHA", script.sha, 1, key, *args)
        replies = list(await pipe.execute(raise_on_error=False))
        for i, (script, key, args) in enumerate(calls):
            if isinstance(replies[i], NoScriptError):
                try:
                    replies[i] = await self.client().execute_command("EVAL", script.source, 1, key, *args)
                except RedisError as exc:
                    replies[i] = exc
        return replies

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

    def observe(self, observer: IndexObserver) -> None:
        """`observer` hears whether Redis is usable: now, and at every change."""
        self._observer = observer
        observer.index_backend_state(self.up)

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
        if self._observer is not None:
            self._observer.index_backend_state(False)
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
        if self._observer is not None:
            self._observer.index_backend_state(True)
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
