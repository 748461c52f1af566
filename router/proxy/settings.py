"""What the proxy serves and how it forwards: the proxied paths and `ProxySettings`."""

from __future__ import annotations

from dataclasses import dataclass

from router.chain import RequestKind

PROXIED_PATHS: dict[str, RequestKind | None] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": None,
    "/v1/responses": "responses",
}
"""Path -> the kind of prompt it carries (None: embeddings, routed on load alone)."""


@dataclass(frozen=True)
class ProxySettings:
    """The `proxy` section of the router's config: how requests are read and forwarded."""

    max_body_bytes: int = 32 * 1024 * 1024
    max_attempts: int = 3
    """Distinct workers tried for one request before it fails."""
    first_byte_timeout_s: float = 300.0
    """Until the worker's first body byte (queueing + prefill), per attempt."""
    idle_timeout_s: float = 120.0
    """Longest silence between two chunks of a stream."""
    total_timeout_s: float | None = None
    connect_timeout_s: float = 5.0
    max_connections: int = 4096
    forward_client_auth: bool = False
    upstream_client: str = "raw"
    """The forwarding client (router/proxy/upstream.py): "raw", or "httpx" / "aiohttp" to
    compare against in benchmarks (`kvroute bench-proxy` names like kvroute-POLICY+httpx)."""
