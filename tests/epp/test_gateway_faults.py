"""Faults through a real Envoy and `kvroute epp`:

* a worker SIGKILLed under load: no request fails before its first byte (Envoy's retry
  takes the picker's next endpoint; streams already under way on the victim are cut, the
  gateway owning the bytes), and the picker stops choosing the victim;
* the picker restarted mid-run, with Envoy's `failure_mode_allow` either way: without it
  (FailClose) requests sent while the picker is away fail (Envoy's 500); with it (FailOpen)
  and the request body BUFFERED they are answered by Envoy's own round robin (no
  `x-kvroute-worker`); with it and the body FULL_DUPLEX_STREAMED some fail as with FailClose
  (Envoy fails open only until the body's first chunk has gone to the picker). Routing
  resumes when the picker is back, every way.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from loadtests.benchmark.envoy import EnvoyPicker, EnvoyProcess, PickerProcess, endpoints_of
from loadtests.e2e.faults import RestartableWorker, chat, stream_one
from loadtests.support.routerproc import free_port
from router.epp.envoy_config import EnvoyBootstrap
from tests.epp.support import require_envoy

pytestmark = [pytest.mark.slow]


def test_a_worker_sigkilled_under_load_fails_no_request_before_its_first_byte(tmp_path: Path) -> None:
    require_envoy()
    workers = [RestartableWorker(f"w{i}", time_scale=1.0) for i in range(2)]
    for w in workers:
        w.start()
    victim = workers[0]
    try:
        args = ["--health-interval-s", "0.3", "--breaker-open-s", "0.5"]
        with EnvoyPicker({w.name: w.url for w in workers}, "least_loaded", args, log_path=str(tmp_path / "gw.log")) as gw:

            async def load() -> list:
                async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100), trust_env=False) as client:
                    tasks = [asyncio.create_task(stream_one(client, gw.url, chat(f"story {i}", 300))) for i in range(40)]
                    await asyncio.sleep(0.6)  # every stream is under way
                    victim.kill()
                    # New requests right after the kill, before the picker has noticed.
                    tasks += [asyncio.create_task(stream_one(client, gw.url, chat(f"late {i}", 20))) for i in range(20)]
                    return await asyncio.gather(*tasks)

            outcomes = asyncio.run(load())
            kinds = Counter(o.kind for o in outcomes)
            assert kinds["failed_before_byte"] == 0, [o for o in outcomes if o.kind == "failed_before_byte"]
            # Streams the victim had begun end early (cut by the gateway); none other does.
            assert all(o.worker == victim.name for o in outcomes if o.kind != "ok")
            assert kinds["ok"] >= 20
            assert all(o.kind == "ok" and o.worker == "w1" for o in outcomes[40:])  # the late ones: the survivor
            later = asyncio.run(_sequential(gw.url, 10))
            assert [o.worker for o in later] == ["w1"] * 10
    finally:
        for w in workers:
            w.stop()


async def _sequential(url: str, n: int) -> list:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        return [await stream_one(client, url, chat(f"after {i}", 4)) for i in range(n)]


def _one(client: httpx.Client, url: str, i: int) -> tuple[int, bool]:
    """(status, routed by the picker) of one short request; status 0: no answer."""
    try:
        r = client.post(url + "/v1/chat/completions", json=chat(f"restart {i}", 4, stream=False))
    except httpx.HTTPError:
        return 0, False
    return r.status_code, "x-kvroute-worker" in r.headers


GATEWAYS = {
    "FailClose": {"failure_mode_allow": False},
    "FailOpen": {"failure_mode_allow": True},  # the request body BUFFERED: Envoy keeps it
    "FailOpen+FULL_DUPLEX_STREAMED": {"failure_mode_allow": True, "request_body_mode": "FULL_DUPLEX_STREAMED"},
}


def test_the_picker_restarted_mid_run_with_failure_mode_allow_either_way(tmp_path: Path) -> None:
    require_envoy()
    workers = [RestartableWorker(f"w{i}", time_scale=1.0) for i in range(2)]
    for w in workers:
        w.start()
    urls = {w.name: w.url for w in workers}
    picker = PickerProcess(urls, "cache_aware", log_path=str(tmp_path / "picker.log"))
    envoys = {
        name: EnvoyProcess(EnvoyBootstrap(listen=("127.0.0.1", free_port()), epp=picker.grpc, endpoints=endpoints_of(urls),
                                          **options), log_path=str(tmp_path / f"envoy-{name}.log"))
        for name, options in GATEWAYS.items()
    }  # fmt: skip
    try:
        picker.start()
        for envoy in envoys.values():
            envoy.start()
        phases: dict[str, dict[str, Counter]] = {name: {"before": Counter(), "away": Counter(), "back": Counter()} for name in envoys}
        with httpx.Client(timeout=10, trust_env=False) as client:

            def round_of(phase: str, i: int) -> None:
                for name, envoy in envoys.items():
                    status, routed = _one(client, envoy.url, i)
                    phases[name][phase][(status, routed)] += 1

            for i in range(5):
                round_of("before", i)
            picker.stop()  # SIGTERM: the picker drains and exits
            for i in range(8):
                round_of("away", i)
            picker.start()  # the same ports
            for envoy in envoys.values():
                envoy.wait_picker_healthy()
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:  # Envoy reconnects to the picker
                    status, routed = _one(client, envoy.url, -1)
                    if status == 200 and routed:
                        break
                    time.sleep(0.1)
            for i in range(5):
                round_of("back", i)
        print({name: {phase: dict(c) for phase, c in by_phase.items()} for name, by_phase in phases.items()})
        for name in envoys:
            assert phases[name]["before"] == Counter({(200, True): 5}), name
            assert phases[name]["back"] == Counter({(200, True): 5}), name
        # FailClose: Envoy refuses what it cannot ask the picker about.
        assert phases["FailClose"]["away"] == Counter({(500, False): 8})
        # FailOpen with the body buffered: answered, unrouted (Envoy's own round robin).
        assert phases["FailOpen"]["away"] == Counter({(200, False): 8})
        # FailOpen with the body streamed to the picker: Envoy 1.40 fails open only until the
        # body's first chunk is on its way, which a request arriving whole passes as its
        # connection to the picker fails: some fail (500), some go on unrouted.
        assert set(phases["FailOpen+FULL_DUPLEX_STREAMED"]["away"]) <= {(500, False), (200, False)}
    finally:
        for envoy in envoys.values():
            envoy.stop()
        picker.stop()
        for w in workers:
            w.stop()
