"""One client request on its way through the proxy: `Exchange`, and how its body is read.

The handler creates one `Exchange` per request when it arrives and fills it in as the request
moves on: the body as read, parsed, canonicalised and serialised once (`payload`, the exact
bytes every attempt forwards), the headers to forward, the routing choice, the retry
bookkeeping, and the flags the disconnect watcher and the error handlers read (`started`:
the response has begun, so errors can no longer be answered with a status; `finished`: the
last byte is being sent, so a disconnect now is no cancellation; `disconnected`). In a
disaggregated fleet it also carries its split between prefill and decode workers (`PdState`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from normalizer.anthropic import canonicalize_messages_body
from normalizer.canonical import canonicalize_body
from normalizer.responses import canonicalize_responses_body
from router.chain import RequestKind
from router.errors import RouterError
from router.proxy.settings import PROXIED_PATHS, Endpoint, ProxySettings
from router.requests import parse_body, validate

if TYPE_CHECKING:
    from normalizer.canonical import NormalizeOptions
    from router.routing import PdPlan, Routed
    from router.tenants.enforce import Grant
    from router.tenants.model import Tenant

Headers = list[tuple[bytes, bytes]]

# Never forwarded upstream: hop-by-hop headers (RFC 9110 §7.6.1), what the client sets itself,
# and the client's credentials (workers get their own, see WorkerSpec.api_key).
_DROP_REQUEST_HEADERS = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
        b"accept-encoding", b"authorization", b"cookie", b"x-api-key",
    }
)


@dataclass
class PdState:
    """One request's split between prefill and decode workers, across its decode attempts
    (router/proxy/disagg.py's `PdFlow` fills it in)."""

    plan: PdPlan
    payload: bytes
    """The client's request as loaded (what a local prefill sends)."""
    send: Any
    """The client's own ASGI send."""
    local: bool = False
    """D prefills what it lacks: decided so, or no prefill worker gave params."""
    params: dict[str, Any] | None = None
    """P's params while P holds the blocks for this request; empty when P stored the KV
    where every decode worker reads it (shared-storage: nothing to hand over)."""
    held_at: float = 0.0
    prefill_cached: int | None = None
    delivered: bool = False
    """`params` went to a decode attempt (whose end or abort frees P's blocks)."""
    prefill_tried: set[str] = field(default_factory=set)


class Disconnected(Exception):
    """The client went away before an answer could start."""


class Exchange:
    __slots__ = (
        "arrived", "attempts", "body", "choice", "disconnected", "endpoint", "finished", "generated", "grant",
        "headers", "kind", "last_error", "model", "payload", "pd", "prefill_turn", "queue_deadline", "recorded", "scope", "send",
        "session_key",
        "started", "stream", "tenant", "tried", "turn", "within",
    )  # fmt: skip

    def __init__(self, scope: dict, send: Any, arrived: float) -> None:
        self.scope = scope
        self.send = send
        self.arrived = arrived
        """perf_counter() when the request arrived: route and TTFT metrics count from here."""
        self.endpoint: Endpoint = PROXIED_PATHS[scope["path"]]
        """What the path carries and whose error shapes it answers in (known before the body)."""
        self.started = False
        self.finished = False
        self.disconnected = False
        self.kind: RequestKind | None = None
        self.body: dict[str, Any] = {}
        self.model = ""
        self.payload = b""
        self.headers: Headers = []
        """Forwarded to every worker tried (each attempt adds the worker's credential)."""
        self.stream = False
        self.session_key: str | None = None
        self.choice: Routed | None = None
        """The latest routing decision (None until the first)."""
        self.attempts = 0
        self.recorded = False
        """Its routing was recorded in the index: its answer ends once the record is written."""
        self.tried: set[str] = set()
        self.last_error = "no worker tried"
        self.turn = False
        """Holds a slot handed over by the admission queue, until it takes a ticket."""
        self.prefill_turn = False
        """Holds a turn handed over by the prefill queue, until it takes a ticket."""
        self.queue_deadline = 0.0
        """Loop time by which a queued request must have a slot (0: never queued yet)."""
        self.tenant: Tenant | None = None
        """Whose request this is: resolved once from the client key (None: no tenants, or
        a key no tenant holds)."""
        self.grant: Grant | None = None
        """The tenant limits' hold on this request, given back whichever way it ends."""
        self.generated = 0
        """Generated tokens the answer's usage reported (with tenants: charged to the tenant)."""
        self.pd: PdState | None = None
        """In a disaggregated fleet: its split across decode attempts (`PdState`)."""
        self.within: frozenset[str] | None = None
        """The workers it may go to, when a gateway narrows them (the endpoint picker's
        subset hint, router/epp); None: every candidate."""

    def load(
        self, raw: bytes, settings: ProxySettings, normalize: NormalizeOptions, cache_salt: str | None = None
    ) -> None:
        """Parse the body once, check it, and serialise its canonical form for forwarding.
        `cache_salt` (tenants' cache isolation) replaces any the client sent."""
        kind = self.kind = self.endpoint.kind
        body = parse_body(raw)
        self.model = validate(body, kind, self.endpoint.model_optional)
        try:
            body = canonical(body, kind, normalize)
            if cache_salt is not None and kind is not None:
                body["cache_salt"] = cache_salt
            self.payload = orjson.dumps(body)
        except (orjson.JSONEncodeError, RecursionError):
            # orjson parses 1024 levels of nesting but serialises 254: deeper is bad input.
            raise RouterError(400, "The request body is nested too deeply.", "invalid_body") from None
        self.body = body
        self.session_key = session_key(self, body)
        self.headers = upstream_headers(self.scope, settings.forward_client_auth)
        self.stream = body.get("stream") is True

    def header(self, name: bytes) -> str | None:
        for k, v in self.scope["headers"]:
            if k == name:
                return v.decode("latin-1")
        return None


def session_key(ex: Exchange, body: dict[str, Any]) -> str | None:
    """The client's hint that requests belong to one conversation, first found of: the
    `x-session-id` header, aiperf's `x-session-affinity` header, the OpenAI
    `prompt_cache_key` (meant for exactly this routing), Anthropic's `metadata.user_id`,
    then `user`. Only strings count (validate checks `user`; the others are optional hints)."""
    key = ex.header(b"x-session-id") or ex.header(b"x-session-affinity")
    if key:
        return key
    hint = body.get("prompt_cache_key")
    if isinstance(hint, str) and hint:
        return hint
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        hint = metadata.get("user_id")
        if isinstance(hint, str) and hint:
            return hint
    return body.get("user")


def canonical(body: dict[str, Any], kind: RequestKind | None, normalize: NormalizeOptions) -> dict[str, Any]:
    """The body as it is routed and forwarded: generation requests canonicalized (so that
    equal prompts hash and cache alike), embeddings as sent."""
    if kind is None:
        return body
    return _CANONICALIZE.get(kind, canonicalize_body)(body, normalize)


_CANONICALIZE = {"responses": canonicalize_responses_body, "messages": canonicalize_messages_body}


def upstream_headers(scope: dict, forward_client_auth: bool) -> Headers:
    headers = [(k, v) for k, v in scope["headers"] if k not in _DROP_REQUEST_HEADERS]
    if forward_client_auth:
        headers += [(k, v) for k, v in scope["headers"] if k == b"authorization"]
    headers.append((b"accept-encoding", b"identity"))
    return headers


def with_credential(headers: Headers, api_key: str | None, forward_client_auth: bool) -> Headers:
    """`headers` for a worker: with the worker's own credential, if it has one and the
    client's is not forwarded."""
    if api_key and not forward_client_auth:
        return [*headers, (b"authorization", b"Bearer " + api_key.encode())]
    return headers


def _too_large(limit: int) -> RouterError:
    return RouterError(413, f"Request body exceeds the limit of {limit} bytes.", "request_too_large")


async def read_body(scope: dict, receive: Any, limit: int) -> bytes:
    """The whole request body, refused (413) as soon as it is known to exceed `limit`."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
