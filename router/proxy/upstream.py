"""The client the proxy forwards requests to workers with.

`UpstreamClient.post(base_url, path, headers, body)` sends one POST and returns an
`UpstreamResponse` as soon as the status line and headers are in: `status`, `headers`
(lower-cased names, raw bytes), `read()` for the whole body, `chunks()` for the body as it
arrives, and `aclose()`, which puts a fully read connection back in the pool and closes
any other (so an engine sees an abandoned stream's client go away and aborts it). Failures
are `UpstreamConnectError` (the worker cannot be reached: the proxy takes it out) and
`UpstreamError` (any other transport failure).

`RawUpstreamClient` is the default: HTTP/1.1 over asyncio protocols, httptools parsing (the
same C parser uvicorn uses), a LIFO keep-alive pool per worker with O(1) checkout and
check-in. It exists because httpx (httpcore) was measured to be the router's bottleneck:
its pool scans every connection on each checkout, polling each socket, so a request costs
O(open connections). With httpx the router spent 10.7 ms of CPU per request at 256
concurrent requests; with this client 0.22 ms, all of the router's work included
(docs/performance.md has the numbers, aiohttp's client among them). `HttpxUpstreamClient` keeps the httpx
path behind the same interface for comparison (`RouterConfig.upstream_client = "httpx"`,
env `KVROUTE_UPSTREAM_CLIENT`), and `AiohttpUpstreamClient` the other candidate measured
(`"aiohttp"`, if aiohttp is installed).

Read timeouts are not here: router/proxy/deadlines.py bounds the first byte and the silence
between chunks for the proxy as a whole.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
import time
from collections.abc import AsyncIterator
from typing import Protocol
from urllib.parse import urlsplit

import httptools

Headers = list[tuple[bytes, bytes]]

# Past this many body bytes buffered and not yet relayed, stop reading from the worker, so
# that a slow client slows its worker down (TCP backpressure) instead of growing memory.
READ_HIGH_WATER = 1 << 20
READ_LOW_WATER = 1 << 18


class UpstreamError(Exception):
    """A transport failure talking to a worker (reset, malformed answer, ...)."""


class UpstreamConnectError(UpstreamError):
    """The worker could not be reached at all (refused, unreachable, connect timeout)."""


class UpstreamResponse(Protocol):
    status: int
    headers: Headers

    async def read(self) -> bytes: ...
    def chunks(self) -> AsyncIterator[bytes]: ...
    async def aclose(self) -> None: ...


class UpstreamClient(Protocol):
    async def post(self, base_url: str, path: str, headers: Headers, body: bytes) -> UpstreamResponse: ...
    async def request(
        self, method: str, base_url: str, path: str, headers: Headers, body: bytes = b""
    ) -> UpstreamResponse: ...
    async def aclose(self) -> None: ...


# -- raw asyncio + httptools -----------------------------------------------------------------


class _Origin:
    """Where a worker's connections go, parsed once per worker URL."""

    __slots__ = ("host", "host_header", "port", "prefix", "ssl")

    def __init__(self, base_url: str) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = u.scheme == "https"
        default_port = self.port == (443 if self.ssl else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = (host if default_port else f"{host}:{self.port}").encode("idna")
        self.prefix = u.path.rstrip("/").encode()


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a worker, carrying one request at a time."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: RawResponse | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._header_name = b""
        self._headers: Headers = []
        self._got_bytes = False

    # -- transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Each SSE chunk must leave at once, not wait for the previous one's ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("the worker upgraded the connection"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed answer from the worker: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        r = self.response
        if r is not None and not r.complete:
            if r.headers_done and not r.framed:
                r._finish()  # a body delimited by the end of the connection
            else:
                r._fail(UpstreamError("the worker closed the connection" + (f" ({exc})" if exc else "")),
                        before_first_byte=not self._got_bytes)

    def _fail(self, exc: UpstreamError) -> None:
        self.closed = True
        if self.response is not None:
            self.response._fail(exc, before_first_byte=False)
        if self.transport is not None:
            self.transport.abort()

    # -- parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        # httptools calls this once per header, with the name and value reassembled.
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        r = self.response
        if r is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer: the real one follows
            self._headers = []
            return
        r.status = status
        r.headers = self._headers
        framed = False
        for k, v in self._headers:
            if k == b"content-length" or (k == b"transfer-encoding" and b"chunked" in v.lower()):
                framed = True
        r.framed = framed
        r.headers_done = True
        self._headers = []
        r._wake()
        r._headers_waiter_done()

    def on_body(self, body: bytes) -> None:
        r = self.response
        if r is not None:
            r._push(body)

    def on_message_complete(self) -> None:
        r = self.response
        if r is not None and r.headers_done:
            r.keep_alive = self.parser.should_keep_alive()
            r._finish()

    # -- requests
    def start(self, response: RawResponse, request: bytes) -> None:
        self.response = response
        self._got_bytes = False
        self._headers = []
        self.transport.write(request)  # type: ignore[union-attr]

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class RawResponse:
    """A worker's answer, its body buffered between the connection and the relay."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._loop = asyncio.get_running_loop()
        self.status = 0
        self.headers: Headers = []
        self.headers_done = False
        self.framed = True
        self.complete = False
        self.keep_alive = False
        self.failed_before_first_byte = False
        self._buffer: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None
        self._headers_waiter: asyncio.Future | None = None
        self._released = False

    # -- fed by the connection
    def _push(self, data: bytes) -> None:
        self._buffer.append(data)
        self._buffered += len(data)
        if self._buffered > READ_HIGH_WATER and not self._paused:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, exc: UpstreamError, before_first_byte: bool) -> None:
        if self.complete:
            return
        self._error = exc
        self.failed_before_first_byte = before_first_byte
        self._wake()
        self._headers_waiter_done()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def _headers_waiter_done(self) -> None:
        w = self._headers_waiter
        if w is not None:
            self._headers_waiter = None
            if not w.done():
                w.set_result(None)

    # -- used by the client and the proxy
    async def _wait_headers(self) -> None:
        while not self.headers_done:
            if self._error is not None:
                raise self._error
            self._headers_waiter = self._loop.create_future()
            await self._headers_waiter

    def _take(self) -> bytes:
        buf = self._buffer
        # What piled up while the relay was busy leaves in one write: same bytes, fewer syscalls.
        data = buf.popleft() if len(buf) == 1 else b"".join(buf)
        if len(buf) != 0:
            buf.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self._conn.resume()
        return data

    async def read(self) -> bytes:
        parts: list[bytes] = []
        while True:
            if self._buffer:
                parts.append(self._take())
                continue
            if self.complete:
                return b"".join(parts)
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            await self._waiter

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            if self._buffer:
                yield self._take()
                continue
            if self.complete:
                return
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            await self._waiter

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.response = None
        if self.complete and self.keep_alive and not conn.closed and not self._buffer and self._error is None:
            conn.pool.check_in(conn)
        else:
            # Unfinished: closing the connection is how the worker learns the client left.
            conn.close()
            conn.pool.forget(conn)


class _Pool:
    """Keep-alive connections to one worker: idle ones on a LIFO stack (the most recently
    used socket is the warmest), at most `limit` open, waiters served first come first."""

    def __init__(self, client: RawUpstreamClient, origin: _Origin) -> None:
        self.client = client
        self.origin = origin
        self.idle: collections.deque[_Connection] = collections.deque()
        self.open = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    async def check_out(self) -> _Connection:
        now = time.monotonic()
        idle = self.idle
        expiry = self.client.keepalive_expiry_s
        # Connections idle too long sit at the bottom of the stack; a worker may have closed them.
        while idle and now - idle[0].idle_since > expiry:
            self._drop(idle.popleft())
        while idle:
            conn = idle.pop()
            if not conn.closed:
                conn.reused = True
                return conn
            self.open -= 1
        if self.open >= self.client.max_connections_per_worker:
            waiter = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            try:
                conn = await waiter
            except asyncio.CancelledError:
                # Cancelled after being served: pass the connection (or the slot) on.
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    handed = waiter.result()
                    if handed is not None:
                        self.check_in(handed)
                    else:
                        self._serve_waiter()
                raise
            if conn is not None:
                return conn
        self.open += 1
        try:
            return await self._connect()
        except BaseException:
            self.open -= 1
            self._serve_waiter()
            raise

    async def _connect(self) -> _Connection:
        o = self.origin
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(self), o.host, o.port,
                    ssl=self.client.ssl_context() if o.ssl else None,
                    server_hostname=o.host if o.ssl else None,
                ),
                self.client.connect_timeout_s,
            )
        except asyncio.TimeoutError:
            raise UpstreamConnectError("ConnectTimeout") from None
        except OSError as exc:
            raise UpstreamConnectError(f"ConnectError: {exc.strerror or type(exc).__name__}") from None
        return conn

    def check_in(self, conn: _Connection) -> None:
        if conn.closed:
            self.forget(conn)
            return
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                conn.reused = True
                waiter.set_result(conn)
                return
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        """A connection closed while checked out: its slot goes to a waiter, if any."""
        self.open -= 1
        self._serve_waiter()

    def _serve_waiter(self) -> None:
        # None tells the first waiter a slot is free: it opens a connection itself.
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self.open -= 1

    def close(self) -> None:
        while self.idle:
            self._drop(self.idle.pop())
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_exception(UpstreamError("the client is closed"))
        self.waiters.clear()


class RawUpstreamClient:
    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        max_connections_per_worker: int = 4096,
        keepalive_expiry_s: float = 30.0,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_connections_per_worker = max_connections_per_worker
        self.keepalive_expiry_s = keepalive_expiry_s
        self._pools: dict[str, _Pool] = {}
        self._ssl: ssl.SSLContext | None = None

    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _pool(self, base_url: str) -> _Pool:
        pool = self._pools.get(base_url)
        if pool is None:
            pool = self._pools[base_url] = _Pool(self, _Origin(base_url))
        return pool

    async def post(self, base_url: str, path: str, headers: Headers, body: bytes) -> RawResponse:
        return await self.request("POST", base_url, path, headers, body)

    async def request(self, method: str, base_url: str, path: str, headers: Headers, body: bytes = b"") -> RawResponse:
        """`method` PATH (a query string included) with `body`; `post` is this with POST."""
        pool = self._pool(base_url)
        o = pool.origin
        head = [method.encode(), b" ", o.prefix, path.encode(), b" HTTP/1.1\r\nhost: ", o.host_header, b"\r\n"]
        for k, v in headers:
            head += (k, b": ", v, b"\r\n")
        head += (b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body)
        request = b"".join(head)
        for attempt in (0, 1):
            conn = await pool.check_out()
            response = RawResponse(conn)
            try:
                conn.start(response, request)
                await response._wait_headers()
                return response
            except UpstreamError:
                await response.aclose()
                # A kept-alive connection the worker closed meanwhile fails before any byte
                # comes back: the request never reached the engine; send it once more on a
                # new connection, as browsers do.
                if attempt == 0 and conn.reused and response.failed_before_first_byte:
                    continue
                raise
            except BaseException:
                await response.aclose()
                raise
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


# -- httpx, kept behind the same interface to compare ---------------------------------------


class _HttpxResponse:
    def __init__(self, response) -> None:
        import httpx

        self._r = response
        self._httpx = httpx
        self.status = response.status_code
        self.headers = [(k.lower(), v) for k, v in response.headers.raw]

    async def read(self) -> bytes:
        try:
            return await self._r.aread()
        except self._httpx.HTTPError as exc:
            raise UpstreamError(type(exc).__name__) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._r.aiter_raw():
                yield chunk
        except self._httpx.HTTPError as exc:
            raise UpstreamError(type(exc).__name__) from None

    async def aclose(self) -> None:
        await self._r.aclose()


class HttpxUpstreamClient:
    def __init__(self, *, connect_timeout_s: float = 5.0, max_connections: int = 4096) -> None:
        import httpx

        self._httpx = httpx
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout_s, read=None, write=connect_timeout_s, pool=None),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=30),
            follow_redirects=False,
            trust_env=False,  # a proxy from the environment must never see worker traffic
        )

    async def post(self, base_url: str, path: str, headers: Headers, body: bytes) -> _HttpxResponse:
        return await self.request("POST", base_url, path, headers, body)

    async def request(self, method: str, base_url: str, path: str, headers: Headers, body: bytes = b"") -> _HttpxResponse:
        httpx = self._httpx
        request = self._client.build_request(method, base_url + path, content=body, headers=headers)
        try:
            return _HttpxResponse(await self._client.send(request, stream=True))
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise UpstreamConnectError(type(exc).__name__) from None
        except httpx.HTTPError as exc:
            raise UpstreamError(type(exc).__name__) from None

    async def aclose(self) -> None:
        await self._client.aclose()


# -- aiohttp (optional, not a dependency), measured as the other candidate ------------------


class _AiohttpResponse:
    def __init__(self, response, errors: tuple[type[BaseException], ...]) -> None:
        self._r = response
        self._errors = errors
        self.status = response.status
        self.headers = [(k.lower(), v) for k, v in response.raw_headers]

    async def read(self) -> bytes:
        try:
            return await self._r.read()
        except self._errors as exc:
            raise UpstreamError(type(exc).__name__) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._r.content.iter_any():
                yield chunk
        except self._errors as exc:
            raise UpstreamError(type(exc).__name__) from None

    async def aclose(self) -> None:
        if self._r.content.at_eof():
            self._r.release()
        else:
            self._r.close()


class AiohttpUpstreamClient:
    def __init__(self, *, connect_timeout_s: float = 5.0, max_connections: int = 4096) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._errors = (aiohttp.ClientError, asyncio.TimeoutError)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=max_connections, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout_s),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            trust_env=False,
        )

    async def post(self, base_url: str, path: str, headers: Headers, body: bytes) -> _AiohttpResponse:
        return await self.request("POST", base_url, path, headers, body)

    async def request(self, method: str, base_url: str, path: str, headers: Headers, body: bytes = b"") -> _AiohttpResponse:
        aiohttp = self._aiohttp
        try:
            r = await self._session.request(
                method, base_url + path, data=body, allow_redirects=False,
                headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers],
            )
        except (aiohttp.ClientConnectorError, asyncio.TimeoutError) as exc:
            raise UpstreamConnectError(type(exc).__name__) from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(type(exc).__name__) from None
        return _AiohttpResponse(r, self._errors)

    async def aclose(self) -> None:
        await self._session.close()


def make_upstream_client(*, connect_timeout_s: float, max_connections: int, kind: str) -> UpstreamClient:
    """The forwarding client of `kind` (`RouterConfig.upstream_client`): "raw", or "httpx" /
    "aiohttp" to compare against in benchmarks."""
    if kind == "raw":
        return RawUpstreamClient(connect_timeout_s=connect_timeout_s, max_connections_per_worker=max_connections)
    if kind == "httpx":
        return HttpxUpstreamClient(connect_timeout_s=connect_timeout_s, max_connections=max_connections)
    if kind == "aiohttp":
        return AiohttpUpstreamClient(connect_timeout_s=connect_timeout_s, max_connections=max_connections)
    raise ValueError(f"upstream_client: unknown upstream client {kind!r} (raw, httpx or aiohttp)")
