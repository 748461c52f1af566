"""A worker SIGKILLed under load: requests that had not received a byte are retried and
succeed, streams that had started end with an error event and [DONE], nothing is cut
silently; the worker is re-admitted when it comes back on its port. (The few-hundred-stream
version with its numbers is loadtests/e2e/faults.py's sigkill scenario.)"""

from __future__ import annotations

import asyncio
import time

import httpx

from loadtests.e2e.faults import RestartableWorker, chat, stream_one
from loadtests.support.routerproc import RouterProcess


def test_sigkill_mid_load_then_restart() -> None:
    workers = [RestartableWorker(f"w{i}", time_scale=1.0) for i in range(2)]
    for w in workers:
        w.start()
    victim = workers[0]
    try:
        args = ["--health-interval-s", "0.3", "--breaker-open-s", "0.5"]
        with RouterProcess({w.name: w.url for w in workers}, policy="least_loaded", extra_args=args) as r:

            async def load() -> list:
                async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100)) as client:
                    tasks = [asyncio.create_task(stream_one(client, r.url, chat(f"story {i}", 300))) for i in range(40)]
                    await asyncio.sleep(0.6)  # every stream is under way
                    victim.kill()
                    # New requests right after the kill, before the router has noticed.
                    tasks += [asyncio.create_task(stream_one(client, r.url, chat(f"late {i}", 20))) for i in range(20)]
                    return await asyncio.gather(*tasks)

            outcomes = asyncio.run(load())
            kinds = [o.kind for o in outcomes]
            assert kinds.count("failed_before_byte") == 0, [o for o in outcomes if o.kind == "failed_before_byte"]
            assert kinds.count("cut") == 0
            broken = [o for o in outcomes if o.kind == "stream_error"]
            assert broken and all(o.worker == victim.name for o in broken)
            assert all(o.worker == "w1" for o in outcomes[40:])  # the late ones went to the survivor
            assert kinds.count("ok") == len(outcomes) - len(broken)

            victim.start()  # same port
            deadline = time.monotonic() + 10
            served = set()
            while "w0" not in served:
                assert time.monotonic() < deadline, "the restarted worker was never re-admitted"
                resp = httpx.post(r.url + "/v1/chat/completions", json=chat("after restart", 4, stream=False), timeout=10)
                assert resp.status_code == 200
                served.add(resp.headers["x-kvroute-worker"])
                time.sleep(0.05)
            text = r.metrics()
            assert 'kvroute_worker_healthy{worker="w0"} 1' in text
            assert "kvroute_stream_errors_total 0" not in text
    finally:
        for w in workers:
            w.stop()
