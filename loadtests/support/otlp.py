"""An OTLP trace receiver on loopback, for tests and the vLLM e2e stage: a real collector's
protocol (OTLP/HTTP protobuf on `/v1/traces`, or OTLP/gRPC), decoding every
`ExportTraceServiceRequest` it receives into flat `Span` records.

    with OtlpReceiver("http") as rx:   # rx.endpoint: what --otlp-endpoint takes
        ...
        spans = rx.wait_for(lambda spans: len(spans) >= 4)

Needs opentelemetry-proto (the `tracing` extra) and, for gRPC, grpcio.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from loadtests.support.routerproc import free_port


@dataclass
class Span:
    """One received span: ids in lowercase hex (parent "" for a root)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status: int = 0
    """0 unset, 1 ok, 2 error."""
    start_ns: int = 0
    end_ns: int = 0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(request: Any) -> list[Span]:
    """The spans of one ExportTraceServiceRequest."""
    out = []
    for rs in request.resource_spans:
        service = str(_attrs(rs.resource.attributes).get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(
                    service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), _attrs(s.attributes),
                    [(e.name, _attrs(e.attributes)) for e in s.events], s.status.code, s.start_time_unix_nano,
                    s.end_time_unix_nano,
                ))  # fmt: skip
    return out


class OtlpReceiver:
    """A collector of one protocol (`http` or `grpc`) on 127.0.0.1; `spans` in arrival order."""

    def __init__(self, protocol: str = "http", port: int | None = None) -> None:
        self.protocol = protocol
        self.port = port or free_port()
        self.spans: list[Span] = []
        self.requests = 0
        self._lock = threading.Lock()
        self._server: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def received(self, raw: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest.FromString(raw)
        with self._lock:
            self.requests += 1
            self.spans.extend(decode(request))

    def snapshot(self) -> list[Span]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, done: Callable[[list[Span]], bool], timeout_s: float = 15.0) -> list[Span]:
        """The spans once `done(spans)` holds (AssertionError with what came, if it never does)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"the receiver never got the spans awaited; it has {[(s.service, s.name) for s in spans]}")
            time.sleep(0.05)

    def __enter__(self) -> OtlpReceiver:
        if self.protocol == "grpc":
            self._server = _grpc_server(self)
        else:
            self._server = _http_server(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.protocol == "grpc":
            self._server.stop(grace=None)
        else:
            self._server.shutdown()
            self._server.server_close()


def _http_server(rx: OtlpReceiver) -> ThreadingHTTPServer:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                self.send_response(404)
                self.end_headers()
                return
            if self.headers.get("content-encoding") == "gzip":
                import gzip

                raw = gzip.decompress(raw)
            rx.received(raw)
            body = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", rx.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _grpc_server(rx: OtlpReceiver) -> Any:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            rx.received(request.SerializeToString())
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    server.add_insecure_port(f"127.0.0.1:{rx.port}")
    server.start()
    return server
