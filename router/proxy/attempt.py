"""One try of one request on one worker: `Attempt`.

Everything a try claims or reports is taken and given back here, in one object: the load
ticket (`LoadBoard.acquire` when the attempt is made, `first_byte`, `release`), the circuit
breaker's verdict (the handler asks `begin()` before making the attempt; then `success` at
the first byte, `failure` before it or when the stream breaks after it, or `abandon` when
neither comes), the fleet's passive health (`mark_ok` / `mark_failed`) and the admission
slot handed on at release.

`run()` sends the request and waits for the worker's first body byte. A failure before it
(connect error, a 5xx answer, the first-byte deadline) raises `AttemptFailed`, and the
handler tries the next worker; from the first byte on the answer is the client's (relay.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from router.breaker import CLOSED
from router.proxy.exchange import Exchange, with_credential
from router.proxy.fair import Flow
from router.proxy.relay import relay_stream, response_headers, send_whole
from router.proxy.upstream import Headers, UpstreamConnectError, UpstreamError, UpstreamResponse
from router.workers import Worker

if TYPE_CHECKING:
    from router.proxy.context import AnswerLearner, ProxyContext
    from router.tracing import AttemptTrace

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})


class AttemptFailed(Exception):
    """The worker failed before its first byte: the request may go to the next worker."""

    def __init__(self, why: str, passive_down: bool) -> None:
        super().__init__(why)
        self.why = why
        self.passive_down = passive_down
        """A connection-level failure: take the worker out until a health check passes."""


class Attempt:
    __slots__ = (
        "chunks", "expected_s", "first_byte_s", "marked", "prefill_over", "probing", "proxy", "reason", "sent_at", "ticket",
        "trace", "upstream", "worker",
    )  # fmt: skip

    def __init__(
        self, proxy: ProxyContext, worker: Worker, reason: str, prefill_s: float,
        expected_s: float | None = None, modelled_s: float | None = None,
    ) -> None:  # fmt: skip
        """Claim `worker` for one try; its breaker has admitted the try (`begin()`).
        `expected_s`: what the breaker judges the time to first byte against (the policy's
        prediction; 0.0: none made; None: the worker was queued, the time is not judged).
        `modelled_s`: the cost model's time to first token, which the load board's lag is
        measured from (None: not tracked)."""
        self.proxy = proxy
        self.worker = worker
        self.reason = reason
        self.expected_s = expected_s
        self.probing = worker.breaker.state is not CLOSED
        """Holds a half-open breaker's probe slot: given back if no verdict comes."""
        self.ticket = proxy.loads.acquire(worker.name, prefill_s, modelled_s)
        self.upstream: UpstreamResponse | None = None
        self.chunks: AsyncIterator[bytes] | None = None
        self.first_byte_s: float | None = None
        """Dispatch to the stream's first token (its first byte; a Responses stream's first
        output item, `relay_stream`): what cost learning fits."""
        self.sent_at = 0.0
        """When the request went to the worker (the event loop's clock)."""
        self.marked: tuple[Flow, bool] | None = None
        """A tenant's request (its flow, and whether it was light): its prefill is in flight
        for the admission's fair share until its first token (`Admission.mark`)."""
        self.prefill_over: asyncio.TimerHandle | None = None
        """A whole answer's mark ends when its prefill is expected to (`mark`)."""
        self.trace: AttemptTrace | None = None
        """Its spans, when the request is traced (router/tracing.py)."""

    def mark(self, flow: Flow, *, light: bool, stream: bool) -> None:
        """The request's prefill is in flight for the admission until its first token. A
        whole answer's first byte comes after its decode: its prefill is taken to end when
        the cost model expected it to (its predicted prefill), or with the answer if the
        policy predicted none."""
        self.marked = (flow, light)
        self.proxy.admission.mark(self.worker.name, flow, light=light)
        expected_s = self.ticket.prefill_s
        if not stream and expected_s > 0:
            self.prefill_over = asyncio.get_running_loop().call_later(expected_s, self._unmark)

    def _unmark(self) -> None:
        if self.prefill_over is not None:
            self.prefill_over.cancel()
            self.prefill_over = None
        if self.marked is not None:
            (flow, light), self.marked = self.marked, None
            self.proxy.admission.unmark(self.worker.name, flow, light=light)

    # -- outcomes -----------------------------------------------------------------------
    def first_byte(self, latency_s: float | None) -> None:
        """The worker answered: its prefill leaves the queue; breaker and health see a success."""
        proxy = self.proxy
        proxy.loads.first_byte(self.ticket)
        proxy.prefill_queue.kick()
        self._unmark()
        self.worker.breaker.success()
        if latency_s is not None:
            self._timed(latency_s)
        proxy.fleet.mark_ok(self.worker.name)

    def _timed(self, latency_s: float) -> None:
        """The first token's time, for outlier detection: judged only if the worker had no
        queue when the request was sent (`expected_s` None: it had one)."""
        if self.expected_s is not None:
            self.worker.breaker.timed(latency_s, self.expected_s or None)

    def prefilled(self, now: float) -> None:
        """A Responses stream's first output item (its first token): its prefill leaves the
        queue, and its time is what cost learning fits (its first byte came before prefill)."""
        self.first_byte_s = now - self.sent_at
        self.proxy.loads.first_byte(self.ticket)
        self.proxy.prefill_queue.kick()
        self._unmark()
        self._timed(self.first_byte_s)

    async def failed(self, why: str, passive_down: bool) -> None:
        """No first byte: the breaker and the metrics count a failure; a connection-level
        failure (`passive_down`) takes the worker out until a health check passes."""
        proxy = self.proxy
        self.worker.breaker.failure(why)
        proxy.metrics.requests.inc(self.worker.name, self.reason, "error")
        if self.trace is not None:
            self.trace.failed(why)
        if passive_down:
            await proxy.fleet.mark_failed(self.worker.name)

    def interrupted(self, why: str) -> None:
        """The stream broke after its first byte: a failure for the breaker."""
        self.worker.breaker.failure(why)

    def abandon(self) -> None:
        """The try ended without a verdict (the client left, a bug): free its probe slot."""
        if self.probing:
            self.worker.breaker.abandon()

    def release(self) -> None:
        """The try is over, whatever its outcome: its ticket and its slot go back."""
        proxy = self.proxy
        prefilling = not self.ticket.first_byte
        proxy.loads.release(self.ticket)
        if prefilling:  # its prefill leaves the queue only now (no first byte: it failed or was cut)
            proxy.prefill_queue.kick()
        self._unmark()
        if proxy.admission.limits_inflight:
            proxy.admission.released()

    # -- forwarding ---------------------------------------------------------------------
    async def run(self, ex: Exchange) -> None:
        """Forward `ex` and answer the client from the worker's answer, whole or streamed."""
        proxy = self.proxy
        s = proxy.settings
        deadlines = proxy.deadlines
        loop = asyncio.get_running_loop()
        self.sent_at = loop.time()
        flight = deadlines.track(s.first_byte_timeout_s if ex.stream else (s.total_timeout_s or s.first_byte_timeout_s), s.total_timeout_s)
        try:
            # POST the payload and wait for the first body chunk of a stream, else the whole
            # body: here, not in a coroutine of its own, because every frame between the task
            # and the upstream read is re-entered at each wake-up.
            try:
                upstream = self.upstream = await proxy.client.post(self.worker.url, ex.scope["path"], self._headers(ex), ex.payload)
                status = upstream.status
                if status in RETRYABLE_STATUS:
                    await upstream.read()
                    raise AttemptFailed(f"worker answered {status}", passive_down=False)
                chunks = self.chunks = upstream.chunks()
                relay = ex.stream and status == 200
                first = await anext(chunks, b"") if relay else await upstream.read()
            except asyncio.CancelledError:
                if flight.expired is None:
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                raise AttemptFailed("no first byte before the timeout", passive_down=False) from None
            except UpstreamConnectError as exc:
                raise AttemptFailed(str(exc), passive_down=True) from None
            except UpstreamError as exc:
                raise AttemptFailed(str(exc), passive_down=False) from None
            # No await since the first byte arrived, so the deadline sweeper cannot have fired
            # in between: move the deadline on (stream) or drop it (whole answer in hand) now,
            # before the sends below can be cancelled by a first-byte deadline that passed.
            if relay:
                flight.extend(loop.time() + s.idle_timeout_s)
            else:
                deadlines.done(flight)
            self._answered(ex, status, relay)
            self._count_answer(ex, status, relay, first)
            headers = response_headers(upstream.headers, self.worker.name, self.reason)
            learner = proxy.learner(ex, self.worker.name) if ex.kind == "responses" and status == 200 else None
            if relay:
                await relay_stream(ex, self, headers, first, chunks, flight, learner)
            else:
                await self._send_whole(ex, status, headers, first, learner)
        finally:
            deadlines.done(flight)
            if self.upstream is not None:
                await self.upstream.aclose()

    def _answered(self, ex: Exchange, status: int, relay: bool) -> None:
        """The worker's first byte: the worker is healthy; a stream's time to it is measured."""
        proxy = self.proxy
        if relay and ex.kind == "responses":
            # A Responses stream opens with response.created before any prefill: the
            # worker is healthy, but its prefill leaves the queue at the first output
            # item (relay_stream), or busy workers would look idle.
            self.worker.breaker.success()  # timed at the first output item (prefilled)
            proxy.fleet.mark_ok(self.worker.name)
        else:
            self.first_byte_s = asyncio.get_running_loop().time() - self.sent_at if relay else None
            self.first_byte(self.first_byte_s)
        if relay:
            proxy.metrics.ttft.observe(time.perf_counter() - ex.arrived)
            if proxy.metrics.tenants is not None:
                proxy.metrics.tenants.first_byte(ex.tenant, time.perf_counter() - ex.arrived)
        if self.trace is not None:
            self.trace.first_byte(ex, status, self.first_byte_s, relay)

    def _count_answer(self, ex: Exchange, status: int, relay: bool, first: bytes) -> None:
        """The answer's status in the metrics (a whole answer's generated tokens too): from
        here on the answer is the client's (`ex.started`)."""
        metrics = self.proxy.metrics
        metrics.requests.inc(self.worker.name, self.reason, str(status))
        tenants = metrics.tenants
        if tenants is not None:
            tenants.request(ex.tenant, status)
            if not relay and status == 200:
                ex.generated = tenants.generated_in(ex.tenant, first)
        ex.started = True

    async def _send_whole(
        self, ex: Exchange, status: int, headers: Headers, body: bytes, learner: AnswerLearner | None
    ) -> None:
        """A whole answer, sent once what it teaches is recorded: the client's next turn may
        come at once, through another replica."""
        if learner is not None:
            await learner.from_body(body)
        if ex.recorded:
            await self.proxy.index.written()
        ex.finished = True
        if self.trace is not None:
            self.trace.relayed("complete", None, body)
        await send_whole(ex.send, status, headers, body)

    def _headers(self, ex: Exchange) -> Headers:
        """The request's headers for this worker: its trace context, its own credential."""
        headers = ex.headers if self.trace is None else self.trace.headers(ex.headers)
        return with_credential(headers, self.worker.api_key, self.proxy.settings.forward_client_auth)
