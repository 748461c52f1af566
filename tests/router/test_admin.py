"""Admin endpoints over real HTTP: drain (no new requests, in-flight ones finish), undrain,
add and remove workers, and /debug/route explaining a decision — never with a worker URL."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from loadtests.support.routerproc import RouterProcess
from tests.support.upstream import RecordingUpstream, UpstreamBehaviour

TOKEN = "admin-token-for-tests-0123"
AUTH = {"authorization": "Bearer " + TOKEN}
CHAT = {"model": "rec-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def fleet():
    with (
        RecordingUpstream(behaviour=UpstreamBehaviour(chunks=8, chunk_delay_s=0.15)) as a,
        RecordingUpstream(behaviour=UpstreamBehaviour(chunks=8, chunk_delay_s=0.15)) as b,
        RecordingUpstream() as c,
        RouterProcess({"a": a.url, "b": b.url}, policy="round_robin", env={"KVROUTE_ADMIN_TOKEN": TOKEN},
                      extra_args=["--health-interval-s", "0.5"]) as r,
    ):
        yield r, {"a": a, "b": b, "c": c}


def workers(r) -> dict[str, dict]:
    resp = httpx.get(r.url + "/admin/workers", headers=AUTH)
    assert resp.status_code == 200
    return {w["name"]: w for w in resp.json()["data"]}


def test_listing_names_workers_without_addresses(fleet) -> None:
    r, ups = fleet
    resp = httpx.get(r.url + "/admin/workers", headers=AUTH)
    listed = resp.json()["data"]
    assert {w["name"] for w in listed} == {"a", "b"}
    assert all(w["healthy"] and w["serving"] and w["circuit"] == "closed" for w in listed)
    for up in ups.values():
        assert str(up.port) not in resp.text


def test_drain_lets_in_flight_streams_finish_and_sends_nothing_new(fleet) -> None:
    r, ups = fleet
    results: dict[str, list[str]] = {}

    def stream(key: str) -> None:
        with httpx.stream("POST", r.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=20) as resp:
            results[key] = [resp.headers["x-kvroute-worker"], *(line for line in resp.iter_lines() if line.startswith("data: "))]

    threads = [threading.Thread(target=stream, args=(f"s{i}",)) for i in range(2)]  # one on each worker
    for t in threads:
        t.start()
    time.sleep(0.3)
    resp = httpx.post(r.url + "/admin/workers/a/drain", headers=AUTH)
    assert resp.status_code == 200 and resp.json()["draining"] and not resp.json()["serving"]
    assert resp.json()["inflight"] == 1  # its stream is still running
    before = len(ups["a"].received)
    for _ in range(4):
        assert httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=10).headers["x-kvroute-worker"] == "b"
    assert len(ups["a"].received) == before
    for t in threads:
        t.join()
    drained = next(v for v in results.values() if v[0] == "a")
    assert drained[-1] == "data: [DONE]" and len(drained) == 1 + 9 and not any('"error"' in e for e in drained)
    assert workers(r)["a"]["inflight"] == 0
    assert httpx.post(r.url + "/admin/workers/a/undrain", headers=AUTH).json()["serving"]
    served = {httpx.post(r.url + "/v1/chat/completions", json=CHAT).headers["x-kvroute-worker"] for _ in range(4)}
    assert served == {"a", "b"}


def test_add_and_remove_workers(fleet) -> None:
    r, ups = fleet
    c = ups["c"]
    resp = httpx.post(r.url + "/admin/workers", headers=AUTH, json={"name": "c", "url": c.url})
    assert resp.status_code == 201, resp.text
    assert resp.json()["healthy"] and resp.json()["models"] == ["rec-model"]
    assert c.url not in resp.text and str(c.port) not in resp.text
    served = {httpx.post(r.url + "/v1/chat/completions", json=CHAT).headers["x-kvroute-worker"] for _ in range(6)}
    assert "c" in served
    bad = [
        ({"name": "c", "url": c.url}, 409, "worker_exists"),
        ({"name": "d", "url": "ftp://x"}, 400, "invalid_request"),
        ({"name": "d/e", "url": c.url}, 400, "invalid_request"),
        ({"name": "d", "url": c.url, "api_key_env": "KVROUTE_NO_SUCH_VARIABLE"}, 400, "invalid_request"),
        ({"url": c.url}, 400, "invalid_request"),
    ]
    for body, status, code in bad:
        resp = httpx.post(r.url + "/admin/workers", headers=AUTH, json=body)
        assert resp.status_code == status and resp.json()["error"]["code"] == code, (body, resp.text)
    resp = httpx.post(r.url + "/admin/workers", headers=AUTH, content=b"[")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"
    # Streams teach the router c's costs (cost learning is on by default) ...
    observed = 'kvroute_cost_observations_total{worker="c"}'
    for _ in range(12):  # round robin; a try that lands on c as another's fallback teaches nothing
        httpx.post(r.url + "/v1/chat/completions", json={**CHAT, "stream": True})
        if observed in r.metrics():
            break
    assert observed in r.metrics()
    assert httpx.delete(r.url + "/admin/workers/c", headers=AUTH).json()["removed"]
    assert httpx.delete(r.url + "/admin/workers/c", headers=AUTH).status_code == 404
    # ... which go with it, like its load counts.
    assert 'worker="c"' not in "".join(
        line for line in r.metrics().splitlines(keepends=True) if line.startswith("kvroute_cost_")
    )
    served = {httpx.post(r.url + "/v1/chat/completions", json=CHAT).headers["x-kvroute-worker"] for _ in range(6)}
    assert served == {"a", "b"}
    assert 'kvroute_worker_healthy{worker="c"}' not in r.metrics()  # counters keep history; gauges go
    assert httpx.post(r.url + "/admin/workers/zzz/drain", headers=AUTH).status_code == 404


def test_debug_route_explains_a_decision() -> None:
    convo = {"model": "rec-model", "messages": [
        {"role": "system", "content": "You are a careful assistant. " * 40},
        {"role": "user", "content": "Summarise the plot of a long novel. " * 20},
    ]}
    with (
        RecordingUpstream() as a,
        RecordingUpstream() as b,
        RouterProcess({"a": a.url, "b": b.url}, policy="cache_aware", env={"KVROUTE_ADMIN_TOKEN": TOKEN}) as r,
    ):
        served = httpx.post(r.url + "/v1/chat/completions", json=convo).headers["x-kvroute-worker"]
        received = len(a.received) + len(b.received)
        resp = httpx.post(r.url + "/debug/route", headers=AUTH, json=convo)
        assert resp.status_code == 200, resp.text
        why = resp.json()
        assert len(a.received) + len(b.received) == received  # explaining forwards nothing
        assert why["chosen"]["worker"] == served and why["chosen"]["reason"] == "gpu_hit"
        assert why["chosen"]["cached_tokens"] > 0 and why["prompt_tokens"] >= why["chosen"]["cached_tokens"]
        rows = {row["worker"]: row for row in why["candidates"]}
        assert set(rows) == {"a", "b"}
        other = ({"a", "b"} - {served}).pop()
        assert rows[served]["cached_tokens_gpu"] > 0 and rows[other]["cached_tokens_gpu"] == 0
        assert rows[served]["predicted_ttft_s"] < rows[other]["predicted_ttft_s"]
        assert why["ranking"][0] == served and why["policy"] == "cache_aware"
        for up in (a, b):
            assert str(up.port) not in resp.text
        httpx.post(r.url + "/admin/workers/" + other + "/drain", headers=AUTH)
        why = httpx.post(r.url + "/debug/route", headers=AUTH, json=convo).json()
        assert why["excluded"] == [{"worker": other, "why": "draining"}]
        resp = httpx.post(r.url + "/debug/route?path=/v1/nope", headers=AUTH, json=convo)
        assert resp.status_code == 400
        resp = httpx.post(r.url + "/debug/route", headers=AUTH, json={"model": "rec-model"})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "missing_required_parameter"
        resp = httpx.post(r.url + "/debug/route?path=/v1/embeddings", headers=AUTH, json={"model": "rec-model", "input": "x"})
        assert resp.status_code == 200 and resp.json()["chosen"]["reason"] == "least_loaded"
