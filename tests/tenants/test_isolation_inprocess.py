"""Cache isolation in process (the real app, a scripted upstream, no sockets): the salt
every forwarded request carries, the index kept apart per scope, /debug/route in a named
tenant's scope, and the per-tenant metrics with their bounded labels."""

from __future__ import annotations

import httpx
import orjson
import pytest

from cache_client.memory import MemoryIndex
from router.app import build_app
from router.config_loader import flat_config
from router.tenants.loader import TenantRegistry
from router.tenants.model import Tenant, TenantTable
from router.tenants.salt import CacheSalter
from router.workers import WorkerSpec
from tests.support.asgi import MODEL, Answer, AsgiCall, FakeUpstream, healthy_workers

SECRET = "inprocess-test-salt-secret"
ADMIN = "inprocess-admin-token-1234"
TABLE = TenantTable([
    Tenant("alice", ("key-alice",)),
    Tenant("bob", ("key-bob",)),
    Tenant("carol", ("key-carol",), cache_scope="research"),
    Tenant("dave", ("key-dave",), cache_scope="research"),
])
SALTS = CacheSalter(SECRET.encode())
KEYS = ["key-alice", "key-bob", "key-carol", "key-dave", "key-nobody"]
DOC = "Clause 7.3: the licensee shall keep the following records confidential. " * 220  # ~4k tokens
WHOLE = Answer(chunks=(b'{"id":"x","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":7,"total_tokens":16}}',))


def chat(content: str = DOC, **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def app_with(upstream: FakeUpstream, tenants: TenantTable | None = TABLE):
    config = flat_config(
        workers=[WorkerSpec("w1", "http://w1.test"), WorkerSpec("w2", "http://w2.test")],
        policy="cache_aware", api_keys=KEYS, admin_token=ADMIN, tenant_salt_secret=SECRET, load_factor=100,
    )
    return build_app(config, upstream=upstream, health_client=healthy_workers(), index=MemoryIndex(10**8),
                     tenants=TenantRegistry(None, tenants))


async def send(app, key: str, body: dict, path: str = "/v1/chat/completions"):
    return await AsgiCall(app, path, body, [(b"authorization", f"Bearer {key}".encode())]).start().finish()


def forwarded_salt(upstream: FakeUpstream) -> object:
    return orjson.loads(upstream.posts[-1].body).get("cache_salt", "absent")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", chat()),
    ("/v1/completions", {"model": MODEL, "prompt": DOC}),
    ("/v1/responses", {"model": MODEL, "input": DOC}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": DOC}]}),
])
async def test_every_generation_api_forwards_the_scopes_salt_not_the_clients(path: str, body: dict) -> None:
    upstream = FakeUpstream([WHOLE])
    app = app_with(upstream)
    async with app.lifespan(app.api):
        for key, tenant in [("key-alice", "alice"), ("key-bob", "bob"), ("key-carol", "carol")]:
            resp = await send(app, key, {**body, "cache_salt": "key-alice-salt-guess"}, path)
            assert resp.status == 200, resp.body
            assert forwarded_salt(upstream) == SALTS.salt_for(TABLE.tenants[tenant])
        await send(app, "key-nobody", body, path)  # a valid key no tenant holds
        assert forwarded_salt(upstream) == SALTS.salt_for(None)
    salts = {orjson.loads(p.body)["cache_salt"] for p in upstream.posts}
    assert len(salts) == 4 and "key-alice-salt-guess" not in salts


async def test_without_tenants_the_body_is_forwarded_as_sent() -> None:
    upstream = FakeUpstream([WHOLE])
    app = app_with(upstream, tenants=None)
    async with app.lifespan(app.api):
        await send(app, "key-alice", chat("hi"))
        assert forwarded_salt(upstream) == "absent"
        await send(app, "key-alice", chat("hi", cache_salt="clients-own"))
        assert forwarded_salt(upstream) == "clients-own"
        assert "kvroute_tenant_requests_total" not in app.metrics.registry.render()


async def test_embeddings_carry_no_salt() -> None:
    upstream = FakeUpstream([WHOLE])
    app = app_with(upstream)
    async with app.lifespan(app.api):
        resp = await send(app, "key-alice", {"model": MODEL, "input": "hello"}, "/v1/embeddings")
        assert resp.status == 200
        assert forwarded_salt(upstream) == "absent"


async def test_the_index_predicts_hits_within_a_scope_only() -> None:
    upstream = FakeUpstream([WHOLE])
    app = app_with(upstream)
    async with app.lifespan(app.api):
        first = await send(app, "key-alice", chat())
        assert first.headers["x-kvroute-route-reason"] != "gpu_hit"
        home = first.headers["x-kvroute-worker"]
        bob = await send(app, "key-bob", chat())
        assert bob.headers["x-kvroute-route-reason"] != "gpu_hit"
        again = await send(app, "key-alice", chat())
        assert again.headers["x-kvroute-route-reason"] == "gpu_hit"
        assert again.headers["x-kvroute-worker"] == home
        # One sharing group: dave finds what carol's request left.
        carol = await send(app, "key-carol", chat("research notes " * 900))
        assert carol.headers["x-kvroute-route-reason"] != "gpu_hit"
        dave = await send(app, "key-dave", chat("research notes " * 900))
        assert dave.headers["x-kvroute-route-reason"] == "gpu_hit"
        assert dave.headers["x-kvroute-worker"] == carol.headers["x-kvroute-worker"]


async def test_debug_route_answers_in_the_named_tenants_scope_only() -> None:
    upstream = FakeUpstream([WHOLE])
    app = app_with(upstream)
    async with app.lifespan(app.api):
        await send(app, "key-alice", chat())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            admin = {"authorization": f"Bearer {ADMIN}"}

            async def explain(tenant: str | None, headers: dict = admin) -> httpx.Response:
                params = {"tenant": tenant} if tenant else {}
                return await client.post("/debug/route", json=chat(), params=params, headers=headers)

            as_alice, as_bob, unscoped = await explain("alice"), await explain("bob"), await explain(None)
            assert as_alice.json()["chosen"]["cached_tokens"] > 3000
            assert as_bob.json()["chosen"]["cached_tokens"] == 0
            assert unscoped.json()["chosen"]["cached_tokens"] == 0
            assert (await explain("mallory")).status_code == 404
            # A tenant's key is no admin token: no tenant asks about another's prefixes.
            assert (await explain("alice", {"authorization": "Bearer key-bob"})).status_code == 401
            for resp in (as_alice, as_bob):
                assert "cache_salt" not in resp.text and SALTS.salt_for(TABLE.tenants["alice"]) not in resp.text


async def test_per_tenant_metrics_are_labelled_by_name_and_bounded() -> None:
    stream = Answer(
        chunks=(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
                b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}\n\ndata: [DONE]\n\n'),
        headers=[(b"content-type", b"text/event-stream")],
    )
    upstream = FakeUpstream([WHOLE, stream, WHOLE])
    app = app_with(upstream)
    async with app.lifespan(app.api):
        app.metrics.tenants.max_labels = 2  # alice and bob get labels; carol is "other"
        await send(app, "key-alice", chat("hello there"))
        await send(app, "key-bob", chat("hello there", stream=True))
        await send(app, "key-carol", chat("hello there"))
        await send(app, "key-nobody", chat("hello there"))
        app.metrics.tenant_rejected(TABLE.tenants["alice"], "requests_per_s")
        app.metrics.tenant_queue_wait(TABLE.tenants["bob"], 0.02)
        text = app.metrics.registry.render()
    lines = set(text.splitlines())
    assert 'kvroute_tenant_requests_total{tenant="alice",status="200"} 1' in lines
    assert 'kvroute_tenant_requests_total{tenant="other",status="200"} 1' in lines
    assert 'kvroute_tenant_requests_total{tenant="none",status="200"} 1' in lines
    assert 'kvroute_tenant_generated_tokens_total{tenant="alice"} 7' in lines
    assert 'kvroute_tenant_generated_tokens_total{tenant="bob"} 5' in lines
    assert 'kvroute_tenant_ttft_seconds_count{tenant="bob"} 1' in lines
    assert 'kvroute_tenant_rejected_total{tenant="alice",reason="requests_per_s"} 1' in lines
    assert 'kvroute_tenant_queue_wait_seconds_count{tenant="bob"} 1' in lines
    assert any(line.startswith('kvroute_tenant_prompt_tokens_total{tenant="alice"}') for line in lines)
    assert "carol" not in text and "key-" not in text and "hello" not in text
