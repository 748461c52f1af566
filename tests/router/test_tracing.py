"""OpenTelemetry traces through a real router process, real loopback workers and a real OTLP
receiver (HTTP/protobuf and gRPC): the client's trace continued, the spans' structure, a
retry's two attempts, the worker handed the attempt's context, exemplars on /metrics, and
no prompt or answer text anywhere in the exported spans."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from loadtests.support.otlp import OtlpReceiver, Span
from loadtests.support.routerproc import RouterProcess
from router.config_loader import load_config
from router.tracing import TracingSettings, lookup_outcome, require_tracing_extra
from tests.support.upstream import RecordingUpstream, UpstreamBehaviour

pytest.importorskip("opentelemetry.sdk.trace")

PROMPT_WORDS = ("periwinkle", "zeppelin", "marmalade", "quokka")
ANSWER_WORDS = ("t0", "t1", "t2")  # what RecordingUpstream streams back
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # the SDK's batch delay (ms): spans out at once


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _chat(url: str, traceparent: str, stream: bool) -> httpx.Response:
    body = {"model": "rec-model", "stream": stream,
            "messages": [{"role": "user", "content": " ".join(PROMPT_WORDS)}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=10,
                      headers={"traceparent": traceparent, "tracestate": "vendor=abc"})


def _of_trace(trace_id: str, names: tuple[str, ...]):
    def done(spans: list[Span]) -> bool:
        got = {s.name for s in spans if s.trace_id == trace_id}
        return all(n in got for n in names)

    return done


def _one(spans: list[Span], trace_id: str, name: str) -> Span:
    found = [s for s in spans if s.trace_id == trace_id and s.name == name]
    assert len(found) == 1, (name, found)
    return found[0]


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[RouterProcess, OtlpReceiver, RecordingUpstream, RecordingUpstream]]:
    """One router, round robin over a worker that answers 503 and one that answers, both
    real HTTP servers; tracing to an OTLP/HTTP receiver."""
    with OtlpReceiver("http") as rx, RecordingUpstream(behaviour=UpstreamBehaviour(status=503)) as bad, \
            RecordingUpstream() as good:
        args = ["--otlp-endpoint", rx.endpoint, "--breaker-failures", "0", "--outlier-interval-s", "0",
                "--trace-service-name", "kvroute-test"]
        with RouterProcess({"bad": bad.url, "good": good.url}, policy="round_robin", extra_args=args,
                           env=FAST_EXPORT) as router:
            yield router, rx, bad, good


def test_spans_continue_the_clients_trace_and_nest(traced) -> None:
    router, rx, _, good = traced
    traceparent, trace_id, client_span = _traceparent()
    resp = _chat(router.url, traceparent, stream=True)
    assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == "good"
    spans = rx.wait_for(_of_trace(trace_id, ("kvroute.request", "kvroute.route", "kvroute.attempt", "kvroute.relay")))
    request = _one(spans, trace_id, "kvroute.request")
    assert request.parent_id == client_span and request.service == "kvroute-test"
    assert request.attributes["gen_ai.request.model"] == "rec-model"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["kvroute.stream"] is True
    route = _one(spans, trace_id, "kvroute.route")
    assert route.parent_id == request.span_id
    assert route.attributes["kvroute.route.worker"] in ("bad", "good")
    assert route.attributes["kvroute.route.candidates"] == 2
    attempts = [s for s in spans if s.trace_id == trace_id and s.name == "kvroute.attempt"]
    assert all(a.parent_id == request.span_id for a in attempts)
    answered = next(a for a in attempts if a.attributes["kvroute.worker"] == "good")
    assert answered.attributes["http.response.status_code"] == 200
    # The event loop's clock (uvloop: milliseconds, read once per turn) may read 0 on loopback.
    assert answered.attributes["kvroute.first_byte_s"] >= 0
    relay = _one(spans, trace_id, "kvroute.relay")
    assert relay.parent_id == answered.span_id
    assert relay.attributes["kvroute.relay.end"] == "complete"
    assert relay.attributes["gen_ai.usage.output_tokens"] == 3
    # The worker got the attempt's context, the client's trace id and tracestate with it.
    sent = good.received[-1].headers
    assert sent["traceparent"] == f"00-{trace_id}-{answered.span_id}-01"
    assert sent["tracestate"] == "vendor=abc"


def test_a_retried_request_shows_both_attempts(traced) -> None:
    router, rx, bad, good = traced
    for _ in range(2):  # round robin: one of two requests tries the failing worker first
        traceparent, trace_id, _ = _traceparent()
        before = len(bad.received)
        assert _chat(router.url, traceparent, stream=False).status_code == 200
        if len(bad.received) > before:
            break
    else:
        pytest.fail("no request went to the failing worker first")
    spans = rx.wait_for(lambda s: len([x for x in s if x.trace_id == trace_id and x.name == "kvroute.attempt"]) == 2
                        and _of_trace(trace_id, ("kvroute.request", "kvroute.relay"))(s))
    request = _one(spans, trace_id, "kvroute.request")
    first, second = sorted((s for s in spans if s.trace_id == trace_id and s.name == "kvroute.attempt"),
                           key=lambda s: s.attributes["kvroute.attempt.number"])
    assert first.parent_id == second.parent_id == request.span_id
    assert first.attributes["kvroute.worker"] == "bad" and first.status == 2
    assert first.attributes["kvroute.attempt.error"] == "worker answered 503"
    assert second.attributes["kvroute.worker"] == "good"
    assert second.attributes["kvroute.retry_cause"] == "worker answered 503"
    assert second.attributes["http.response.status_code"] == 200
    assert request.attributes["kvroute.attempts"] == 2
    # Each worker saw its own attempt's span as the parent.
    assert bad.received[-1].headers["traceparent"] == f"00-{trace_id}-{first.span_id}-01"
    assert good.received[-1].headers["traceparent"] == f"00-{trace_id}-{second.span_id}-01"


def test_no_prompt_or_answer_text_nor_worker_address_in_any_span(traced) -> None:
    router, rx, bad, good = traced
    traceparent, trace_id, _ = _traceparent()
    assert _chat(router.url, traceparent, stream=True).status_code == 200
    assert _chat(router.url, _traceparent()[0], stream=False).status_code == 200
    spans = rx.wait_for(_of_trace(trace_id, ("kvroute.request", "kvroute.relay")))
    texts = []
    for s in spans:
        texts += [s.name, *map(str, s.attributes.values()), *map(str, s.attributes)]
        for name, attrs in s.events:
            texts += [name, *map(str, attrs.values()), *map(str, attrs)]
    blob = "\n".join(texts)
    for word in PROMPT_WORDS:
        assert word not in blob
    assert not any(w in texts for w in ANSWER_WORDS) and "t0 " not in blob
    for url in (bad.url, good.url):
        assert url.split("//")[1] not in blob


def test_ttft_exemplars_carry_the_trace_id_in_openmetrics(traced) -> None:
    router = traced[0]
    traceparent, trace_id, _ = _traceparent()
    assert _chat(router.url, traceparent, stream=True).status_code == 200
    om = httpx.get(router.url + "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n")
    exemplar = f'# {{trace_id="{trace_id}"}}'
    assert any(line.startswith("kvroute_ttft_seconds_bucket") and exemplar in line for line in om.text.splitlines())
    assert "# TYPE kvroute_requests counter" in om.text and "kvroute_requests_total{" in om.text
    plain = httpx.get(router.url + "/metrics")
    assert plain.headers["content-type"].startswith("text/plain") and "trace_id" not in plain.text


def test_grpc_export() -> None:
    with OtlpReceiver("grpc") as rx, RecordingUpstream() as good:
        args = ["--otlp-endpoint", rx.endpoint, "--otlp-protocol", "grpc"]
        with RouterProcess({"good": good.url}, extra_args=args, env=FAST_EXPORT) as router:
            traceparent, trace_id, client_span = _traceparent()
            assert _chat(router.url, traceparent, stream=True).status_code == 200
            spans = rx.wait_for(_of_trace(trace_id, ("kvroute.request", "kvroute.attempt", "kvroute.relay")))
    request = _one(spans, trace_id, "kvroute.request")
    assert request.parent_id == client_span and request.service == "kvroute"
    assert _one(spans, trace_id, "kvroute.attempt").parent_id == request.span_id


def test_a_request_without_traceparent_starts_a_trace_and_shutdown_flushes() -> None:
    with OtlpReceiver("http") as rx, RecordingUpstream() as good:
        # The default batch delay (5 s): the spans go out when the router stops.
        with RouterProcess({"good": good.url}, extra_args=["--otlp-endpoint", rx.endpoint]) as router:
            body = {"model": "rec-model", "messages": [{"role": "user", "content": "x"}]}
            assert httpx.post(router.url + "/v1/chat/completions", json=body, timeout=10).status_code == 200
        spans = rx.wait_for(lambda s: any(x.name == "kvroute.request" for x in s), timeout_s=5)
    request = next(s for s in spans if s.name == "kvroute.request")
    assert request.parent_id == ""
    sent = good.received[-1].headers["traceparent"]
    assert sent.split("-")[1] == request.trace_id


# -- configuration and the off state (pure logic) -----------------------------------------
def test_otel_variables_are_read_below_kvroutes_own() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SERVICE_NAME": "edge",
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    t = load_config(["--worker", "a=http://w:1"], env).tracing
    assert t == TracingSettings("http://collector:4318/v1/traces", "http", 0.25, "edge")
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://traces:4318/custom"
    env["KVROUTE_TRACE_SERVICE_NAME"] = "mine"
    t = load_config(["--worker", "a=http://w:1", "--trace-sample-ratio", "1"], env).tracing
    assert (t.traces_url(), t.service_name, t.sample_ratio) == ("http://traces:4318/custom", "mine", 1.0)
    grpc = load_config(["--worker", "a=http://w:1"], {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                                                       "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}).tracing
    assert (grpc.otlp_protocol, grpc.traces_url()) == ("grpc", "http://c:4317")
    off = load_config(["--worker", "a=http://w:1"], {**env, "OTEL_SDK_DISABLED": "true"}).tracing
    assert not off.enabled
    assert not load_config(["--worker", "a=http://w:1"], {}).tracing.enabled
    with pytest.raises(SystemExit, match="otlp_protocol"):
        load_config(["--worker", "a=http://w:1", "--otlp-protocol", "http/json"], {})


def test_lookup_outcome() -> None:
    assert lookup_outcome({"w": 2}, None, None) == "hit"
    assert lookup_outcome({}, 3, 3) == "miss"
    assert lookup_outcome({}, 3, 4) == "local"


def test_without_the_extra_the_message_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # an import of it fails
    with pytest.raises(SystemExit, match=r"kvroute\[tracing\]"):
        require_tracing_extra()


def test_tracing_off_loads_no_sdk_and_no_tracer() -> None:
    # OpenTelemetry's API and metrics SDK may be loaded by others (redis-py's observability
    # hooks import them when installed): what tracing loads is the trace SDK and exporters.
    code = ("import sys\nfrom router.config_loader import flat_config\nfrom router.app import build_app\n"
            "app = build_app(flat_config(workers=['a=http://127.0.0.1:9']))\n"
            "assert app.proxy.tracer is None\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace', 'opentelemetry.exporter'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
