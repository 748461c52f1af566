"""What the proxy serves and how it forwards: the proxied endpoints and `ProxySettings`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from router.chain import RequestKind

Api = Literal["openai", "anthropic"]
"""Whose error shapes an endpoint speaks (router/errors.py)."""


class Endpoint(NamedTuple):
    """One proxied path: the kind of prompt it carries (None: a pass-through, routed on
    load alone among the workers serving the model) and whose error shapes it answers in."""

    kind: RequestKind | None
    api: Api = "openai"
    model_optional: bool = False
    """vLLM's tokenize/detokenize/rerank/score take `model` as optional (one model per
    engine): without it the request goes to any worker serving."""


OPENAI_PASS_THROUGH = Endpoint(None)
_MODEL_OPTIONAL = Endpoint(None, model_optional=True)

PROXIED_PATHS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint("chat"),
    "/v1/completions": Endpoint("completion"),
    "/v1/responses": Endpoint("responses"),
    "/v1/messages": Endpoint("messages", "anthropic"),
    "/v1/messages/count_tokens": Endpoint(None, "anthropic"),
    "/v1/embeddings": OPENAI_PASS_THROUGH,
    "/tokenize": _MODEL_OPTIONAL,
    "/detokenize": _MODEL_OPTIONAL,
    "/v1/rerank": _MODEL_OPTIONAL,
    "/rerank": _MODEL_OPTIONAL,
    "/v2/rerank": _MODEL_OPTIONAL,
    "/v1/score": _MODEL_OPTIONAL,
    "/score": _MODEL_OPTIONAL,
}
"""Path -> its `Endpoint` (every one is POST)."""


def api_of(path: str) -> Api:
    """The error shape a path answers in (OpenAI's unless it is an Anthropic endpoint)."""
    endpoint = PROXIED_PATHS.get(path)
    return endpoint.api if endpoint is not None else "openai"


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
