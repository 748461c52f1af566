"""A simulated fleet over loopback: shared pool hits, KV events, disconnects, faults."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgpack
import pytest
import zmq

from loadtests.sim.cluster import SimCluster, SimWorkerProcess
from normalizer.prefix import chat_segments
from tests.support.wait import wait_for

MODEL = "sim-llama3-8b"


pytestmark = pytest.mark.sim_cluster(workers=3, time_scale=0.01, pool=True, kv_events=True)


def chat(content: str, max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing")


def test_pool_serves_a_prompt_computed_on_another_worker(cluster: SimCluster) -> None:
    assert cluster.pool_url is not None
    w0, w1 = cluster.worker_urls["w0"], cluster.worker_urls["w1"]
    body = chat("pool me " * 1000)
    prompt = len(b"".join(chat_segments(body))) // 4
    chunks = prompt // 256
    first = httpx.post(f"{w0}/v1/chat/completions", json=body).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_for(lambda: httpx.get(f"{cluster.pool_url}/stats").json()["chunks"] >= chunks)
    hits_before = metric(w1, "vllm:external_prefix_cache_hits_total")
    second = httpx.post(f"{w1}/v1/chat/completions", json=body).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == chunks * 256
    assert metric(w1, "vllm:external_prefix_cache_hits_total") - hits_before == chunks * 256
    assert metric(w1, "vllm:prefix_cache_hits_total") == 0  # nothing came from w1's own GPU


def recv_batches(sub: zmq.Socket, until: Callable[[list[Any]], bool], timeout: float = 5.0) -> list[Any]:
    events: list[Any] = []
    deadline = time.monotonic() + timeout
    last_seq = -1
    while time.monotonic() < deadline:
        if not sub.poll(50):
            continue
        topic, seq_bytes, payload = sub.recv_multipart()
        assert topic == b"" and len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big")
        assert seq > last_seq
        last_seq = seq
        ts, batch, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and dp_rank == 0
        events += batch
        if until(events):
            return events
    raise AssertionError(f"expected events not received; got {events!r:.500}")


def test_kv_events_describe_gpu_and_pool_blocks(cluster: SimCluster) -> None:
    url, endpoint = cluster.worker_urls["w2"], cluster.kv_event_endpoints["w2"]
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        body = chat("events " * 300)
        token_ids = httpx.post(f"{url}/tokenize", json=body).json()["tokens"]
        blocks = len(token_ids) // 16
        # PUB/SUB joins asynchronously: repeat a cheap request until the first events flow.
        deadline = time.monotonic() + 5
        while not sub.poll(100):
            assert time.monotonic() < deadline, "no KV events"
            httpx.post(f"{url}/v1/chat/completions", json=chat(f"warm-up {time.monotonic()} " * 8))
        sub.recv_multipart()
        while sub.poll(100):
            sub.recv_multipart()
        httpx.post(f"{url}/v1/chat/completions", json=body)

        def stored(events: list[Any], medium: str) -> list[Any]:
            return [e for e in events if e[0] == "BlockStored" and e[6] == medium]

        events = recv_batches(
            sub, lambda ev: sum(len(e[1]) for e in stored(ev, "GPU")) >= blocks and bool(stored(ev, "CPU"))
        )
        gpu = stored(events, "GPU")
        hashes = [h for e in gpu for h in e[1]]
        assert len(hashes) == blocks == len(set(hashes))
        assert all(0 <= h < 2**63 for h in hashes)
        assert gpu[0][2] is None  # first block has no parent
        assert all(e[4] == 16 and len(e) == 8 for e in gpu)  # block_size; positional layout
        assert [t for e in gpu for t in e[3]] == token_ids[: blocks * 16]
        cpu = stored(events, "CPU")
        assert [h for e in cpu for h in e[1]] == hashes[: len(token_ids) // 256 * 16]

        assert httpx.post(f"{url}/reset_prefix_cache").status_code == 200
        recv_batches(sub, lambda ev: ["AllBlocksCleared"] in ev)
        sources = httpx.get(f"{url}/kv_event_sources").json()["sources"]
        assert sources[0]["endpoint"] == endpoint and sources[0]["block_size"] == 16
    finally:
        sub.close(linger=0)


def state(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/sim/state").json()


def set_fault(url: str, mode: str, **extra: Any) -> None:
    r = httpx.post(f"{url}/sim/fault", json={"mode": mode, **extra})
    assert r.status_code == 200, r.text


@pytest.fixture
def slow_worker(cluster: SimCluster) -> Iterator[str]:
    """w1 with every step 100x slower: a 30k-token prefill takes ~1.2 s of real time."""
    url = cluster.worker_urls["w1"]
    set_fault(url, "slow", slow_factor=100)
    try:
        yield url
    finally:
        set_fault(url, "none")


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_promptly(slow_worker: str, stream: bool) -> None:
    url = slow_worker
    before = state(url)
    body = chat(f"abort {stream} " * 7000, max_tokens=50, stream=stream)
    if stream:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            wait_for(lambda: state(url)["running"] == 1)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=0.3)
    wait_for(lambda: state(url)["aborted"] == before["aborted"] + 1, timeout_s=1.0)
    after = state(url)
    assert after["running"] == 0 and after["waiting"] == 0 and after["kv_used_blocks"] == 0
    assert after["last_abort_delays_s"][-1] < 0.1
    assert after["finished"] == before["finished"]


def test_fault_injection_modes(cluster: SimCluster) -> None:
    url = cluster.worker_urls["w0"]
    try:
        set_fault(url, "error500")
        r = httpx.post(f"{url}/v1/chat/completions", json=chat("fail"))
        assert r.status_code == 500 and r.json()["error"]["code"] == 500
        assert httpx.get(f"{url}/health").status_code == 500
        set_fault(url, "hang")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=chat("hang"), timeout=0.2)
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(f"{url}/health", timeout=0.2)
        set_fault(url, "hang", include_health=False)
        assert httpx.get(f"{url}/health", timeout=1).status_code == 200
        set_fault(url, "none")
        assert httpx.post(f"{url}/v1/chat/completions", json=chat("fine")).status_code == 200
        # slow: the same (uncached) work takes slow_factor times the simulated time.
        base = metric(url, "vllm:time_to_first_token_seconds_sum")
        httpx.post(f"{url}/v1/chat/completions", json=chat("slow a " * 500))
        normal = metric(url, "vllm:time_to_first_token_seconds_sum") - base
        set_fault(url, "slow", slow_factor=10)
        base = metric(url, "vllm:time_to_first_token_seconds_sum")
        httpx.post(f"{url}/v1/chat/completions", json=chat("slow b " * 500))
        slowed = metric(url, "vllm:time_to_first_token_seconds_sum") - base
        assert 7 < slowed / normal < 13
        assert httpx.post(f"{url}/sim/fault", json={"mode": "explode"}).status_code == 400
    finally:
        set_fault(url, "none")


def test_single_worker_process_and_no_leaks() -> None:
    with SimWorkerProcess(name="solo", time_scale=0.01, extra_args=["--get-load-format", "legacy"]) as w:
        r = httpx.post(f"{w.url}/v1/chat/completions", json=chat("solo"))
        assert r.status_code == 200
        assert state(w.url)["name"] == "solo"
        assert httpx.get(f"{w.url}/get_load").json() == {"load": 0}  # what vllm-router reads
        pid = w.proc.pid if w.proc else -1
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
