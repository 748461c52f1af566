"""The hot path: the proxied OpenAI endpoints as a raw ASGI handler.

Per request: read the body (bounded), parse it once (orjson), canonicalize it, hash its
prefix chain once, look the chain up in the index (at most one round trip), ask the policy,
forward the canonical bytes, and relay the answer. Streams are relayed chunk by chunk as
the worker sends them, never parsed or re-serialised.

Failures before the first byte (connect errors, 5xx answers, first-byte timeouts) are
retried on the next worker of the policy's ranking; after the first byte a stream ends with
an OpenAI-style error event and `[DONE]`. A client that disconnects cancels the handler,
which closes the upstream request so the engine aborts it and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from cache_client.base import EMPTY_VIEW, POOL, PrefixIndex, key_tokens_of
from normalizer.canonical import NormalizeOptions, canonicalize_body
from normalizer.prefix import PrefixChain
from router.breaker import CLOSED
from router.chain import ChainBuilder, RequestKind
from router.cost import CostModel
from router.deadlines import Deadlines, Flight
from router.errors import RouterError, sse_error_event
from router.load import LoadBoard, Ticket
from router.metrics import RouterMetrics
from router.overload import Admission
from router.policies.base import Policy
from router.policies.least_loaded import LeastLoadedPolicy
from router.redact import exc_summary
from router.requests import parse_body, validate
from router.routing import Routed, RouteRequest
from router.upstream import UpstreamClient, UpstreamConnectError, UpstreamError, UpstreamResponse
from router.workers import Fleet, Worker

log = logging.getLogger("kvroute.proxy")

PROXIED_PATHS: dict[str, RequestKind | None] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": None,
}

# Never forwarded upstream: hop-by-hop headers (RFC 9110 §7.6.1), what the client sets itself,
# and the client's credentials (workers get their own, see WorkerSpec.api_key).
_DROP_REQUEST_HEADERS = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
        b"accept-encoding", b"authorization", b"cookie", b"x-api-key",
    }
)
_DROP_RESPONSE_HEADERS = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"content-length", b"server", b"date",
        b"location", b"x-kvroute-worker", b"x-kvroute-route-reason",
    }
)
_RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
_EMBEDDINGS_POLICY = LeastLoadedPolicy()
_EMPTY_CHAIN = PrefixChain((), (), 0)


@dataclass(frozen=True)
class ProxySettings:
    max_body_bytes: int = 32 * 1024 * 1024
    max_attempts: int = 3
    """Distinct workers tried for one request before it fails."""
    first_byte_timeout_s: float = 300.0
    """Until the worker's first body byte (queueing + prefill), per attempt."""
    idle_timeout_s: float = 120.0
    """Longest silence between two chunks of a stream."""
    total_timeout_s: float | None = None
    forward_client_auth: bool = False
    normalize: NormalizeOptions = field(default_factory=NormalizeOptions)
    pool_enabled: bool = False
    """Workers share an LMCache pool: every routed prefix is also recorded on the pool."""


class _UpstreamFailed(Exception):
    def __init__(self, why: str, passive_down: bool) -> None:
        super().__init__(why)
        self.why = why
        self.passive_down = passive_down
        """A connection-level failure: take the worker out until a health check passes."""


class _Disconnected(Exception):
    pass


class Proxy:
    def __init__(
        self,
        settings: ProxySettings,
        fleet: Fleet,
        index: PrefixIndex,
        loads: LoadBoard,
        policy: Policy,
        cost: CostModel,
        chains: ChainBuilder,
        metrics: RouterMetrics,
        client: UpstreamClient,
        admission: Admission | None = None,
    ) -> None:
        self.settings = settings
        self.admission = admission
        """Per-worker in-flight limits and the wait queue; None: no limits."""
        self.fleet = fleet
        self.index = index
        self.loads = loads
        self.policy = policy
        self.cost = cost
        self.chains = chains
        self.metrics = metrics
        self.client = client
        self.deadlines = Deadlines()

    # -- ASGI entry ---------------------------------------------------------------------
    async def __call__(self, scope: dict, receive, send) -> None:
        started = time.perf_counter()
        task = asyncio.current_task()
        watcher: asyncio.Task | None = None
        state = {"finished": False, "disconnected": False, "started": False}
        try:
            raw = await self._read_body(scope, receive)

            async def watch() -> None:
                # Loops because a server may hand over an empty body message first; only a
                # disconnect ends the watch.
                while (await receive())["type"] != "http.disconnect":
                    pass
                if not state["finished"]:
                    state["disconnected"] = True
                    task.cancel()  # type: ignore[union-attr]

            watcher = asyncio.create_task(watch())
            await self._handle(scope, raw, send, started, state)
        except _Disconnected:
            self.metrics.client_disconnects.inc()
        except RouterError as exc:
            self.metrics.rejected.inc(exc.code)
            if not state.get("started"):
                await _send_whole(send, exc.status, exc.headers(), exc.body())
        except asyncio.CancelledError:
            if state["disconnected"]:
                self.metrics.client_disconnects.inc()
            else:
                # Cancelled by the server itself: the graceful-shutdown grace period ran out.
                # Answer what can still be answered instead of letting the server log a
                # traceback for every request still in flight.
                log.warning("request on %s cancelled: the router is shutting down", scope["path"])
                if not state["started"]:
                    error = RouterError(503, "The router is shutting down; retry.", "shutting_down", retry_after=1)
                    with contextlib.suppress(Exception):
                        await _send_whole(send, 503, error.headers(), error.body())
            task.uncancel()  # type: ignore[union-attr]
        except Exception as exc:
            # A bug, not bad input: the client gets an OpenAI-style 500 (never a traceback),
            # the log gets the exception type and where it was raised (never its message,
            # which may carry a worker URL).
            log.error("internal error on %s: %s", scope["path"], exc_summary(exc))
            self.metrics.rejected.inc("internal_error")
            if not state.get("started"):
                error = RouterError(500, "Internal router error.", "internal_error")
                await _send_whole(send, 500, error.headers(), error.body())
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _read_body(self, scope: dict, receive) -> bytes:
        limit = self.settings.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise RouterError(413, f"Request body exceeds the limit of {limit} bytes.", "request_too_large")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise RouterError(413, f"Request body exceeds the limit of {limit} bytes.", "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    # -- routing ------------------------------------------------------------------------
    def _candidates(self, model: str) -> list[Worker]:
        candidates = self.fleet.candidates(model)
        if candidates:
            return candidates
        known = any(model in w.models for w in self.fleet)
        if known or not any(w.models for w in self.fleet):
            raise RouterError(503, "No healthy worker is available for this model.", "no_healthy_worker", retry_after=1)
        raise RouterError(404, f"The model '{model}' does not exist.", "model_not_found")

    def canonical(self, body: dict[str, Any], kind: RequestKind | None) -> dict[str, Any]:
        """The body as it is routed and forwarded: generation requests canonicalized (so that
        equal prompts hash and cache alike), embeddings as sent."""
        return body if kind is None else canonicalize_body(body, self.settings.normalize)

    async def decide(
        self, body: dict[str, Any], kind: RequestKind | None, model: str, session_key: str | None
    ) -> Routed:
        """Everything between a canonical body and a worker: the part `/debug/route` explains."""
        candidates = self._candidates(model)
        if kind is None:
            chain, view = _EMPTY_CHAIN, EMPTY_VIEW
        else:
            chain = self.chains.build(body, kind)
            view = EMPTY_VIEW
            if self.policy.uses_index:
                t0 = time.perf_counter()
                view = await self.index.lookup(chain.keys)
                self.metrics.index_lookup_seconds.observe(time.perf_counter() - t0)
        # Loads are read after the lookup: requests arriving while it awaits (a Redis round
        # trip) must see each other's tickets, or a burst all lands on one worker.
        loads = self.loads.snapshot([w.name for w in candidates])
        if self.fleet.scrape_metrics:
            # The engines' own queues also count requests of other routers sharing them.
            loads = [
                replace(load, engine_waiting=int(w.metrics.get("vllm:num_requests_waiting", 0)))
                for load, w in zip(loads, candidates, strict=True)
            ]
        if kind is None:
            return Routed(_EMBEDDINGS_POLICY.choose(RouteRequest(chain), view, loads, self.cost), chain, view, loads)
        request = RouteRequest(chain, session_key)
        return Routed(self.policy.choose(request, view, loads, self.cost), chain, view, loads)

    async def _handle(self, scope: dict, raw: bytes, send, started: float, state: dict) -> None:
        kind = PROXIED_PATHS[scope["path"]]
        body = parse_body(raw)
        model = validate(body, kind)
        try:
            body = self.canonical(body, kind)
            payload = orjson.dumps(body)
        except (orjson.JSONEncodeError, RecursionError):
            # orjson parses 1024 levels of nesting but serialises 254: deeper is bad input.
            raise RouterError(400, "The request body is nested too deeply.", "invalid_body") from None
        session_key = _header(scope, b"x-session-id") or body.get("user")
        headers = self._upstream_headers(scope)
        stream = body.get("stream") is True
        admission = self.admission
        max_attempts = self.settings.max_attempts
        loop = asyncio.get_running_loop()
        deadline = 0.0
        turn = False
        """Holds a slot handed over by the admission queue, until it takes a ticket."""
        attempts = 0
        tried: set[str] = set()
        last_error = "no worker tried"
        observed = False
        try:
            if admission is not None and admission.busy():
                deadline = loop.time() + admission.queue_timeout_s
                await admission.wait(deadline)
                turn = True
            while True:
                routed = await self.decide(body, kind, model, session_key)
                decision, chain = routed.decision, routed.chain
                if not observed:
                    observed = True
                    self.metrics.route_seconds.observe(time.perf_counter() - started)
                    if kind is not None:
                        self.metrics.prompt_tokens.inc(amount=chain.total_tokens)
                        self.metrics.predicted_cached.inc(amount=decision.cached_tokens)
                full = False
                for name in (decision.worker, *decision.ranking):
                    if attempts >= max_attempts:
                        break
                    if state["disconnected"]:
                        # The client left while a timeout was being handled (both cancelled
                        # this task, one cancellation was consumed): no retry for nobody.
                        raise _Disconnected()
                    worker = self.fleet.get(name)
                    if worker is None or name in tried or not worker.serving:
                        continue
                    if admission is not None and not admission.has_room(self.loads.inflight(name)):
                        full = True
                        continue
                    if not worker.breaker.begin():
                        continue
                    probing = worker.breaker.state is not CLOSED
                    if name == decision.worker:
                        reason, prefill_s = decision.reason, decision.prefill_s
                    else:
                        reason = "retry" if attempts else "overload"
                        prefill_s = self.cost.prefill_s(0, chain.total_tokens)
                    ticket = self.loads.acquire(name, prefill_s)
                    if turn:
                        admission.end_turn()  # type: ignore[union-attr]
                        turn = False
                    attempts += 1
                    tried.add(name)
                    try:
                        if self.chains.records_on_route and chain.keys:
                            await self._record(name, chain)
                        await self._forward(
                            scope, worker, reason, payload, headers, stream, ticket, started, send, state
                        )
                        return
                    except _UpstreamFailed as exc:
                        last_error = exc.why
                        worker.breaker.failure(exc.why)
                        self.metrics.requests.inc(name, reason, "error")
                        if exc.passive_down:
                            await self.fleet.mark_failed(name)
                        if attempts < max_attempts:
                            self.metrics.retries.inc()
                        log.warning("worker %s failed before the first byte (%s); %s", name, exc.why,
                                    "retrying" if attempts < max_attempts else "giving up")
                    except BaseException:
                        if probing:
                            worker.breaker.abandon()
                        raise
                    finally:
                        self.loads.release(ticket)
                        if admission is not None:
                            admission.released()
                if not full or admission is None or attempts >= max_attempts:
                    break
                # Every worker we could still try is at its in-flight limit: wait for a slot.
                if not deadline:
                    deadline = loop.time() + admission.queue_timeout_s
                requeue, turn = turn, False
                await admission.wait(deadline, requeue=requeue, pass_on=requeue and self._room_anywhere())
                turn = True
        finally:
            if turn:
                admission.end_turn()  # type: ignore[union-attr]
        raise RouterError(502, f"The request failed on every worker tried ({last_error}).", "upstream_unavailable")

    def _room_anywhere(self) -> bool:
        """Some serving worker has a free slot (that this request could not use)."""
        admission = self.admission
        return admission is not None and any(
            w.serving and admission.has_room(self.loads.inflight(w.name)) for w in self.fleet
        )

    async def _record(self, worker: str, chain: PrefixChain) -> None:
        key_tokens = key_tokens_of(chain.cum_tokens)
        await self.index.record(worker, chain.keys, key_tokens)
        if self.settings.pool_enabled:
            await self.index.record(POOL, chain.keys, key_tokens)

    def _upstream_headers(self, scope: dict) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in scope["headers"] if k not in _DROP_REQUEST_HEADERS]
        if self.settings.forward_client_auth:
            headers += [(k, v) for k, v in scope["headers"] if k == b"authorization"]
        headers.append((b"accept-encoding", b"identity"))
        return headers

    # -- forwarding ---------------------------------------------------------------------
    async def _forward(
        self,
        scope: dict,
        worker: Worker,
        reason: str,
        payload: bytes,
        headers: list[tuple[bytes, bytes]],
        stream: bool,
        ticket: Ticket,
        started: float,
        send,
        state: dict,
    ) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        attempt_started = loop.time()
        flight = self.deadlines.track(s.first_byte_timeout_s if stream else (s.total_timeout_s or s.first_byte_timeout_s), s.total_timeout_s)
        upstream: UpstreamResponse | None = None
        try:
            request_headers = list(headers)
            if worker.api_key and not s.forward_client_auth:
                request_headers.append((b"authorization", b"Bearer " + worker.api_key.encode()))
            try:
                upstream = await self.client.post(worker.url, scope["path"], request_headers, payload)
                if upstream.status in _RETRYABLE_STATUS:
                    await upstream.read()
                    raise _UpstreamFailed(f"worker answered {upstream.status}", passive_down=False)
                chunks = upstream.chunks()
                if stream and upstream.status == 200:
                    first = await anext(chunks, b"")
                else:
                    first = await upstream.read()
            except asyncio.CancelledError:
                if flight.expired is None:
                    raise
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                raise _UpstreamFailed("no first byte before the timeout", passive_down=False) from None
            except UpstreamConnectError as exc:
                raise _UpstreamFailed(str(exc), passive_down=True) from None
            except UpstreamError as exc:
                raise _UpstreamFailed(str(exc), passive_down=False) from None

            status = upstream.status
            relay = stream and status == 200
            # No await since the first byte arrived, so the deadline sweeper cannot have fired
            # in between: move the deadline on (stream) or drop it (whole answer in hand) now,
            # before the sends below can be cancelled by a first-byte deadline that passed.
            if relay:
                flight.extend(loop.time() + s.idle_timeout_s)
            else:
                self.deadlines.done(flight)
            self.loads.first_byte(ticket)
            worker.breaker.success(loop.time() - attempt_started if relay else None)
            self.fleet.mark_ok(worker.name)
            if relay:
                self.metrics.ttft.observe(time.perf_counter() - started)
            response_headers = [(k, v) for k, v in upstream.headers if k not in _DROP_RESPONSE_HEADERS]
            response_headers += [
                (b"x-kvroute-worker", worker.name.encode()),
                (b"x-kvroute-route-reason", reason.encode()),
            ]
            self.metrics.requests.inc(worker.name, reason, str(status))
            state["started"] = True
            if not relay:
                state["finished"] = True
                await _send_whole(send, status, response_headers, first)
                return
            await self._relay(response_headers, first, chunks, flight, send, state, worker)
        finally:
            self.deadlines.done(flight)
            if upstream is not None:
                await upstream.aclose()

    async def _relay(
        self, response_headers: list[tuple[bytes, bytes]], first: bytes, chunks, flight: Flight, send, state: dict,
        worker: Worker,
    ) -> None:
        loop = asyncio.get_running_loop()
        idle = self.settings.idle_timeout_s
        tail = b""
        try:
            await send({"type": "http.response.start", "status": 200, "headers": response_headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async for chunk in chunks:
                flight.extend(loop.time() + idle)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except asyncio.CancelledError:
            if flight.expired is None:
                if state["disconnected"]:
                    raise
                # Cancelled by the server: the graceful-shutdown grace period ran out. End
                # the stream the way the client can parse rather than cutting it.
                tail = self._stream_failed("the router is shutting down")
                state["finished"] = True
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": tail, "more_body": False})
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            if flight.expired == "total":
                tail = self._stream_failed("the request exceeded its total timeout")
            else:
                worker.breaker.failure("stream stalled")
                tail = self._stream_failed("the worker stopped sending (timeout)")
        except UpstreamError as exc:
            worker.breaker.failure("stream broken")
            tail = self._stream_failed(f"the worker connection failed ({exc})")
        self.deadlines.done(flight)  # the last send below must not be cancelled by a deadline
        state["finished"] = True
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def _stream_failed(self, why: str) -> bytes:
        self.metrics.stream_errors.inc()
        log.warning("stream broken after its first byte: %s", why)
        return sse_error_event(f"The stream was interrupted: {why}.", "stream_interrupted")

    async def close(self) -> None:
        await self.deadlines.close()


def _header(scope: dict, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


async def _send_whole(send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
