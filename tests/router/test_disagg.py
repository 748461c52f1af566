"""Prefill/decode disaggregation end to end: `kvroute serve` with `--role` flags in front of a
simulated fleet of 2 prefill and 2 decode workers speaking vLLM's NixlConnector protocol
over loopback HTTP. Every API, streaming and not; the priced choice of a local prefill;
`/debug/route`; and each fault path, each checked to leave no KV blocks held on the
prefill workers (the simulator's `nixl_held_blocks`)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtests.sim.cluster import SimCluster
from loadtests.support.routerproc import RouterProcess
from tests.support.wait import wait_for

MODEL = "sim-llama3-8b"
PREFILL, DECODE = ("w0", "w1"), ("w2", "w3")
TOKEN = "pd-admin-token"

pytestmark = pytest.mark.sim_cluster(workers=4, time_scale=0.01, pool=False, roles="prefill:2,decode:2")


@contextlib.contextmanager
def router(cluster: SimCluster, *args: str) -> Iterator[RouterProcess]:
    extra = [*cluster.router_role_args(), "--breaker-failures", "0", "--health-interval-s", "0.5", *args]
    with RouterProcess(cluster.worker_urls, extra_args=extra, env={"KVROUTE_ADMIN_TOKEN": TOKEN}) as r:
        yield r


@pytest.fixture(scope="module")
def split(cluster: SimCluster) -> Iterator[RouterProcess]:
    """A router that splits every request (`--pd-split always`)."""
    with router(cluster, "--pd-split", "always") as r:
        yield r


@pytest.fixture(autouse=True)
def healthy(cluster: SimCluster) -> Iterator[None]:
    """Every worker without faults after each test, and no blocks left held on P."""
    yield
    for url in cluster.worker_urls.values():
        httpx.post(f"{url}/sim/fault", json={"mode": "none"})
    wait_for(lambda: held(cluster) == 0, timeout_s=10)


def nixl(cluster: SimCluster, name: str) -> dict[str, Any]:
    return httpx.get(f"{cluster.worker_urls[name]}/sim/state").json()["nixl"]


def held(cluster: SimCluster) -> int:
    """Blocks the prefill workers hold for a decoder, as their /metrics say."""
    total = 0
    for name in PREFILL:
        text = httpx.get(f"{cluster.worker_urls[name]}/metrics").text
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("kvroute_sim:nixl_held_blocks"))
    return int(total)


def fault(cluster: SimCluster, names: tuple[str, ...], mode: str, **extra: Any) -> None:
    for name in names:
        r = httpx.post(f"{cluster.worker_urls[name]}/sim/fault", json={"mode": mode, "include_health": False, **extra})
        assert r.status_code == 200, r.text


def metric(r: RouterProcess, name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{r.url}/metrics").text.splitlines()
        if line.startswith(name) and all(w in line for w in want)
    )  # fmt: skip


SYSTEM = "You answer in short sentences and never repeat yourself. " * 12


def body(api: str, stream: bool, text: str | None = None, max_tokens: int = 6) -> dict[str, Any]:
    user = text or f"Question {uuid.uuid4().hex}: what is next?"
    if api == "chat":
        out: dict[str, Any] = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
        out["max_tokens"] = max_tokens
        if stream:
            out["stream_options"] = {"include_usage": True}
    elif api == "completions":
        out = {"prompt": SYSTEM + user, "max_tokens": max_tokens}
        if stream:
            out["stream_options"] = {"include_usage": True}
    elif api == "responses":
        out = {"instructions": SYSTEM, "input": user, "max_output_tokens": max_tokens}
    else:
        out = {"system": SYSTEM, "messages": [{"role": "user", "content": user}], "max_tokens": max_tokens}
    return {"model": MODEL, "stream": stream, **out}


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def send(r: RouterProcess, api: str = "chat", stream: bool = False, **kw: Any) -> httpx.Response:
    return httpx.post(r.url + PATHS[api], json=body(api, stream, **kw), timeout=30)


# -- the flow, on every API ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", list(PATHS))
def test_every_api_is_split_and_answered_by_the_decode_worker(cluster: SimCluster, split: RouterProcess, api: str, stream: bool) -> None:
    holds = sum(nixl(cluster, p)["holds"] for p in PREFILL)
    pulls = sum(nixl(cluster, d)["pulls"] for d in DECODE)
    resp = send(split, api, stream)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvroute-route-reason"] == "pd"
    assert resp.headers["x-kvroute-worker"] in DECODE
    text = resp.text
    assert "kv_transfer_params\":{" not in text  # D's own params (none), never P's
    if stream:
        assert ("[DONE]" in text) == (api in ("chat", "completions"))
        assert {"responses": "response.completed", "messages": "message_stop"}.get(api, "[DONE]") in text
    # P held the prompt for D, and D pulled it rather than prefilling it.
    assert sum(nixl(cluster, p)["holds"] for p in PREFILL) == holds + 1
    assert sum(nixl(cluster, d)["pulls"] for d in DECODE) == pulls + 1
    for d in DECODE:
        assert nixl(cluster, d)["local_prefills"] == {"missing": 0, "invalid": 0, "stale": 0, "mismatch": 0, "unreachable": 0}
    wait_for(lambda: held(cluster) == 0)


def test_usage_reports_the_tokens_the_fleet_did_not_recompute(cluster: SimCluster, split: RouterProcess) -> None:
    """D reuses every prompt token but the last (its hit and the pulled ones); the client is
    told, as an aggregated engine would, what P reused: here the shared system prompt."""
    first = send(split, "chat").json()["usage"]
    again = send(split, "chat").json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] < first["prompt_tokens"] - 1
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"] - 1
    msg = send(split, "messages").json()["usage"]
    total = msg["input_tokens"] + msg["cache_read_input_tokens"]
    assert msg["input_tokens"] > 1 and total > 100


def test_a_stored_response_continues_on_its_decode_worker(split: RouterProcess) -> None:
    first = send(split, "responses")
    assert first.status_code == 200
    follow = httpx.post(split.url + "/v1/responses", json={"model": MODEL, "input": "and then?", "previous_response_id": first.json()["id"]}, timeout=30)
    assert follow.status_code == 200, follow.text
    assert follow.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_shared_storage_split_hands_nothing_over(cluster: SimCluster, api: str) -> None:
    """`--pd-connector shared-storage`: P stores the KV where D loads it by the prompt's
    tokens, so P is asked to hold nothing and its answer without params is the split's
    success; D gets the client's own body. (The simulator has no shared storage: D prefills.)"""
    holds = sum(nixl(cluster, p)["holds"] for p in PREFILL)
    pulls = sum(nixl(cluster, d)["pulls"] for d in DECODE)
    with router(cluster, "--pd-split", "always", "--pd-connector", "shared-storage") as r:
        for stream in (False, True):
            resp = send(r, api, stream)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvroute-route-reason"] == "pd" and resp.headers["x-kvroute-worker"] in DECODE
        assert metric(r, "kvroute_pd_prefills_total", outcome="stored") == 2
        assert metric(r, "kvroute_pd_prefills_total") == 2
        assert metric(r, "kvroute_pd_fallbacks_total") == 0
    assert sum(nixl(cluster, p)["holds"] for p in PREFILL) == holds
    assert sum(nixl(cluster, d)["pulls"] for d in DECODE) == pulls
    assert held(cluster) == 0


# -- the decision ----------------------------------------------------------------------------------


def test_an_idle_decode_worker_prefills_locally_and_debug_route_says_why(cluster: SimCluster) -> None:
    holds = sum(nixl(cluster, p)["holds"] for p in PREFILL)
    with router(cluster) as r:
        resp = send(r, "chat")
        assert resp.status_code == 200
        assert resp.headers["x-kvroute-route-reason"] == "pd_local"
        assert resp.headers["x-kvroute-worker"] in DECODE
        explained = httpx.post(f"{r.url}/debug/route", json=body("chat", False), headers={"authorization": f"Bearer {TOKEN}"}).json()
    assert sum(nixl(cluster, p)["holds"] for p in PREFILL) == holds
    pd = explained["disaggregation"]
    assert explained["chosen"]["reason"] == pd["mode"] == "pd_local"
    assert pd["prefill_worker"] in PREFILL and explained["chosen"]["worker"] in DECODE
    assert pd["predicted_ttft_s"]["pd_local"] <= pd["predicted_ttft_s"]["pd"]
    assert pd["running_decodes"] == 0 and pd["local_itl_stall_s"] == 0.0
    assert {c["worker"] for c in explained["candidates"]} == set(DECODE)


# -- faults ------------------------------------------------------------------------------------------


def test_a_failing_prefill_worker_is_replaced_by_another(cluster: SimCluster, split: RouterProcess) -> None:
    fault(cluster, ("w0",), "error500")
    for _ in range(3):
        resp = send(split, "chat")
        assert resp.status_code == 200 and resp.headers["x-kvroute-route-reason"] == "pd"
    wait_for(lambda: held(cluster) == 0)


def test_no_prefill_worker_answering_means_a_local_prefill(cluster: SimCluster, split: RouterProcess) -> None:
    before = metric(split, "kvroute_pd_fallbacks_total", why="prefill_failed")
    fault(cluster, PREFILL, "error500")
    resp = send(split, "chat", stream=True)
    assert resp.status_code == 200 and resp.headers["x-kvroute-route-reason"] == "pd_local"
    assert metric(split, "kvroute_pd_fallbacks_total", why="prefill_failed") == before + 1


def test_a_prefill_answer_without_params_means_a_counted_local_prefill(cluster: SimCluster, split: RouterProcess) -> None:
    before = metric(split, "kvroute_pd_fallbacks_total", why="no_params")
    fault(cluster, PREFILL, "eos")
    resp = send(split, "completions")
    assert resp.status_code == 200 and resp.headers["x-kvroute-route-reason"] == "pd_local"
    assert metric(split, "kvroute_pd_fallbacks_total", why="no_params") == before + 1
    assert held(cluster) == 0


def test_a_failing_decode_worker_hands_the_params_to_another(cluster: SimCluster, split: RouterProcess) -> None:
    fault(cluster, ("w2",), "error500")
    before = metric(split, "kvroute_pd_fallbacks_total", why="decode_retry")
    stale = nixl(cluster, "w3")["local_prefills"]["stale"]
    for _ in range(4):
        resp = send(split, "chat", stream=True)
        assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == "w3"
    assert metric(split, "kvroute_pd_fallbacks_total", why="decode_retry") > before
    assert nixl(cluster, "w3")["local_prefills"]["stale"] == stale  # it read what P held
    wait_for(lambda: held(cluster) == 0)


def test_a_hung_decode_worker_times_out_and_another_reads_the_blocks(cluster: SimCluster) -> None:
    fault(cluster, ("w2",), "hang")
    with router(cluster, "--pd-split", "always", "--first-byte-timeout-s", "1") as r:
        for _ in range(3):
            resp = send(r, "messages")
            assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == "w3"
        wait_for(lambda: held(cluster) == 0)


def test_params_no_decode_worker_took_are_released(cluster: SimCluster) -> None:
    """With one attempt allowed, a decode worker's 500 ends the request (502): the params it
    never used are read by the other decode worker in the background."""
    fault(cluster, ("w2",), "error500")
    with router(cluster, "--pd-split", "always", "--max-attempts", "1") as r:
        statuses = set()
        for _ in range(6):
            statuses.add(send(r, "chat").status_code)
            if 502 in statuses:
                break
        assert 502 in statuses
        wait_for(lambda: metric(r, "kvroute_pd_fallbacks_total", why="released") >= 1)
        wait_for(lambda: held(cluster) == 0)


def test_a_client_leaving_during_the_prefill_leaves_nothing_held(cluster: SimCluster, split: RouterProcess) -> None:
    fault(cluster, PREFILL, "slow", slow_factor=20000)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(split.url + PATHS["chat"], json=body("chat", True, text="long " * 2000), timeout=0.5)
    wait_for(lambda: all(httpx.get(f"{cluster.worker_urls[p]}/sim/state").json()["running"] == 0 for p in PREFILL), timeout_s=10)
    assert held(cluster) == 0


def test_a_client_leaving_during_the_decode_leaves_nothing_held(cluster: SimCluster, split: RouterProcess) -> None:
    fault(cluster, DECODE, "slow", slow_factor=200)
    with httpx.stream("POST", split.url + PATHS["chat"], json=body("chat", True, max_tokens=4000), timeout=30) as resp:
        assert resp.headers["x-kvroute-route-reason"] == "pd"
        next(resp.iter_raw())
    wait_for(lambda: held(cluster) == 0)
    wait_for(lambda: all(httpx.get(f"{cluster.worker_urls[d]}/sim/state").json()["running"] == 0 for d in DECODE), timeout_s=10)


# -- tracing -------------------------------------------------------------------------------------


def test_a_traced_split_shows_the_prefill_beside_the_decode_attempt(cluster: SimCluster) -> None:
    pytest.importorskip("opentelemetry.sdk.trace")
    from loadtests.support.otlp import OtlpReceiver

    trace_id, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    with OtlpReceiver("http") as rx, router(cluster, "--pd-split", "always", "--otlp-endpoint", rx.endpoint) as r:
        resp = httpx.post(r.url + PATHS["chat"], json=body("chat", False), timeout=30,
                          headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
        assert resp.status_code == 200 and resp.headers["x-kvroute-route-reason"] == "pd"

        def mine(spans: list[Any]) -> list[Any]:
            return [s for s in spans if s.trace_id == trace_id]

        spans = mine(rx.wait_for(lambda got: {"kvroute.request", "kvroute.prefill", "kvroute.attempt"} <= {s.name for s in mine(got)}))
    request = next(s for s in spans if s.name == "kvroute.request")
    prefill = next(s for s in spans if s.name == "kvroute.prefill")
    attempt = next(s for s in spans if s.name == "kvroute.attempt")
    assert prefill.parent_id == request.span_id and attempt.parent_id == request.span_id
    assert prefill.attributes["kvroute.worker"] in PREFILL and prefill.attributes["kvroute.prefill.outcome"] == "held"
    assert attempt.attributes["kvroute.worker"] in DECODE
