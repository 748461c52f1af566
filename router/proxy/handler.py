"""The hot path: the proxied endpoints (OpenAI's, Anthropic's Messages) as a raw ASGI handler.

Per request: read the body (bounded), parse it once (orjson), canonicalize it, hash its
prefix chain once, look the chain up in the index (at most one round trip), ask the policy,
forward the canonical bytes, and relay the answer. Streams are relayed chunk by chunk as
the worker sends them, never parsed or re-serialised.

Failures before the first byte (connect errors, 5xx answers, first-byte timeouts) are
retried on the next worker of the policy's ranking; after the first byte a stream ends with
an error event in the endpoint's own stream format (relay.py). Errors the router answers
itself are in the endpoint's error shape (`Exchange.endpoint.api`). A client that disconnects cancels the handler,
which closes the upstream request so the engine aborts it and frees its KV blocks.

This module is the request's outline: `Proxy.__call__` (the ASGI entry: body, errors,
disconnects), `decide` (rank the candidates), `handle` (then, for each candidate in
order, one `Attempt`, attempt.py; the answer itself is relay.py's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from cache_client.base import EMPTY_VIEW, IndexView, PrefixIndex, key_tokens_of
from cache_client.redact import exc_summary
from cache_client.response_owners import MemoryResponseOwners
from cache_client.served_ends import ServedEnds
from cache_client.tiers import Tiers
from normalizer.canonical import NormalizeOptions
from normalizer.prefix import PrefixChain
from router.auth import presented_key
from router.calibration import Calibrator, Dispatch, relative_error
from router.chain import ChainBuilder, RequestKind
from router.cost import CostModel
from router.errors import RouterError
from router.load import LoadBoard
from router.metrics import RouterMetrics
from router.policies.base import Policy
from router.policies.disagg import choose_pd
from router.policies.least_loaded import LeastLoadedPolicy
from router.proxy.admission import Admission, NoAdmission
from router.proxy.attempt import Attempt, AttemptFailed
from router.proxy.deadlines import Deadlines
from router.proxy.exchange import Disconnected, Exchange, canonical, read_body
from router.proxy.fair import NO_FLOW, Flow
from router.proxy.prefill_queue import NoPrefillQueue, PrefillQueue
from router.proxy.relay import send_whole
from router.proxy.settings import ProxySettings
from router.proxy.stateful import Learner, ResponsesAffinity, owner_unavailable, previous_id
from router.proxy.upstream import Headers, UpstreamClient, UpstreamResponse, make_upstream_client
from router.routing import Routed, RouteDecision, RouteRequest
from router.tenants.enforce import OverLimit
from router.tenants.limits import REASONS
from router.tracing import lookup_outcome
from router.workers import Fleet, Worker

if TYPE_CHECKING:
    from router.proxy.disagg import PdFlow
    from router.tenants.enforce import TenantLimiter
    from router.tenants.model import Tenant
    from router.tenants.salt import CacheSalter
    from router.tracing import Tracer

log = logging.getLogger("kvroute.proxy")

_EMBEDDINGS_POLICY = LeastLoadedPolicy()
_EMPTY_CHAIN = PrefixChain((), (), 0)
# Builds a Routed from a plain tuple, skipping the NamedTuple's Python-level __new__ (one
# per request; as for CandidateScore in router/policies/cache_aware.py).
_new_routed = tuple.__new__

_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_INPUT = re.compile(rb'"input_tokens"\s*:\s*(\d+)')
_CACHE_READ = re.compile(rb'"cache_read_input_tokens"\s*:\s*(\d+)')
_CACHE_CREATION = re.compile(rb'"cache_creation_input_tokens"\s*:\s*(\d+)')

_Outcome = Literal["answered", "full", "held", "exhausted"]
"""How one pass over a ranking ended: a worker answered; every worker left was at its
in-flight limit (wait for a slot); the free slots are reserved for tenants below their fair
share (wait); or nothing is left to try."""


class _NotStarted:
    """The forwarding client before `Proxy.start()`: a request then is a bug, said plainly."""

    async def post(self, base_url: str, path: str, headers: Headers, body: bytes) -> UpstreamResponse:
        raise RuntimeError("the proxy forwards only once started (Proxy.start)")

    async def request(self, method: str, base_url: str, path: str, headers: Headers, body: bytes = b"") -> UpstreamResponse:
        raise RuntimeError("the proxy forwards only once started (Proxy.start)")

    async def aclose(self) -> None:
        return None


_NOT_STARTED = _NotStarted()


class TenantLookup(Protocol):
    """Who holds a client key (`TenantRegistry`: the table in force, swapped on reload)."""

    def for_key(self, key: bytes | None) -> Tenant | None: ...


class Proxy:
    """The request's outline (module docstring), over the router's parts: its stages
    (attempt.py, relay.py, stateful.py, disagg.py) see it as a `ProxyContext`."""

    attempt_type: type[Attempt] = Attempt
    """What one try on one worker is: `Attempt` forwards it; the endpoint picker's
    (router/epp) answers its gateway with the worker and observes the gateway's answer."""
    pd: PdFlow | None = None
    """Splits requests between prefill and decode workers in a fleet with roles
    (router/proxy/disagg.py); None: every request goes whole to one worker."""
    tracer: Tracer | None = None
    """OpenTelemetry spans of each request (router/tracing.py); None: tracing off."""
    client: UpstreamClient
    """The forwarding client: the one given, or `settings.upstream_client`'s from `start()`."""
    admission: Admission
    """Per-worker in-flight limits and the wait queue (NoAdmission: no limits)."""
    prefill_queue: PrefillQueue
    """Holds requests while every worker has a full step of prefill queued (NoPrefillQueue: off)."""
    tiers: Tiers
    """The tiers besides the GPUs (pools, disks, remote): where a routed prefix is also
    recorded."""
    affinity: ResponsesAffinity
    """Which worker stores each Responses-API response (router/proxy/stateful.py)."""
    ends: ServedEnds | None
    """Where the prompts sent to workers ended: which worker a request without a reply
    continues (`RouteRequest.continues`). None when the policy reads no index."""
    tenants: TenantLookup | None
    """Tenants by client key (None: no tenants configured)."""
    salter: CacheSalter | None
    """With tenants: the `cache_salt` of each request's cache scope (router/tenants/salt.py)."""
    limiter: TenantLimiter | None
    """With tenants: their limits (router/tenants/enforce.py)."""
    calibrator: Calibrator | None
    """Learns each worker's costs from its answers (None: `--cost-learning off`)."""

    def __init__(
        self,
        settings: ProxySettings,
        fleet: Fleet,
        index: PrefixIndex,
        loads: LoadBoard,
        policy: Policy,
        cost: CostModel,
        chains: ChainBuilder,
        metrics: RouterMetrics,
        client: UpstreamClient | None = None,
        admission: Admission | None = None,
        *,
        normalize: NormalizeOptions | None = None,
        tiers: Tiers | None = None,
        affinity: ResponsesAffinity | None = None,
        ends: ServedEnds | None = None,
        tenants: TenantLookup | None = None,
        salter: CacheSalter | None = None,
        limiter: TenantLimiter | None = None,
        calibrator: Calibrator | None = None,
        prefill_queue: PrefillQueue | None = None,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.index = index
        self.loads = loads
        self.policy = policy
        self.cost = cost
        self.chains = chains
        self.metrics = metrics
        self._given_client = client
        self.client = client if client is not None else _NOT_STARTED
        self.deadlines = Deadlines()
        self.normalize = normalize if normalize is not None else NormalizeOptions()
        self.tiers = tiers if tiers is not None else Tiers()
        self.affinity = affinity if affinity is not None else ResponsesAffinity(MemoryResponseOwners(), 3600.0)
        self.ends = ends if ends is not None else (ServedEnds() if policy.uses_index else None)
        self.tenants, self.salter, self.limiter, self.calibrator = tenants, salter, limiter, calibrator
        self.admission = admission if admission is not None else NoAdmission()
        if self.admission.activity is not None:
            self.admission.bind_slots(self._fleet_slots)
        self.prefill_queue = prefill_queue if prefill_queue is not None else NoPrefillQueue()
        self.prefill_queue.free_workers = self._free_workers

    # -- ASGI entry ---------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        ex = Exchange(scope, send, time.perf_counter())
        task = asyncio.current_task()
        watcher: asyncio.Task | None = None
        try:
            raw = await read_body(scope, receive, self.settings.max_body_bytes)
            watcher = asyncio.create_task(self._watch(ex, receive, task))  # type: ignore[arg-type]
            self.prepare(ex, raw)
            await self.handle(ex)
        except Disconnected:
            self.metrics.client_disconnects.inc()
        except RouterError as exc:
            self.metrics.rejected.inc(exc.code)
            if not ex.started:
                await send_whole(send, exc.status, exc.headers(), exc.body(ex.endpoint.api))
        except asyncio.CancelledError:
            if ex.disconnected:
                self.metrics.client_disconnects.inc()
            else:
                # Cancelled by the server itself: the graceful-shutdown grace period ran out.
                # Answer what can still be answered instead of letting the server log a
                # traceback for every request still in flight.
                log.warning("request on %s cancelled: the router is shutting down", scope["path"])
                if not ex.started:
                    error = RouterError(503, "The router is shutting down; retry.", "shutting_down", retry_after=1)
                    with contextlib.suppress(Exception):
                        await send_whole(send, 503, error.headers(), error.body(ex.endpoint.api))
            task.uncancel()  # type: ignore[union-attr]
        except Exception as exc:
            # A bug, not bad input: the client gets an OpenAI-style 500 (never a traceback),
            # the log gets the exception type and where it was raised (never its message,
            # which may carry a worker URL).
            log.error("internal error on %s: %s", scope["path"], exc_summary(exc))
            self.metrics.rejected.inc("internal_error")
            if not ex.started:
                error = RouterError(500, "Internal router error.", "internal_error")
                await send_whole(send, 500, error.headers(), error.body(ex.endpoint.api))
        finally:
            if watcher is not None:
                watcher.cancel()
            self.end(ex)

    def prepare(self, ex: Exchange, raw: bytes) -> None:
        """Whose request it is (its tenant, from the client key), and its body read once:
        parsed, checked, canonicalized with the tenant's cache salt, serialized."""
        if self.tenants is not None:
            ex.tenant = self.tenants.for_key(presented_key(ex.scope["headers"]))
        salt = self.salter.salt_for(ex.tenant) if self.salter is not None else None
        ex.load(raw, self.settings, self.normalize, salt)

    def end(self, ex: Exchange) -> None:
        """Every end path (answer, error, disconnect, cancel): give back the tenant's hold
        and charge the generated tokens to its limits and its fair share."""
        if ex.pd is not None and self.pd is not None:
            self.pd.finish(ex)  # a prefill hold no decode worker was sent is freed now
        if ex.tenant is None:
            return
        if ex.grant is not None and self.limiter is not None:
            grant, ex.grant = ex.grant, None
            self.limiter.finish(grant, ex.generated)
        if ex.generated:
            self.admission.charge(_flow(ex), ex.generated)

    @staticmethod
    async def _watch(ex: Exchange, receive: Any, task: asyncio.Task) -> None:
        """Cancel the request's task when its client disconnects (before the answer ends)."""
        # Loops because a server may hand over an empty body message first; only a
        # disconnect ends the watch.
        while (await receive())["type"] != "http.disconnect":
            pass
        if not ex.finished:
            ex.disconnected = True
            task.cancel()

    # -- routing ------------------------------------------------------------------------
    def _candidates(self, model: str, within: frozenset[str] | None = None) -> list[Worker]:
        candidates = self.fleet.candidates(model or None)  # "": a pass-through without a model
        if within is not None:
            candidates = [w for w in candidates if w.name in within]
            if not candidates:
                raise RouterError(503, "No worker the gateway allows is available for this model.", "no_healthy_worker", retry_after=1)
        if candidates:
            return candidates
        known = any(model in w.models for w in self.fleet)
        if known or not any(w.models for w in self.fleet):
            raise RouterError(503, "No healthy worker is available for this model.", "no_healthy_worker", retry_after=1)
        raise RouterError(404, f"The model '{model}' does not exist.", "model_not_found")

    def canonical(self, body: dict[str, Any], kind: RequestKind | None) -> dict[str, Any]:
        """`body` as `decide` expects it and the workers get it (see `exchange.canonical`)."""
        return canonical(body, kind, self.normalize)

    async def decide(
        self, body: dict[str, Any], kind: RequestKind | None, model: str, session_key: str | None,
        chain: PrefixChain | None = None, within: frozenset[str] | None = None,
    ) -> Routed:
        """Everything between a canonical body and a worker: the part `/debug/route` explains.
        It only reads (the index, the loads, the ends memory): what routing a request teaches
        the router is recorded when the request is sent (`record_sent`), so a dry run
        changes no later decision. `chain`: the body's, if already built; `within`: the
        workers a gateway allows (None: all)."""
        if kind == "responses" and (prev := previous_id(body)) is not None:
            routed = await self._pinned(body, prev)
            if within is not None and routed.decision.worker not in within:
                raise owner_unavailable(prev)
            return routed
        tracer = self.tracer
        started = time.perf_counter() if tracer is not None else 0.0
        candidates = self._candidates(model, within)
        if kind is None:
            chain, view, continues, lookup = _EMPTY_CHAIN, EMPTY_VIEW, None, None
        else:
            chain = chain if chain is not None else self.chains.build(body, kind)
            view, continues, lookup = await self._lookup(chain) if self.policy.uses_index else (EMPTY_VIEW, None, None)
        # Loads are read after the lookup: requests arriving while it awaits (a Redis round
        # trip) must see each other's tickets, or a burst all lands on one worker.
        loads = self.loads.snapshot([w.name for w in candidates])
        if self.fleet.scrape_metrics:
            # The engines' own queues also count requests of other routers sharing them.
            loads = [
                replace(load, engine_waiting=int(w.metrics.get("vllm:num_requests_waiting", 0)))
                for load, w in zip(loads, candidates, strict=True)
            ]
        if any(w.node for w in candidates):  # workers on named nodes: which tiers each reaches
            loads = [replace(load, node=w.node) for load, w in zip(loads, candidates, strict=True)]
        if kind is None:
            decision = _EMBEDDINGS_POLICY.choose(RouteRequest(chain), view, loads, self.cost)
        elif self.pd is not None and (roles := self.pd.roles(candidates)):
            request = RouteRequest(chain, session_key, continues)
            decision = choose_pd(self.policy, request, view, loads, self.cost, roles, self.pd.pricing)
        else:
            decision = self.policy.choose(RouteRequest(chain, session_key, continues), view, loads, self.cost)
        routed = _new_routed(Routed, (decision, chain, view, loads))
        if tracer is not None:
            tracer.decided(routed, started, lookup)
        return routed

    async def _lookup(self, chain: PrefixChain) -> tuple[IndexView, str | None, tuple[float, str] | None]:
        """The chain's one index lookup: what the index holds of it, the worker whose prompt
        it continues (if any), and, when traced, the lookup's seconds and outcome."""
        fallbacks = _fallbacks(self.index) if self.tracer is not None else None
        t0 = time.perf_counter()
        view = await self.index.lookup(chain.keys)
        lookup_s = time.perf_counter() - t0
        self.metrics.index_lookup_seconds.observe(lookup_s)
        continues = None
        if self.ends is not None and not chain.reply_depth:
            # Read only: a dry run (/debug/route) must not change later decisions.
            continues = self.ends.lookup(chain, view)
        if self.tracer is None:
            return view, continues, None
        return view, continues, (lookup_s, lookup_outcome(view.depths, fallbacks, _fallbacks(self.index)))

    async def _pinned(self, body: dict[str, Any], response_id: str) -> Routed:
        """A request continuing a stored response: its owner only (the owner lookup is the
        request's one round trip, in place of the index lookup)."""
        chain = self.chains.build(body, "responses")
        decision, _ = await self.affinity.pin(response_id, chain, self.fleet, self.cost)
        loads = self.loads.snapshot([decision.worker])
        return _new_routed(Routed, (decision, chain, EMPTY_VIEW, loads))

    def learner(self, ex: Exchange, worker: str) -> Learner | None:
        """Records who answered a `/v1/responses` request (unless it is not stored)."""
        choice = ex.choice
        if choice is None:
            return None
        prior = choice.decision.cached_tokens if previous_id(ex.body) is not None else 0
        return self.affinity.learner(ex.body, worker, choice.chain.total_tokens, prior)

    def learn_cost(self, ex: Exchange, worker: str, sent_at: float, first_byte_s: float, tail: bytes) -> None:
        """A stream sent to `worker` at `sent_at` (the loop's clock), its first token
        `first_byte_s` after (the first byte; a Responses stream's first output item,
        `relay_stream`), its usage in `tail`: record the prediction error and feed the
        worker's cost model. Every API's streams teach it (`_cached_tokens` reads each one's
        usage); requests of no kind (embeddings, rerank) have no prefill to learn from."""
        choice = ex.choice
        if choice is None or ex.kind is None or choice.decision.worker != worker:
            return  # or a retry went elsewhere than the decision priced
        if ex.pd is not None and not ex.pd.local:
            return  # D's first token waited on P's prefill: no measure of D's own costs
        dispatch = _dispatch_of(choice, worker)
        if dispatch is None:
            return
        if dispatch.predicted_ttft_s is not None:
            error = relative_error(dispatch.predicted_ttft_s, first_byte_s)
            if error == error:  # not NaN
                self.metrics.ttft_prediction_error.observe(error, worker)
        if self.calibrator is not None:
            self.calibrator.observe(
                dispatch, first_byte_s, _cached_tokens(tail, dispatch.total_tokens), sent_at,
            )

    # -- rank, then attempt each candidate in turn --------------------------------------
    async def handle(self, ex: Exchange) -> None:
        """A loaded request (`prepare`), from its tenant's limits and the admission queue
        to the end of its answer; each try is an `attempt_type` (the endpoint picker's
        answers its gateway instead of forwarding)."""
        if self.tracer is not None and not self.tracer.tracing(ex):
            await self.tracer.request(self.handle, ex)  # `handle` again, inside its span
            return
        admission = self.admission
        first: Routed | None = None
        flow = _flow(ex) if admission.activity is not None else NO_FLOW
        if admission.activity is not None:
            admission.arrived(flow)
        try:
            if self.limiter is not None and self.limiter.applies(ex.tenant):
                first = await self._check_limits(ex, decide=not admission.busy(flow))
            if admission.busy(flow):
                first = None  # decided again after the wait: the loads will have changed
                await self._wait_for_slot(ex)
            if self.prefill_queue.enabled:
                first = await self._hold_for_prefill(ex, first)
            while True:
                choice = first or await self.decide(ex.body, ex.kind, ex.model, ex.session_key, within=ex.within)
                first = None
                if ex.choice is None:
                    self._observe_route(ex, choice)
                ex.choice = choice
                outcome = await self._try_ranking(ex, choice)
                if outcome == "answered":
                    return
                if outcome == "exhausted" or ex.attempts >= self.settings.max_attempts:
                    break
                # Every worker we could still try is at its in-flight limit, or the free slots
                # are reserved for tenants below their fair share: wait for a slot.
                await self._wait_for_slot(ex, held_back=outcome == "held")
        finally:
            if ex.turn:
                admission.end_turn()
            self._end_prefill_turn(ex)
        if ex.kind == "responses" and (prev := previous_id(ex.body)) is not None:
            # Pinned: no other worker stores that response (it would answer 404).
            raise owner_unavailable(prev)
        raise RouterError(502, f"The request failed on every worker tried ({ex.last_error}).", "upstream_unavailable")

    async def _check_limits(self, ex: Exchange, *, decide: bool) -> Routed | None:
        """The tenant's limits (429 naming the one exceeded). With `decide`, the routing
        decision is made meanwhile, so that the check rides in its index lookup's round trip."""
        assert self.limiter is not None and ex.tenant is not None
        chain = self.chains.build(ex.body, ex.kind) if ex.kind is not None else _EMPTY_CHAIN
        pending = self.limiter.begin(ex.tenant, chain.total_tokens)
        choice = None
        try:
            if decide:
                choice = await self.decide(ex.body, ex.kind, ex.model, ex.session_key, chain=chain, within=ex.within)
        finally:
            # Settled even if deciding failed: the check may have been charged in Redis.
            try:
                ex.grant = await self.limiter.settle(pending)
            except OverLimit as exc:
                self.metrics.tenant_rejected(ex.tenant, REASONS[exc.limit])
                raise
        return choice

    async def _hold_for_prefill(self, ex: Exchange, first: Routed | None) -> Routed | None:
        """While every candidate has a full engine step of prefill queued, wait in the prefill
        queue (router/proxy/prefill_queue.py) and return None: decided again with the loads
        of its turn. A request pinned to one worker (a stored response's owner) does not
        wait. With in-flight limits it keeps the slot it was handed meanwhile."""
        if ex.kind == "responses" and previous_id(ex.body) is not None:
            return first
        choice = first or await self.decide(ex.body, ex.kind, ex.model, ex.session_key, within=ex.within)
        queue = self.prefill_queue
        if not queue.must_wait(ex.model, choice.loads):
            return choice
        t0 = time.perf_counter()
        try:
            ex.prefill_turn = await queue.wait(ex.model, choice.decision.prefill_s)
        finally:
            if self.tracer is not None:
                self.tracer.span_between("kvroute.prefill_queue_wait", t0, {"kvroute.turn": ex.prefill_turn})
        return None

    def _end_prefill_turn(self, ex: Exchange) -> None:
        """The request took its ticket (or gave up): a turn it held goes to the next waiter."""
        if ex.prefill_turn:
            ex.prefill_turn = False
            self.prefill_queue.end_turn(ex.model)

    def _free_workers(self, model: str) -> int:
        """`model`'s serving workers under the prefill queue's busy mark."""
        candidates = self.fleet.candidates(model or None)
        return self.prefill_queue.free(self.loads.snapshot([w.name for w in candidates]))

    def _observe_route(self, ex: Exchange, choice: Routed) -> None:
        """The first decision's metrics (a request re-ranked after queueing counts once)."""
        self.metrics.route_seconds.observe(time.perf_counter() - ex.arrived)
        if ex.kind is not None:
            self.metrics.prompt_tokens.inc(amount=choice.chain.total_tokens)
            decision = choice.decision
            self.metrics.predicted_cached.inc(amount=decision.engine_cached_tokens)
            if decision.reuse.copied:
                for tier, tokens in (("pool", decision.reuse.pool), ("disk", decision.reuse.disk),
                                     ("remote", decision.reuse.remote)):
                    if tokens:
                        self.metrics.predicted_copied.inc(tier, amount=tokens)
            if self.metrics.tenants is not None:
                self.metrics.tenants.prompt(ex.tenant, choice.chain.total_tokens)

    async def _wait_for_slot(self, ex: Exchange, *, held_back: bool = False) -> None:
        """Queue until the admission hands this request a slot (429 if none comes in time).
        `held_back`: the free slots are reserved for other tenants (not for this one)."""
        admission = self.admission
        if not ex.queue_deadline:
            ex.queue_deadline = asyncio.get_running_loop().time() + admission.queue_timeout_s
        requeue, ex.turn = ex.turn, False
        flow = _flow(ex)
        t0 = time.perf_counter()
        try:
            await admission.wait(
                ex.queue_deadline, requeue=requeue, pass_on=requeue and (held_back or self._room_anywhere(flow)),
                flow=flow, held_back=held_back,
            )
        except RouterError:
            self.metrics.tenant_rejected(ex.tenant, "queue")
            raise
        finally:
            self.metrics.tenant_queue_wait(ex.tenant, time.perf_counter() - t0)
            if self.tracer is not None:
                self.tracer.span_between("kvroute.admission_wait", t0, {"kvroute.held_back": held_back})
        ex.turn = True

    async def _try_ranking(self, ex: Exchange, choice: Routed) -> _Outcome:
        """Offer the request to the ranked workers in order, one attempt each, until one answers."""
        admission = self.admission
        max_attempts = self.settings.max_attempts
        flow, light = NO_FLOW, False
        if admission.activity is not None:
            flow = _flow(ex)
            light = admission.light(flow)
            if not admission.may_take(flow, holding_turn=ex.turn):
                return "held"
        full = False
        for name in self._ranking(choice.decision, light):
            if ex.attempts >= max_attempts:
                break
            if ex.disconnected:
                # The client left while a timeout was being handled (both cancelled
                # this task, one cancellation was consumed): no retry for nobody.
                raise Disconnected()
            worker = self.fleet.get(name)
            if worker is None or name in ex.tried or not worker.serving:
                continue
            if admission.limits_inflight and not admission.room_for(name, self.loads.inflight(name), flow, light=light):
                full = True
                continue
            if not worker.breaker.begin():
                continue
            attempt = await self._attempt_on(ex, choice, worker)
            self._begin_attempt(ex, attempt, flow, light, choice.chain)
            # One try on one worker, inline rather than a coroutine of its own: every frame
            # between the task and the upstream read is re-entered on each chunk relayed.
            try:
                await self.record_sent(ex, worker, choice.chain)
                await attempt.run(ex)
                return "answered"
            except AttemptFailed as exc:
                await self._attempt_failed(ex, attempt, exc)
            except BaseException:
                attempt.abandon()
                raise
            finally:
                admission.gave_back(flow)
                attempt.release()
                if attempt.trace is not None:
                    attempt.trace.close(ex)
        return "full" if full else "exhausted"

    def _ranking(self, decision: RouteDecision, light: bool) -> list[str]:
        """The workers to try, in order: the policy's choice, then its ranking; a light
        tenant's request goes first where no prefill is in flight (`Admission.light_order`)."""
        ranking = [decision.worker, *decision.ranking]
        if light:
            ranking = self.admission.light_order(ranking, lambda: _no_dearer(decision))
        return ranking

    async def _attempt_on(self, ex: Exchange, choice: Routed, worker: Worker) -> Attempt:
        """The try of `ex` on `worker`, with its route reason and its predicted prefill there:
        the decision's for its choice (a disaggregated request's after P's prefill, or for a
        local one), else the whole prompt at the worker's own costs."""
        decision = choice.decision
        expected = _expected_first_token_s(choice, worker.name, ex.stream)
        if decision.pd is not None and self.pd is not None:  # P's params first, or a local prefill
            reason, prefill_s = await self.pd.prepare(ex, choice, worker)
        elif worker.name == decision.worker:
            reason, prefill_s = decision.reason, decision.prefill_s
        else:
            reason = "retry" if ex.attempts else "overload"
            cost = self.loads.costs.get(worker.name) or self.cost  # its own learned costs, if any
            prefill_s = cost.prefill_s(0, choice.chain.total_tokens)
        return self.attempt_type(self, worker, reason, prefill_s, *expected)

    def _begin_attempt(self, ex: Exchange, attempt: Attempt, flow: Flow, light: bool, chain: PrefixChain) -> None:
        """The attempt is made: the turns the request held are used, the worker counts as
        tried, the tenant's prefill is in flight (and served: its fair share is charged at
        the first attempt), and the attempt gets its span."""
        admission = self.admission
        if ex.turn:
            admission.end_turn()
            ex.turn = False
        self._end_prefill_turn(ex)
        ex.attempts += 1
        ex.tried.add(attempt.worker.name)
        admission.took(flow)
        if admission.activity is not None:
            attempt.mark(flow, light=light, stream=ex.stream)
        if ex.attempts == 1 and ex.tenant is not None:
            admission.charge(_flow(ex), chain.total_tokens)
        if self.tracer is not None:
            attempt.trace = self.tracer.attempt(ex, attempt.worker.name, attempt.reason)

    async def _attempt_failed(self, ex: Exchange, attempt: Attempt, exc: AttemptFailed) -> None:
        """The worker failed before its first byte: count it; the next worker may try."""
        ex.last_error = exc.why
        if ex.pd is not None and self.pd is not None:
            self.pd.decode_failed(ex, exc)
        await attempt.failed(exc.why, exc.passive_down)
        retrying = ex.attempts < self.settings.max_attempts
        if retrying:
            self.metrics.retries.inc()
        log.warning("worker %s failed before the first byte (%s); %s", attempt.worker.name, exc.why,
                    "retrying" if retrying else "giving up")

    def _fleet_slots(self) -> tuple[int, int]:
        """(free, total) in-flight slots across the serving workers (the reservation's view)."""
        per_worker = self.admission.per_worker
        inflight = self.loads.inflight
        free = total = 0
        for w in self.fleet:
            if w.serving:
                total += per_worker
                free += max(0, per_worker - inflight(w.name))
        return free, total

    def _room_anywhere(self, flow: Flow) -> bool:
        """Some serving worker has a slot free to `flow` (that this request could not use). A
        slot on a worker guarding another tenant's prefill is not free to it."""
        admission = self.admission
        return any(w.serving and admission.room_for(w.name, self.loads.inflight(w.name), flow) for w in self.fleet)

    async def record_sent(self, ex: Exchange, worker: Worker, chain: PrefixChain) -> None:
        """`ex` is sent to `worker` (not a dry run): what routing it teaches the router."""
        if chain.keys:
            if self.ends is not None:
                self.ends.record(worker.name, chain)
            if self.chains.records_on_route or chain.fallback:
                await self.record_prefix(worker, chain)
                ex.recorded = True

    async def record_prefix(self, worker: Worker, chain: PrefixChain) -> None:
        """The prompt is now on `worker`'s GPU and, once its LMCache stores it, in the
        tiers it writes to (its node's pool and disk, the remote tier)."""
        key_tokens = key_tokens_of(chain.cum_tokens)
        for location in self.tiers.written(worker.name, worker.node):
            await self.index.record(location, chain.keys, key_tokens)

    async def start(self) -> None:
        # Built here, in the serving loop: aiohttp's session binds the loop it is made in.
        if self._given_client is None:
            s = self.settings
            self.client = make_upstream_client(
                connect_timeout_s=s.connect_timeout_s, max_connections=s.max_connections, kind=s.upstream_client
            )

    async def stop(self) -> None:
        if self.pd is not None:
            await self.pd.stop()
        await self.deadlines.close()
        await self.client.aclose()


def _fallbacks(index: PrefixIndex) -> float | None:
    """A shared index's count of lookups answered from the local view (None: not shared)."""
    stats = getattr(index, "stats", None)
    return stats.get("fallback_lookups") if isinstance(stats, dict) else None


def _flow(ex: Exchange) -> Flow:
    """The request's flow in the fair-share queue: its tenant (weighted), or none."""
    tenant = ex.tenant
    return NO_FLOW if tenant is None else Flow(tenant.name, tenant.weight)


def _no_dearer(decision: RouteDecision) -> frozenset[str] | None:
    """The workers where the request's own prefill costs no more than its prefill and the
    queued prefill on the policy's choice (None: the policy priced no candidates)."""
    chosen = next((s for s in decision.scores if s.worker == decision.worker), None)
    if chosen is None:
        return None
    budget_s = chosen.prefill_s + chosen.load.queued_prefill_s
    return frozenset(s.worker for s in decision.scores if s.prefill_s <= budget_s)


def _expected_first_token_s(choice: Routed, worker: str, stream: bool) -> tuple[float | None, float | None]:
    """What an attempt on `worker` is measured against, from one look at the decision:

    * for the outlier detector (router/breaker.py): the policy's predicted time to first
      byte there (0.0: a policy that predicts nothing), or None if the worker had a queue
      when the request was sent (requests of the router's awaiting their first byte there,
      or waiting in its engine). A queued answer says how busy the worker is, which the
      policy already weighs, not whether it is sick;
    * for the load board's lag (`WorkerLoad.lag_s`): a streamed request's time to first
      token as the cost model predicts it, before any lag; None for a whole answer (its
      first byte comes after its decode) or a policy that predicts nothing."""
    score = next((s for s in choice.decision.scores if s.worker == worker), None)
    load = score.load if score is not None else next((w for w in choice.loads if w.name == worker), None)
    judged = None
    if load is not None and not load.prefilling and not load.engine_waiting:
        judged = score.ttft_s if score is not None else 0.0
    modelled = max(score.ttft_s - score.load.lag_s, 0.0) if stream and score is not None else None
    return judged, modelled


def _dispatch_of(choice: Routed, worker: str) -> Dispatch | None:
    """What the decision knew about `worker` when it sent the request there."""
    load = next((w for w in choice.loads if w.name == worker), None)
    if load is None:
        return None
    decision = choice.decision
    score = next((s for s in decision.scores if s.worker == worker), None)
    return Dispatch(
        worker, choice.chain.total_tokens, decision.cached_tokens, score.gpu_tokens if score else decision.cached_tokens,
        load.queued_prefill_s, load.inflight, load.engine_waiting, decision.prefill_s,
        score.ttft_s if score else None, score.reuse.disk if score else 0, score.reuse.remote if score else 0,
    )  # fmt: skip


def _cached_tokens(tail: bytes, total_tokens: int) -> int | None:
    """The prompt tokens the engine reports it reused, in the router's token units (its
    estimate of the prompt's length may differ from the engine's count); None if the stream
    carried no usage. Chat and completions: `prompt_tokens_details.cached_tokens` of
    `prompt_tokens`; Responses: `input_tokens_details.cached_tokens` of `input_tokens`;
    Messages (vLLM, as Anthropic): `cache_read_input_tokens`, of `input_tokens` + those +
    `cache_creation_input_tokens` (Anthropic's `input_tokens` leaves the cached ones out)."""
    read = _CACHE_READ.findall(tail)
    if read:
        cached = int(read[-1])
        creation = _CACHE_CREATION.findall(tail)
        prompt = cached + sum(int(found[-1]) for found in (_INPUT.findall(tail), creation) if found)
    else:
        found_cached, found_prompt = _CACHED.findall(tail), _PROMPT.findall(tail) or _INPUT.findall(tail)
        if not found_cached or not found_prompt:
            return None
        cached, prompt = int(found_cached[-1]), int(found_prompt[-1])
    if prompt <= 0:
        return None
    return round(min(cached, prompt) * total_tokens / prompt)
