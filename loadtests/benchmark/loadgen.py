"""Closed-loop HTTP/1.1 load generator for the proxy benchmark (one process per run).

Each of `--concurrency` virtual users owns one keep-alive connection and sends its next
request as soon as the previous answer is complete. It is a raw asyncio protocol on uvloop
with httptools parsing, because a convenient client costs more per request than the router
it measures: `kvroute bench-proxy --client-check` measured httpx.AsyncClient at ~670 µs of
client CPU per request on the 2-core benchmark machine, this client at ~15 µs.

Protocol with the harness (stdout, one line each): `warm` when the warm-up is over and the
measured window starts, `done` when it ends; then the JSON results, on stdout or in the `--out` file. Latency
samples are returned raw (µs) so that several runs can be merged before taking percentiles.

    python -m loadtests.benchmark.loadgen --url http://127.0.0.1:9001 --concurrency 16 --duration 5 [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import socket
import sys
import time
from array import array
from typing import Any
from urllib.parse import urlsplit

import httptools
import orjson

from loadtests.benchmark.fast_upstream import DEFAULT_MODEL, raise_fd_limit

SYSTEM_PROMPT = (
    "You are a helpful assistant for a software company. Answer precisely, cite the relevant "
    "documentation section when you can, and keep answers short unless asked for detail. "
) * 8  # ~1.4 kB: a typical shared system prompt


def request_bytes(host: str, path: str, model: str, user: int, turn: int, stream: bool, chunks: int) -> bytes:
    body = orjson.dumps(
        {
            "model": model,
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"user {user} question {turn}: how do I rotate the API keys?"},
            ],
            "max_tokens": chunks,
            "stream": stream,
        }
    )
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"accept: {'text/event-stream' if stream else 'application/json'}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


class _Result:
    __slots__ = ("events", "first_byte", "status", "tail")

    def __init__(self) -> None:
        self.status = 0
        self.first_byte = 0.0
        self.events = 0
        self.tail = b""


class ClientConnection(asyncio.Protocol):
    """One keep-alive connection; `request()` sends a request and awaits its full answer."""

    def __init__(self, stats: Stats) -> None:
        self._stats = stats
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future | None = None
        self._result = _Result()
        self._last_nl = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError("connection closed by the server"))

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(exc)
            self._transport.close()  # type: ignore[union-attr]

    def on_status(self, status: bytes) -> None:
        self._result.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        r = self._result
        if not r.first_byte:
            r.first_byte = time.perf_counter()
        # SSE events end with a blank line; count the "\n\n" separators, including one
        # split across two reads.
        n = body.count(b"\n\n")
        if self._last_nl and body[:1] == b"\n":
            n += 1
        self._last_nl = body[-1:] == b"\n"
        r.events += n
        self._stats.events_now += n
        r.tail = (r.tail + body)[-32:]

    def on_message_complete(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(self._result)
        if not self._parser.should_keep_alive():
            self._transport.close()  # type: ignore[union-attr]

    async def request(self, data: bytes) -> _Result:
        self._result = _Result()
        self._last_nl = False
        self._waiter = asyncio.get_running_loop().create_future()
        self._transport.write(data)  # type: ignore[union-attr]
        return await self._waiter

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class Stats:
    def __init__(self) -> None:
        self.measuring = False
        self.events_now = 0
        """All events received; the measured count is the difference across the window."""
        self.latency_us = array("d")
        self.ttfb_us = array("d")
        self.requests = 0
        self.errors: dict[str, int] = {}
        self.stream_events: int = 0

    def error(self, kind: str) -> None:
        if self.measuring:
            self.errors[kind] = self.errors.get(kind, 0) + 1


async def _user(
    i: int, host: str, port: int, path: str, args: argparse.Namespace, stats: Stats, stop: asyncio.Event
) -> None:
    loop = asyncio.get_running_loop()
    conn: ClientConnection | None = None
    turn = 0
    expected_events = args.chunks + 1 if args.stream else 0
    while not stop.is_set():
        if conn is None or conn.closed:
            try:
                _, conn = await loop.create_connection(lambda: ClientConnection(stats), host, port)
            except OSError as exc:
                stats.error(f"connect:{type(exc).__name__}")
                conn = None
                await asyncio.sleep(0.05)
                continue
        data = request_bytes(f"{host}:{port}", path, args.model, i, turn, args.stream, args.chunks)
        turn += 1
        t0 = time.perf_counter()
        try:
            result = await conn.request(data)
        except (ConnectionError, httptools.HttpParserError, OSError) as exc:
            stats.error(f"io:{type(exc).__name__}")
            conn.close()
            conn = None
            continue
        t1 = time.perf_counter()
        if not stats.measuring:
            continue
        if result.status != 200:
            stats.error(f"status:{result.status}")
            continue
        if args.stream:
            if result.events != expected_events or not result.tail.endswith(b"data: [DONE]\n\n"):
                stats.error("stream:incomplete")
                continue
            stats.stream_events += result.events
            stats.ttfb_us.append((result.first_byte - t0) * 1e6)
        stats.requests += 1
        stats.latency_us.append((t1 - t0) * 1e6)
    if conn is not None:
        conn.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    stats = Stats()
    stop = asyncio.Event()
    targets = []
    for url in args.url:
        u = urlsplit(url)
        targets.append((u.hostname or "127.0.0.1", u.port or 80))
    path = args.path
    users = [
        asyncio.create_task(_user(i, *targets[i % len(targets)], path, args, stats, stop))
        for i in range(args.concurrency)
    ]
    await asyncio.sleep(args.warmup)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    events0 = stats.events_now
    stats.measuring = True
    t0 = time.perf_counter()
    print("warm", flush=True)
    await asyncio.sleep(args.duration)
    stats.measuring = False
    elapsed = time.perf_counter() - t0
    events = stats.events_now - events0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    print("done", flush=True)
    stop.set()
    # Users finish the request they are in; one stuck longer than the grace is an error.
    _, pending = await asyncio.wait(users, timeout=args.grace)
    for task in pending:
        task.cancel()
    unfinished = len(pending)
    errors = dict(stats.errors)
    if unfinished:
        errors["unfinished"] = unfinished
    return {
        "concurrency": args.concurrency,
        "stream": args.stream,
        "chunks": args.chunks,
        "duration_s": elapsed,
        "requests": stats.requests,
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "req_per_s": stats.requests / elapsed,
        "events": events,
        "chunks_per_s": events / elapsed if args.stream else 0.0,
        "loadgen_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
        "latency_us": list(stats.latency_us),
        "ttfb_us": list(stats.ttfb_us),
    }


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.benchmark.loadgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", action="append", required=True, help="base URL (repeatable: users spread over them)")
    parser.add_argument("--path", default="/v1/chat/completions")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--grace", type=float, default=10.0, help="seconds for in-flight requests after the window")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--chunks", type=int, default=40, help="SSE chunks per streamed answer (max_tokens)")
    parser.add_argument("--out", help="write the JSON results to this file instead of stdout")
    args = parser.parse_args(argv)
    raise_fd_limit()
    import uvloop

    result = uvloop.run(run(args))
    data = orjson.dumps(result)
    if args.out:
        # A file, not the pipe: a megabyte of samples written to stdout after the event loop
        # was seen to come out short (the pipe left non-blocking), silently.
        with open(args.out, "wb") as fh:
            fh.write(data)
    else:
        sys.stdout.buffer.write(data + b"\n")
        sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(cli())
