"""The proxy in process: the real app against a scripted fake upstream client, driven as
ASGI (tests/support/asgi.py). No sockets, no subprocesses: each test takes milliseconds.

Covers what happens around one attempt: a retry on the next worker before the first byte,
an error event after it, a client disconnect mid-stream, and 429 when every slot is taken;
and that the `upstream_client` setting (env KVROUTE_UPSTREAM_CLIENT) picks the client.
"""

from __future__ import annotations

import asyncio

import pytest

from router.app import build_app
from router.config import RouterConfig
from router.config_loader import flat_config
from router.proxy.upstream import (
    HttpxUpstreamClient,
    RawUpstreamClient,
    UpstreamConnectError,
    UpstreamError,
)
from router.workers import WorkerSpec
from tests.support.asgi import (
    Answer,
    AsgiCall,
    FakeUpstream,
    chat_body,
    healthy_workers,
    post,
    running_app,
)

CHAT = "/v1/chat/completions"
SSE = [(b"content-type", b"text/event-stream")]
EVENTS = [b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n', b'data: {"choices": [{"delta": {"content": "b"}}]}\n\n']


def config(workers: int = 2, **overrides: object) -> RouterConfig:
    specs = [WorkerSpec(f"w{i}", f"http://w{i}.test:8000") for i in range(1, workers + 1)]
    return flat_config(workers=specs, health_interval_s=3600.0, outlier_interval_s=0.0, **overrides)


def worker_of(url: str) -> str:
    return url.removeprefix("http://").split(".", 1)[0]


@pytest.mark.parametrize(
    "failure",
    [Answer(post_error=UpstreamConnectError("ConnectError: refused")), Answer(status=503, chunks=(b"busy",))],
    ids=["connect_error", "status_503"],
)
async def test_failure_before_first_byte_is_retried_on_the_next_worker(failure: Answer) -> None:
    upstream = FakeUpstream([failure, Answer()])
    async with running_app(config(), upstream) as app:
        response = await post(app, CHAT, chat_body())
        assert response.status == 200 and response.json() == {"ok": True}
        assert len(upstream.posts) == 2
        failed, answered = (worker_of(p.base_url) for p in upstream.posts)
        assert failed != answered
        assert response.headers["x-kvroute-worker"] == answered
        assert response.headers["x-kvroute-route-reason"] == "retry"
        assert upstream.posts[0].body == upstream.posts[1].body  # the same canonical bytes
        assert app.fleet is not None
        bad = app.fleet.get(failed)
        assert bad is not None and bad.breaker.failures == 1
        # A connection-level failure takes the worker out at once; a 5xx answer does not.
        assert bad.healthy is (failure.post_error is None)
        assert app.metrics.retries.get() == 1
        assert sum(v for (w, _, status), v in app.metrics.requests.values.items() if w == failed and status == "error") == 1
        assert app.loads.inflight(failed) == 0 and app.loads.inflight(answered) == 0


async def test_stream_broken_after_first_byte_ends_with_an_error_event() -> None:
    upstream = FakeUpstream([Answer(chunks=EVENTS, headers=SSE, error_after_chunks=UpstreamError("reset"))])
    async with running_app(config(workers=1), upstream) as app:
        response = await post(app, CHAT, chat_body(stream=True))
        assert response.status == 200
        assert response.headers["content-type"] == "text/event-stream"
        assert response.body.startswith(b"".join(EVENTS))  # relayed as sent, byte for byte
        tail = response.body[len(b"".join(EVENTS)):]
        assert tail.startswith(b"data: {") and b'"code":"stream_interrupted"' in tail
        assert tail.endswith(b"\n\ndata: [DONE]\n\n")
        assert len(upstream.posts) == 1  # never retried once the client has bytes
        assert app.metrics.stream_errors.get() == 1
        assert app.fleet is not None and app.fleet.get("w1").breaker.failures == 1  # type: ignore[union-attr]
        assert upstream.responses[0].closed
        assert app.loads.inflight("w1") == 0


async def test_client_disconnect_mid_stream_closes_the_upstream_response() -> None:
    upstream = FakeUpstream([Answer(chunks=EVENTS[:1], headers=SSE, hold_after_chunks=True)])
    async with running_app(config(workers=1), upstream) as app:
        call = AsgiCall(app, CHAT, chat_body(stream=True)).start()
        assert (await call.next_message())["type"] == "http.response.start"
        assert (await call.next_message())["body"] == EVENTS[0]
        assert app.loads.inflight("w1") == 1
        call.disconnect()
        await call.finish()
        assert upstream.responses[0].closed  # the engine sees its client go and aborts
        assert app.loads.inflight("w1") == 0
        assert app.metrics.client_disconnects.get() == 1
        assert app.metrics.stream_errors.get() == 0  # nobody left to send an error event to
        assert not any(m.get("more_body") is False for m in call.sent)


@pytest.mark.parametrize(
    ("queue_size", "why"), [(0, "queue full"), (4, "no slot freed in time")], ids=["queue_full", "queue_timeout"]
)
async def test_every_slot_taken_answers_429_with_retry_after(queue_size: int, why: str) -> None:
    upstream = FakeUpstream([Answer(chunks=EVENTS[:1], headers=SSE, hold_after_chunks=True), Answer()])
    overrides = {"max_inflight_per_worker": 1, "queue_size": queue_size, "queue_timeout_s": 0.05, "retry_after_s": 2}
    async with running_app(config(workers=1, **overrides), upstream) as app:
        holder = AsgiCall(app, CHAT, chat_body(stream=True)).start()
        await holder.next_message()  # the only slot is taken
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        response = await post(app, CHAT, chat_body())
        assert response.status == 429
        assert response.headers["retry-after"] == "2"
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
        assert why in error["message"] and error["param"] is None
        if queue_size:
            assert loop.time() - t0 >= 0.04  # it did wait for a slot first
        assert len(upstream.posts) == 1  # the limit held: the worker never saw the second
        assert app.metrics.rejected.get("overloaded") == 1
        holder.disconnect()
        await holder.finish()
        assert app.admission.queued == 0 and app.loads.inflight("w1") == 0


@pytest.mark.parametrize(("kind", "client_class"), [("raw", RawUpstreamClient), ("httpx", HttpxUpstreamClient)])
async def test_upstream_client_setting_picks_the_forwarding_client(kind: str, client_class: type) -> None:
    app = build_app(config(upstream_client=kind), health_client=healthy_workers())
    async with app.lifespan(app.api):
        assert app.proxy is not None and isinstance(app.proxy.client, client_class)
