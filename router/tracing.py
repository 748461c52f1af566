"""OpenTelemetry traces of one request's path through the router (`--otlp-endpoint`).

A traced request is one span (`kvroute.request`, continuing the client's `traceparent` or
starting a trace) with children: the admission and prefill-queue waits, the routing
decision (`kvroute.route`: every candidate priced, the index lookup), one `kvroute.attempt`
per worker tried, and under the attempt that answered its `kvroute.relay` (first byte to
the answer's end). The worker receives the attempt span's context as its `traceparent`,
so a vLLM started with `--otlp-traces-endpoint` files its spans under the attempt.

Spans carry names, counts and times only: never a prompt's or an answer's text, never a
worker's address (workers by name). Off by default: the proxy then holds no tracer, every
hook is one `is not None` check, and nothing of OpenTelemetry is imported. This module
imports only the standard library at the top, so the router runs without the `tracing`
extra; `build_tracer` imports the SDK, and says which extra to install when it is missing.
"""

from __future__ import annotations

import contextvars
import importlib
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from router.metrics import Histogram
    from router.proxy.exchange import Exchange
    from router.routing import Routed

PROTOCOLS = ("http", "grpc")
TRACING_EXTRA_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                         "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
_TRACE_HEADERS = (b"traceparent", b"tracestate")
_OUTPUT_TOKENS = re.compile(rb'"(?:completion_tokens|output_tokens)"\s*:\s*(\d+)')


@dataclass(frozen=True)
class TracingSettings:
    """The `tracing` section: where spans go (none: tracing off), how, and how many."""

    otlp_endpoint: str | None = None
    """The collector: `http://HOST:4318` (http; `/v1/traces` is added to a URL without a
    path) or `http://HOST:4317` (grpc; `https://` for TLS). None: tracing off."""
    otlp_protocol: str = "http"
    """`http` (OTLP over HTTP, protobuf) or `grpc`."""
    sample_ratio: float = 1.0
    """Share of new traces recorded; a client's trace keeps the client's sampling decision."""
    service_name: str = "kvroute"

    def __post_init__(self) -> None:
        protocol = {"http/protobuf": "http"}.get(self.otlp_protocol, self.otlp_protocol)
        if protocol not in PROTOCOLS:
            raise ValueError(f"otlp_protocol must be http or grpc, not {self.otlp_protocol!r}")
        object.__setattr__(self, "otlp_protocol", protocol)
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio must be between 0 and 1, not {self.sample_ratio}")

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint)

    def traces_url(self) -> str:
        """The exporter's endpoint: an http collector's traces path added when none is given."""
        endpoint = str(self.otlp_endpoint)
        if self.otlp_protocol == "http" and urlsplit(endpoint).path in ("", "/"):
            return endpoint.rstrip("/") + "/v1/traces"
        return endpoint


def require_tracing_extra() -> None:
    """Exit naming the extra to install when `--otlp-endpoint` is set without the SDK."""
    for module in TRACING_EXTRA_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as error:
            if "opentelemetry.proto" in str(error):
                # xds-protos (the epp extra) ships an old copy of opentelemetry-proto's modules;
                # whichever package pip installs last owns the files.
                raise SystemExit(
                    "kvroute: --otlp-endpoint (tracing) finds an old copy of opentelemetry-proto's modules "
                    "(xds-protos ships one): pip install --force-reinstall --no-deps opentelemetry-proto"
                ) from None
            raise SystemExit(
                "kvroute: --otlp-endpoint (tracing) needs the OpenTelemetry SDK and OTLP exporters, which are not "
                "installed: pip install 'kvroute[tracing]'"
            ) from None


def build_tracer(settings: TracingSettings, ttft: Histogram | None = None) -> Tracer | None:
    """The tracer `settings` describe, exporting in the background (None: tracing off).
    `ttft`: the histogram whose buckets get the traces' ids as exemplars."""
    if not settings.enabled:
        return None
    require_tracing_extra()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if settings.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        endpoint = settings.traces_url()
        exporter: Any = GrpcExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        exporter = HttpExporter(endpoint=settings.traces_url())
    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.service_name}),
        sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracer(provider, ttft)


def _epoch_ns(perf: float) -> int:
    """A `time.perf_counter()` reading as the wall-clock nanoseconds spans are stamped in."""
    return time.time_ns() - int((time.perf_counter() - perf) * 1e9)


class RequestTrace:
    """One traced request: its span, and what its attempts report back to it."""

    __slots__ = ("ex", "span", "status")

    def __init__(self, ex: Exchange, span: Any) -> None:
        self.ex = ex
        self.span = span
        self.status: int | None = None


_CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("kvroute_trace", default=None)
"""The request the running task traces (each request runs in a task of its own)."""


class Tracer:
    """Makes the spans. Parents come from OpenTelemetry's context, which `request` sets to
    the request's span for the task that handles it."""

    def __init__(self, provider: Any, ttft: Histogram | None = None) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from router import __version__

        self.provider = provider
        self.ttft = ttft
        self._tracer = provider.get_tracer("kvroute", __version__)
        self._context = context
        self._trace = trace
        self._kinds = SpanKind
        self._error = Status(StatusCode.ERROR)
        self._propagator = TraceContextTextMapPropagator()

    def tracing(self, ex: Exchange) -> bool:
        """`ex` is the request this task traces already (its span is open)."""
        current = _CURRENT.get()
        return current is not None and current.ex is ex

    async def request(self, handle: Callable[[Exchange], Awaitable[None]], ex: Exchange) -> None:
        """`handle(ex)` (the proxy's) inside the request's span, the client's trace continued."""
        carrier = {k.decode(): v.decode("latin-1") for k, v in ex.scope["headers"] if k in _TRACE_HEADERS}
        parent = self._propagator.extract(carrier) if carrier else None
        span = self._tracer.start_span(
            "kvroute.request", context=parent, kind=self._kinds.SERVER, start_time=_epoch_ns(ex.arrived)
        )
        current = RequestTrace(ex, span)
        token = self._context.attach(self._trace.set_span_in_context(span))
        mark = _CURRENT.set(current)
        try:
            await handle(ex)
        except BaseException as exc:
            self._failed(current, exc)
            raise
        finally:
            _CURRENT.reset(mark)
            self._context.detach(token)
            if span.is_recording():
                _describe_request(span, ex, current.status)
            span.end()

    def _failed(self, current: RequestTrace, exc: BaseException) -> None:
        from router.errors import RouterError

        span = current.span
        if isinstance(exc, RouterError):
            current.status = exc.status
            span.set_attribute("error.type", exc.code)
        elif current.ex.disconnected:
            span.set_attribute("kvroute.client_disconnected", True)
            return
        else:
            span.set_attribute("error.type", type(exc).__name__)
        span.set_status(self._error)

    def span_between(self, name: str, started: float, attributes: dict[str, Any] | None = None) -> None:
        """A finished step of the current request, from `started` (perf_counter) to now."""
        if _CURRENT.get() is None:
            return  # not a request's step (a dry run on /debug/route, a pass-through)
        span = self._tracer.start_span(name, start_time=_epoch_ns(started), attributes=attributes)
        span.end()

    def decided(self, routed: Routed, started: float, lookup: tuple[float, str] | None) -> None:
        """The routing decision, made from `started` to now: every candidate as priced, and
        the index lookup's (seconds, outcome) (None: the policy read no index)."""
        if _CURRENT.get() is None:
            return
        span = self._tracer.start_span("kvroute.route", start_time=_epoch_ns(started))
        if span.is_recording():
            _describe_decision(span, routed, *(lookup or (None, "not_read")))
        span.end()

    def attempt(self, ex: Exchange, worker: str, reason: str) -> AttemptTrace:
        """The span of one try on `worker` (routed there for `reason`), open until
        `AttemptTrace.close`."""
        span = self._tracer.start_span("kvroute.attempt", kind=self._kinds.CLIENT)
        if span.is_recording():
            span.set_attributes({
                "kvroute.worker": worker, "kvroute.attempt.number": ex.attempts,
                "kvroute.route.reason": reason,
            })  # fmt: skip
            if ex.attempts > 1:
                span.set_attribute("kvroute.retry_cause", ex.last_error)
        return AttemptTrace(self, span, _CURRENT.get())

    def prefill(self, worker: str) -> AttemptTrace | None:
        """The span of a disaggregated request's prefill on `worker` (kind client), whose
        context the prefill worker receives; None outside a traced request."""
        current = _CURRENT.get()
        if current is None:
            return None
        span = self._tracer.start_span("kvroute.prefill", kind=self._kinds.CLIENT, attributes={"kvroute.worker": worker})
        return AttemptTrace(self, span, None)

    def shutdown(self) -> None:
        """Export what is left and stop the exporter (blocking: call it off the event loop)."""
        self.provider.shutdown()


class AttemptTrace:
    """The spans of one attempt: its own, and its relay's from the first byte on."""

    __slots__ = ("ended", "relay", "request", "span", "tracer")

    def __init__(self, tracer: Tracer, span: Any, request: RequestTrace | None) -> None:
        self.tracer = tracer
        self.span = span
        self.request = request
        self.relay: Any = None
        self.ended = False

    def headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """`headers` with this attempt's context as the worker's `traceparent`/`tracestate`."""
        out = [(k, v) for k, v in headers if k not in _TRACE_HEADERS]
        return out + self.propagation()

    def propagation(self) -> list[tuple[bytes, bytes]]:
        carrier: dict[str, str] = {}
        t = self.tracer
        t._propagator.inject(carrier, context=t._trace.set_span_in_context(self.span))
        return [(k.encode(), v.encode("latin-1")) for k, v in carrier.items()]

    def first_byte(
        self, ex: Exchange, status: int, first_byte_s: float | None, relay: bool, *, exemplar: bool = True
    ) -> None:
        """The worker answered `status`: the relay starts; a stream's TTFT gets an exemplar
        (`exemplar`: the TTFT is observed now)."""
        if self.request is not None:
            self.request.status = status
        span = self.span
        if not span.is_recording():
            return
        span.set_attribute("http.response.status_code", status)
        if first_byte_s is not None:
            span.set_attribute("kvroute.first_byte_s", first_byte_s)
        t = self.tracer
        self.relay = t._tracer.start_span("kvroute.relay", context=t._trace.set_span_in_context(span))
        self.relay.set_attribute("kvroute.stream", relay)
        if relay and exemplar and t.ttft is not None:
            trace_id = format(span.get_span_context().trace_id, "032x")
            t.ttft.exemplar(time.perf_counter() - ex.arrived, trace_id)

    def failed(self, why: str) -> None:
        """No first byte (`why` names the failure, never an address)."""
        self.span.set_attribute("kvroute.attempt.error", why)
        self.span.set_status(self.tracer._error)

    def relayed(self, how: str, first_token_s: float | None, usage: bytes = b"", streamed: int = 0) -> None:
        """The answer ended `how` (complete, worker_error, stalled, total_timeout, shutdown)."""
        self.ended = True
        relay = self.relay
        if relay is None:
            return
        relay.set_attribute("kvroute.relay.end", how)
        if first_token_s is not None:
            relay.set_attribute("kvroute.first_token_s", first_token_s)
        found = _OUTPUT_TOKENS.findall(usage)
        tokens = int(found[-1]) if found else streamed
        if tokens:
            relay.set_attribute("gen_ai.usage.output_tokens", tokens)
        if how != "complete":
            relay.set_status(self.tracer._error)
        relay.end()
        self.relay = None

    def prefilled(self, outcome: str) -> None:
        """A prefill try's span (`Tracer.prefill`) ends: held, stored, no_params, rejected,
        failed (an error) or cancelled."""
        self.span.set_attribute("kvroute.prefill.outcome", outcome)
        if outcome == "failed":
            self.span.set_status(self.tracer._error)
        self.span.end()

    def close(self, ex: Exchange) -> None:
        """The attempt is over: a relay not ended explicitly ended with the request."""
        if self.relay is not None:
            how = "client_disconnected" if ex.disconnected else ("complete" if ex.finished else "interrupted")
            self.relayed(how, None)
        self.span.end()


def _describe_request(span: Any, ex: Exchange, status: int | None) -> None:
    """The request span's attributes: what was asked and how it ended, never its content."""
    attrs: dict[str, Any] = {
        "http.request.method": ex.scope.get("method", "POST"), "url.path": ex.scope["path"],
        "kvroute.api": ex.endpoint.api, "kvroute.request.kind": ex.kind or "pass_through",
        "kvroute.stream": ex.stream, "kvroute.attempts": ex.attempts,
    }  # fmt: skip
    if ex.model:
        attrs["gen_ai.request.model"] = ex.model
    if ex.tenant is not None:
        attrs["kvroute.tenant"] = ex.tenant.name
    if ex.choice is not None:
        attrs["kvroute.prompt_tokens"] = ex.choice.chain.total_tokens
    if status is not None:
        attrs["http.response.status_code"] = status
    span.set_attributes(attrs)


def _describe_decision(span: Any, routed: Routed, lookup_s: float | None, outcome: str) -> None:
    """The decision span: the choice, the index lookup, and one event per priced candidate."""
    decision = routed.decision
    reuse = decision.reuse
    span.set_attributes({
        "kvroute.route.worker": decision.worker, "kvroute.route.reason": decision.reason,
        "kvroute.route.cached_tokens": decision.cached_tokens, "kvroute.route.prefill_s": decision.prefill_s,
        "kvroute.route.cached_tokens.pool": reuse.pool, "kvroute.route.cached_tokens.disk": reuse.disk,
        "kvroute.route.cached_tokens.remote": reuse.remote, "kvroute.route.candidates": len(routed.loads),
        "kvroute.index.outcome": outcome, "kvroute.prompt_tokens": routed.chain.total_tokens,
    })  # fmt: skip
    if decision.ranking:
        span.set_attribute("kvroute.route.fallbacks", list(decision.ranking))
    if lookup_s is not None:
        span.set_attribute("kvroute.index.lookup_s", lookup_s)
    for score in decision.scores:
        span.add_event("candidate", {
            "kvroute.worker": score.worker, "kvroute.predicted_ttft_s": score.ttft_s,
            "kvroute.predicted_prefill_s": score.prefill_s, "kvroute.score_s": score.score_s,
            "kvroute.cached_tokens.gpu": score.reuse.gpu, "kvroute.cached_tokens.pool": score.reuse.pool,
            "kvroute.cached_tokens.disk": score.reuse.disk, "kvroute.cached_tokens.remote": score.reuse.remote,
            "kvroute.inflight": score.load.inflight, "kvroute.queued_prefill_s": score.load.queued_prefill_s,
        })  # fmt: skip


def lookup_outcome(depths: Any, fallbacks_before: float | None, fallbacks_after: float | None) -> str:
    """How the index answered: `hit` (some location holds a prefix), `miss`, or `local`
    (the shared index did not answer within its budget: this replica's own view)."""
    if fallbacks_before is not None and fallbacks_after is not None and fallbacks_after > fallbacks_before:
        return "local"
    return "hit" if depths else "miss"
