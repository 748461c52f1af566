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
    kv_capacity_tokens: int = 2_000_000
    pool_capacity_tokens: int = 0
    """>0: the workers share an LMCache CPU pool of this many tokens."""

    # routing
    load_factor: float = 1.25
    recent_half_life_s: float = 30.0
    cost_prefill_base_us: float = 20.3
    cost_prefill_ctx_ns: float = 1.01
    cost_pool_load_us: float = 2.4
    cost_inflight_penalty_ms: float = 2.0

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

    # health
    health_interval_s: float = 2.0
    unhealthy_after: int = 2
    scrape_metrics: bool = False
