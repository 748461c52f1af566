"""The picker's own gRPC server (router/epp/h2grpc.py) against an independent client, grpcio:
unary and streaming calls, flow control with messages far larger than the windows, many
concurrent streams, cancellation, errors, unknown methods, TLS; and the health service as
gateways and kubelets ask it."""

from __future__ import annotations

import asyncio
import os
import ssl
import tempfile
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtests.support.routerproc import free_port
from router.epp.h2grpc import GrpcServer
from router.epp.server import Health, self_signed_certificate


async def echo(call) -> None:  # type: ignore[no-untyped-def]
    while (message := await call.read()) is not None:
        call.send(message[::-1])


async def fail(call) -> None:  # type: ignore[no-untyped-def]
    await call.read()
    raise RuntimeError("a handler bug")


started = asyncio.Event()
cancelled: list[bool] = []


async def hang(call) -> None:  # type: ignore[no-untyped-def]
    try:
        started.set()
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        cancelled.append(True)
        raise


@pytest.fixture
async def server() -> AsyncIterator[tuple[GrpcServer, Health, int]]:
    health = Health()
    health.set("", True)
    health.set("readiness", False)
    srv = GrpcServer({"/t.T/Echo": echo, "/t.T/Fail": fail, "/t.T/Hang": hang,
                      "/grpc.health.v1.Health/Check": health.check, "/grpc.health.v1.Health/Watch": health.watch})  # fmt: skip
    port = free_port()
    await srv.start("127.0.0.1", port)
    yield srv, health, port
    await srv.stop(1.0)


def _raw(channel: grpc.aio.Channel, method: str) -> grpc.aio.StreamStreamMultiCallable:
    return channel.stream_stream(method, request_serializer=None, response_deserializer=None)


async def test_streams_echo_through_windows_far_smaller_than_the_messages(server: tuple[GrpcServer, Health, int]) -> None:
    _, _, port = server
    big = bytes(range(256)) * 4096  # 1 MiB: 16 of the client's default 64 KiB stream windows
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 8 << 20),
                                                                        ("grpc.max_send_message_length", 8 << 20)]) as channel:  # fmt: skip
        call = _raw(channel, "/t.T/Echo")(iter([b"abc", big, b"", b"xyz" * 30_000]))
        answers = [m async for m in call]
        assert answers == [b"cba", big[::-1], b"", (b"xyz" * 30_000)[::-1]]
        assert await call.code() == grpc.StatusCode.OK

        async def one(i: int) -> list[bytes]:
            return [m async for m in _raw(channel, "/t.T/Echo")(iter([str(i).encode() * 1000] * 5))]

        results = await asyncio.gather(*(one(i) for i in range(200)))
        assert all(r == [(str(i).encode() * 1000)[::-1]] * 5 for i, r in enumerate(results))


async def test_errors_unknown_methods_and_cancellation(server: tuple[GrpcServer, Health, int]) -> None:
    _, _, port = server
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            [m async for m in _raw(channel, "/t.T/Fail")(iter([b"x"]))]
        assert exc.value.code() == grpc.StatusCode.UNKNOWN
        # No request message: the server answers an unknown method at once, and grpcio's
        # client reports a message still being sent after that as its own INTERNAL error.
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            [m async for m in _raw(channel, "/t.T/Nope")(iter([]))]
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
        call = _raw(channel, "/t.T/Hang")(iter([b"x"]))
        await asyncio.wait_for(started.wait(), 5)
        call.cancel()
        for _ in range(100):
            if cancelled:
                break
            await asyncio.sleep(0.01)
        assert cancelled == [True]  # the client's RST_STREAM cancels the handler


async def test_health_check_and_watch(server: tuple[GrpcServer, Health, int]) -> None:
    _, health, port = server
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert (await stub.Check(health_pb2.HealthCheckRequest(service=""))).status == health_pb2.HealthCheckResponse.SERVING
        assert (await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Check(health_pb2.HealthCheckRequest(service="nobody"))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.NOT_SERVING
        health.set("readiness", True)
        assert (await asyncio.wait_for(watch.read(), 5)).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


async def test_tls_with_alpn_h2() -> None:
    key, cert = self_signed_certificate()
    health = Health()
    health.set("", True)
    srv = GrpcServer({"/grpc.health.v1.Health/Check": health.check})
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.set_alpn_protocols(["h2"])
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in (("k.pem", key), ("c.pem", cert)):
            with open(os.path.join(tmp, name), "wb") as fh:
                fh.write(data)
        context.load_cert_chain(os.path.join(tmp, "c.pem"), os.path.join(tmp, "k.pem"))
    port = free_port()
    await srv.start("127.0.0.1", port, ssl=context)
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert)
        async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await srv.stop(1.0)
