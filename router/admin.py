"""Admin endpoints (need the admin token): fleet membership, draining, routing explained.

    GET    /admin/workers                   the fleet: health, circuit, in-flight, models
    POST   /admin/workers                   {"name", "url", "api_key_env"?} add a worker
    DELETE /admin/workers/{name}            remove it (its in-flight requests finish)
    POST   /admin/workers/{name}/drain      no new requests; in-flight ones finish
    POST   /admin/workers/{name}/undrain
    POST   /debug/route?path=/v1/chat/completions   explain the decision for this body

Answers never contain worker URLs or credentials: an admin may add a worker by URL, but
what the router says about workers uses their names only. Without a configured admin
token every admin endpoint answers 403.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from normalizer.media import MediaReader
from router.auth import KeyCheck, unauthorized
from router.chain import media_elements
from router.cost import CostModel
from router.errors import RouterError
from router.proxy import PROXIED_PATHS
from router.requests import parse_body, validate
from router.routing import CandidateScore, WorkerLoad
from router.workers import ROLES, Fleet, Worker, WorkerSpec, parse_worker_arg

if TYPE_CHECKING:
    from router.routing import PdPlan
    from router.services import Services
    from router.tenants.model import Tenant


ADMIN_BODY_BYTES = 64 * 1024
"""Bodies of the admin API's own requests (a worker, a reload) are small."""


def _json(status: int, content: Any) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


def _bad(message: str, code: str = "invalid_request") -> RouterError:
    return RouterError(400, message, code)


def register_admin(api: FastAPI, services: Services) -> None:
    """The admin endpoints on `api`, over the router's components."""
    admin = _Admin(services)
    _register_worker_endpoints(api, admin)
    _register_tenant_endpoints(api, admin)

    @api.post("/debug/route", include_in_schema=False)
    async def debug_route(request: Request) -> Response:
        admin.check(request)
        path = request.query_params.get("path", "/v1/chat/completions")
        if path not in PROXIED_PATHS:
            raise _bad(f"'path' must be one of {', '.join(PROXIED_PATHS)}.")
        tenant = tenant_named(services, request.query_params.get("tenant"))
        # Any body the proxy takes: an operator asks about the request that was routed.
        body = await json_body(request, services.config.proxy.max_body_bytes)
        return _json(200, await explain(services, path, body, request.headers.get("x-session-id"), tenant))


class _Admin:
    """What the admin endpoints share: the token check each one makes first, and how a
    worker is named and shown."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.token: KeyCheck | None = services.admin_token

    def check(self, request: Request) -> None:
        if self.token is None:
            raise RouterError(403, "Admin endpoints are disabled: no admin token is configured.", "admin_disabled")
        if not self.token.accepts_headers(request.scope["headers"]):
            raise unauthorized(admin=True)

    def info(self, w: Worker) -> dict[str, Any]:
        return {
            "name": w.name,
            "node": w.node,
            "role": w.role,
            "healthy": w.healthy,
            "draining": w.draining,
            "serving": w.serving,
            "circuit": w.breaker.state,
            "inflight": self.services.loads.inflight(w.name),
            "models": sorted(w.models),
        }

    def worker(self, name: str) -> Worker:
        w = self.services.fleet.get(name)
        if w is None:
            raise RouterError(404, f"No worker named '{name}'.", "worker_not_found")
        return w


async def json_body(request: Request, limit: int = ADMIN_BODY_BYTES) -> dict[str, Any]:
    """An admin request's JSON body, refused (413) beyond `limit` bytes."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise RouterError(413, f"This request's body is limited to {limit} bytes.", "request_too_large")
    raw = await request.body()
    if len(raw) > limit:
        raise RouterError(413, f"This request's body is limited to {limit} bytes.", "request_too_large")
    return parse_body(raw)


def _register_worker_endpoints(api: FastAPI, admin: _Admin) -> None:
    """/admin/workers: list, add, remove, drain and undrain workers."""
    fleet = admin.services.fleet

    @api.get("/admin/workers", include_in_schema=False)
    async def list_workers(request: Request) -> Response:
        admin.check(request)
        return _json(200, {"object": "list", "data": [admin.info(w) for w in fleet]})

    @api.post("/admin/workers", include_in_schema=False)
    async def add_worker(request: Request) -> Response:
        admin.check(request)
        spec = worker_spec(await json_body(request), admin.services.environ)
        if fleet.get(spec.name) is not None:
            raise RouterError(409, f"A worker named '{spec.name}' already exists.", "worker_exists")
        added = fleet.add(spec)
        await fleet.check(added)  # usable at once if it is up, not after the next round
        return _json(201, admin.info(added))

    @api.delete("/admin/workers/{name}", include_in_schema=False)
    async def remove_worker(request: Request, name: str) -> Response:
        admin.check(request)
        w = admin.worker(name)
        await fleet.remove(name)
        return _json(200, {"name": name, "removed": True, "inflight": admin.services.loads.inflight(w.name)})

    @api.post("/admin/workers/{name}/drain", include_in_schema=False)
    async def drain(request: Request, name: str) -> Response:
        admin.check(request)
        w = admin.worker(name)
        fleet.drain(name, True)
        return _json(200, admin.info(w))

    @api.post("/admin/workers/{name}/undrain", include_in_schema=False)
    async def undrain(request: Request, name: str) -> Response:
        admin.check(request)
        w = admin.worker(name)
        fleet.drain(name, False)
        admin.services.admission.released()  # capacity came back: let a queued request in
        return _json(200, admin.info(w))


def worker_spec(body: dict[str, Any], environ: Mapping[str, str]) -> WorkerSpec:
    """The worker a `POST /admin/workers` body describes (400 naming the field at fault).
    Its credential is given (`api_key`) or named (`api_key_env`, looked up in `environ`)."""
    name, url = body.get("name"), body.get("url")
    if not isinstance(name, str) or not name or not name.isprintable() or "/" in name or len(name) > 128:
        raise _bad("'name' must be a non-empty printable string without '/' (at most 128 characters).")
    if not isinstance(url, str) or not url:
        raise _bad("'url' must be a string: http://HOST:PORT or https://HOST:PORT.")
    try:
        spec = parse_worker_arg(f"{name}={url}")
    except ValueError:
        raise _bad("'url' must start with http:// or https://.") from None
    api_key = body.get("api_key")
    env_name = body.get("api_key_env")
    if env_name is not None:
        if not isinstance(env_name, str) or env_name not in environ:
            raise _bad("'api_key_env' must name an environment variable set for the router.")
        api_key = environ[env_name]
    if api_key is not None and not isinstance(api_key, str):
        raise _bad("'api_key' must be a string.")
    node = body.get("node")
    if node is not None and (not isinstance(node, str) or not node.isprintable() or len(node) > 128):
        raise _bad("'node' must be a printable string (at most 128 characters).")
    role = body.get("role")
    if role is not None and role not in ROLES:
        raise _bad("'role' must be one of " + ", ".join(ROLES) + ".")
    return WorkerSpec(spec.name, spec.url, api_key, node, role)


def _register_tenant_endpoints(api: FastAPI, admin: _Admin) -> None:
    """/admin/tenants: the tenants in force (without their keys), and a reload of their file."""
    tenants = admin.services.tenants

    @api.get("/admin/tenants", include_in_schema=False)
    async def list_tenants(request: Request) -> Response:
        admin.check(request)
        return _json(200, tenants_info(admin.services))

    @api.post("/admin/tenants/reload", include_in_schema=False)
    async def reload_tenants(request: Request) -> Response:
        admin.check(request)
        if tenants.path is None:
            raise RouterError(409, "No tenants file is configured (--tenants).", "tenants_not_configured")
        try:
            tenants.reload()
        except OSError as exc:
            raise RouterError(422, f"Tenants file not reloaded: {exc.strerror}; the previous tenants stay.",
                              "tenants_invalid") from None
        except ValueError as exc:
            raise RouterError(422, f"Tenants file not reloaded: {exc}; the previous tenants stay.",
                              "tenants_invalid") from None
        return _json(200, tenants_info(admin.services))


def tenants_info(services: Services) -> dict[str, Any]:
    """The tenants in force, without their keys."""
    table = services.tenants.table
    data = [
        {"name": t.name, "cache_scope": t.cache_scope, "weight": t.weight, "keys": len(t.keys),
         "limits": asdict(t.limits)}
        for t in (table.tenants.values() if table is not None else ())
    ]
    return {"object": "list", "reloads": services.tenants.reloads, "data": data}


def tenant_named(services: Services, name: str | None) -> Tenant | None:
    """`/debug/route?tenant=NAME`: explain the routing in that tenant's cache scope (with
    tenants, the index holds each scope's prefixes apart; no `tenant`: the scope of requests
    without one)."""
    if name is None:
        return None
    table = services.tenants.table
    if table is None:
        raise _bad("'tenant' is only meaningful when tenants are configured.")
    tenant = table.tenants.get(name)
    if tenant is None:
        raise RouterError(404, "No tenant by that name.", "tenant_not_found")
    return tenant


async def explain(
    services: Services, path: str, body: dict[str, Any], session_header: str | None, tenant: Tenant | None = None
) -> dict[str, Any]:
    """What `Proxy.decide` chooses for this body, and the numbers it chose by.

    Everything shown comes from that one decision (its one index lookup, the loads it read,
    the policy's own price of each candidate in `RouteDecision.scores`), never recomputed
    here, so the explanation cannot disagree with the decision. Policies that do not price
    candidates (all but cache_aware) show the candidates' loads only.
    """
    proxy = services.proxy
    kind = PROXIED_PATHS[path].kind
    model = validate(body, kind)
    body = proxy.canonical(body, kind)
    if proxy.salter is not None and kind is not None:  # as the proxy salts it: the scope's keys
        body["cache_salt"] = proxy.salter.salt_for(tenant)
    routed = await proxy.decide(body, kind, model, session_header or body.get("user"))
    decision, loads = routed.decision, routed.loads
    chosen: dict[str, Any] = {
        "worker": decision.worker,
        "reason": decision.reason,
        "cached_tokens": decision.cached_tokens,
        "predicted_prefill_s": decision.prefill_s,
    }
    if decision.scores:
        rows = [_priced(score, proxy.cost) for score in decision.scores]
        mine = next(score for score in decision.scores if score.worker == decision.worker)
        chosen.update(predicted_ttft_s=mine.ttft_s, score_s=mine.score_s)
    else:
        rows = [_load(load) for load in loads]
    media = [
        {"kind": m.kind, "key": m.digest.hex(), "tokens": m.tokens}
        for m in media_elements(body, kind, MediaReader(services.config.media))
    ] if kind is not None else []  # fmt: skip
    return {
        "policy": services.policy.name,
        "path": path,
        "model": model,
        "prompt_tokens": routed.chain.total_tokens,
        # Each image, audio clip or video of the prompt: one chain element of these tokens.
        "media": media,
        "chosen": chosen,
        "ranking": [decision.worker, *decision.ranking],
        "candidates": rows,
        "excluded": _excluded(services.fleet, {load.name for load in loads}),
        "cost_model": asdict(proxy.cost),
        "cost_learning": proxy.calibrator is not None,
        **({"disaggregation": _pd(decision.pd, proxy.cost)} if decision.pd is not None else {}),
    }


def _pd(plan: PdPlan, default: CostModel) -> dict[str, Any]:
    """A disaggregated fleet's choice: split (`pd`) or prefill on D (`pd_local`), and why."""
    return {
        "mode": plan.mode,
        "why": plan.why,
        "decode_reason": plan.decode_reason,
        "prefill_worker": plan.prefill_worker,
        "prefill_ranking": list(plan.prefill_ranking),
        "predicted_ttft_s": {"pd": plan.pd_ttft_s, "pd_local": plan.local_ttft_s},
        "predicted_prefill_s": {"prefill_worker": plan.prefill_s, "decode_worker": plan.local_prefill_s},
        "pull_tokens": plan.pull_tokens,
        "transfer_s": plan.transfer_s,
        "running_decodes": plan.running_decodes,
        "local_itl_stall_s": plan.local_stall_s,
        "local_excess_stall_s": plan.local_excess_stall_s,
        "itl_budget_s": plan.itl_budget_s,
        "priced_s": {"pd": plan.pd_cost_s, "pd_local": plan.local_cost_s},
        "prefill_candidates": [_priced(score, default) for score in plan.prefill_scores],
    }


def _load(load: WorkerLoad) -> dict[str, Any]:
    return {
        "worker": load.name, "inflight": load.inflight, "prefilling": load.prefilling,
        "queued_prefill_s": load.queued_prefill_s, "lag_s": load.lag_s, "recent": load.recent,
    }  # fmt: skip


def _priced(score: CandidateScore, default: CostModel) -> dict[str, Any]:
    cost, reuse = score.load.cost, score.reuse
    return {
        **_load(score.load),
        # Which coefficients priced this candidate: its own learned ones, or the router's.
        "cost_source": "learned" if cost is not None else "configured",
        "cost_model": asdict(cost if cost is not None else default),
        "node": score.load.node,
        "cached_tokens_gpu": score.gpu_tokens,
        # The reuse that priced it: tokens kept on its GPU and copied from each tier it
        # reaches (its node's pool and disk, the remote tier), and the farthest of those.
        "tier": reuse.tier,
        "cached_tokens": reuse.tokens,
        "cached_tokens_pool": reuse.pool,
        "cached_tokens_disk": reuse.disk,
        "cached_tokens_remote": reuse.remote,
        "predicted_prefill_s": score.prefill_s,
        "predicted_ttft_s": score.ttft_s,
        "score_s": score.score_s,
        "within_load_bound": score.within_bound,
    }


def _excluded(fleet: Fleet, candidates: set[str]) -> list[dict[str, str]]:
    """The workers the decision did not consider, and why."""
    excluded = []
    for w in fleet:
        if w.name in candidates:
            continue
        if not w.healthy:
            why = "unhealthy"
        elif w.draining:
            why = "draining"
        elif not w.breaker.admits():
            why = f"circuit {w.breaker.state}"
        else:
            why = "does not serve the model"
        excluded.append({"worker": w.name, "why": why})
    return excluded
