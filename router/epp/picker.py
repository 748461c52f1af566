"""The endpoint picker: one gateway request (one ext_proc stream) on the proxy's decision path.

Per request, as Envoy sends it in `FULL_DUPLEX_STREAMED` mode:

1. request headers: the path, the client key (tenants, `--api-keys`), the session hint and
   the gateway's subset hint (`envoy.lb.subset_hint`: the endpoints the picker may choose);
2. the body, buffered to its end, then the proxy's own steps (`Proxy.prepare`,
   `Proxy.handle`): parse once, validate, canonicalize with the tenant's cache salt, build
   the prefix chain once, one index lookup, the tenant's limits and the admission queue
   (429 in the API's error shape), the policy;
3. the answer to Envoy, from `GatewayAttempt.run` (the proxy's try on a worker, which
   forwards, is replaced by one that answers the gateway): the request headers' response
   sets `x-gateway-destination-endpoint` to the chosen endpoint then its fallbacks (the
   ranking, `--max-attempts` endpoints in all) and the same list in the `envoy.lb`
   dynamic metadata; the body is replaced by the canonical bytes (so the engine's prefix
   cache hits too), with their `content-length`;
4. the response: its headers name the endpoint that served it (`envoy.lb`
   `x-gateway-destination-endpoint-served`): a fallback that served it counts as a failure
   of the endpoint before it, and the chain is recorded on it too. The picker adds
   `x-kvroute-worker` and `x-kvroute-route-reason`; the body passes through unchanged
   (echoed chunk by chunk in FULL_DUPLEX_STREAMED mode) while the picker reads what the
   proxy reads from it: the first token's time (cost learning, the load board), usage
   (tenants), a Responses answer's id (`previous_response_id` affinity).

Refusals are immediate responses with the proxy's statuses and bodies: tenant limits and a
full admission queue 429, no endpoint 503 (also an empty subset), a bad body 400, too large
413, an unknown stored response 404. Requests the proxy does not route by their body (GET
/v1/models, /health, ...) go to the least-loaded endpoint; a stored response's by-id
requests (`GET /v1/responses/{id}`, ...) to its owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from cache_client.redact import exc_summary
from router.auth import KeyCheck, presented_key, unauthorized
from router.epp import messages as m
from router.errors import RouterError
from router.proxy.attempt import RETRYABLE_STATUS, Attempt
from router.proxy.exchange import Disconnected, Exchange
from router.proxy.relay import COUNTED_KINDS, FIRST_OUTPUT, token_events
from router.proxy.settings import PROXIED_PATHS, api_of
from router.proxy.stateful import BY_ID_PATH

if TYPE_CHECKING:
    from router.proxy.handler import Proxy
    from router.tenants.loader import TenantRegistry
    from router.workers import Worker

log = logging.getLogger("kvroute.epp")

_CREDENTIALS = (b"authorization", b"x-api-key", b"cookie")
"""Client credentials a worker never sees (as `kvroute serve` forwards): workers get their
own (`WorkerSpec.api_key`), unless `--forward-client-auth` passes `authorization` on."""
_OWN_REPLY = "response.code_details"
"""The attribute that tells a gateway's own reply (anything but `via_upstream`)."""


class Stream(Protocol):
    """One ext_proc stream as the picker uses it: the gateway's messages in order (`read`:
    None at the end) and the picker's answers (`send`: messages, or already serialized)."""

    async def read(self) -> m.ProcessingRequest | None: ...
    async def send(self, *responses: m.ProcessingResponse | bytes) -> None: ...


class CallStream:
    """A gRPC call of the picker's server (router/epp/h2grpc.py) as a `Stream`."""

    __slots__ = ("call",)

    def __init__(self, call: Any) -> None:
        self.call = call

    async def read(self) -> m.ProcessingRequest | None:
        raw = await self.call.read()
        return None if raw is None else m.ProcessingRequest.FromString(raw)

    async def send(self, *responses: m.ProcessingResponse | bytes) -> None:
        send = self.call.send
        for response in responses:
            send(response if isinstance(response, bytes) else response.SerializeToString())


class GatewayExchange(Exchange):
    """A proxied request that came through a gateway: the `Exchange` the proxy's steps fill
    in, plus the stream it came on and how the gateway sends the bodies."""

    __slots__ = ("gateway", "picker", "request_mode", "request_trailers", "response_mode")

    def __init__(
        self, scope: dict, arrived: float, gateway: Stream, picker: Picker, request_mode: int, response_mode: int,
    ) -> None:  # fmt: skip
        super().__init__(scope, None, arrived)
        self.gateway = gateway
        self.picker = picker
        self.request_mode = request_mode
        self.response_mode = response_mode
        self.request_trailers = False
        """The request ended with trailers, to be answered after its body."""

    async def read_body(self, limit: int, ended: bool) -> bytes:
        """The request body to its end (its last chunk, or its trailers); 413 as soon as it
        is known to exceed `limit`."""
        if ended:
            return b""
        for name, value in self.scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.gateway.read()
            if message is None:
                raise Disconnected()
            kind = m.request_kind(message)
            if kind == "request_trailers":
                self.request_trailers = True
                return b"".join(chunks)
            if kind != "request_body":
                raise Disconnected()  # out of order: the gateway gave up on this request
            chunk = message.request_body.body
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if message.request_body.end_of_stream:
                return b"".join(chunks)

    async def route(self, endpoints: list[str], worker: Worker, trace: m.Headers = ()) -> None:
        """Answer the request's headers and body: to `endpoints` (in order), the canonical
        body in place of the client's, the client's credentials swapped for the worker's
        (`trace`: the attempt span's `traceparent`, for the worker's own spans)."""
        payload = self.payload
        set_headers, remove = self.picker.forward_edits(self.scope["headers"], worker)
        mutation = m.route_headers(endpoints, len(payload), [*set_headers, *trace], remove)
        metadata = m.destination_metadata(endpoints)
        gateway = self.gateway
        if self.request_mode == m.BODY_BUFFERED:
            await gateway.send(m.buffered_request_body(payload, mutation, metadata))
        else:
            await gateway.send(m.request_headers_response(mutation, metadata), *m.streamed_bodies(payload, request=True))
        if self.request_trailers:
            await gateway.send(m.trailers_response(request=True))

    async def response_message(self) -> m.ProcessingRequest | None:
        """The gateway's next message about the response (None: the stream ended)."""
        while True:
            message = await self.gateway.read()
            if message is None or m.request_kind(message) != "request_trailers":
                return message
            await self.gateway.send(m.trailers_response(request=True))

    async def pass_chunk(self, chunk: bytes, end: bool) -> None:
        """A response body chunk, let through unchanged."""
        mode = self.response_mode
        if mode == m.BODY_FULL_DUPLEX:
            await self.gateway.send(*m.streamed_bodies(chunk, request=False, end=end))
        elif mode != m.BODY_NONE:
            await self.gateway.send(m.unchanged_body(request=False))


def _too_large(limit: int) -> RouterError:
    return RouterError(413, f"Request body exceeds the limit of {limit} bytes.", "request_too_large")


def _status(message: m.ProcessingRequest) -> int:
    """The response's status (0 if Envoy sent none)."""
    for header in message.response_headers.headers.headers:
        if header.key == ":status":
            with contextlib.suppress(ValueError):
                return int(header.raw_value or header.value)
    return 0


def _own_reply(message: m.ProcessingRequest) -> bool:
    """The gateway answered itself (no endpoint reached, a timeout), when it says so."""
    attributes = message.attributes.get("envoy.filters.http.ext_proc")
    if attributes is None or _OWN_REPLY not in attributes.fields:
        return False
    return attributes.fields[_OWN_REPLY].string_value not in ("", "via_upstream")


def _annotations(worker: str, reason: str) -> m.Headers:
    return [(b"x-kvroute-worker", worker.encode()), (b"x-kvroute-route-reason", reason.encode())]


class GatewayAttempt(Attempt):
    """The proxy's try of a request on one worker, when a gateway forwards it: the worker and
    its fallbacks go to the gateway, which sends the request; the attempt then follows the
    gateway's answer (which endpoint served it, its first token, its end) as `Attempt.run`
    follows a worker's, and never fails over itself (the gateway's retries walk the list)."""

    __slots__ = ("endpoints",)

    async def run(self, ex: Exchange) -> None:
        assert isinstance(ex, GatewayExchange)
        picker = ex.picker
        self.sent_at = asyncio.get_running_loop().time()
        self.endpoints = picker.endpoint_list(self.worker, ex)
        await ex.route(self.endpoints, self.worker, self.trace.propagation() if self.trace is not None else ())
        ex.started = True  # the gateway has the request: it answers the client from here
        message = await ex.response_message()
        if message is None or m.request_kind(message) != "response_headers":
            raise Disconnected()
        status = _status(message)
        served_at = None if _own_reply(message) else m.served_endpoint(message)
        if served_at is None and status >= 500:
            # The gateway's own reply: no endpoint answered (every try failed, or timed out).
            await ex.gateway.send(m.response_headers_response([]))
            await self.failed(f"the gateway answered {status}", passive_down=False)
            await self._relay_rest(ex, message.response_headers.end_of_stream)
            return
        await self._answer_headers(ex, status, picker.worker_at(served_at) if served_at is not None else None)
        ended = message.response_headers.end_of_stream or ex.response_mode == m.BODY_NONE
        if status in RETRYABLE_STATUS:
            await self._relay_rest(ex, ended)
            return
        relay = ex.stream and status == 200
        learner = self.proxy.learner(ex, self.worker.name) if ex.kind == "responses" and status == 200 else None
        if ended:
            # No body comes to the picker (none, or the gateway does not send it): the
            # answer's first byte is as far as it can follow it.
            self.first_byte(None)
            ex.finished = True
            return
        if relay:
            await self._observe_stream(ex, learner)
        else:
            await self._observe_whole(ex, status, learner)

    async def _answer_headers(self, ex: GatewayExchange, status: int, served: Worker | None) -> None:
        """The answer's headers, named with the worker that served it and why: the gateway
        waits for them, so they go first, and what the picker learns after (a fallback that
        served it, `_moved`; the status in the metrics)."""
        moved = served is not None and served is not self.worker
        name, reason = (served.name, "retry") if moved and served is not None else (self.worker.name, self.reason)
        await ex.gateway.send(m.response_headers_response(_annotations(name, reason)))
        if self.trace is not None:
            self.trace.first_byte(ex, status, None, ex.stream and status == 200, exemplar=False)
        if moved and served is not None:
            await self._moved(ex, served)
        if status in RETRYABLE_STATUS:
            await self.failed(f"worker answered {status}", passive_down=False)
            return
        metrics = self.proxy.metrics
        metrics.requests.inc(self.worker.name, self.reason, str(status))
        if metrics.tenants is not None:
            metrics.tenants.request(ex.tenant, status)

    async def _moved(self, ex: GatewayExchange, served: Worker) -> None:
        """The gateway's try on this worker failed before its first byte, and a fallback
        served the request: the request's ticket and chain go there. The failure counts as
        a connection failure (the gateway retries refused and reset connections first): the
        worker is out, its index entries dropped, until a health check passes, as
        `kvroute serve` takes out a worker it cannot connect to."""
        proxy = self.proxy
        log.warning("worker %s failed before the first byte; the gateway served %s", self.worker.name, served.name)
        proxy.metrics.retries.inc()
        await self.failed("the gateway served the request from a fallback", passive_down=True)
        # The fallbacks the gateway tried before the one that served failed as well.
        served_at = ex.picker.endpoint_of(served)
        tried = self.endpoints[1 : self.endpoints.index(served_at)] if served_at in self.endpoints else []
        for endpoint in tried:
            worker = ex.picker.worker_at(endpoint)
            if worker is not None:
                worker.breaker.failure("the gateway tried it and went on")
                proxy.metrics.requests.inc(worker.name, "retry", "error")
                await proxy.fleet.mark_failed(worker.name)
        prefilling = not self.ticket.first_byte
        proxy.loads.release(self.ticket)
        if prefilling:
            proxy.prefill_queue.kick()
        self._unmark()
        chain = ex.choice.chain if ex.choice is not None else None
        tokens = chain.total_tokens if chain is not None else 0
        cost = proxy.loads.costs.get(served.name) or proxy.cost
        self.ticket = proxy.loads.acquire(served.name, cost.prefill_s(0, tokens), None)
        self.worker, self.reason, self.probing, self.expected_s = served, "retry", False, None
        ex.tried.add(served.name)
        if chain is not None:
            await proxy.record_sent(ex, served, chain)

    async def _relay_rest(self, ex: GatewayExchange, ended: bool) -> None:
        """The rest of an answer the picker learns nothing from, let through."""
        while not ended:
            message = await ex.response_message()
            if message is None:
                return
            kind = m.request_kind(message)
            if kind == "response_body":
                ended = message.response_body.end_of_stream
                await ex.pass_chunk(message.response_body.body, ended)
            elif kind == "response_trailers":
                await ex.gateway.send(m.trailers_response(request=False))
                ended = True
        ex.finished = True

    async def _observe_stream(self, ex: GatewayExchange, learner: Any) -> None:
        """A stream, chunk by chunk as the gateway passes it: its first token (the load
        board, the breaker, cost learning), a Responses stream's id, its usage."""
        proxy = self.proxy
        metrics = proxy.metrics
        loop = asyncio.get_running_loop()
        counting = metrics.tenants is not None and ex.kind in COUNTED_KINDS
        streamed = 0
        previous = last = b""
        started = False
        prefilling = ex.kind == "responses"
        while True:
            message = await ex.response_message()
            if message is None:
                # The gateway's stream ended before the answer did: the worker's stream
                # broke, or the client left.
                self.interrupted("stream broken")
                metrics.stream_errors.inc()
                return
            kind = m.request_kind(message)
            end = kind != "response_body" or message.response_body.end_of_stream
            chunk = message.response_body.body if kind == "response_body" else b""
            if chunk and not started:
                started = True
                self._first_token(ex, loop.time(), prefilling)
            if prefilling and started and FIRST_OUTPUT in chunk:
                prefilling = False
                self.prefilled(loop.time())
            if chunk:
                previous, last = last, chunk
                if counting:
                    streamed += token_events(chunk)
            if not end:
                await ex.pass_chunk(chunk, False)
                if learner is not None:
                    learner.feed(chunk)
                continue
            if learner is not None and chunk:
                learner.feed(chunk)
            usage = previous + last
            if metrics.tenants is not None:
                ex.generated = metrics.tenants.generated_in(ex.tenant, usage, streamed)
            if learner is not None:
                await learner.settle()
            if ex.recorded:  # this turn's prefix, before the client can send the next
                await proxy.index.written()
            if self.first_byte_s is not None:
                proxy.learn_cost(ex, self.worker.name, self.sent_at, self.first_byte_s, usage)
            await _pass_end(ex, kind, chunk)
            return

    def _first_token(self, ex: GatewayExchange, now: float, responses: bool) -> None:
        proxy = self.proxy
        if responses:
            # A Responses stream opens with response.created before any prefill: the worker
            # is healthy, its prefill ends at the first output item (`prefilled`).
            self.worker.breaker.success()
            proxy.fleet.mark_ok(self.worker.name)
        else:
            self.first_byte_s = now - self.sent_at
            self.first_byte(self.first_byte_s)
        since = time.perf_counter() - ex.arrived
        proxy.metrics.ttft.observe(since)
        if proxy.metrics.tenants is not None:
            proxy.metrics.tenants.first_byte(ex.tenant, since)

    async def _observe_whole(self, ex: GatewayExchange, status: int, learner: Any) -> None:
        """A whole answer: its first byte comes with its end (as the proxy counts it), its
        usage and a Responses answer's id are in it."""
        proxy = self.proxy
        keep = learner is not None or (proxy.metrics.tenants is not None and status == 200)
        parts: list[bytes] = []
        while True:
            message = await ex.response_message()
            if message is None:
                self.interrupted("answer cut")
                return
            kind = m.request_kind(message)
            end = kind != "response_body" or message.response_body.end_of_stream
            chunk = message.response_body.body if kind == "response_body" else b""
            if keep and chunk:
                parts.append(chunk)
            if not end:
                await ex.pass_chunk(chunk, False)
                continue
            self.first_byte(None)
            body = b"".join(parts)
            if proxy.metrics.tenants is not None and status == 200:
                ex.generated = proxy.metrics.tenants.generated_in(ex.tenant, body)
            if learner is not None:
                await learner.from_body(body)
            if ex.recorded:  # the client's next turn may come at once, through another replica
                await proxy.index.written()
            await _pass_end(ex, kind, chunk)
            return


class Picker:
    """Answers gateways on the proxy's decision path: `process` handles one ext_proc stream.
    Installs `GatewayAttempt` as the proxy's attempt: the picker's proxy forwards nothing."""

    def __init__(self, proxy: Proxy, api_keys: KeyCheck | None = None, tenants: TenantRegistry | None = None) -> None:
        self.proxy = proxy
        proxy.attempt_type = GatewayAttempt
        proxy.pd = None  # a gateway sends each request to one endpoint: no prefill/decode split
        self.api_keys = api_keys
        self.tenants = tenants
        self._endpoints: dict[tuple[str, str], str] = {}
        """(worker name, URL) -> its `ip:port`, as gateways name endpoints."""
        self._workers: dict[str, str] = {}
        """`ip:port` -> worker name."""

    # -- endpoints ----------------------------------------------------------------------
    def endpoint_of(self, worker: Worker) -> str:
        """The worker as a gateway names it: `ip:port` (`[v6]:port`) of its URL, resolved
        once if its host is a name."""
        key = (worker.name, worker.url)
        endpoint = self._endpoints.get(key)
        if endpoint is None:
            parts = urlsplit(worker.url)
            host = parts.hostname or ""
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                ip = ipaddress.ip_address(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
            endpoint = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
            self._endpoints[key] = endpoint
            self._workers[endpoint] = worker.name
        return endpoint

    def worker_at(self, endpoint: str) -> Worker | None:
        fleet = self.proxy.fleet
        name = self._workers.get(endpoint)
        if name is None or fleet.get(name) is None:
            for worker in fleet:  # joined since (discovery), or its address was never asked for
                with contextlib.suppress(OSError, ValueError):
                    self.endpoint_of(worker)
            name = self._workers.get(endpoint)
        return fleet.get(name) if name is not None else None

    def within(self, hint: list[str] | None) -> frozenset[str] | None:
        """The worker names a subset hint allows (None: no hint, every worker)."""
        if hint is None:
            return None
        names = {w.name for w in (self.worker_at(e) for e in hint) if w is not None}
        return frozenset(names)

    def endpoint_list(self, worker: Worker, ex: Exchange) -> list[str]:
        """`worker`, then the ranking's other serving workers not tried yet: `--max-attempts`
        endpoints in all, the gateway's tries in order."""
        proxy = self.proxy
        out = [self.endpoint_of(worker)]
        limit = max(proxy.settings.max_attempts, 1)
        if ex.choice is None or len(out) >= limit:
            return out
        decision = ex.choice.decision
        if ex.kind == "responses" and isinstance(ex.body.get("previous_response_id"), str):
            return out  # the owner alone stores the response: nowhere else to go
        for name in (decision.worker, *decision.ranking):
            if len(out) >= limit:
                break
            other = proxy.fleet.get(name)
            if other is None or other is worker or name in ex.tried or not other.serving:
                continue
            out.append(self.endpoint_of(other))
        return out

    def forward_edits(self, headers: m.Headers, worker: Worker) -> tuple[m.Headers, list[str]]:
        """(set, remove) on the request's headers on its way to `worker`: the client's
        credentials out (unless forwarded), the worker's in, an identity encoding (the
        picker reads the answer's usage and ids)."""
        forward_auth = self.proxy.settings.forward_client_auth
        present = {k for k, _ in headers}
        remove = [k.decode() for k in _CREDENTIALS if k in present and not (forward_auth and k == b"authorization")]
        set_headers: m.Headers = [(b"accept-encoding", b"identity")]
        if worker.api_key and not forward_auth:
            set_headers.append((b"authorization", b"Bearer " + worker.api_key.encode()))
            remove = [k for k in remove if k != "authorization"]
        return set_headers, remove

    # -- one ext_proc stream ------------------------------------------------------------
    async def process(self, gateway: Stream) -> None:
        first = await gateway.read()
        if first is None or m.request_kind(first) != "request_headers":
            return
        arrived = time.perf_counter()
        pairs = m.header_pairs(first.request_headers)
        method, raw_path = "GET", "/"
        headers: m.Headers = []
        for name, value in pairs:
            if name == b":method":
                method = value.decode("latin-1")
            elif name == b":path":
                raw_path = value.decode("latin-1")
            elif not name.startswith(b":"):
                headers.append((name, value))
        path, _, query = raw_path.partition("?")
        scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": query.encode("latin-1")}
        config = first.protocol_config
        request_mode = config.request_body_mode if first.HasField("protocol_config") else m.BODY_FULL_DUPLEX
        response_mode = config.response_body_mode if first.HasField("protocol_config") else m.BODY_FULL_DUPLEX
        ended = first.request_headers.end_of_stream
        if (self.api_keys is not None or (self.tenants is not None and self.tenants.enabled)) and (
            path.startswith("/v1/") or path in PROXIED_PATHS
        ) and not self._accepts(headers):
            error = unauthorized()
            await gateway.send(m.immediate_response(
                401, [*error.headers(), (b"www-authenticate", b"Bearer")], error.body(api_of(path)), "kvroute_unauthorized",
            ))  # fmt: skip
            return
        hint = m.subset_hint(first)
        if method == "POST" and path in PROXIED_PATHS and request_mode in (m.BODY_FULL_DUPLEX, m.BODY_BUFFERED):
            ex = GatewayExchange(scope, arrived, gateway, self, request_mode, response_mode)
            await self._proxied(ex, hint, ended)
        else:
            await self._pass_through(gateway, scope, hint, request_mode, response_mode, ended)

    def _accepts(self, headers: m.Headers) -> bool:
        key = presented_key(headers)
        if self.api_keys is not None and self.api_keys.accepts(key):
            return True
        return self.tenants is not None and self.tenants.for_key(key) is not None

    async def _proxied(self, ex: GatewayExchange, hint: list[str] | None, ended: bool) -> None:
        proxy = self.proxy
        try:
            if ex.request_mode == m.BODY_BUFFERED and not ended:
                # Envoy sends a buffered body only once its headers are answered; the
                # destination goes with the body's answer.
                await ex.gateway.send(m.request_headers_response())
            ex.within = self.within(hint)
            raw = await ex.read_body(proxy.settings.max_body_bytes, ended)
            proxy.prepare(ex, raw)
            await proxy.handle(ex)
        except Disconnected:
            proxy.metrics.client_disconnects.inc()
        except RouterError as exc:
            proxy.metrics.rejected.inc(exc.code)
            if not ex.started:
                await ex.gateway.send(m.immediate_response(exc.status, exc.headers(), exc.body(ex.endpoint.api), f"kvroute_{exc.code}"))
        except asyncio.CancelledError:
            proxy.metrics.client_disconnects.inc()  # the gateway reset the stream: its client left
            raise
        except Exception as exc:
            # A bug, not bad input: the client gets an OpenAI-style 500, the log the
            # exception's type and place (never its message, which may carry a URL).
            log.error("internal error on %s: %s", ex.scope["path"], exc_summary(exc))
            proxy.metrics.rejected.inc("internal_error")
            if not ex.started:
                error = RouterError(500, "Internal router error.", "internal_error")
                with contextlib.suppress(Exception):
                    await ex.gateway.send(m.immediate_response(500, error.headers(), error.body(ex.endpoint.api)))
        finally:
            proxy.end(ex)

    async def _pass_through(
        self, gateway: Stream, scope: dict, hint: list[str] | None, request_mode: int, response_mode: int,
        ended: bool,
    ) -> None:  # fmt: skip
        """A request the proxy does not route by its body: to the least-loaded endpoint (a
        stored response's by-id requests: to its owner); its body and answer pass unchanged."""
        proxy = self.proxy
        path = scope["path"]
        try:
            names, reason = await self._pass_through_route(path, self.within(hint))
        except RouterError as exc:
            proxy.metrics.rejected.inc(exc.code)
            await gateway.send(m.immediate_response(exc.status, exc.headers(), exc.body(api_of(path)), f"kvroute_{exc.code}"))
            return
        workers = [w for w in (proxy.fleet.get(n) for n in names[: max(proxy.settings.max_attempts, 1)]) if w is not None]
        endpoints = [self.endpoint_of(w) for w in workers]
        set_headers, remove = self.forward_edits(scope["headers"], workers[0])
        mutation = m.route_headers(endpoints, None, set_headers, remove)
        await gateway.send(m.request_headers_response(mutation, m.destination_metadata(endpoints)))
        await self._pass_unchanged(gateway, reason, request_mode, response_mode)

    async def _pass_through_route(self, path: str, within: frozenset[str] | None) -> tuple[list[str], str]:
        """(workers in order, route reason) for a pass-through request: a stored response's
        owner, else the ranking of the least loaded."""
        proxy = self.proxy
        match = BY_ID_PATH.match(path)
        if match is not None:
            _, owner = await proxy.affinity.owner_of(match.group(1), proxy.fleet)
            if within is not None and owner.name not in within:
                raise RouterError(503, "The response's owner is not among the endpoints the gateway allows.", "response_owner_unavailable")
            return [owner.name], "pinned"
        routed = await proxy.decide({}, None, "", None, within=within)
        return [routed.decision.worker, *routed.decision.ranking], routed.decision.reason

    async def _pass_unchanged(self, gateway: Stream, reason: str, request_mode: int, response_mode: int) -> None:
        """The rest of a pass-through request's stream: bodies and trailers let through, the
        answer's headers named with the endpoint that served it."""
        while True:
            message = await gateway.read()
            if message is None:
                return
            kind = m.request_kind(message)
            if kind == "request_body":
                if request_mode == m.BODY_FULL_DUPLEX:
                    body = message.request_body
                    await gateway.send(*m.streamed_bodies(body.body, request=True, end=body.end_of_stream))
                elif request_mode != m.BODY_NONE:
                    await gateway.send(m.unchanged_body(request=True))
            elif kind in ("request_trailers", "response_trailers"):
                await gateway.send(m.trailers_response(request=kind == "request_trailers"))
            elif kind == "response_headers":
                served_at = None if _own_reply(message) else m.served_endpoint(message)
                served = self.worker_at(served_at) if served_at is not None else None
                annotations = _annotations(served.name, reason) if served is not None else []
                await gateway.send(m.response_headers_response(annotations))
            elif kind == "response_body":
                body = message.response_body
                if response_mode == m.BODY_FULL_DUPLEX:
                    await gateway.send(*m.streamed_bodies(body.body, request=False, end=body.end_of_stream))
                elif response_mode != m.BODY_NONE:
                    await gateway.send(m.unchanged_body(request=False))


async def _pass_end(ex: GatewayExchange, kind: str | None, chunk: bytes) -> None:
    """The answer's last message on to the gateway: its last body chunk, or its trailers.
    The exchange counts as finished from here."""
    ex.finished = True
    if kind == "response_body":
        await ex.pass_chunk(chunk, True)
    elif kind == "response_trailers":
        await ex.gateway.send(m.trailers_response(request=False))
