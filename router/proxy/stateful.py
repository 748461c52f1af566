"""Stateful Responses affinity: which worker holds each stored response, and the requests
that must go there.

vLLM keeps stored responses in the memory of the worker that produced them: a request with
`previous_response_id`, and `GET`/`DELETE /v1/responses/{id}`, `/cancel`, `/input_items`,
can only be served by that worker (any other answers 404), which also holds the
conversation's KV cache. So:

* learning: a `/v1/responses` answered 200 (and not `"store": false`) records its id ->
  worker (`ResponsesAffinity.learner`), from the JSON body, or from the stream's first
  event (`response.created`), scanned as bytes while the relay goes on (`ResponseIdScanner`);
* pinning: a request with `previous_response_id` goes to the owner, a GPU hit for the
  tokens the conversation holds (`ResponsesAffinity.pin`), and is never retried elsewhere;
* the by-id endpoints are forwarded to the owner (`ResponsesAffinity.by_id`).

Owner unknown (never seen, expired): 404 `response_not_found`; owner drained, down or
removed, or failing before its first byte: 503 `response_owner_unavailable`. Both say to
resend the full input without `previous_response_id`.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import TYPE_CHECKING, Any

import orjson

from cache_client.redact import exc_summary
from cache_client.response_owners import OwnerRecord, ResponseOwners
from normalizer.prefix import PrefixChain
from router.errors import RouterError
from router.proxy.exchange import read_body, upstream_headers, with_credential
from router.proxy.relay import response_headers, send_whole
from router.proxy.upstream import UpstreamError
from router.routing import RouteDecision

if TYPE_CHECKING:
    from router.cost import CostModel
    from router.proxy.context import ProxyContext
    from router.workers import Fleet, Worker

log = logging.getLogger("kvroute.proxy")

SCAN_LIMIT = 64 * 1024
"""Bytes of a stream's beginning scanned for its response id; past them, give up."""
RESPONSES_BY_ID = "/v1/responses/"
BY_ID_PATH = re.compile(r"^/v1/responses/([A-Za-z0-9_.\-]{1,256})(/cancel|/input_items)?$")
_BY_ID_METHODS = {"": ("GET", "DELETE"), "/cancel": ("POST",), "/input_items": ("GET",)}
# In `response.created`, the response object's "id" (vLLM and OpenAI write it first).
_CREATED = re.compile(rb'"response\.created".*?"response"\s*:\s*\{.*?"id"\s*:\s*"([^"\\]{1,256})"', re.DOTALL)
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d{1,9})')
_RESEND = "Resend the full conversation as `input`, without `previous_response_id`."


def not_found(response_id: str) -> RouterError:
    return RouterError(
        404, f"The router does not know the response '{response_id}' (never seen, or expired): "
        f"it cannot tell which worker stores it. {_RESEND}", "response_not_found",
    )


def owner_unavailable(response_id: str) -> RouterError:
    return RouterError(
        503, f"The worker that stores the response '{response_id}' is unavailable (drained, down or "
        f"removed); no other worker has it. {_RESEND}", "response_owner_unavailable",
    )


def previous_id(body: dict[str, Any]) -> str | None:
    """The stored response a `/v1/responses` body continues, if any."""
    prev = body.get("previous_response_id")
    return prev if isinstance(prev, str) and prev else None


class ResponseIdScanner:
    """Finds the response id in the first bytes of a Responses stream, as the chunks pass
    by (never holding them back, never re-serialising them): `feed` each chunk until
    `done`; `response_id` is then the id, or None past `SCAN_LIMIT` bytes without one."""

    __slots__ = ("buffer", "done", "response_id")

    def __init__(self) -> None:
        self.buffer = b""
        self.done = False
        self.response_id: str | None = None

    def feed(self, chunk: bytes) -> str | None:
        if self.done:
            return self.response_id
        # Only what is still within the limit is kept: a huge first chunk is cut, not copied whole.
        self.buffer += chunk[: SCAN_LIMIT - len(self.buffer)]
        match = _CREATED.search(self.buffer)
        if match is not None:
            self.response_id = match.group(1).decode("ascii", "replace")
        if match is not None or len(self.buffer) >= SCAN_LIMIT:
            self.done = True
            self.buffer = b""
        return self.response_id


class Learner:
    """Records the owner of one answered `/v1/responses` request."""

    __slots__ = ("affinity", "last", "previous", "response_id", "scanner", "task", "tokens", "worker")

    def __init__(self, affinity: ResponsesAffinity, worker: str, tokens: int) -> None:
        self.affinity = affinity
        self.worker = worker
        self.tokens = tokens
        """The conversation's tokens as estimated before the answer (input side)."""
        self.scanner: ResponseIdScanner | None = None
        self.task: asyncio.Task | None = None
        self.response_id: str | None = None
        self.previous = b""
        self.last = b""
        """The stream's last two chunks (references, not copies): where its usage is."""

    async def from_body(self, body: bytes) -> None:
        """A whole answer: its "id", and its usage when the worker reports it. Recorded
        before the client has the id, so its next request finds the owner on any replica."""
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        if not isinstance(answer, dict) or not isinstance(answer.get("id"), str):
            return
        usage = answer.get("usage")
        total = usage.get("total_tokens") if isinstance(usage, dict) else None
        tokens = total if isinstance(total, int) and total > 0 else self.tokens
        await self.affinity.remember(answer["id"], OwnerRecord(self.worker, tokens))

    def feed(self, chunk: bytes) -> None:
        """A stream chunk, after it was relayed: once the id is found, record it in the
        background (the relay does not wait for Redis)."""
        scanner = self.scanner
        if scanner is None:
            scanner = self.scanner = ResponseIdScanner()
        if scanner.done:
            if self.response_id is not None:
                self.previous, self.last = self.last, chunk
            return
        response_id = self.response_id = scanner.feed(chunk)
        if response_id is not None:
            record = OwnerRecord(self.worker, self.tokens)
            self.task = asyncio.ensure_future(self.affinity.remember(response_id, record))

    async def settle(self) -> None:
        """Before the stream's last byte: the record is made (the client's next request
        may follow at once, on another replica), with the tokens `response.completed`
        reports if the stream ended with it."""
        if self.task is not None:
            await self.task
        if self.response_id is None or not self.last:
            return
        tail = self.previous + self.last
        done = tail.rfind(b'"response.completed"')
        match = _TOTAL_TOKENS.search(tail, done) if done >= 0 else None
        if match is not None and int(match.group(1)) > 0:
            await self.affinity.remember(self.response_id, OwnerRecord(self.worker, int(match.group(1))))


class ResponsesAffinity:
    """The response-owner map of one router, and the decisions made from it."""

    def __init__(self, owners: ResponseOwners, ttl_s: float) -> None:
        self.owners = owners
        self.ttl_s = ttl_s

    async def remember(self, response_id: str, record: OwnerRecord) -> None:
        try:
            await self.owners.remember(response_id, record, self.ttl_s)
        except Exception as exc:  # never the request's failure
            log.error("recording a response owner failed: %s", exc_summary(exc))

    def learner(self, body: dict[str, Any], worker: str, prompt_tokens: int, prior_tokens: int) -> Learner | None:
        """A `Learner` for an answer from `worker`, unless the client asked not to store it."""
        if body.get("store") is False:
            return None
        return Learner(self, worker, prior_tokens + prompt_tokens)

    async def owner_of(self, response_id: str, fleet: Fleet) -> tuple[OwnerRecord, Worker]:
        record = await self.owners.owner(response_id)
        if record is None:
            raise not_found(response_id)
        worker = fleet.get(record.worker)
        if worker is None or not worker.serving:
            raise owner_unavailable(response_id)
        return record, worker

    async def pin(
        self, response_id: str, chain: PrefixChain, fleet: Fleet, cost: CostModel
    ) -> tuple[RouteDecision, OwnerRecord]:
        """The decision for a request continuing `response_id`: its owner in `fleet`, nothing
        else to try; its prefill priced by `cost`."""
        record, worker = await self.owner_of(response_id, fleet)
        total = record.tokens + chain.total_tokens
        decision = RouteDecision(
            worker=worker.name, reason="gpu_hit", cached_tokens=record.tokens,
            prefill_s=cost.prefill_s(record.tokens, total),
        )
        return decision, record

    # -- GET/DELETE /v1/responses/{id}, POST .../cancel, GET .../input_items --------------
    async def by_id(self, proxy: ProxyContext, scope: dict, receive: Any, send: Any) -> None:
        try:
            await self._by_id(proxy, scope, receive, send)
        except RouterError as exc:
            proxy.metrics.rejected.inc(exc.code)
            await send_whole(send, exc.status, exc.headers(), exc.body())
        except Exception as exc:  # a bug: a redacted line and an OpenAI-style 500, no traceback
            log.error("internal error on %s: %s", scope["path"], exc_summary(exc))
            error = RouterError(500, "Internal router error.", "internal_error")
            await send_whole(send, 500, error.headers(), error.body())

    async def _by_id(self, proxy: ProxyContext, scope: dict, receive: Any, send: Any) -> None:
        match = BY_ID_PATH.match(scope["path"])
        if match is None:
            raise RouterError(404, "Not Found.", "not_found")
        response_id, action = match.group(1), match.group(2) or ""
        method = scope["method"]
        if method not in _BY_ID_METHODS[action]:
            raise RouterError(405, f"Method {method} is not allowed here.", "method_not_allowed")
        body = await read_body(scope, receive, proxy.settings.max_body_bytes)
        _, worker = await self.owner_of(response_id, proxy.fleet)
        path = scope["path"] + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
        auth = proxy.settings.forward_client_auth
        headers = with_credential(upstream_headers(scope, auth), worker.api_key, auth)
        try:
            upstream = await asyncio.wait_for(
                proxy.client.request(method, worker.url, path, headers, body), proxy.settings.first_byte_timeout_s
            )
        except (UpstreamError, asyncio.TimeoutError):
            raise owner_unavailable(response_id) from None
        try:
            answer = await asyncio.wait_for(upstream.read(), proxy.settings.first_byte_timeout_s)
        except (UpstreamError, asyncio.TimeoutError):
            raise owner_unavailable(response_id) from None
        finally:
            await upstream.aclose()
        if method == "DELETE" and upstream.status == 200:
            await self.owners.forget(response_id)
        await send_whole(send, upstream.status, response_headers(upstream.headers, worker.name, "pinned"), answer)
