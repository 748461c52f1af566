"""`kvroute epp` traces like `kvroute serve`: the picker in process (ext_proc messages in and
out), its spans exported to a real OTLP receiver on loopback, the gateway told to send the
attempt's `traceparent` to the worker."""

from __future__ import annotations

import asyncio
import secrets

import orjson
import pytest

from loadtests.support.otlp import OtlpReceiver
from router.config_loader import flat_config
from router.epp.picker import Picker
from tests.epp.test_picker import (
    SSE_CHUNKS,
    WORKERS,
    chat,
    response_body_message,
    response_headers_message,
    routed,
    set_headers,
)
from tests.support.asgi import FakeUpstream, running_app

pytest.importorskip("opentelemetry.sdk.trace")


async def test_the_pickers_attempt_span_is_the_workers_parent() -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with OtlpReceiver("http") as rx:
        config = flat_config(workers=WORKERS, policy="cache_aware", otlp_endpoint=rx.endpoint)
        async with running_app(config, FakeUpstream([])) as app:
            picker = Picker(app.services.proxy, app.services.api_keys, app.services.tenants)
            headers = {"traceparent": f"00-{trace_id}-{client_span}-01"}
            gateway, task, answer, _ = await routed(picker, orjson.dumps(chat()), headers=headers)
            mutation = set_headers(answer.request_headers.response.header_mutation)
            chosen = mutation["x-gateway-destination-endpoint"].split(",")[0]
            gateway.put(response_headers_message(served=chosen))
            await gateway.answer()
            for i, chunk in enumerate(SSE_CHUNKS):
                gateway.put(response_body_message(chunk, eos=i == len(SSE_CHUNKS) - 1))
                await gateway.answer()
            gateway.put(None)
            await asyncio.wait_for(task, 5)
            tracer = app.services.proxy.tracer
            assert tracer is not None
            tracer.provider.force_flush()
            spans = rx.wait_for(lambda s: {"kvroute.request", "kvroute.attempt", "kvroute.relay"} <= {x.name for x in s})
    by_name = {s.name: s for s in spans if s.trace_id == trace_id}
    request, attempt = by_name["kvroute.request"], by_name["kvroute.attempt"]
    assert request.parent_id == client_span and attempt.parent_id == request.span_id
    assert by_name["kvroute.route"].parent_id == request.span_id
    assert by_name["kvroute.relay"].parent_id == attempt.span_id
    assert attempt.attributes["http.response.status_code"] == 200
    # The gateway sends the worker the attempt's context.
    assert mutation["traceparent"] == f"00-{trace_id}-{attempt.span_id}-01"
