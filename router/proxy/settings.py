"""What the proxy serves and how it forwards: the proxied paths and `ProxySettings`."""

from __future__ import annotations

from dataclasses import dataclass, field

from normalizer.canonical import NormalizeOptions
from router.chain import RequestKind

PROXIED_PATHS: dict[str, RequestKind | None] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": None,
}
"""Path -> the kind of prompt it carries (None: embeddings, routed on load alone)."""


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
