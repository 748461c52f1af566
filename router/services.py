"""Every component of a router, built in one place from its config (`build_services`).

The app (router/app.py) and the admin endpoints (router/admin.py) are assembled from the
`Services` object; nothing reaches for a component through the app. Components with a
lifecycle share one protocol (`Lifecycle`: async `start()` / `stop()`); `Services.lifecycle`
lists them in start order, and the app's lifespan stops them in reverse.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from cache_client.base import IndexObserver, PrefixIndex
from cache_client.memory import MemoryIndex
from cache_client.response_owners import MemoryResponseOwners, RedisResponseOwners, ResponseOwners
from cache_client.served_ends import ServedEnds
from cache_client.tiers import Tiers
from normalizer.media import MediaReader
from router.auth import KeyCheck
from router.breaker import OutlierDetector
from router.calibration import Calibrator, cost_readers
from router.chain import ChainBuilder, EstimateChainBuilder
from router.config import RouterConfig
from router.cost import CostModel
from router.discovery import DnsDiscovery, EndpointSliceDiscovery, start_discovery
from router.load import LoadBoard, LocalLoadBoard
from router.looplag import LoopLagMonitor
from router.metrics import RouterMetrics
from router.policies import Policy, make_policy
from router.precise import PreciseMode, build_precise
from router.proxy import Proxy
from router.proxy.admission import Admission
from router.proxy.disagg import PdFlow
from router.proxy.stateful import ResponsesAffinity
from router.proxy.upstream import UpstreamClient
from router.tenants.enforce import TenantLimiter
from router.tenants.loader import TenantRegistry
from router.tenants.salt import CacheSalter
from router.tracing import build_tracer
from router.workers import Fleet, Worker

log = logging.getLogger("kvroute")


class Lifecycle(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


class Stage:
    """A `Lifecycle` made of two callables, for components whose own methods are named or
    shaped otherwise (`PrefixIndex.close`, `PreciseMode.start(fleet=...)`)."""

    def __init__(
        self,
        name: str,
        start: Callable[[], Awaitable[None]] | None = None,
        stop: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.name = name
        self._start = start
        self._stop = stop

    async def start(self) -> None:
        if self._start is not None:
            await self._start()

    async def stop(self) -> None:
        if self._stop is not None:
            await self._stop()


class Discoveries:
    """The fleet kept in step with each `--discover` target while the router runs. Built at
    start: a k8s:// target needs the pod's service account, which only the server has."""

    def __init__(self, fleet: Fleet, targets: list[str], environ: Mapping[str, str]) -> None:
        self._fleet = fleet
        self._targets = targets
        self._environ = environ
        self.running: list[DnsDiscovery | EndpointSliceDiscovery] = []

    async def start(self) -> None:
        for target in self._targets:
            self.running.append(await start_discovery(self._fleet, target, environ=self._environ))

    async def stop(self) -> None:
        for discovery in self.running:
            await discovery.stop()
        self.running.clear()


@dataclass
class Services:
    config: RouterConfig
    environ: Mapping[str, str]
    """The environment as the config builder read it: admin's `api_key_env` lookups and
    Kubernetes discovery look names up here."""
    metrics: RouterMetrics
    index: PrefixIndex
    loads: LoadBoard
    chains: ChainBuilder
    precise: PreciseMode | None
    """`chains` when it is precise mode (KV-event ingestion then runs with the fleet)."""
    policy: Policy
    cost: CostModel
    admission: Admission
    api_keys: KeyCheck | None
    """Checked for every /v1/* request; None: no client authentication."""
    admin_token: KeyCheck | None
    tenants: TenantRegistry
    """The tenants in force (none without a tenants file); their keys are client keys too."""
    health_client: httpx.AsyncClient
    fleet: Fleet
    proxy: Proxy
    outliers: OutlierDetector
    loop_lag: LoopLagMonitor
    discoveries: Discoveries
    salter: CacheSalter | None = None
    """With tenants: each cache scope's `cache_salt` (router/tenants/salt.py)."""
    lifecycle: list[Lifecycle] = field(default_factory=list)
    """Started in this order, stopped in reverse."""


def redis_components(config: RouterConfig, observer: IndexObserver | None = None) -> dict[str, Any]:
    """The `redis` section's components: `index` (RedisIndex, reporting its health to
    `observer`) and `loads` (RedisLoadBoard), sharing one client. Connects lazily, on the
    first call in the app's loop."""
    from cache_client.redis_index import RedisIndex
    from router.load.redis import RedisLoadBoard

    index = RedisIndex.from_settings(config.redis.index_settings(config.index.kv_capacity_tokens), observer)
    loads = RedisLoadBoard(
        index.backend, prefix=config.redis.prefix, half_life_s=config.routing.recent_half_life_s,
        replica_id=f"{os.uname().nodename}:{os.getpid()}:{secrets.token_hex(3)}",
    )
    logging.getLogger("kvroute.redis").info(
        "index and loads shared through %s, prefix %s", index.backend.settings.display(), index.tag
    )
    return {"index": index, "loads": loads}


def response_owners(config: RouterConfig, index: PrefixIndex) -> ResponseOwners:
    """Who stores each Responses-API response: in Redis beside the index when it is shared
    there (every replica agrees), else in this process."""
    from cache_client.redis_index import RedisIndex

    if isinstance(index, RedisIndex):
        return RedisResponseOwners(index.backend, prefix=config.redis.prefix)
    return MemoryResponseOwners()


def cache_salter(config: RouterConfig, index: PrefixIndex) -> CacheSalter:
    """Tenants' cache salts: from the configured secret, else one shared through the
    index's Redis, else this process's own (router/tenants/salt.py)."""
    from cache_client.redis_index import RedisIndex

    redis = index.backend if isinstance(index, RedisIndex) else None
    return CacheSalter(config.isolation.configured_secret(), redis=redis, prefix=config.redis.prefix)


def tenant_limiter(config: RouterConfig, index: PrefixIndex, loads: LoadBoard) -> TenantLimiter:
    """The tenant limits: shared through the index's Redis when it has one (the check rides
    in the index lookup's round trip), else this process's alone."""
    from cache_client.redis_index import RedisIndex

    settings = config.tenants

    def replicas() -> int:
        return settings.replicas or int(getattr(loads, "replicas", 1))

    redis = index if isinstance(index, RedisIndex) else None
    return TenantLimiter(redis, prefix=config.redis.prefix, replicas=replicas, lease_s=settings.concurrency_lease_s)


INDEX_EVENTS = (("remote_lookup", "remote_lookups"), ("fallback_lookup", "fallback_lookups"),
                ("unsettled_write", "unsettled_writes"))
"""The shared index's counters on /metrics (`kvroute_index_events_total`): event, stats key."""


def expose_index_stats(index: PrefixIndex, metrics: RouterMetrics) -> None:
    """A shared index's lookups by how they were answered, and its answers that ended before
    their write landed, on /metrics: why a turn that changed replica lost its worker."""
    from cache_client.redis_index import RedisIndex

    if isinstance(index, RedisIndex):
        stats = index.stats
        metrics.enable_index_stats(lambda: {(event,): float(stats[key]) for event, key in INDEX_EVENTS})


def _health_client(config: RouterConfig) -> httpx.AsyncClient:
    p = config.proxy
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=p.connect_timeout_s, read=None, write=p.connect_timeout_s, pool=None),
        limits=httpx.Limits(
            max_connections=p.max_connections, max_keepalive_connections=p.max_connections, keepalive_expiry=30
        ),
        follow_redirects=False,
        trust_env=False,  # a proxy from the environment must never see worker traffic
    )


def build_services(
    config: RouterConfig,
    *,
    environ: Mapping[str, str] | None = None,
    index: PrefixIndex | None = None,
    loads: LoadBoard | None = None,
    chains: ChainBuilder | None = None,
    metrics: RouterMetrics | None = None,
    upstream: UpstreamClient | None = None,
    health_client: httpx.AsyncClient | None = None,
    tenants: TenantRegistry | None = None,
) -> Services:
    """Every component `config` describes; the keyword arguments replace one each (tests:
    a fake upstream, an httpx MockTransport for health checks, a prepared index)."""
    # Given when the index reports its health into them (it is built before the app).
    metrics = metrics if metrics is not None else RouterMetrics()
    index, loads = _index_and_loads(config, metrics, index, loads)
    chains = chains if chains is not None else _chain_builder(config)
    policy = make_policy(
        config.routing.policy, config.routing.load_factor, config.routing.random_seed, config.routing.ablate
    )
    cost = config.cost.model()
    calibrator = _cost_learning(config, cost, loads, metrics)
    tenants = tenants if tenants is not None else TenantRegistry(config.tenants.file)
    # With tenants the wait queue serves them by weighted fair share (router/proxy/fair.py).
    admission = config.overload.admission(fair=tenants.enabled)
    client = health_client or _health_client(config)
    tiers = Tiers.of(config.index)
    fleet = _fleet(config, client, index, loads, calibrator, tiers)
    salter = _tenancy(config, index, metrics, tenants)
    proxy = Proxy(
        config.proxy, fleet, index, loads, policy, cost, chains, metrics, upstream, admission=admission,
        ends=_served_ends(policy, loads), normalize=config.normalize, tiers=tiers,
        affinity=ResponsesAffinity(response_owners(config, index), config.index.responses_owner_ttl_s),
        tenants=tenants if tenants.enabled else None, salter=salter, calibrator=calibrator,
        limiter=tenant_limiter(config, index, loads) if tenants.enabled else None,
        prefill_queue=config.overload.prefill_queue(cost),
    )
    _add_pd_and_tracing(proxy, config)
    env: Mapping[str, str] = environ if environ is not None else {}
    services = Services(
        config=config, environ=env, metrics=metrics, index=index, loads=loads, chains=chains,
        precise=chains if isinstance(chains, PreciseMode) else None, policy=policy, cost=cost,
        admission=admission, api_keys=config.security.client_keys(), admin_token=config.security.admin_check(),
        tenants=tenants, health_client=client, fleet=fleet, proxy=proxy,
        outliers=OutlierDetector(lambda: fleet, config.outlier), loop_lag=LoopLagMonitor(),
        discoveries=Discoveries(fleet, config.discover, env), salter=salter,
    )
    services.lifecycle = _lifecycle(services)
    return services


def _add_pd_and_tracing(proxy: Proxy, config: RouterConfig) -> None:
    """The proxy's prefill/decode splits, for fleets whose workers have roles (inert while
    none has), and its spans of each request, exported over OTLP (router/tracing.py; None:
    tracing off)."""
    proxy.pd = PdFlow(proxy, config.disagg, config.disagg.pricing(config.cost.kv_bytes_per_token))
    proxy.tracer = build_tracer(config.tracing, proxy.metrics.ttft)


def _tenancy(config: RouterConfig, index: PrefixIndex, metrics: RouterMetrics, tenants: TenantRegistry) -> CacheSalter | None:
    """With tenants: their series on /metrics, and each cache scope's salt, which every
    request then carries (router/tenants/salt.py). None: no tenants."""
    if not tenants.enabled:
        return None
    metrics.enable_tenants()
    return cache_salter(config, index)


def _index_and_loads(
    config: RouterConfig, metrics: RouterMetrics, index: PrefixIndex | None, loads: LoadBoard | None
) -> tuple[PrefixIndex, LoadBoard]:
    """The prefix index and the load board (those given, else shared through Redis when
    the config names it, else this process's own); a shared index's stats on /metrics."""
    if config.redis.url and index is None and loads is None:
        shared = redis_components(config, observer=metrics)
        index, loads = shared["index"], shared["loads"]
    index = index if index is not None else MemoryIndex(config.index.kv_capacity_tokens)
    expose_index_stats(index, metrics)
    loads = loads if loads is not None else LocalLoadBoard(config.routing.recent_half_life_s)
    return index, loads


def _chain_builder(config: RouterConfig) -> ChainBuilder:
    """Precise mode's chain builder when configured (falling back on the estimate), else
    the estimate's."""
    estimate = EstimateChainBuilder(MediaReader(config.media))
    mode = build_precise(config.precise, fallback=estimate)
    return mode if mode is not None else estimate


def _cost_learning(config: RouterConfig, cost: CostModel, loads: LoadBoard, metrics: RouterMetrics) -> Calibrator | None:
    """With `cost.learning` on: each worker's costs learned from its answers, carried on the
    load board (shared with the other replicas through a Redis one) and on /metrics."""
    if config.cost.learning != "on":
        return None
    calibrator = Calibrator(cost, config.cost.fixed())
    loads.costs = calibrator.costs  # the load view carries each worker's learned model
    if hasattr(loads, "calibrator"):  # RedisLoadBoard: replicas share their statistics
        loads.calibrator = calibrator
    metrics.enable_cost_learning(*cost_readers(calibrator))
    return calibrator


def _fleet(
    config: RouterConfig, client: httpx.AsyncClient, index: PrefixIndex, loads: LoadBoard,
    calibrator: Calibrator | None, tiers: Tiers,
) -> Fleet:  # fmt: skip
    """The workers, health-checked with `client`; the index (with the capacities of each
    worker's `tiers`) and the load board follow the fleet's changes. (Forwarding has its
    own client, built by `Proxy.start`: httpx costs O(open connections) per request, the
    raw client O(1), docs/performance.md.)"""

    def forget(worker: str) -> None:
        # A removed worker's counts and learned costs would otherwise stay (and its
        # coefficients stay on /metrics) for every pod a Kubernetes rollout replaces.
        loads.forget(worker)
        if calibrator is not None:
            calibrator.forget(worker)

    def place(worker: Worker) -> None:
        # Capacity models of a joining worker's GPU and of the tiers its node brings.
        index.set_capacity(worker.name, config.index.kv_capacity_tokens)
        for location, tokens in tiers.capacities(worker.node):
            index.set_capacity(location, tokens)

    return config.health.fleet(
        config.workers, client, on_down=index.drop_location, on_removed=forget, on_added=place,
        breaker=config.breaker, nodes=config.nodes, roles=config.roles,
    )


def _served_ends(policy: Policy, loads: LoadBoard) -> ServedEnds | None:
    """Where the prompts sent ended, to find a conversation's home (cache_client/served_ends.py);
    replicas sharing Redis pass theirs on at the load board's sync. None: the policy reads
    no index."""
    if not policy.uses_index:
        return None
    ends = ServedEnds()
    if hasattr(loads, "ends"):
        ends.share()
        loads.ends = ends
    return ends


REDIS_STARTUP_WAIT_S = 2.0
"""How long a starting router waits for Redis before it serves on its own view."""


async def connect_shared(index: PrefixIndex, loads: LoadBoard) -> None:
    """Connect to the shared Redis before the first request, and read the other replicas'
    loads and prompt ends once: otherwise the connection opens on the first request, which
    then routes on this replica's empty view (the lookup budget is far shorter than a
    connect). Redis not answering within `REDIS_STARTUP_WAIT_S` does not stop the start:
    the router serves degraded and connects in the background, as after an outage."""
    from cache_client.redis_index import RedisIndex
    from router.load.redis import RedisLoadBoard

    if not isinstance(index, RedisIndex):
        return
    if not await index.connect(REDIS_STARTUP_WAIT_S):
        log.warning("Redis at %s did not answer within %g s: routing on this replica's own view until it does",
                    index.backend.settings.display(), REDIS_STARTUP_WAIT_S)
        return
    if isinstance(loads, RedisLoadBoard):
        await loads.sync()


def _lifecycle(s: Services) -> list[Lifecycle]:
    async def close_index_and_client() -> None:
        await s.index.close()
        await s.health_client.aclose()

    async def open_index() -> None:
        await connect_shared(s.index, s.loads)

    stages: list[Lifecycle] = [Stage("index", open_index, close_index_and_client)]
    if s.salter is not None:  # the salts' secret is settled before the first request
        stages.append(s.salter)
    stages += [s.proxy, s.fleet]
    if s.precise is not None:  # KV-event ingestion (router/precise/events.py)
        mode = s.precise

        async def ingest() -> None:
            salts = s.salter.known if s.salter is not None else None
            await mode.start(fleet=s.fleet, index=s.index, registry=s.metrics.registry, salts=salts,
                             follow=event_writer_election(s.index, s.loads))

        stages.append(Stage("precise", ingest, mode.stop))
    if s.tenants.path is not None:
        stages.append(TenantReloadOnHangup(s.tenants))
    tracer = s.proxy.tracer
    if tracer is not None:  # stopped last: the spans of requests drained at shutdown go out
        stages.insert(0, Stage("tracing", None, lambda: asyncio.to_thread(tracer.shutdown)))
    return [*stages, s.outliers, s.loop_lag, s.discoveries]


def event_writer_election(index: PrefixIndex, loads: LoadBoard) -> tuple[PrefixIndex, Callable[[], bool]] | None:
    """With the index in Redis: one replica writes the workers' KV events there, the others
    keep them in their own view (`RedisLoadBoard.writes_events`); a replica that becomes the
    writer pushes its view first."""
    from cache_client.redis_index import RedisIndex
    from router.load.redis import RedisLoadBoard

    if not (isinstance(index, RedisIndex) and isinstance(loads, RedisLoadBoard)):
        return None
    loads.on_writer.append(index.push_mirror)
    return index.mirror, lambda: loads.writes_events


class TenantReloadOnHangup:
    """SIGHUP reloads the tenants file in this process (with `--processes N`, signal each
    process, or call `POST /admin/tenants/reload` on each replica). A bad file is logged and
    the tenants in force stay."""

    def __init__(self, registry: TenantRegistry) -> None:
        self._registry = registry
        self._installed = False

    def _reload(self) -> None:
        try:
            table = self._registry.reload()
        except (OSError, ValueError) as exc:
            log.error("tenants file not reloaded, the previous tenants stay in force: %s", exc)
            return
        log.info("tenants reloaded: %d tenants", len(table))

    async def start(self) -> None:
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload)
            self._installed = True
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (in-process tests)
            log.info("SIGHUP reload unavailable here; use POST /admin/tenants/reload")

    async def stop(self) -> None:
        if self._installed:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._installed = False


async def start_all(services: Services) -> None:
    """Start every component in order; if one fails, stop those already started."""
    started: list[Lifecycle] = []
    try:
        for component in services.lifecycle:
            await component.start()
            started.append(component)
    except BaseException:
        await stop_all(started)
        raise


async def stop_all(components: list[Lifecycle]) -> None:
    for component in reversed(components):
        await component.stop()
