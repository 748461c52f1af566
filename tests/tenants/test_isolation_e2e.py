"""Cache isolation end to end: `kvroute serve --tenants FILE` in front of the simulated vLLM
cluster (which honours `cache_salt` as vLLM does), through one router and through four
replicas sharing Redis (their salt secret created once in Redis).

Tenant A sends a ~4,000-token prompt, tenant B the same prompt: B gets no cached token and
no `gpu_hit` route, A's second send is a hit, and two tenants of one sharing group share.
A recording upstream shows what a worker receives: the scope's salt, never the client's.
"""

from __future__ import annotations

import itertools
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from loadtests.benchmark.harness import metric_sum, parse_prometheus
from loadtests.sim.cluster import SimCluster
from loadtests.support.routerproc import RouterProcess
from router.tenants.salt import derive_salt
from tests.support.system_redis import SYSTEM_REDIS
from tests.support.upstream import RecordingUpstream
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.sim_cluster(workers=4, time_scale=0.02)]

TENANTS = """\
groups: [research]
tenants:
  alice: {keys: [sk-alice-e2e]}
  bob: {keys: [sk-bob-e2e]}
  carol: {keys: [sk-carol-e2e], cache_scope: research}
  dave: {keys: [sk-dave-e2e], cache_scope: research}
"""
KEYS = {name: f"sk-{name}-e2e" for name in ("alice", "bob", "carol", "dave")}
SECRET = "e2e-tenant-salt-secret-0123456789"
# Bounded loads off: only the index decides, so a predicted hit always shows as gpu_hit.
ROUTER_ARGS = ["--load-factor", "100"]


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("isolation")
    (d / "tenants.yaml").write_text(TENANTS)
    (d / "salt").write_text(SECRET + "\n")
    return d / "tenants.yaml"


def prompt() -> str:
    """~4,000 tokens (4 bytes a token), new for every test: the cluster outlives each test."""
    return f"[{uuid.uuid4().hex}] " + "The contract's confidential clause reads as follows. " * 300


def send(url: str, tenant: str, content: str, model: str, **extra: Any) -> tuple[int, str]:
    """(cached prompt tokens the worker reports, the router's route reason)."""
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": content}], **extra}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEYS[tenant]}"})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] > 3500
    return usage["prompt_tokens_details"]["cached_tokens"], resp.headers["x-kvroute-route-reason"]


def index_state(url: str) -> str:
    """A router's shared-index lines of /metrics: whether Redis answered its lookups."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return "; ".join(re.findall(r"^kvroute_index_\S+ \S+$", text, re.MULTILINE)) or "in-memory index"


def send_hit(url: str, tenant: str, content: str, model: str) -> None:
    """A send the router must route to its copy (its index shows it) and the worker reuse."""
    cached, reason = send(url, tenant, content, model)
    assert cached > 3000 and reason == "gpu_hit", f"{tenant}: {cached} cached, {reason}; {index_state(url)}"


def check_isolation(urls: list[str], model: str) -> None:
    """The acceptance scenario, each send through the next router in `urls`."""
    at = itertools.cycle(urls)
    secret_doc = prompt()
    a_cached, _ = send(next(at), "alice", secret_doc, model)
    assert a_cached == 0
    # Bob sends the same prompt, with a salt of his choosing: it is replaced by his scope's.
    b_cached, b_reason = send(next(at), "bob", secret_doc, model, cache_salt="alice")
    assert b_cached == 0 and b_reason != "gpu_hit"
    # ...which is why his plain resend hits his own copy (the client's salt was never used).
    send_hit(next(at), "bob", secret_doc, model)
    send_hit(next(at), "alice", secret_doc, model)
    shared_doc = prompt()
    assert send(next(at), "carol", shared_doc, model)[0] == 0
    send_hit(next(at), "dave", shared_doc, model)


def wait_until_redis_answers(router: RouterProcess) -> None:
    """A router serves before Redis answers it (on its own, empty view): the scenario's
    later sends would route blind."""
    wait_for(lambda: metric_sum(parse_prometheus(router.metrics()), "kvroute_index_backend_up") == 1.0, timeout_s=20)


def test_one_router_keeps_tenants_apart(cluster: SimCluster, tenants_file: Path) -> None:
    args = [*ROUTER_ARGS, "--tenants", str(tenants_file)]
    with RouterProcess(cluster.worker_urls, extra_args=args) as router:
        check_isolation([router.url], cluster.model)
        metrics = httpx.get(router.url + "/metrics").text
    assert 'kvroute_tenant_requests_total{tenant="alice",status="200"} 2' in metrics
    assert 'kvroute_tenant_requests_total{tenant="bob",status="200"} 2' in metrics
    assert "sk-" not in metrics and "confidential" not in metrics



@pytest.mark.redis
def test_four_replicas_sharing_redis_keep_tenants_apart(cluster: SimCluster, tenants_file: Path, redis_prefix: str) -> None:
    # No salt secret configured: the replicas agree through the one Redis creates.
    # The budget is generous: a lookup that a busy machine delays past it answers from the
    # replica's own view, and a fresh clone's CI run saw Alice's resend route blind (a
    # `miss`) with a 200 ms one. The budget itself is tested in tests/index/test_redis.py.
    args = [*ROUTER_ARGS, "--tenants", str(tenants_file), "--redis", SYSTEM_REDIS, "--redis-prefix", redis_prefix,
            "--redis-lookup-budget-ms", "1000"]
    routers = [RouterProcess(cluster.worker_urls, extra_args=args) for _ in range(4)]
    try:
        for r in routers:
            r.start()
            wait_until_redis_answers(r)
        check_isolation([r.url for r in routers], cluster.model)
    finally:
        for r in routers:
            r.stop()
    with redis.Redis.from_url(SYSTEM_REDIS) as c:
        assert c.exists("{" + redis_prefix + "}:tenant-salt-secret")


def test_the_worker_receives_the_scopes_salt_never_the_clients(tenants_file: Path) -> None:
    secret_file = tenants_file.parent / "salt"
    args = ["--tenants", str(tenants_file), "--tenant-salt-secret-file", str(secret_file)]
    with RecordingUpstream() as up, RouterProcess({"rec": up.url}, extra_args=args) as router:
        for tenant, salt in [("alice", None), ("alice", "chosen-by-alice"), ("bob", "tenant:alice"),
                             ("carol", None), ("dave", "x")]:
            body = {"model": up.model, "messages": [{"role": "user", "content": "hello"}]}
            if salt is not None:
                body["cache_salt"] = salt
            resp = httpx.post(router.url + "/v1/chat/completions", json=body,
                              headers={"authorization": f"Bearer {KEYS[tenant]}"})
            assert resp.status_code == 200, resp.text
        received = [orjson.loads(r.body)["cache_salt"] for r in up.received if r.path == "/v1/chat/completions"]
    key = SECRET.encode()
    alice, bob, group = (derive_salt(key, s) for s in ("tenant:alice", "tenant:bob", "group:research"))
    assert received == [alice, alice, bob, group, group]
    assert len({alice, bob, group}) == 3
