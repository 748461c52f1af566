"""Phase `tracing` of the vLLM e2e stage: one trace from the client through kvroute into vLLM.

The fleet's workers run with `--otlp-traces-endpoint` at an OTLP/gRPC receiver of the
harness's own (loadtests/support/otlp.py), started before them (`worker_tracing`); this phase starts
a router exporting there too, over w1 and a worker that answers 503 to every generation
request (healthy to the router's checks), and sends chat requests carrying a client
`traceparent`. Checked: the receiver holds the router's spans and vLLM's `llm_request`
under the client's trace id, vLLM's span a child of the attempt that reached it; and a
request whose first attempt got the 503 shows both attempts, the vLLM span under the second.
A few seconds: the workers are already up, the router is a plain one (no precise mode).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import httpx

from loadtests.support.otlp import OtlpReceiver, Span
from loadtests.support.routerproc import free_port

if TYPE_CHECKING:
    from loadtests.e2e.vllm.run_e2e import Stack

VLLM_SPAN = "llm_request"
"""The span vLLM exports per request (vllm/tracing.py, `SpanAttributes`)."""


def worker_tracing(stack: Stack, rx: OtlpReceiver) -> None:
    """Every fleet worker exports its spans to `rx` (gRPC, vLLM's default protocol), soon
    after each request ends rather than in the SDK's default 5 s batches."""
    stack.worker_args += ["--otlp-traces-endpoint", rx.endpoint]
    stack.worker_env.update({"OTEL_SERVICE_NAME": "vllm", "OTEL_BSP_SCHEDULE_DELAY": "100"})


def _failing_worker(model: str) -> ThreadingHTTPServer:
    """Healthy to the router's checks (/health, /v1/models), 503 to every POST: an attempt
    on it fails before its first byte and is retried elsewhere."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: bytes) -> None:
            # A health check that gives up early closes its connection first: not an error.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer(200, b'{"object": "list", "data": [{"id": "%s", "object": "model"}]}' % model.encode())

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            self._answer(503, b'{"error": {"message": "injected", "type": "server_error", "code": 503}}')

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _traced_chat(url: str, model: str) -> tuple[int, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": model, "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "Name three rivers in Europe."}]}
    headers = {"traceparent": f"00-{trace_id}-{span_id}-01"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as resp:
        resp.read()
        return resp.status_code, trace_id, span_id


def _check(spans: list[Span], trace_id: str, client_span: str, attempts: int) -> dict[str, Any]:
    mine = [s for s in spans if s.trace_id == trace_id]
    request = next((s for s in mine if s.name == "kvroute.request"), None)
    tried = sorted((s for s in mine if s.name == "kvroute.attempt"), key=lambda s: s.attributes["kvroute.attempt.number"])
    vllm = [s for s in mine if s.name == VLLM_SPAN]
    answered = tried[-1] if tried else None
    ok = (
        request is not None and request.parent_id == client_span and len(tried) == attempts
        and all(a.parent_id == request.span_id for a in tried)
        and len(vllm) == 1 and answered is not None and vllm[0].parent_id == answered.span_id
        and answered.attributes.get("kvroute.worker") == "w1"
    )  # fmt: skip
    return {
        "trace_id": trace_id, "spans": sorted(f"{s.service}:{s.name}" for s in mine),
        "attempts": [(a.attributes.get("kvroute.worker"), a.attributes.get("http.response.status_code")) for a in tried],
        "vllm_parent_is_attempt": bool(vllm and answered and vllm[0].parent_id == answered.span_id), "ok": ok,
    }


def phase_tracing(stack: Stack, rx: OtlpReceiver, model: str) -> dict[str, Any]:
    """One plain request and one retried request, each traced client -> kvroute -> vLLM."""
    w1 = stack.workers[0]
    bad = _failing_worker(model)
    args = [
        "--policy", "round_robin", "--worker", f"w1={w1.url}", "--worker", f"bad=http://127.0.0.1:{bad.server_port}",
        "--otlp-endpoint", rx.endpoint, "--otlp-protocol", "grpc", "--trace-service-name", "kvroute",
        "--breaker-failures", "0", "--outlier-interval-s", "0", "--log-level", "warning",
    ]
    from loadtests.e2e.vllm.run_e2e import start_kvroute

    with contextlib.ExitStack() as cleanup:
        cleanup.callback(bad.shutdown)
        router, url = start_kvroute("router-tracing", args, stack.logdir, {**stack.env(), "OTEL_BSP_SCHEDULE_DELAY": "100"})
        cleanup.callback(router.stop)
        cases: dict[str, Any] = {}
        for _ in range(4):  # round robin: within two requests, one tries `bad` first
            status, trace_id, client_span = _traced_chat(url, model)
            retried = any(s.trace_id == trace_id and s.attributes.get("kvroute.worker") == "bad"
                          for s in _settled(rx, trace_id))
            name = "retried" if retried else "plain"
            if status == 200 and name not in cases:
                cases[name] = _check(_settled(rx, trace_id), trace_id, client_span, 2 if retried else 1)
            if len(cases) == 2:
                break
    return {**cases, "ok": len(cases) == 2 and all(c["ok"] for c in cases.values())}


def _settled(rx: OtlpReceiver, trace_id: str, timeout_s: float = 20.0) -> list[Span]:
    """The spans once the trace's vLLM span and kvroute's request span have come (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = {s.name for s in rx.snapshot() if s.trace_id == trace_id}
        if {VLLM_SPAN, "kvroute.request"} <= names:
            break
        time.sleep(0.1)
    time.sleep(0.3)  # the router's attempt spans end with the request: same batch or the next
    return rx.snapshot()
