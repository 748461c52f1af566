"""router/upstream.py's raw HTTP/1.1 client against a real loopback server: keep-alive reuse,
streaming, errors before and after the first byte, closing abandoned streams, pool limits."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from loadtests.support.routerproc import free_port
from router.proxy.upstream import (
    RawUpstreamClient,
    UpstreamConnectError,
    UpstreamError,
    make_upstream_client,
)
from tests.support.upstream import RecordingUpstream, UpstreamBehaviour

CHAT = orjson.dumps({"model": "rec-model", "messages": [{"role": "user", "content": "hi"}]})
STREAM = orjson.dumps({"model": "rec-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"r1")]


async def test_whole_answer_and_keep_alive_reuse(upstream: RecordingUpstream) -> None:
    client = RawUpstreamClient()
    try:
        for _ in range(3):
            r = await client.post(upstream.url, "/v1/chat/completions", HEADERS, CHAT)
            assert r.status == 200
            assert (b"content-type", b"application/json") in r.headers  # names lower-cased
            assert orjson.loads(await r.read())["choices"][0]["message"]["content"] == "ok"
            await r.aclose()
        pool = client._pools[upstream.url]
        assert pool.open == 1 and len(pool.idle) == 1  # one connection carried all three
        got = upstream.received[-1]
        assert got.body == CHAT and got.headers["x-request-id"] == "r1"
        assert got.headers["host"] == upstream.url.removeprefix("http://")
    finally:
        await client.aclose()


async def test_stream_chunks_arrive_whole(upstream: RecordingUpstream) -> None:
    client = RawUpstreamClient()
    try:
        upstream.behaviour = UpstreamBehaviour(chunks=5)
        r = await client.post(upstream.url, "/v1/chat/completions", HEADERS, STREAM)
        body = b"".join([c async for c in r.chunks()])
        await r.aclose()
        events = [e for e in body.split(b"\n\n") if e]
        assert len(events) == 6 and events[-1] == b"data: [DONE]"
        assert client._pools[upstream.url].open == 1  # the connection went back to the pool
    finally:
        upstream.behaviour = UpstreamBehaviour()
        await client.aclose()


async def test_abandoned_stream_closes_its_connection(upstream: RecordingUpstream) -> None:
    client = RawUpstreamClient()
    try:
        upstream.behaviour = UpstreamBehaviour(chunks=50, chunk_delay_s=0.05)
        r = await client.post(upstream.url, "/v1/chat/completions", HEADERS, STREAM)
        chunks = r.chunks()
        assert (await anext(chunks)).startswith(b"data: ")
        conn = r._conn
        await r.aclose()  # the client went away: the worker must see its connection close
        pool = client._pools[upstream.url]
        assert conn.closed and pool.open == 0 and not pool.idle
    finally:
        upstream.behaviour = UpstreamBehaviour()
        await client.aclose()


async def test_worker_dying_mid_stream_raises_upstream_error(upstream: RecordingUpstream) -> None:
    client = RawUpstreamClient()
    try:
        upstream.behaviour = UpstreamBehaviour(chunks=5, break_after_chunks=2)
        r = await client.post(upstream.url, "/v1/chat/completions", HEADERS, STREAM)
        with pytest.raises(UpstreamError):
            async for _ in r.chunks():
                pass
        await r.aclose()
        assert client._pools[upstream.url].open == 0
    finally:
        upstream.behaviour = UpstreamBehaviour()
        await client.aclose()


async def test_unreachable_worker_is_a_connect_error() -> None:
    client = RawUpstreamClient(connect_timeout_s=2)
    try:
        with pytest.raises(UpstreamConnectError):
            await client.post(f"http://127.0.0.1:{free_port()}", "/v1/chat/completions", HEADERS, CHAT)
        assert client._pools[next(iter(client._pools))].open == 0
    finally:
        await client.aclose()


async def test_pool_limit_queues_requests_and_reuses_the_connection(upstream: RecordingUpstream) -> None:
    client = RawUpstreamClient(max_connections_per_worker=1)
    try:
        upstream.behaviour = UpstreamBehaviour(first_byte_delay_s=0.05)

        async def one() -> bytes:
            r = await client.post(upstream.url, "/v1/chat/completions", HEADERS, CHAT)
            try:
                return await r.read()
            finally:
                await r.aclose()

        answers = await asyncio.gather(*(one() for _ in range(4)))
        assert all(orjson.loads(a)["choices"] for a in answers)
        assert client._pools[upstream.url].open == 1
    finally:
        upstream.behaviour = UpstreamBehaviour()
        await client.aclose()


async def test_a_connection_the_worker_closed_while_idle_is_not_reused() -> None:
    """A server that closes every connection after one answer (no `connection: close`)."""
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    served = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await reader.readuntil(b"\r\n\r\n")
        served += 1
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = RawUpstreamClient()
    try:
        for _ in range(3):
            r = await client.post(url, "/v1/completions", HEADERS, b"{}")
            assert await r.read() == b"{}"
            await r.aclose()
            await asyncio.sleep(0.05)  # let the close arrive
        assert served == 3
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_clients_behind_the_interface_agree(upstream: RecordingUpstream) -> None:
    """The httpx adapter (kept for comparison) answers like the raw client."""
    for kind in ("raw", "httpx"):
        client = make_upstream_client(connect_timeout_s=2, max_connections=8, kind=kind)
        try:
            r = await client.post(upstream.url, "/v1/chat/completions", HEADERS, CHAT)
            assert r.status == 200 and orjson.loads(await r.read())["choices"]
            await r.aclose()
            with pytest.raises(UpstreamConnectError):
                await client.post(f"http://127.0.0.1:{free_port()}", "/v1/chat/completions", HEADERS, CHAT)
        finally:
            await client.aclose()


@pytest.mark.parametrize("kind", ["raw", "httpx"])
async def test_request_sends_other_methods(upstream: RecordingUpstream, kind: str) -> None:
    """`request(method, ...)` (used for GET/DELETE /v1/responses/{id}) sends the method named,
    with no body, and the raw client's connection stays reusable for the next POST."""
    client = make_upstream_client(connect_timeout_s=5.0, max_connections=8, kind=kind)
    try:
        r = await client.request("GET", upstream.url, "/v1/models", HEADERS)
        assert r.status == 200 and orjson.loads(await r.read())["data"][0]["id"]
        await r.aclose()
        r = await client.request("DELETE", upstream.url, "/v1/models", HEADERS)
        assert r.status == 405  # the route takes GET only: the method went as DELETE
        await r.read()
        await r.aclose()
        r = await client.post(upstream.url, "/v1/chat/completions", HEADERS, CHAT)
        assert r.status == 200 and upstream.received[-1].body == CHAT
        await r.read()
        await r.aclose()
        if isinstance(client, RawUpstreamClient):
            assert client._pools[upstream.url].open == 1  # one connection carried all three
    finally:
        await client.aclose()
