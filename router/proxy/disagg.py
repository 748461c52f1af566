"""Prefill/decode disaggregation on the wire: vLLM's NixlConnector protocol.

The decision (router/policies/disagg.py) names a decode worker (D), a prefill worker (P)
and whether to split. A split request goes first to P, as vLLM's own proxy sends it: the
client's body with `kv_transfer_params: {do_remote_decode: true, ...}`, `max_tokens: 1`
(`max_completion_tokens: 1` if present; `max_output_tokens: 1` and `store: false` on
Responses), `stream: false`, without `stream_options` or `min_tokens`. P answers one token
and `kv_transfer_params` naming the blocks it now holds for D; D then gets the client's
own body (streaming as asked) with those params, under the same `X-Request-Id`, pulls the
blocks its prefix cache lacks, and answers the client through the handler's ordinary
attempt (attempt.py), byte for byte except the usage's cached tokens (below).

Faults, each leaving no blocks held on P:

* P fails before answering (connect error, 5xx, timeout): the next prefill worker of the
  decision's ranking, up to `max_attempts`; then D prefills locally (`prefill_failed`).
* P answers without params (its one token was a stop token: vLLM frees the blocks and says
  nothing) or refuses the request (4xx): D prefills locally (`no_params`, `prefill_rejected`),
  counted, since D would otherwise prefill silently.
* D fails before its first byte: the next D gets the same params while P still holds the
  blocks (within `hold_timeout_s` of P's answer; a D that cannot read them recomputes, as
  vLLM does); after that a new prefill (`decode_retry`, `decode_reprefill`).
* The client leaves: the handler's cancellation closes P's connection while P prefills
  (vLLM aborts the request and holds nothing) or D's while D runs (D's abort notifies P,
  which frees the blocks). Params no D was sent (the client left between P's answer and
  D's request, or every D failed) are handed to a decode worker in a one-token request in
  the background, which reads and so frees them (`released`): vLLM frees a hold only when
  a D reads it, or on a D's abort, or at its timeout.

Usage: D reports as cached every prompt token it did not compute (its own hit and the
pulled ones); the client gets, as an aggregated engine reports, the tokens the fleet did not
recompute: P's own cached count (`UsageRewrite`).

With `connector: shared-storage` (a connector that writes the prompt's KV to storage every
worker reads, keyed by the prompt's tokens: vLLM's ExampleConnector) nothing is held and
nothing is handed over: P gets the one-token body without `kv_transfer_params`, its 200
answer (which carries none) means the KV is stored (`stored`), and D gets the client's own
body and loads the stored prefix by the prompt's tokens. A retried D loads it as well.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson

from cache_client.redact import exc_summary
from router.breaker import CLOSED
from router.policies.disagg import NIXL, PD, PD_LOCAL, SHARED_STORAGE, DisaggSettings, PdPricing
from router.proxy.attempt import RETRYABLE_STATUS, AttemptFailed
from router.proxy.exchange import Exchange, PdState, with_credential
from router.proxy.upstream import Headers, UpstreamConnectError, UpstreamError
from router.workers import PREFILL, Worker

if TYPE_CHECKING:
    from router.proxy.context import ProxyContext
    from router.routing import Routed

log = logging.getLogger("kvroute.proxy")

PREFILL_PARAMS = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}  # fmt: skip
"""What vLLM's proxy sends a prefill worker: decode elsewhere, no remote KV to read."""
_DROPPED_ON_PREFILL = ("stream_options", "min_tokens")
_REQUEST_ID = b"x-request-id"


def prefill_body(body: dict[str, Any], kind: str | None, connector: str = NIXL) -> dict[str, Any]:
    """The request as P gets it: one token, whole, asking P to hold its KV for a decoder
    (NIXL); a shared-storage connector stores every prompt's KV unasked."""
    out = {k: v for k, v in body.items() if k not in _DROPPED_ON_PREFILL}
    if connector == NIXL:
        out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    out["stream"] = False
    if kind == "responses":
        out["max_output_tokens"] = 1
        out["store"] = False  # P's one-token answer is no response a client can continue
    else:
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The client's own request, with P's params for D to read the blocks by."""
    return {**body, "kv_transfer_params": params}


def answer_params(answer: dict[str, Any]) -> dict[str, Any] | None:
    """P's `kv_transfer_params` if they ask a decoder to read (None: P holds nothing)."""
    params = answer.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("do_remote_prefill"):
        return params
    return None


def reported_cached(answer: dict[str, Any]) -> int | None:
    """The prompt tokens P reported reusing, in any API's usage (None: no usage)."""
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return None
    if "cache_read_input_tokens" in usage:  # Messages
        return _int(usage.get("cache_read_input_tokens"))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return _int(details.get("cached_tokens")) if isinstance(details, dict) else 0


def _int(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


_CACHED = re.compile(rb'("cached_tokens"\s*:\s*)\d+')
_FLAT_USAGE = re.compile(rb'"usage"\s*:\s*\{[^{}]*"cache_read_input_tokens"[^{}]*\}')
_CACHE_READ = re.compile(rb'("cache_read_input_tokens"\s*:\s*)(\d+)')
_INPUT = re.compile(rb'("input_tokens"\s*:\s*)(\d+)')


def rewrite_usage(data: bytes, cached: int) -> bytes:
    """`data` (a body or stream chunk) with every usage's cached tokens set to `cached`:
    `cached_tokens` (chat, completions, Responses); Messages' `cache_read_input_tokens`,
    its `input_tokens` (the uncached rest) moved by as much. Quotes inside generated text
    are escaped, so only JSON keys match."""
    if b"cached_tokens" in data:
        data = _CACHED.sub(lambda m: m.group(1) + str(cached).encode(), data)
    if b"cache_read_input_tokens" in data:
        data = _FLAT_USAGE.sub(lambda m: _messages_usage(m.group(0), cached), data)
    return data


def _messages_usage(usage: bytes, cached: int) -> bytes:
    read, uncached = _CACHE_READ.search(usage), _INPUT.search(usage)
    if read is None or uncached is None:
        return usage
    total = int(read.group(2)) + int(uncached.group(2))
    new_read = min(cached, total)
    usage = _CACHE_READ.sub(lambda m: m.group(1) + str(new_read).encode(), usage)
    return _INPUT.sub(lambda m: m.group(1) + str(total - new_read).encode(), usage)


class UsageRewrite:
    """The client's ASGI `send`, rewriting the usage of a 200 answer (`rewrite_usage`); a
    whole answer's content-length follows its rewritten body."""

    __slots__ = ("active", "cached", "pending", "send")

    def __init__(self, send: Any, cached: int) -> None:
        self.send, self.cached = send, cached
        self.active = True
        self.pending: dict[str, Any] | None = None

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.active = message["status"] == 200
            if self.active and any(k == b"content-length" for k, _ in message["headers"]):
                self.pending = message  # sent with the body, once its length is known
                return
        elif message["type"] == "http.response.body" and self.active:
            body = rewrite_usage(message.get("body", b""), self.cached)
            message = {**message, "body": body}
            if self.pending is not None:
                start, self.pending = self.pending, None
                headers = [(k, str(len(body)).encode() if k == b"content-length" else v) for k, v in start["headers"]]
                await self.send({**start, "headers": headers})
        await self.send(message)


class PdFlow:
    """The split of requests the decision disaggregates (module docstring)."""

    def __init__(self, proxy: ProxyContext, settings: DisaggSettings, pricing: PdPricing) -> None:
        self.proxy = proxy
        self.settings = settings
        self.pricing = pricing
        self._background: set[asyncio.Task[None]] = set()
        metrics = proxy.metrics.registry
        self.prefills = metrics.counter(
            "kvroute_pd_prefills_total",
            "Requests sent to a prefill worker, by worker and outcome (held: it answered with KV transfer "
            "params; stored: it answered, its KV in the shared storage (pd_connector shared-storage); "
            "no_params: it answered without params; rejected: a 4xx; failed: no answer).",
            ("worker", "outcome"),
        )
        self.fallbacks = metrics.counter(
            "kvroute_pd_fallbacks_total",
            "Disaggregated requests off their planned path: prefill_failed, no_params, prefill_rejected (the "
            "decode worker prefilled locally), decode_retry (another decode worker, same params), "
            "decode_reprefill (a new prefill), released (params no decode worker got, handed to one to free P's "
            "blocks).",
            ("why",),
        )

    @staticmethod
    def roles(candidates: list[Worker]) -> dict[str, str]:
        """The candidates' roles other than `both` (empty: an aggregated fleet)."""
        return {w.name: w.role for w in candidates if w.role != "both"}

    async def prepare(self, ex: Exchange, choice: Routed, worker: Worker) -> tuple[str, float]:
        """Before a decode attempt on `worker`: P's params in hand (a prefill, if none are
        held for this request) and D's body; or the client's body for a local prefill.
        (route reason, D's predicted prefill) of the attempt."""
        plan = choice.decision.pd
        assert plan is not None
        st = ex.pd
        if st is None:
            st = ex.pd = PdState(plan, ex.payload, ex.send, local=plan.mode == PD_LOCAL)
            _ensure_request_id(ex)
        st.plan = plan
        first = not ex.attempts
        if not st.local and (st.params is None or self._expired(st)):
            st.params = None
            if not first:
                self.fallbacks.inc("decode_reprefill")
            probing = worker.breaker.state is not CLOSED  # begin() gave D's probe slot to this try
            try:
                st.local = not await self._prefill(ex, st)
            except BaseException:
                if probing:
                    worker.breaker.abandon()
                raise
        if st.local or st.params is None:
            ex.payload, ex.send = st.payload, st.send
            return (PD_LOCAL if first else "retry"), self._local_prefill_s(choice, worker)
        # Shared storage: D loads the KV by the prompt's tokens, so it gets the client's bytes.
        ex.payload = orjson.dumps(decode_body(ex.body, st.params)) if st.params else st.payload
        ex.send = UsageRewrite(st.send, st.prefill_cached) if st.prefill_cached is not None else st.send
        st.delivered = True
        return (PD if first else "retry"), plan.transfer_s + self.proxy.cost.step_s

    def _local_prefill_s(self, choice: Routed, worker: Worker) -> float:
        """The prefill a decode worker computes itself: as the plan priced it on D, else the
        whole prompt at that worker's costs."""
        plan = choice.decision.pd
        if plan is not None and worker.name == choice.decision.worker:
            return plan.local_prefill_s
        return self._whole_prefill_s(worker, choice)

    def _whole_prefill_s(self, worker: Worker, choice: Routed) -> float:
        """The whole prompt's prefill at `worker`'s costs (a worker the plan did not price)."""
        cost = self.proxy.loads.costs.get(worker.name) or self.proxy.cost
        return cost.prefill_s(0, choice.chain.total_tokens)

    def decode_failed(self, ex: Exchange, exc: AttemptFailed) -> None:
        """D failed before its first byte: its params go to the next D while P holds them."""
        st = ex.pd
        if st is None or st.params is None or not st.delivered:
            return
        st.delivered = False
        if self._expired(st):
            st.params = None
        else:
            self.fallbacks.inc("decode_retry")

    def finish(self, ex: Exchange) -> None:
        """Every end path: params no decode attempt was sent are read by a decoder in the
        background, so that P frees the blocks now rather than at its timeout."""
        st = ex.pd
        if st is None or not st.params or st.delivered or self._expired(st):
            return
        params, st.params = st.params, None
        self.fallbacks.inc("released")
        task = asyncio.get_running_loop().create_task(self._release(ex, params), name="kvroute-pd-release")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _expired(self, st: PdState) -> bool:
        if self.settings.connector == SHARED_STORAGE:
            return False  # the storage keeps what P wrote: no hold runs out
        return time.monotonic() - st.held_at > self.settings.hold_timeout_s * 0.9

    # -- the prefill worker ---------------------------------------------------------------
    async def _prefill(self, ex: Exchange, st: PdState) -> bool:
        """P's params for this request, from the plan's prefill workers in order: True once
        one holds the blocks; False for a local prefill on D."""
        proxy = self.proxy
        payload = orjson.dumps(prefill_body(ex.body, ex.kind, self.settings.connector))
        for name in (st.plan.prefill_worker, *st.plan.prefill_ranking):
            if name is None or len(st.prefill_tried) >= proxy.settings.max_attempts:
                break
            worker = proxy.fleet.get(name)
            if worker is None or name in st.prefill_tried or not worker.serving or worker.role == "decode":
                continue
            if not worker.breaker.begin():
                continue
            st.prefill_tried.add(name)
            outcome = await self._traced_prefill_on(ex, st, worker, payload)
            self.prefills.inc(name, outcome)
            if outcome in ("held", "stored"):
                return True
            if outcome != "failed":
                self.fallbacks.inc("no_params" if outcome == "no_params" else "prefill_rejected")
                return False
        self.fallbacks.inc("prefill_failed")
        return False

    async def _traced_prefill_on(self, ex: Exchange, st: PdState, worker: Worker, payload: bytes) -> str:
        """`_prefill_on`, in a `kvroute.prefill` span whose context P gets when the request
        is traced."""
        tracer = self.proxy.tracer
        trace = tracer.prefill(worker.name) if tracer is not None else None
        if trace is None:
            return await self._prefill_on(ex, st, worker, payload, ex.headers)
        outcome = "cancelled"
        try:
            outcome = await self._prefill_on(ex, st, worker, payload, trace.headers(ex.headers))
            return outcome
        finally:
            trace.prefilled(outcome)

    async def _prefill_on(self, ex: Exchange, st: PdState, worker: Worker, payload: bytes, headers: Headers) -> str:
        """One prefill try: held, no_params, rejected or failed. Its prefill is queued on
        the worker's load like any request's until it answers."""
        proxy = self.proxy
        probing = worker.breaker.state is not CLOSED
        prefill_s = st.plan.prefill_s
        if worker.name != st.plan.prefill_worker and ex.choice is not None:
            prefill_s = self._whole_prefill_s(worker, ex.choice)
        ticket = proxy.loads.acquire(worker.name, prefill_s)
        s = proxy.settings
        try:
            status, body = await asyncio.wait_for(
                self._exchange(worker, ex.scope["path"], with_credential(headers, worker.api_key, s.forward_client_auth), payload),
                s.total_timeout_s or s.first_byte_timeout_s,
            )
        except (asyncio.TimeoutError, UpstreamError) as exc:
            why = "no answer before the timeout" if isinstance(exc, asyncio.TimeoutError) else exc_summary(exc)
            return await self._prefill_failed(worker, why, isinstance(exc, UpstreamConnectError))
        except BaseException:
            if probing:
                worker.breaker.abandon()
            raise
        finally:
            proxy.loads.release(ticket)
            proxy.prefill_queue.kick()
        if status in RETRYABLE_STATUS:
            return await self._prefill_failed(worker, f"worker answered {status}", False)
        worker.breaker.success()
        proxy.fleet.mark_ok(worker.name)
        proxy.metrics.requests.inc(worker.name, "pd_prefill", str(status))
        if status != 200:
            return "rejected"
        if ex.choice is not None and (proxy.chains.records_on_route or ex.choice.chain.fallback):
            await proxy.record_prefix(worker, ex.choice.chain)  # P's prefix cache keeps the prompt
        return self._held(st, body)

    def _held(self, st: PdState, body: bytes) -> str:
        """P's 200 answer read: held (NIXL params in hand), stored (shared storage) or no_params."""
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            return "no_params"
        if not isinstance(answer, dict):
            return "no_params"
        shared = self.settings.connector == SHARED_STORAGE
        params = {} if shared else answer_params(answer)
        if params is None:
            return "no_params"
        st.params, st.held_at, st.delivered = params, time.monotonic(), False
        st.prefill_cached = reported_cached(answer)
        return "stored" if shared else "held"

    async def _prefill_failed(self, worker: Worker, why: str, connect: bool) -> str:
        worker.breaker.failure(why)
        self.proxy.metrics.requests.inc(worker.name, "pd_prefill", "error")
        log.warning("prefill worker %s failed (%s)", worker.name, why)
        if connect:
            await self.proxy.fleet.mark_failed(worker.name)
        return "failed"

    async def _exchange(self, worker: Worker, path: str, headers: Headers, payload: bytes) -> tuple[int, bytes]:
        """POST and read the whole answer; a cancellation closes the connection (the
        worker aborts the request and holds nothing)."""
        upstream = await self.proxy.client.post(worker.url, path, headers, payload)
        try:
            return upstream.status, await upstream.read()
        finally:
            await upstream.aclose()

    # -- releasing a hold no decoder was sent -----------------------------------------------
    async def _release(self, ex: Exchange, params: dict[str, Any]) -> None:
        """Read the blocks on a decode worker in a one-token request, and drop its answer."""
        proxy = self.proxy
        body = decode_body(prefill_body(ex.body, ex.kind), params)
        payload = orjson.dumps(body)
        order = [ex.choice.decision.worker, *ex.choice.decision.ranking] if ex.choice is not None else []
        auth = proxy.settings.forward_client_auth
        for name in order:
            worker = proxy.fleet.get(name)
            if worker is None or not worker.serving or worker.role == PREFILL:
                continue
            try:
                status, _ = await asyncio.wait_for(
                    self._exchange(worker, ex.scope["path"], with_credential(ex.headers, worker.api_key, auth), payload),
                    proxy.settings.first_byte_timeout_s,
                )
            except (asyncio.TimeoutError, UpstreamError) as exc:
                log.warning("releasing a prefill hold on %s failed (%s)", name, exc_summary(exc))
                continue
            if status == 200:
                return
        log.warning("a prefill hold was left to its timeout: no decode worker took the release")

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)


def _ensure_request_id(ex: Exchange) -> None:
    """P and D must see one request id (vLLM's proxy sends both the same `X-Request-Id`)."""
    if not any(k == _REQUEST_ID for k, _ in ex.headers):
        ex.headers = [*ex.headers, (_REQUEST_ID, f"kvroute-{uuid.uuid4().hex}".encode())]
