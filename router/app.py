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

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import Route

from cache_client.base import PrefixIndex
from cache_client.memory import MemoryIndex
from cache_client.redact import exc_summary
from normalizer.canonical import NormalizeOptions
from router import __version__
from router.admin import register_admin
from router.auth import KeyCheck, resolve_admin_token, resolve_api_keys, unauthorized
from router.breaker import CLOSED, BreakerSettings, OutlierDetector, OutlierSettings
from router.chain import ChainBuilder, EstimateChainBuilder
from router.config import RouterConfig
from router.cost import CostModel
from router.errors import RouterError, error_body
from router.load import LoadBoard, LocalLoadBoard
from router.looplag import LoopLagMonitor
from router.metrics import CallbackGauge, RouterMetrics
from router.policies import make_policy
from router.precise import PreciseMode
from router.proxy import PROXIED_PATHS, Proxy, ProxySettings
from router.proxy.admission import Admission, NoAdmission
from router.proxy.upstream import UpstreamClient, make_upstream_client
from router.workers import Fleet

log = logging.getLogger("kvroute")

OPENAPI_PATH = Path(__file__).with_name("openapi.json")


def _json(status: int, content: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json", headers=headers)


def _error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, code), status_code=status, media_type="application/json", headers=headers)


def cost_model(config: RouterConfig) -> CostModel:
    return CostModel(
        prefill_base_s=config.cost_prefill_base_us * 1e-6,
        prefill_ctx_s=config.cost_prefill_ctx_ns * 1e-9,
        pool_load_s_per_token=config.cost_pool_load_us * 1e-6,
        inflight_penalty_s=config.cost_inflight_penalty_ms * 1e-3,
        step_s=config.cost_step_ms * 1e-3,
    )


def proxy_settings(config: RouterConfig) -> ProxySettings:
    return ProxySettings(
        max_body_bytes=config.max_body_bytes,
        max_attempts=config.max_attempts,
        first_byte_timeout_s=config.first_byte_timeout_s,
        idle_timeout_s=config.idle_timeout_s,
        total_timeout_s=config.total_timeout_s,
        forward_client_auth=config.forward_client_auth,
        normalize=NormalizeOptions(
            tool_schemas=config.normalize_tool_schemas,
            tool_call_arguments=config.normalize_tool_arguments,
            system_prompt=config.normalize_system_prompt,
        ),
        pool_enabled=config.pool_capacity_tokens > 0,
    )


def admission(config: RouterConfig) -> Admission:
    """Per-worker in-flight limits and the wait queue, or none (`max_inflight_per_worker` 0)."""
    if config.max_inflight_per_worker <= 0:
        return NoAdmission()
    return Admission(config.max_inflight_per_worker, config.queue_size, config.queue_timeout_s, config.retry_after_s)


class KvrouteApp:
    """ASGI app. Components that need the event loop are built in the lifespan."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        index: PrefixIndex | None = None,
        loads: LoadBoard | None = None,
        chains: ChainBuilder | None = None,
        metrics: RouterMetrics | None = None,
        upstream: UpstreamClient | None = None,
        health_client: httpx.AsyncClient | None = None,
    ) -> None:
        self.config = config
        self._upstream = upstream
        """The forwarding client to use instead of `config.upstream_client`'s (tests: a fake)."""
        self._health_client = health_client
        """The health checks' client instead of a new one (tests: an httpx MockTransport)."""
        # Given when the index reports its health into them (it is built before the app).
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.index: PrefixIndex = index if index is not None else MemoryIndex(config.kv_capacity_tokens)
        self.loads: LoadBoard = loads if loads is not None else LocalLoadBoard(config.recent_half_life_s)
        self.chains: ChainBuilder = chains if chains is not None else EstimateChainBuilder()
        self.policy = make_policy(config.policy, config.load_factor)
        self.proxy: Proxy | None = None
        self.fleet: Fleet | None = None
        keys = resolve_api_keys(config.api_keys, config.api_keys_file)
        self.api_keys: KeyCheck | None = KeyCheck(keys) if keys else None
        """Checked for every /v1/* request; None: no client authentication."""
        admin_token = resolve_admin_token(config.admin_token, config.admin_token_file)
        self.admin_token: KeyCheck | None = KeyCheck([admin_token]) if admin_token else None
        self.admission: Admission = admission(config)
        self.outliers: OutlierDetector | None = None
        self.loop_lag = LoopLagMonitor()
        self._register_reliability_metrics()
        self.api = self._build_api()

    def _register_reliability_metrics(self) -> None:
        registry = self.metrics.registry
        self.loop_lag.register(registry)
        self.circuit_open = registry.gauge(
            "kvroute_worker_circuit_open", "1 while the worker's circuit breaker is open or half-open.", ("worker",)
        )
        registry.register(
            CallbackGauge(
                "kvroute_queue_depth", "Requests waiting for a worker slot (--max-inflight-per-worker).", (),
                lambda: {(): float(self.admission.queued)},
            )
        )

    # -- lifespan -----------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        c = self.config
        client = self._health_client or httpx.AsyncClient(
            timeout=httpx.Timeout(connect=c.connect_timeout_s, read=None, write=c.connect_timeout_s, pool=None),
            limits=httpx.Limits(
                max_connections=c.max_connections, max_keepalive_connections=c.max_connections, keepalive_expiry=30
            ),
            follow_redirects=False,
            trust_env=False,  # a proxy from the environment must never see worker traffic
        )
        for spec in c.workers:
            self.index.set_capacity(spec.name, c.kv_capacity_tokens)
        if c.pool_capacity_tokens > 0:
            from cache_client.base import POOL

            self.index.set_capacity(POOL, c.pool_capacity_tokens)
        self.fleet = Fleet(
            c.workers,
            client,
            health_interval_s=c.health_interval_s,
            unhealthy_after=c.unhealthy_after,
            scrape_metrics=c.scrape_metrics,
            on_down=self.index.drop_location,
            breaker=BreakerSettings(c.breaker_failures, c.breaker_open_s, c.breaker_max_open_s),
        )
        # Forwarding has its own client: httpx (above, for health checks) costs O(open
        # connections) per request, the raw client O(1) (docs/performance.md).
        upstream = self._upstream or make_upstream_client(
            connect_timeout_s=c.connect_timeout_s, max_connections=c.max_connections, kind=c.upstream_client
        )
        self.proxy = Proxy(
            proxy_settings(c), self.fleet, self.index, self.loads, self.policy,
            cost_model(c), self.chains, self.metrics, upstream, admission=self.admission,
        )
        await self.fleet.start()
        if isinstance(self.chains, PreciseMode):  # KV-event ingestion (router/precise/events.py)
            await self.chains.start(fleet=self.fleet, index=self.index, registry=self.metrics.registry)
        self.outliers = OutlierDetector(
            lambda: self.fleet or (),
            OutlierSettings(
                interval_s=c.outlier_interval_s,
                min_requests=c.outlier_min_requests,
                error_rate=c.outlier_error_rate,
                latency_factor=c.outlier_latency_factor,
                ejection_s=c.outlier_ejection_s,
                max_ejected_fraction=c.outlier_max_ejected_fraction,
            ),
        )
        self.outliers.start()
        self.loop_lag.start()
        discoveries = []
        for target in c.discover:
            from router.discovery import start_discovery

            discoveries.append(await start_discovery(self.fleet, target))
        log.info("kvroute %s: %d workers, policy %s", __version__, len(self.fleet), c.policy)
        try:
            yield
        finally:
            for discovery in discoveries:
                await discovery.stop()
            if isinstance(self.chains, PreciseMode):
                await self.chains.stop()
            await self.outliers.stop()
            await self.loop_lag.stop()
            await self.fleet.stop()
            await self.proxy.close()
            await self.index.close()
            await upstream.aclose()
            await client.aclose()

    # -- endpoints ----------------------------------------------------------------------
    def _build_api(self) -> FastAPI:
        # The generated schema would not describe the proxied endpoints (they bypass FastAPI);
        # router/openapi.json is written by hand and served instead.
        api = FastAPI(
            title="kvroute", version=__version__, lifespan=self.lifespan, docs_url=None, redoc_url=None,
            openapi_url=None,
        )

        async def proxied(scope, receive, send) -> None:
            assert self.proxy is not None
            await self.proxy(scope, receive, send)

        for path in PROXIED_PATHS:
            api.router.routes.append(Route(path, endpoint=proxied, methods=["POST"]))

        @api.exception_handler(StarletteHTTPException)
        async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
            return _error(exc.status_code, str(exc.detail), code, headers=getattr(exc, "headers", None))

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

        openapi = OPENAPI_PATH.read_bytes()

        @api.get("/openapi.json")
        async def openapi_json() -> Response:
            return Response(openapi, media_type="application/json")

        register_admin(api, self, self.admin_token)

        @api.get("/health")
        async def health() -> Response:
            return _json(200, {"status": "ok"})

        @api.get("/ready")
        async def ready() -> Response:
            if self.fleet is not None and self.fleet.any_serving():
                return _json(200, {"status": "ready"})
            return _error(503, "No healthy worker.", "no_healthy_worker", headers={"retry-after": "1"})

        @api.get("/v1/models")
        async def models() -> Response:
            assert self.fleet is not None
            data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvroute"} for m in self.fleet.models()]
            return _json(200, {"object": "list", "data": data})

        @api.get("/metrics")
        async def metrics() -> Response:
            self._refresh_gauges()
            return Response(self.metrics.registry.render(), media_type="text/plain; version=0.0.4")

        return api

    def _refresh_gauges(self) -> None:
        if self.fleet is None:
            return
        # Rebuilt each scrape so that removed workers disappear from the series.
        self.metrics.worker_healthy.values.clear()
        self.metrics.worker_inflight.values.clear()
        self.circuit_open.values.clear()
        for w in self.fleet:
            self.metrics.worker_healthy.set(w.name, value=1.0 if w.healthy else 0.0)
            self.metrics.worker_inflight.set(w.name, value=float(self.loads.inflight(w.name)))
            w.breaker.admits()  # an open circuit whose time is up reads as half-open
            self.circuit_open.set(w.name, value=0.0 if w.breaker.state is CLOSED else 1.0)

    async def __call__(self, scope, receive, send) -> None:
        if (
            self.api_keys is not None
            and scope["type"] == "http"
            and scope["path"].startswith("/v1/")
            and not self.api_keys.accepts_headers(scope["headers"])
        ):
            await _unauthorized(send)
            return
        if (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and self.proxy is not None
            and scope["path"] in PROXIED_PATHS
        ):
            await self.proxy(scope, receive, send)
            return
        # Starlette re-raises after its 500 handler has answered, for the server to log with
        # a traceback; internal_error has logged a redacted line already.
        with contextlib.suppress(Exception):
            await self.api(scope, receive, send)


async def _unauthorized(send) -> None:
    error = unauthorized()
    body = error.body()
    headers = [*error.headers(), (b"www-authenticate", b"Bearer"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def build_app(config: RouterConfig, **components: Any) -> KvrouteApp:
    return KvrouteApp(config, **components)
