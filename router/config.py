"""Router settings: one dataclass, filled from flags, `KVROUTE_*` environment variables and
an optional YAML file (in that order of precedence)."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.workers import WorkerSpec


@dataclass
class RouterConfig:
    workers: list[WorkerSpec] = field(default_factory=list)
    discover: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 8000
    processes: int = 1
    log_level: str = "info"

    # index
    redis: str | None = None
    redis_prefix: str = "kvroute"
    redis_ttl_s: float = 3600.0
    """Index entries not used for this long expire (Redis backend)."""
    redis_lookup_budget_ms: float = 5.0
    """Longest a lookup waits for Redis before routing on the replica's local view."""
    kv_capacity_tokens: int = 840_000
    pool_capacity_tokens: int = 0
    """>0: the workers share an LMCache CPU pool of this many tokens."""

    # routing
    load_factor: float = 1.25
    recent_half_life_s: float = 30.0
    cost_prefill_base_us: float = 20.3
    cost_prefill_ctx_ns: float = 1.01
    cost_pool_load_us: float = 2.4
    cost_inflight_penalty_ms: float = 0.3
    cost_step_ms: float = 15.0

    # normalizer
    normalize_tool_schemas: bool = True
    normalize_tool_arguments: bool = True
    normalize_system_prompt: bool = True

    # forwarding
    max_body_bytes: int = 32 * 1024 * 1024
    max_attempts: int = 3
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 300.0
    idle_timeout_s: float = 120.0
    total_timeout_s: float | None = None
    max_connections: int = 4096
    forward_client_auth: bool = False
    upstream_client: str = "raw"
    """The forwarding client (router/proxy/upstream.py): "raw", or "httpx" / "aiohttp" to
    compare against in benchmarks (`kvroute bench-proxy` names like kvroute-POLICY+httpx)."""

    # health
    health_interval_s: float = 2.0
    unhealthy_after: int = 2
    scrape_metrics: bool = False

    # passive health: circuit breakers and outlier ejection (router/breaker.py)
    breaker_failures: int = 5
    """Consecutive failures that open a worker's circuit (0: never)."""
    breaker_open_s: float = 5.0
    breaker_max_open_s: float = 60.0
    outlier_interval_s: float = 10.0
    """How often error-rate and latency outliers are judged (0: off)."""
    outlier_min_requests: int = 20
    outlier_error_rate: float = 0.5
    outlier_latency_factor: float = 5.0
    outlier_ejection_s: float = 30.0
    outlier_max_ejected_fraction: float = 0.5

    # overload (router/proxy/admission.py)
    max_inflight_per_worker: int = 0
    """Requests in flight to one worker before new ones wait (0: no limit)."""
    queue_size: int = 1024
    """Requests that may wait for a slot; beyond, 429."""
    queue_timeout_s: float = 10.0
    retry_after_s: int = 1
    shutdown_grace_s: float = 30.0
    """On SIGTERM, how long in-flight requests may take to finish."""
    keep_alive_s: int = 75
    """Idle client connections are kept this long. Longer than clients and load balancers
    keep theirs (httpx 5 s, nginx 60 s), so that the router never closes a connection at
    the moment a client sends a request on it (the client sees a failure without a byte)."""

    # security (router/auth.py)
    api_keys: list[str] = field(default_factory=list)
    """Client keys accepted on /v1/* (empty: no authentication)."""
    api_keys_file: str | None = None
    admin_token: str | None = None
    """Token for /admin/* and /debug/* (prefer KVROUTE_ADMIN_TOKEN or the file)."""
    admin_token_file: str | None = None
