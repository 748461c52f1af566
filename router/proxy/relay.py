"""From the worker's first byte on: the answer as the client gets it.

A whole answer (`send_whole`) leaves in one body message, with its length. A stream
(`relay_stream`) is relayed chunk by chunk as the worker sends it, never parsed or
re-serialised; each chunk costs one `send` and a float store that moves the flight's idle
deadline on (router/proxy/deadlines.py: no timer per chunk). A stream that breaks after its
first byte ends with an error event in the endpoint's stream format (`stream_interrupted`:
chat and completions with `data: [DONE]` after it), which clients parse, rather than a cut
connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from router.errors import stream_error_tail
from router.metrics import RouterMetrics
from router.proxy.deadlines import Flight
from router.proxy.exchange import Exchange, Headers
from router.proxy.upstream import UpstreamError

if TYPE_CHECKING:
    from router.proxy.context import AnswerLearner, RelayedAttempt

log = logging.getLogger("kvroute.proxy")

_DROP_RESPONSE_HEADERS = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"content-length", b"server", b"date",
        b"location", b"x-kvroute-worker", b"x-kvroute-route-reason",
    }
)


def response_headers(upstream_headers: Headers, worker: str, reason: str) -> Headers:
    """The worker's headers the client may see, and which worker answered and why."""
    headers = [(k, v) for k, v in upstream_headers if k not in _DROP_RESPONSE_HEADERS]
    headers += [
        (b"x-kvroute-worker", worker.encode()),
        (b"x-kvroute-route-reason", reason.encode()),
    ]
    return headers


async def send_whole(send: Any, status: int, headers: Headers, body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


FIRST_OUTPUT = b"response.output_item.added"
"""The Responses stream event that comes with the first generated token."""
COUNTED_KINDS = frozenset({"chat", "completion"})
"""Streams whose usage is the client's option: their token events are counted."""


def token_events(chunk: bytes) -> int:
    """Generated tokens in a chat or completions stream's chunk, without parsing it: vLLM
    streams a token an event; the events that carry none (the role's, an empty finish)
    have an empty delta or text. Byte counts in C: a few hundred ns a chunk. An event split
    across two reads (rare: events are small and sent whole) may go uncounted."""
    return (
        chunk.count(b"data: {") - chunk.count(b'"content":""') - chunk.count(b'"text":""') - chunk.count(b'"delta":{}')
    )


async def relay_stream(
    ex: Exchange, attempt: RelayedAttempt, headers: Headers, first: bytes, chunks: AsyncIterator[bytes],
    flight: Flight, learner: AnswerLearner | None = None,
) -> None:
    """The stream from `first` (its first chunk) on, to the client. The loop over the chunks
    is here, not in a coroutine of its own: every frame between the task and the upstream
    read is re-entered on each chunk. `learner`: a `/v1/responses` stream, whose id is
    looked for in the chunks already sent."""
    metrics = attempt.proxy.metrics
    send = ex.send
    loop = asyncio.get_running_loop()
    idle = attempt.proxy.settings.idle_timeout_s
    last = previous = first  # usage arrives in the last chunks: per-tenant generated tokens
    # Without usage (the client did not ask for it) the token events stand in for it.
    counting = (metrics.tenants is not None or attempt.trace is not None) and ex.kind in COUNTED_KINDS
    streamed = token_events(first) if counting else 0
    how, tail = "complete", b""  # how the stream ended (for its trace), and its error event
    try:
        prefilling = await _open_stream(ex, attempt, headers, first, learner)
        async for chunk in chunks:
            flight.extend(loop.time() + idle)
            if prefilling and FIRST_OUTPUT in chunk:
                prefilling = False
                attempt.prefilled(loop.time())
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            previous, last = last, chunk
            if counting:
                streamed += token_events(chunk)
            if learner is not None:
                learner.feed(chunk)
    except asyncio.CancelledError:
        if flight.expired is None:  # not a deadline: the client left, or the server stops
            if not ex.disconnected:
                await _end_on_shutdown(ex, attempt, streamed)
            raise
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        how, tail = _timed_out(ex, attempt, flight)
    except UpstreamError as exc:
        how = "worker_error"
        attempt.interrupted("stream broken")
        tail = stream_failed(metrics, f"the worker connection failed ({exc})", ex.kind)
    usage = previous + last if previous is not last else last  # usage is in the last chunks
    await _close_stream(ex, attempt, flight, learner, how, tail, usage, streamed)


async def _open_stream(
    ex: Exchange, attempt: RelayedAttempt, headers: Headers, first: bytes, learner: AnswerLearner | None
) -> bool:
    """Start the answer with the worker's headers and first chunk. True while a Responses
    stream's prefill is not over: that is at its first output item, not its first byte
    (response.created; see Attempt.run)."""
    await ex.send({"type": "http.response.start", "status": 200, "headers": headers})
    await ex.send({"type": "http.response.body", "body": first, "more_body": True})
    if learner is not None:
        learner.feed(first)
    prefilling = ex.kind == "responses"
    if prefilling and FIRST_OUTPUT in first:
        attempt.prefilled(asyncio.get_running_loop().time())
        return False
    return prefilling


async def _end_on_shutdown(ex: Exchange, attempt: RelayedAttempt, streamed: int) -> None:
    """Cancelled by the server: the graceful-shutdown grace period ran out. End the stream
    the way the client can parse rather than cutting it."""
    tail = stream_failed(attempt.proxy.metrics, "the router is shutting down", ex.kind)
    ex.finished = True
    if attempt.trace is not None:
        attempt.trace.relayed("shutdown", attempt.first_byte_s, streamed=streamed)
    with contextlib.suppress(Exception):
        await ex.send({"type": "http.response.body", "body": tail, "more_body": False})


def _timed_out(ex: Exchange, attempt: RelayedAttempt, flight: Flight) -> tuple[str, bytes]:
    """A deadline cut the stream: how it ended, and its error event. A stall (the idle
    timeout) is the worker's failure; the total timeout is the request's."""
    metrics = attempt.proxy.metrics
    if flight.expired == "total":
        return "total_timeout", stream_failed(metrics, "the request exceeded its total timeout", ex.kind)
    attempt.interrupted("stream stalled")
    return "stalled", stream_failed(metrics, "the worker stopped sending (timeout)", ex.kind)


async def _close_stream(
    ex: Exchange, attempt: RelayedAttempt, flight: Flight, learner: AnswerLearner | None, how: str, tail: bytes,
    usage: bytes, streamed: int,
) -> None:  # fmt: skip
    """What the stream taught (generated tokens, the response's owner, the cost model) is
    recorded before its last byte, `tail` (an error event, or nothing), is sent: the
    client's next request may follow at once, on another replica."""
    proxy = attempt.proxy
    metrics = proxy.metrics
    proxy.deadlines.done(flight)  # the last send below must not be cancelled by a deadline
    if metrics.tenants is not None and not tail:
        ex.generated = metrics.tenants.generated_in(ex.tenant, usage, streamed)
    if learner is not None:
        await learner.settle()
    if ex.recorded:  # this turn's prefix, before the client can send the next
        await proxy.index.written()
    if not tail and attempt.first_byte_s is not None:
        # The usage (cached tokens) is what this answer teaches the cost model.
        proxy.learn_cost(ex, attempt.worker.name, attempt.sent_at, attempt.first_byte_s, usage)
    ex.finished = True
    if attempt.trace is not None:
        attempt.trace.relayed(how, attempt.first_byte_s, usage, streamed)
    await ex.send({"type": "http.response.body", "body": tail, "more_body": False})


def stream_failed(metrics: RouterMetrics, why: str, kind: str | None = None) -> bytes:
    """The tail of a stream that broke after its first byte: an error event in the
    endpoint's own stream format (router/errors.py `stream_error_tail`)."""
    metrics.stream_errors.inc()
    log.warning("stream broken after its first byte: %s", why)
    return stream_error_tail(kind, f"The stream was interrupted: {why}.", "stream_interrupted")
