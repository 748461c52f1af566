"""Prefill/decode disaggregation in the simulator: vLLM's NixlConnector protocol over real
loopback HTTP (roles, P's answer and hold, D's pull, timeouts, missing and stale params,
aborts), the engine's side of it, and the decode interference it removes."""

from __future__ import annotations

import asyncio
import subprocess
import time
from typing import Any

import httpx
import orjson
import pytest

from loadtests.sim import cluster as sim_cluster
from loadtests.sim.cluster import SimCluster, SimWorkerProcess, parse_roles, role_flags
from loadtests.sim.costs import build_cost_model
from loadtests.sim.engine import BLOCK_SIZE, Engine, Seq, State, block_hashes_of
from loadtests.sim.runner import Runner
from normalizer.prefix import chat_segments

MODEL = "sim-llama3-8b"
P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What vLLM's toy proxy sends the prefill worker."""
ANSWER_KEYS = {
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
    "remote_request_id", "remote_host", "remote_port", "tp_size",
}  # fmt: skip
COST = build_cost_model("h200-llama3-8b")

pytestmark = pytest.mark.sim_cluster(workers=3, time_scale=0.01, pool=False, roles="prefill:1,decode:1,both:1")


# -- helpers -------------------------------------------------------------------------------------


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": "You are terse. " * 30}, {"role": "user", "content": content}],
        **extra,
    }


def prompt_tokens(body: dict[str, Any]) -> int:
    return len(b"".join(chat_segments(body))) // 4


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as vLLM's toy proxy sends it to P."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(kv_transfer_params=P_PARAMS, stream=False, max_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def post(url: str, path: str, body: dict[str, Any], rid: str, **kw: Any) -> httpx.Response:
    r = httpx.post(f"{url}{path}", json=body, headers={"X-Request-Id": rid}, timeout=30, **kw)
    assert r.status_code == 200, r.text
    return r


def prefill(url: str, body: dict[str, Any], rid: str, path: str = "/v1/chat/completions") -> dict[str, Any]:
    return post(url, path, prefill_body(body), rid).json()


def sse_data(raw: bytes) -> list[Any]:
    out = []
    for block in raw.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                payload = line[len(b"data: ") :]
                out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


def nixl(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/sim/state").json()["nixl"]


def state(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/sim/state").json()


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in metrics")


def wait_until(check: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


@pytest.fixture
def urls(cluster: SimCluster) -> tuple[str, str, str]:
    """(P, D, both)."""
    return cluster.worker_urls["w0"], cluster.worker_urls["w1"], cluster.worker_urls["w2"]


# -- roles ---------------------------------------------------------------------------------------


def test_roles_are_reported_and_printed_for_the_router(cluster: SimCluster, capsys: pytest.CaptureFixture[str]) -> None:
    assert cluster.worker_roles == {"w0": "prefill", "w1": "decode", "w2": "both"}
    assert cluster.router_role_args() == ["--role", "w0=prefill", "--role", "w1=decode"]
    for name, url in cluster.worker_urls.items():
        role = cluster.worker_roles[name]
        assert state(url)["role"] == role
        engine_id = nixl(url)["engine_id"]
        assert metric(url, "kvroute_sim:worker_info", role=role, kv_engine_id=engine_id) == 1
    assert sim_cluster.cli(["--workers", "8", "--roles", "prefill:2,decode:6", "--print-roles"]) == 0
    flags = capsys.readouterr().out.split()
    assert flags == [x for i in range(8) for x in ("--role", f"w{i}={'prefill' if i < 2 else 'decode'}")]


def test_role_lists_and_counts() -> None:
    assert parse_roles(None, 3) == ["both"] * 3
    assert parse_roles("prefill:1,decode:2", 3) == ["prefill", "decode", "decode"]
    assert parse_roles("decode,prefill,both", 3) == ["decode", "prefill", "both"]
    assert parse_roles(["prefill", "decode"], 2) == ["prefill", "decode"]
    assert role_flags({"w0": "both", "w1": "decode"}) == ["--role", "w1=decode"]
    for bad in ("prefill:1", "prefill:1,decode", "gpu:3", "prefill:x,decode:2"):
        with pytest.raises(ValueError):
            parse_roles(bad, 3)
    with pytest.raises(ValueError):
        SimCluster(workers=2, roles="prefill:3")


# -- the protocol --------------------------------------------------------------------------------


def test_prefill_answer_carries_params_and_holds_the_blocks(urls: tuple[str, str, str]) -> None:
    p_url, _, _ = urls
    body = chat_body("shape of the prefill answer " * 40, max_tokens=50, stream=True, stream_options={"include_usage": True})
    before = nixl(p_url)
    out = prefill(p_url, body, "shape-1")
    n = prompt_tokens(body)
    params = out["kv_transfer_params"]
    assert set(params) == ANSWER_KEYS
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == before["engine_id"]
    assert params["remote_request_id"] == "shape-1"
    host, port = p_url.removeprefix("http://").split(":")
    assert params["remote_host"] == host and params["remote_port"] == int(port)
    assert params["tp_size"] == 1
    blocks = params["remote_block_ids"]
    assert len(blocks) == -(-n // BLOCK_SIZE) and len(set(blocks)) == len(blocks)
    assert all(isinstance(b, int) for b in blocks)
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 1
    # The blocks stay in P's KV until a D reads them (or the timeout).
    after = nixl(p_url)
    assert after["held_blocks"] - before["held_blocks"] == len(blocks)
    assert after["holds"] == before["holds"] + 1
    assert metric(p_url, "kvroute_sim:nixl_held_blocks") == after["held_blocks"]
    assert state(p_url)["kv_used_blocks"] >= len(blocks)
    httpx.post(f"{p_url}/sim/nixl/release", json={"remote_request_id": "shape-1"})
    assert nixl(p_url)["held_blocks"] == before["held_blocks"]


def test_decode_pulls_only_what_it_lacks_and_frees_p(urls: tuple[str, str, str]) -> None:
    p_url, d_url, _ = urls
    turn1 = chat_body("first turn of a long agent session " * 60, max_tokens=12, stream=True)
    n1 = prompt_tokens(turn1)
    d0, p0 = nixl(d_url), nixl(p_url)
    params = prefill(p_url, turn1, "turn-1")["kv_transfer_params"]
    raw = post(d_url, "/v1/chat/completions", {**turn1, "kv_transfer_params": params}, "turn-1").content
    events = sse_data(raw)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert len(text) == 12 * 4
    d1, p1 = nixl(d_url), nixl(p_url)
    assert d1["pulls"] - d0["pulls"] == 1
    assert d1["pulled_blocks"] - d0["pulled_blocks"] == -(-n1 // BLOCK_SIZE)
    assert d1["pulled_tokens"] - d0["pulled_tokens"] == n1
    assert d1["pull_s"] - d0["pull_s"] == pytest.approx(COST.nixl_pull_s(n1))
    # P freed the blocks once read.
    assert p1["held_blocks"] == p0["held_blocks"]
    assert p1["released"]["pulled"] - p0["released"]["pulled"] == 1

    # Turn 2 on the same D: its own prefix cache holds turn 1's prompt, so it pulls less; P
    # reuses its own cache too.
    turn2 = {
        **turn1,
        "stream": False,
        "messages": [*turn1["messages"], {"role": "assistant", "content": text}, {"role": "user", "content": "go on " * 20}],
    }
    n2 = prompt_tokens(turn2)
    hits0 = state(d_url)["prefix_hits_tokens"]
    p_answer = prefill(p_url, turn2, "turn-2")
    assert p_answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    answer = post(d_url, "/v1/chat/completions", {**turn2, "kv_transfer_params": p_answer["kv_transfer_params"]}, "turn-2").json()
    d2 = nixl(d_url)
    hit = state(d_url)["prefix_hits_tokens"] - hits0
    assert hit >= n1 // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE
    pulled = d2["pulled_blocks"] - d1["pulled_blocks"]
    assert pulled == -(-n2 // BLOCK_SIZE) - hit // BLOCK_SIZE
    assert pulled < d1["pulled_blocks"] - d0["pulled_blocks"]
    # D reports the whole prompt but its last token as cached (local hit + pulled).
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == n2 - 1
    assert answer["kv_transfer_params"] is None
    assert nixl(p_url)["held_blocks"] == p0["held_blocks"]


@pytest.mark.parametrize("api", ["completions", "responses", "messages"])
def test_every_api_carries_the_params(urls: tuple[str, str, str], api: str) -> None:
    p_url, d_url, _ = urls
    words = f"{api} prompt for the disaggregated path " * 30
    path, body, d_body = {
        "completions": ("/v1/completions", {"model": MODEL, "prompt": words}, {"max_tokens": 9, "stream": True}),
        "responses": ("/v1/responses", {"model": MODEL, "input": words}, {"max_output_tokens": 9, "stream": True}),
        "messages": (
            "/v1/messages",
            {"model": MODEL, "messages": [{"role": "user", "content": words}]},
            {"max_tokens": 9, "stream": True},
        ),
    }[api]
    p_body = {**body, "stream": False, "kv_transfer_params": P_PARAMS}
    p_body["max_output_tokens" if api == "responses" else "max_tokens"] = 1
    before = nixl(d_url)["pulls"]
    params = post(p_url, path, p_body, f"api-{api}").json()["kv_transfer_params"]
    assert set(params) == ANSWER_KEYS
    raw = post(d_url, path, {**body, **d_body, "kv_transfer_params": params}, f"api-{api}").content
    last = {"completions": b"data: [DONE]", "responses": b"response.completed", "messages": b"message_stop"}[api]
    assert last in raw
    assert nixl(d_url)["pulls"] == before + 1
    assert nixl(p_url)["held_blocks"] == 0


def test_prefill_tool_call_is_capped_at_one_token(urls: tuple[str, str, str]) -> None:
    p_url, _, _ = urls
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
    out = prefill(p_url, chat_body("call the tool", tools=[tool], max_tokens=100), "tool-1")
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 1
    assert out["kv_transfer_params"]["remote_request_id"] == "tool-1"
    httpx.post(f"{p_url}/sim/nixl/release", json={"remote_request_id": "tool-1"})


# -- missing, invalid, stale, mismatched params --------------------------------------------------


def test_missing_params_are_a_counted_local_prefill(urls: tuple[str, str, str]) -> None:
    p_url, d_url, both_url = urls
    body = chat_body("no params for this one " * 20, max_tokens=4)
    missing = nixl(d_url)["local_prefills"]["missing"]
    out = post(d_url, "/v1/chat/completions", body, "missing-1").json()
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] < out["usage"]["prompt_tokens"] - 16
    assert nixl(d_url)["local_prefills"]["missing"] == missing + 1
    assert metric(d_url, "kvroute_sim:pd_local_prefills_total", reason="missing") == missing + 1
    # A `both` worker serving a plain request is not a decode worker missing its params.
    post(both_url, "/v1/chat/completions", body, "missing-2")
    assert nixl(both_url)["local_prefills"]["missing"] == 0

    # P's one token a stop token: vLLM frees the blocks and answers without params.
    httpx.post(f"{p_url}/sim/fault", json={"mode": "eos"})
    try:
        before = nixl(p_url)
        out = prefill(p_url, chat_body("stop right away " * 20), "eos-1")
    finally:
        httpx.post(f"{p_url}/sim/fault", json={"mode": "none"})
    assert out["kv_transfer_params"] is None and out["choices"][0]["finish_reason"] == "stop"
    after = nixl(p_url)
    assert after["held_blocks"] == before["held_blocks"] and after["holds"] == before["holds"]
    assert after["no_params"] == before["no_params"] + 1
    assert metric(p_url, "kvroute_sim:nixl_prefill_no_params_total") == after["no_params"]


def test_invalid_params_are_a_local_prefill(urls: tuple[str, str, str]) -> None:
    _, d_url, _ = urls
    invalid = nixl(d_url)["local_prefills"]["invalid"]
    half = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "x"}  # no host, port, request id
    post(d_url, "/v1/chat/completions", chat_body("half params " * 20, max_tokens=2, kv_transfer_params=half), "inv-1")
    empty = {**half, "remote_block_ids": [], "remote_request_id": "r", "remote_host": "h", "remote_port": 1}
    post(d_url, "/v1/chat/completions", chat_body("no blocks " * 20, max_tokens=2, kv_transfer_params=empty), "inv-2")
    assert nixl(d_url)["local_prefills"]["invalid"] == invalid + 2
    r = httpx.post(f"{d_url}/v1/chat/completions", json=chat_body("x", kv_transfer_params=[1]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


def test_stale_and_mismatched_params_fall_back_to_local_prefill(urls: tuple[str, str, str]) -> None:
    p_url, d_url, _ = urls
    body = chat_body("read twice " * 40, max_tokens=3)
    params = prefill(p_url, body, "stale-1")["kv_transfer_params"]
    post(d_url, "/v1/chat/completions", {**body, "kv_transfer_params": params}, "stale-1")
    before = nixl(d_url)
    # The same params again: P freed those blocks after the first read, as after a timeout.
    out = post(d_url, "/v1/chat/completions", {**body, "kv_transfer_params": params}, "stale-1b").json()
    after = nixl(d_url)
    assert after["local_prefills"]["stale"] == before["local_prefills"]["stale"] + 1
    assert after["pulls"] == before["pulls"] and after["pull_failures"] == before["pull_failures"] + 1
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 3

    # D sent other tokens than P computed: the simulator refuses the KV instead of using it.
    params = prefill(p_url, chat_body("what P saw " * 40), "mismatch-1")["kv_transfer_params"]
    post(d_url, "/v1/chat/completions", chat_body("what D got " * 40, max_tokens=2, kv_transfer_params=params), "mismatch-1")
    assert nixl(d_url)["local_prefills"]["mismatch"] == before["local_prefills"]["mismatch"] + 1
    # P's blocks stay held: the router must release them (or they time out).
    assert nixl(p_url)["held_requests"] == 1
    r = httpx.post(f"{p_url}/sim/nixl/release", json={"remote_request_id": "mismatch-1"}).json()
    assert r["released"] is True and r["blocks"] == len(params["remote_block_ids"])
    assert httpx.post(f"{p_url}/sim/nixl/release", json={"remote_request_id": "mismatch-1"}).json()["released"] is False
    assert nixl(p_url)["held_blocks"] == 0 and nixl(p_url)["released"]["released"] >= 1


def test_hold_times_out() -> None:
    # 2 simulated seconds at 0.01: P gives the blocks up after 20 ms of real time.
    with SimCluster(workers=2, time_scale=0.01, pool=False, roles="prefill:1,decode:1", nixl_abort_timeout_s=2.0) as c:
        p_url, d_url = c.worker_urls["w0"], c.worker_urls["w1"]
        body = chat_body("held too long " * 40, max_tokens=5)
        params = prefill(p_url, body, "late-1")["kv_transfer_params"]
        wait_until(lambda: nixl(p_url)["held_blocks"] == 0)
        p = nixl(p_url)
        assert p["released"] == {"pulled": 0, "released": 0, "expired": 1}
        assert p["released_blocks"] == len(params["remote_block_ids"])
        assert metric(p_url, "kvroute_sim:nixl_released_total", reason="expired") == 1
        # D finds nothing to read and recomputes, as vLLM does after a failed transfer.
        out = post(d_url, "/v1/chat/completions", {**body, "kv_transfer_params": params}, "late-1").json()
        assert out["usage"]["completion_tokens"] == 5 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert nixl(d_url)["local_prefills"]["stale"] == 1
        assert state(d_url)["computed_prompt_tokens"] == prompt_tokens(body)


# -- aborts --------------------------------------------------------------------------------------


def test_client_gone_during_prefill_leaves_no_hold(urls: tuple[str, str, str]) -> None:
    p_url, _, _ = urls
    before = nixl(p_url)
    # ~1 s of real time for this prefill: the client leaves long before it ends.
    httpx.post(f"{p_url}/sim/fault", json={"mode": "slow", "slow_factor": 2000})
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                f"{p_url}/v1/chat/completions", json=prefill_body(chat_body("long prefill " * 800)),
                headers={"X-Request-Id": "gone-1"}, timeout=0.2,
            )  # fmt: skip
        wait_until(lambda: state(p_url)["running"] == 0 and state(p_url)["waiting"] == 0)
    finally:
        httpx.post(f"{p_url}/sim/fault", json={"mode": "none"})
    after = nixl(p_url)
    assert after["holds"] == before["holds"] and after["held_blocks"] == 0
    assert state(p_url)["kv_used_blocks"] == 0


def test_decode_aborted_before_its_read_releases_p(urls: tuple[str, str, str]) -> None:
    """vLLM's way for a router to free P's blocks: send D the params and abort it; D's
    `request_finished` notifies P even though it never read."""
    p_url, d_url, _ = urls
    body = chat_body("abandoned after prefill " * 40, max_tokens=30)
    params = prefill(p_url, body, "abandon-1")["kv_transfer_params"]
    assert nixl(p_url)["held_requests"] == 1
    pulls = nixl(d_url)["pulls"]

    async def scenario(client: httpx.AsyncClient) -> None:
        # D inside one long step: the request waits in its queue, unread, until it is aborted.
        await client.post(f"{d_url}/sim/fault", json={"mode": "slow", "slow_factor": 3000})
        blocker = asyncio.create_task(client.post(f"{d_url}/v1/chat/completions", json=chat_body("blocker " * 300, max_tokens=1)))
        while (await client.get(f"{d_url}/sim/state")).json()["running"] == 0:
            await asyncio.sleep(0.005)
        with pytest.raises(httpx.TimeoutException):
            await client.post(
                f"{d_url}/v1/chat/completions", json={**body, "kv_transfer_params": params},
                headers={"X-Request-Id": "abandon-1"}, timeout=0.05,
            )  # fmt: skip
        deadline = time.monotonic() + 5
        while (await client.get(f"{p_url}/sim/nixl")).json()["held_requests"]:
            assert time.monotonic() < deadline, "P still holds the blocks"
            await asyncio.sleep(0.005)
        await client.post(f"{d_url}/sim/fault", json={"mode": "none"})
        await blocker

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await scenario(client)

    try:
        asyncio.run(main())
    finally:
        httpx.post(f"{d_url}/sim/fault", json={"mode": "none"})
    p = nixl(p_url)
    assert p["held_blocks"] == 0 and p["released"]["released"] >= 1
    assert nixl(d_url)["pulls"] == pulls  # nothing was read


# -- between processes --------------------------------------------------------------------------


def test_pull_over_http_between_two_sim_worker_processes() -> None:
    with SimWorkerProcess("p0", role="prefill") as p, SimWorkerProcess("d0", role="decode") as d:
        assert state(p.url)["role"] == "prefill" and state(d.url)["role"] == "decode"
        body = chat_body("across processes " * 50, max_tokens=6)
        params = prefill(p.url, body, "xproc-1")["kv_transfer_params"]
        assert nixl(p.url)["held_blocks"] == len(params["remote_block_ids"])
        out = post(d.url, "/v1/chat/completions", {**body, "kv_transfer_params": params}, "xproc-1").json()
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens(body) - 1
        assert nixl(d.url)["pulls"] == 1 and nixl(p.url)["held_blocks"] == 0
        assert nixl(p.url)["released"]["pulled"] == 1
        # P gone: D cannot reach it and prefills itself.
        params = prefill(p.url, body, "xproc-2")["kv_transfer_params"]
        p.stop()
        post(d.url, "/v1/chat/completions", {**body, "kv_transfer_params": params}, "xproc-2")
        assert nixl(d.url)["local_prefills"]["unreachable"] == 1


def test_vllm_router_pd_mode_runs_on_the_simulated_fleet() -> None:
    """vllm-router's own P/D mode (NixlConnector flow) against the simulator: the peer the
    bench compares kvroute's disaggregation with."""
    from loadtests.benchmark.peers import PEERS, peer_env, peers_dir
    from loadtests.support.processes import spawn, stop_group
    from loadtests.support.routerproc import free_port

    spec = PEERS["vllm-router"]
    exe = peers_dir() / spec.name / "bin" / spec.binary
    if not exe.exists():
        pytest.skip("vllm-router is not installed (kvroute bench --peers vllm-router installs it)")
    with SimCluster(workers=3, time_scale=0.01, pool=False, roles="prefill:1,decode:2") as c:
        port = free_port()
        cmd = [
            str(exe), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
            "--prefill", c.worker_urls["w0"], "--decode", c.worker_urls["w1"], "--decode", c.worker_urls["w2"],
            "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--log-level", "warning",
        ]  # fmt: skip
        proc = spawn(cmd, env=peer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda: _healthy(url), timeout_s=30)
            body = chat_body("through vllm-router's P/D mode " * 30, max_tokens=8)
            for stream in (False, True):
                r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream}, timeout=30, trust_env=False)
                assert r.status_code == 200, r.text
        finally:
            stop_group(proc)
        p, d1, d2 = (nixl(c.worker_urls[w]) for w in ("w0", "w1", "w2"))
    assert p["holds"] == 2 and p["released"]["pulled"] == 2 and p["held_blocks"] == 0
    assert d1["pulls"] + d2["pulls"] == 2
    assert sum(d1["local_prefills"].values()) + sum(d2["local_prefills"].values()) == 0


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


# -- decode interference -------------------------------------------------------------------------


def test_decode_worker_itl_stays_low_under_long_prompts() -> None:
    """Long prefills on a `both` worker share steps with its running decodes (chunked
    prefill in mixed steps), so their inter-token latency jumps; on a decode worker the same
    prompts arrive as pulled KV and only their last token is computed."""

    async def stream(
        client: httpx.AsyncClient, url: str, body: dict[str, Any], rid: str, first: asyncio.Event | None = None
    ) -> None:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": rid}) as r:
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                if first is not None:
                    first.set()

    async def disaggregated(
        client: httpx.AsyncClient, p_url: str, d_url: str, body: dict[str, Any], rid: str, first: asyncio.Event | None = None
    ) -> None:
        out = (await client.post(f"{p_url}/v1/chat/completions", json=prefill_body(body), headers={"X-Request-Id": rid})).json()
        await stream(client, d_url, {**body, "stream": True, "kv_transfer_params": out["kv_transfer_params"]}, rid, first)

    async def fleet(client: httpx.AsyncClient, send: Any) -> int:
        started = asyncio.Event()
        decoders = [
            asyncio.create_task(send(chat_body(f"decoder {i} " * 40, max_tokens=600), f"dec-{i}", started)) for i in range(6)
        ]
        sent = 0
        await started.wait()
        while not all(t.done() for t in decoders):  # a stream of long prompts while they decode
            await send(chat_body(f"long prompt {sent} " * 4000, max_tokens=2), f"long-{sent}")
            sent += 1
        await asyncio.gather(*decoders)
        return sent

    async def run(c: SimCluster) -> tuple[int, int]:
        p_url, d_url, both_url = (c.worker_urls[w] for w in ("w0", "w1", "w2"))
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(
                fleet(client, lambda body, rid, first=None: stream(client, both_url, {**body, "stream": True}, rid, first)),
                fleet(client, lambda body, rid, first=None: disaggregated(client, p_url, d_url, body, "pd-" + rid, first)),
            )

    # A quarter of real time: faster, a busy machine sends the first long prompt only after
    # the decodes it should interrupt have finished.
    with SimCluster(workers=3, time_scale=0.25, pool=False, roles="prefill:1,decode:1,both:1") as c:
        longs_both, longs_pd = asyncio.run(run(c))
        both, decode = state(c.worker_urls["w2"]), state(c.worker_urls["w1"])
    assert longs_both >= 1 and longs_pd >= 1
    assert decode["nixl"]["pulls"] == 6 + longs_pd
    b, d = both["inter_token_latency_s"], decode["inter_token_latency_s"]
    # One 8192-token prefill chunk takes ~190 ms on an H200; a decode step ~5 ms.
    assert b["max"] > 0.1
    assert d["max"] < 0.02
    assert d["mean"] < b["mean"]
    assert decode["generation_tokens"] >= 6 * 600


# -- the engine's side ---------------------------------------------------------------------------


def seq_of(data: bytes, sid: str, max_tokens: int = 4, **kw: Any) -> Seq:
    return Seq(sid, len(data) // 4, max_tokens, block_hashes_of(data, b"m"), 0.0, **kw)


def drive(engine: Engine, now: float = 0.0, limit: int = 1000) -> float:
    for _ in range(limit):
        step = engine.schedule()
        if step is None:
            return now
        now += step.duration
        engine.complete(step, now)
    return now


def test_engine_hold_keeps_blocks_until_released() -> None:
    e = Engine(COST, 16 * 100)
    data = bytes(range(256)) * 4  # 256 tokens: 16 blocks
    e.add(seq_of(data, "p", max_tokens=1, hold=True))
    drive(e)
    assert e.held["p"].state is State.HELD and e.held_blocks == 16 and e.blocks.used == 16
    assert [s.id for s in e.drain_new_holds()] == ["p"]
    assert e.release_held("p") == 16 and e.blocks.used == 0 and e.release_held("p") is None
    # Still in the prefix cache, evictable.
    assert e.blocks.cached_run(block_hashes_of(data, b"m"), 16) == 16


def test_engine_pull_waits_without_budget_then_computes_one_token() -> None:
    e = Engine(COST, 16 * 100)
    data = bytes(range(256)) * 4 + b"tail" * 8  # 264 tokens: 17 blocks
    e.add(seq_of(data, "d", max_tokens=3, pull=True))
    e.add(seq_of(b"other prompt" * 40, "o", max_tokens=2))
    step = e.schedule()
    assert step is not None and [i.seq.id for i in step.items] == ["o"]  # the pull took no budget
    [pulling] = e.drain_pull_starts()
    assert pulling.state is State.PULLING and pulling.pull_blocks == 17 and pulling.pull_tokens == 264
    assert e.blocks.used >= 17
    now = step.duration
    e.complete(step, now)
    e.pull_done("d", True)
    step = e.schedule()
    assert step is not None
    item = next(i for i in step.items if i.seq.id == "d")
    assert (item.start, item.tokens) == (263, 1)
    e.complete(step, now + step.duration)
    d = item.seq
    assert d.generated == 1 and d.nixl_tokens == 263 and e.counters.nixl_hits == 263
    assert e.counters.computed_prompt_tokens >= 1 and e.counters.pulled_blocks == 17


def test_engine_failed_pull_recomputes_and_abort_frees() -> None:
    e = Engine(COST, 16 * 100)
    data = bytes(range(256)) * 4
    e.add(seq_of(data, "d", max_tokens=2, pull=True))
    assert e.schedule() is None
    e.drain_pull_starts()
    e.pull_done("d", False)
    drive(e)
    assert e.counters.pull_failures == 1 and e.counters.computed_prompt_tokens == 256 and e.blocks.used == 0
    e.add(seq_of(b"x" * 4096, "gone", pull=True))
    assert e.schedule() is None and e.blocks.used > 0
    assert e.abort("gone") and e.blocks.used == 0 and e.pull_done("gone", True) is None


async def test_runner_without_a_pull_source_recomputes_and_times_tokens() -> None:
    engine = Engine(COST, 16 * 100)
    runner = Runner(engine, time_scale=0.001)
    runner.start()
    try:
        handle = runner.submit(seq_of(bytes(range(256)) * 4, "d", max_tokens=3, pull=True))
        while not handle.finished:
            await asyncio.wait_for(handle.wait(), 5)
    finally:
        await runner.close()
    assert engine.counters.pull_failures == 1 and engine.counters.computed_prompt_tokens == 256
    # Two gaps between three tokens, each one decode step.
    assert runner.itl.n == 2 and runner.tpot.n == 1 and runner.decode_time.n == 1
    assert runner.itl.total == pytest.approx(2 * COST.step_s([], [257]), rel=0.01)
