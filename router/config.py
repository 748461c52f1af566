"""Router settings: one `RouterConfig` in sections, each section a small dataclass defined
beside the component that takes it, with its defaults there.

`router/config_loader.py` fills it from flags, `KVROUTE_*` environment variables and an
optional YAML file (flat keys as ever, or nested sections); it is the only module that
reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache_client.base import IndexSettings
from cache_client.redis_index import RedisOptions
from normalizer.canonical import NormalizeOptions
from normalizer.media import MediaSettings
from router.auth import SecuritySettings
from router.breaker import BreakerSettings, OutlierSettings
from router.cost import CostSettings
from router.epp.settings import EppSettings
from router.policies import RoutingSettings
from router.policies.disagg import DisaggSettings
from router.precise.settings import PreciseSettings
from router.proxy.admission import AdmissionSettings
from router.proxy.settings import ProxySettings
from router.tenants.loader import TenantSettings
from router.tenants.salt import IsolationSettings
from router.tracing import TracingSettings
from router.workers import HealthSettings, WorkerSpec


@dataclass(frozen=True)
class ServerSettings:
    """The `server` section: the router's processes and their HTTP server (router/serve.py)."""

    host: str = "127.0.0.1"
    port: int = 8000
    processes: int = 1
    """Router processes on one port (they share state through Redis)."""
    log_level: str = "info"
    shutdown_grace_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish."""
    keep_alive_s: int = 75
    """Idle client connections are kept this long. Longer than clients and load balancers
    keep theirs (httpx 5 s, nginx 60 s), so that the router never closes a connection at
    the moment a client sends a request on it (the client sees a failure without a byte)."""


@dataclass
class RouterConfig:
    workers: list[WorkerSpec] = field(default_factory=list)
    discover: list[str] = field(default_factory=list)
    """Discovery targets, e.g. dns://HEADLESS_SERVICE:PORT (router/discovery.py)."""
    nodes: dict[str, str] = field(default_factory=dict)
    """Worker name -> the node it runs on (`--node NODE=W1,W2`), for workers whose spec
    (YAML `workers: [{name, url, node}]`, Kubernetes discovery) names none. A worker on no
    node is on the default one: a fleet given no nodes is one node."""
    roles: dict[str, str] = field(default_factory=dict)
    """Worker name -> its role, prefill, decode or both (`--role NAME=ROLE`), for workers
    whose spec names none. A fleet given no roles is aggregated (every worker `both`)."""
    server: ServerSettings = field(default_factory=ServerSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    index: IndexSettings = field(default_factory=IndexSettings)
    redis: RedisOptions = field(default_factory=RedisOptions)
    cost: CostSettings = field(default_factory=CostSettings)
    normalize: NormalizeOptions = field(default_factory=NormalizeOptions)
    media: MediaSettings = field(default_factory=MediaSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    outlier: OutlierSettings = field(default_factory=OutlierSettings)
    overload: AdmissionSettings = field(default_factory=AdmissionSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    precise: PreciseSettings = field(default_factory=PreciseSettings)
    tenants: TenantSettings = field(default_factory=TenantSettings)
    isolation: IsolationSettings = field(default_factory=IsolationSettings)
    epp: EppSettings = field(default_factory=EppSettings)
    disagg: DisaggSettings = field(default_factory=DisaggSettings)
    """Prefill/decode disaggregation (router/policies/disagg.py), for fleets with roles."""
    """`kvroute epp`'s own settings (router/epp); `kvroute serve` ignores them."""
    tracing: TracingSettings = field(default_factory=TracingSettings)
    """OpenTelemetry traces over OTLP (router/tracing.py); off without an endpoint."""
