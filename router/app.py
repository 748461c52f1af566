"""The HTTP application: the proxied OpenAI endpoints plus health, models and metrics.

The proxied POST endpoints bypass FastAPI's routing and middleware (a few tens of
microseconds a request) and go straight to `Proxy`; they are also registered as ordinary
routes, so the rest of the app (405 for other methods, the route table) sees them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Route

from cache_client.base import PrefixIndex
from cache_client.redact import exc_summary
from router import __version__
from router.admin import register_admin
from router.auth import KeyCheck, presented_key, unauthorized
from router.breaker import CLOSED
from router.config import RouterConfig
from router.errors import RouterError, error_body
from router.load import LoadBoard
from router.metrics import OPENMETRICS_CONTENT_TYPE, OPENMETRICS_TYPE, CallbackGauge
from router.proxy import PROXIED_PATHS, Proxy
from router.proxy.admission import Admission
from router.proxy.settings import Api, api_of
from router.proxy.stateful import RESPONSES_BY_ID
from router.services import Services, build_services, start_all, stop_all
from router.workers import Fleet

log = logging.getLogger("kvroute")

OPENAPI_PATH = Path(__file__).with_name("openapi.json")


def _json(status: int, content: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json", headers=headers)


def _error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, code), status_code=status, media_type="application/json", headers=headers)


def _answer_errors_in_api_shapes(api: FastAPI) -> None:
    """FastAPI's own errors (404, 405, invalid parameters), `RouterError`s and bugs, as
    error bodies in the endpoint's API shape (a bug: a redacted log line, never a traceback)."""

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        # e.g. GET /v1/messages: a 405 in the endpoint's own shape.
        body = RouterError(exc.status_code, str(exc.detail), code).body(api_of(request.url.path))
        return Response(body, status_code=exc.status_code, media_type="application/json",
                        headers=getattr(exc, "headers", None))

    @api.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> Response:
        return _error(400, "Invalid request parameters.", "invalid_request")

    @api.exception_handler(RouterError)
    async def router_error(_request: Request, exc: RouterError) -> Response:
        headers = {k.decode(): v.decode() for k, v in exc.headers()}
        if exc.status == 401:
            headers["www-authenticate"] = "Bearer"
        return Response(exc.body(), status_code=exc.status, headers=headers)

    @api.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> Response:
        log.error("internal error: %s", exc_summary(exc))
        return _error(500, "Internal router error.", "internal_error")


class KvrouteApp:
    """ASGI app, assembled from one `Services` object (router/services.py); its lifespan
    starts the components with a lifecycle in order and stops them in reverse."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.config: RouterConfig = services.config
        # The components the endpoints (and tests) use, by name.
        self.metrics = services.metrics
        self.index: PrefixIndex = services.index
        self.loads: LoadBoard = services.loads
        self.chains = services.chains
        self.policy = services.policy
        self.fleet: Fleet = services.fleet
        self.proxy: Proxy = services.proxy
        self.admission: Admission = services.admission
        self.api_keys: KeyCheck | None = services.api_keys
        self.tenants = services.tenants
        self._register_reliability_metrics()
        self.api = self._build_api()

    def _register_reliability_metrics(self) -> None:
        registry = self.metrics.registry
        self.services.loop_lag.register(registry)
        self.circuit_open = registry.gauge(
            "kvroute_worker_circuit_open", "1 while the worker's circuit breaker is open or half-open.", ("worker",)
        )
        registry.register(
            CallbackGauge(
                "kvroute_queue_depth", "Requests waiting for a worker slot (--max-inflight-per-worker).", (),
                lambda: {(): float(self.admission.queued)},
            )
        )
        prefill_queue = self.proxy.prefill_queue
        registry.callback_gauge(
            "kvroute_prefill_queue_depth", "Requests waiting in the router for a worker to free (--prefill-queue-tokens).",
            (), lambda: {(): float(prefill_queue.waiting)},
        )  # fmt: skip
        registry.callback_counter(
            "kvroute_prefill_queue_held_total", "Requests that waited in the prefill queue (--prefill-queue-tokens).",
            (), lambda: {(): float(prefill_queue.held)},
        )  # fmt: skip

    # -- lifespan -----------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        await start_all(self.services)
        log.info("kvroute %s: %d workers, policy %s", __version__, len(self.fleet), self.policy.name)
        try:
            yield
        finally:
            await stop_all(self.services.lifecycle)

    # -- endpoints ----------------------------------------------------------------------
    def _build_api(self) -> FastAPI:
        # The generated schema would not describe the proxied endpoints (they bypass FastAPI);
        # router/openapi.json is written by hand and served instead.
        api = FastAPI(
            title="kvroute", version=__version__, lifespan=self.lifespan, docs_url=None, redoc_url=None,
            openapi_url=None,
        )

        async def proxied(scope, receive, send) -> None:
            await self.proxy(scope, receive, send)

        for path in PROXIED_PATHS:
            api.router.routes.append(Route(path, endpoint=proxied, methods=["POST"]))
        _answer_errors_in_api_shapes(api)
        openapi = OPENAPI_PATH.read_bytes()

        @api.get("/openapi.json")
        async def openapi_json() -> Response:
            return Response(openapi, media_type="application/json")

        register_admin(api, self.services)
        self._add_status_endpoints(api)
        return api

    def _add_status_endpoints(self, api: FastAPI) -> None:
        """/health, /ready, /v1/models and /metrics."""

        @api.get("/health")
        async def health() -> Response:
            return _json(200, {"status": "ok"})

        @api.get("/ready")
        async def ready() -> Response:
            if self.fleet.any_serving():
                return _json(200, {"status": "ready"})
            return _error(503, "No healthy worker.", "no_healthy_worker", headers={"retry-after": "1"})

        @api.get("/v1/models")
        async def models() -> Response:
            data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvroute"} for m in self.fleet.models()]
            return _json(200, {"object": "list", "data": data})

        @api.get("/metrics")
        async def metrics(request: Request) -> Response:
            self._refresh_gauges()
            # Exemplars (trace ids on kvroute_ttft_seconds) exist only in OpenMetrics, which
            # Prometheus asks for in its Accept header; other scrapers get the text format.
            if OPENMETRICS_TYPE in request.headers.get("accept", ""):
                return Response(self.metrics.registry.render(openmetrics=True), media_type=OPENMETRICS_CONTENT_TYPE)
            return Response(self.metrics.registry.render(), media_type="text/plain; version=0.0.4")

    def _refresh_gauges(self) -> None:
        # Rebuilt each scrape so that removed workers disappear from the series.
        self.metrics.worker_healthy.values.clear()
        self.metrics.worker_inflight.values.clear()
        self.circuit_open.values.clear()
        for w in self.fleet:
            self.metrics.worker_healthy.set(w.name, value=1.0 if w.healthy else 0.0)
            self.metrics.worker_inflight.set(w.name, value=float(self.loads.inflight(w.name)))
            w.breaker.admits()  # an open circuit whose time is up reads as half-open
            self.circuit_open.set(w.name, value=0.0 if w.breaker.state is CLOSED else 1.0)

    def _accepts(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """A client key is a configured API key or a tenant's key."""
        key = presented_key(headers)
        if self.api_keys is not None and self.api_keys.accepts(key):
            return True
        return self.tenants.for_key(key) is not None

    async def __call__(self, scope, receive, send) -> None:
        if (
            (self.api_keys is not None or self.tenants.enabled)
            and scope["type"] == "http"
            and (scope["path"].startswith("/v1/") or scope["path"] in PROXIED_PATHS)
            and not self._accepts(scope["headers"])
        ):
            await _unauthorized(send, api_of(scope["path"]))
            return
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and scope["path"] in PROXIED_PATHS
        ):
            await self.proxy(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"].startswith(RESPONSES_BY_ID):
            # GET/DELETE /v1/responses/{id}, .../cancel, .../input_items: to the owner only.
            await self.proxy.affinity.by_id(self.proxy, scope, receive, send)
            return
        # Starlette re-raises after its 500 handler has answered, for the server to log with
        # a traceback; internal_error has logged a redacted line already.
        with contextlib.suppress(Exception):
            await self.api(scope, receive, send)


async def _unauthorized(send, api: Api) -> None:
    error = unauthorized()
    body = error.body(api)
    headers = [*error.headers(), (b"www-authenticate", b"Bearer"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def build_app(config: RouterConfig, **overrides: Any) -> KvrouteApp:
    """The app `config` describes; `overrides` replace components (see `build_services`)."""
    return KvrouteApp(build_services(config, **overrides))
