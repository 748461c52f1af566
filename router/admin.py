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

import os
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response

from cache_client.base import EMPTY_VIEW
from normalizer.canonical import canonicalize_body
from router.auth import KeyCheck, unauthorized
from router.errors import RouterError
from router.proxy import PROXIED_PATHS
from router.requests import parse_body, validate
from router.routing import cached_tokens
from router.workers import Worker, WorkerSpec, parse_worker_arg

if TYPE_CHECKING:
    from router.app import KvrouteApp


def _json(status: int, content: Any) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


def _bad(message: str, code: str = "invalid_request") -> RouterError:
    return RouterError(400, message, code)


def register_admin(api: FastAPI, app: KvrouteApp, token: KeyCheck | None) -> None:
    def check(request: Request) -> None:
        if token is None:
            raise RouterError(403, "Admin endpoints are disabled: no admin token is configured.", "admin_disabled")
        if not token.accepts_headers(request.scope["headers"]):
            raise unauthorized(admin=True)

    def info(w: Worker) -> dict[str, Any]:
        return {
            "name": w.name,
            "healthy": w.healthy,
            "draining": w.draining,
            "serving": w.serving,
            "circuit": w.breaker.state,
            "inflight": app.loads.inflight(w.name),
            "models": sorted(w.models),
        }

    def worker(name: str) -> Worker:
        assert app.fleet is not None
        w = app.fleet.get(name)
        if w is None:
            raise RouterError(404, f"No worker named '{name}'.", "worker_not_found")
        return w

    async def json_body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if len(raw) > 64 * 1024:
            raise RouterError(413, "Admin request bodies are limited to 64 KiB.", "request_too_large")
        return parse_body(raw)

    @api.get("/admin/workers", include_in_schema=False)
    async def list_workers(request: Request) -> Response:
        check(request)
        assert app.fleet is not None
        return _json(200, {"object": "list", "data": [info(w) for w in app.fleet]})

    @api.post("/admin/workers", include_in_schema=False)
    async def add_worker(request: Request) -> Response:
        check(request)
        assert app.fleet is not None
        body = await json_body(request)
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
            if not isinstance(env_name, str) or env_name not in os.environ:
                raise _bad("'api_key_env' must name an environment variable set for the router.")
            api_key = os.environ[env_name]
        if api_key is not None and not isinstance(api_key, str):
            raise _bad("'api_key' must be a string.")
        if app.fleet.get(name) is not None:
            raise RouterError(409, f"A worker named '{name}' already exists.", "worker_exists")
        added = app.fleet.add(WorkerSpec(spec.name, spec.url, api_key))
        app.index.set_capacity(name, app.config.kv_capacity_tokens)
        await app.fleet.check(added)  # usable at once if it is up, not after the next round
        return _json(201, info(added))

    @api.delete("/admin/workers/{name}", include_in_schema=False)
    async def remove_worker(request: Request, name: str) -> Response:
        check(request)
        assert app.fleet is not None
        w = worker(name)
        await app.fleet.remove(name)
        return _json(200, {"name": name, "removed": True, "inflight": app.loads.inflight(w.name)})

    @api.post("/admin/workers/{name}/drain", include_in_schema=False)
    async def drain(request: Request, name: str) -> Response:
        check(request)
        assert app.fleet is not None
        w = worker(name)
        app.fleet.drain(name, True)
        return _json(200, info(w))

    @api.post("/admin/workers/{name}/undrain", include_in_schema=False)
    async def undrain(request: Request, name: str) -> Response:
        check(request)
        assert app.fleet is not None
        w = worker(name)
        app.fleet.drain(name, False)
        app.admission.released()  # capacity came back: let a queued request in
        return _json(200, info(w))

    @api.post("/debug/route", include_in_schema=False)
    async def debug_route(request: Request) -> Response:
        check(request)
        assert app.fleet is not None and app.proxy is not None
        path = request.query_params.get("path", "/v1/chat/completions")
        if path not in PROXIED_PATHS:
            raise _bad(f"'path' must be one of {', '.join(PROXIED_PATHS)}.")
        return _json(200, await explain(app, path, await json_body(request), request.headers.get("x-session-id")))


async def explain(app: KvrouteApp, path: str, body: dict[str, Any], session_header: str | None) -> dict[str, Any]:
    """What `Proxy.decide` chooses for this body, and the numbers behind it per worker.

    The per-worker prediction is the cache-aware policy's: queued prefill + in-flight ×
    the per-request batch penalty + the prefill of the tokens the worker does not hold
    (tokens in the shared pool cost their copy instead).
    """
    assert app.fleet is not None and app.proxy is not None
    proxy = app.proxy
    kind = PROXIED_PATHS[path]
    model = validate(body, kind)
    if kind is not None:
        body = canonicalize_body(body, proxy.settings.normalize)
    session_key = session_header or body.get("user")
    choice = await proxy.decide(body, kind, model, session_key)
    decision, chain = choice.decision, choice.chain
    candidates = app.fleet.candidates(model)
    names = [w.name for w in candidates]
    view = await app.index.lookup(chain.keys) if kind is not None and app.policy.uses_index else EMPTY_VIEW
    cost = proxy.cost
    rows = []
    for load in app.loads.snapshot(names):
        gpu, pool = cached_tokens(chain, view, load.name)
        reuse = max(gpu, pool)
        prefill = cost.pool_load_s(pool - gpu) + cost.prefill_s(reuse, chain.total_tokens)
        ttft = load.queued_prefill_s + load.inflight * cost.inflight_penalty_s + prefill
        rows.append(
            {
                "worker": load.name,
                "cached_tokens_gpu": gpu,
                "cached_tokens_pool": pool,
                "predicted_prefill_s": prefill,
                "predicted_ttft_s": ttft,
                "inflight": load.inflight,
                "queued_prefill_s": load.queued_prefill_s,
                "recent": load.recent,
            }
        )
    rows.sort(key=lambda r: r["predicted_ttft_s"])
    excluded = []
    for w in app.fleet:
        if w.name in names:
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
    return {
        "policy": app.policy.name,
        "path": path,
        "model": model,
        "prompt_tokens": chain.total_tokens,
        "chosen": {
            "worker": decision.worker,
            "reason": decision.reason,
            "cached_tokens": decision.cached_tokens,
            "predicted_prefill_s": decision.prefill_s,
        },
        "ranking": [decision.worker, *decision.ranking],
        "candidates": rows,
        "excluded": excluded,
    }
