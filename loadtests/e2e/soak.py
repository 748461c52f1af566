"""Soak: minutes of mixed traffic through the router, with cancellations and worker
restarts, watching the router process for leaks.

`python -m loadtests.e2e.soak --minutes M --out DIR [--clients 32] [--workers 3]` writes
DIR/soak.json.

Traffic: multi-turn chat conversations (streaming and not) and completions from closed-loop
clients; about one request in seven is abandoned by its client (before the first byte or
mid-stream). Every `--restart-every-s` one worker is killed (alternately SIGKILL and
SIGTERM) and started again on its port. Every `--sample-s` the router process is sampled:
RSS, open file descriptors, open TCP sockets, its own event-loop lag
(`kvroute_event_loop_lag_seconds`) and its in-flight gauges.

Verdicts, after a warm-up (the first 20% of the run, at least 30 s): RSS growth from the end
of the warm-up to the end of the run (`rss_growth_pct`, target < 10%); file descriptors
when the traffic has stopped and the clients are gone, against the warm-up
(`fd_leak`: more than a few above it means descriptors are leaking).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtests.benchmark.harness import metric_sum, parse_prometheus, percentile
from loadtests.e2e.faults import MODEL, RestartableWorker
from loadtests.support.extras import require_bench_extra
from loadtests.support.processes import stop_children_on_signals
from loadtests.support.routerproc import RouterProcess

FD_SLACK = 8
"""Descriptors the router may hold beyond its warm-up count once traffic stops (its pool
to the workers may have grown a little)."""


def sample_process(pid: int) -> dict[str, float]:
    import psutil  # the `bench` extra, checked by main()

    p = psutil.Process(pid)
    return {
        "rss_mb": p.memory_info().rss / 2**20,
        "fds": float(p.num_fds()),
        "tcp": float(len(p.net_connections(kind="tcp"))),
    }


class Traffic:
    def __init__(self, url: str, seed: int) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.counts: dict[str, int] = {}
        self.ttfb: list[float] = []

    def count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    async def one(self, client: httpx.AsyncClient, history: list[dict[str, Any]], user: int) -> None:
        rng = self.rng
        roll = rng.random()
        cancel = rng.random() < 0.15
        if roll < 0.15:
            path = "/v1/completions"
            body: dict[str, Any] = {"model": MODEL, "prompt": f"user {user} says " * rng.randint(5, 200),
                                    "max_tokens": rng.randint(4, 48), "stream": rng.random() < 0.5}
        else:
            path = "/v1/chat/completions"
            history.append({"role": "user", "content": f"turn {len(history)} of user {user}: " + "words " * rng.randint(5, 80)})
            body = {"model": MODEL, "messages": list(history), "max_tokens": rng.randint(4, 64), "stream": roll < 0.8}
        t0 = time.monotonic()
        try:
            if cancel:
                # Abandon it: before the first byte, or after a chunk or two.
                async with client.stream("POST", self.url + path, json=body, timeout=rng.uniform(0.01, 0.3)) as resp:
                    async for _ in resp.aiter_raw():
                        if rng.random() < 0.5:
                            break
                self.count("cancelled")
                return
            if body["stream"]:
                async with client.stream("POST", self.url + path, json=body) as resp:
                    first = True
                    tail = b""
                    async for chunk in resp.aiter_raw():
                        if first:
                            self.ttfb.append(time.monotonic() - t0)
                            first = False
                        tail = (tail + chunk)[-300:]
                    ok = resp.status_code == 200 and b"[DONE]" in tail
                    self.count("stream_ok" if ok and b'"error"' not in tail else f"stream_{resp.status_code}_error" if ok else f"stream_{resp.status_code}")
            else:
                resp = await client.post(self.url + path, json=body)
                self.count(f"whole_{resp.status_code}")
            if path == "/v1/chat/completions":
                history.append({"role": "assistant", "content": "ok " * 8})
                if len(history) > 16:
                    del history[:]
        except httpx.TimeoutException:
            self.count("cancelled")
        except httpx.HTTPError as exc:
            self.count(f"exception_{type(exc).__name__}")

    async def client_loop(self, client: httpx.AsyncClient, user: int, stop_at: float) -> None:
        history: list[dict[str, Any]] = []
        while time.monotonic() < stop_at:
            await self.one(client, history, user)


async def soak(minutes: float, clients: int, n_workers: int, restart_every_s: float, sample_s: float) -> dict[str, Any]:
    workers = [RestartableWorker(f"w{i}", time_scale=0.5) for i in range(n_workers)]
    for w in workers:
        await asyncio.to_thread(w.start)
    router = RouterProcess({w.name: w.url for w in workers}, policy="cache_aware",
                           extra_args=["--health-interval-s", "1", "--breaker-open-s", "1"])
    await asyncio.to_thread(router.start)
    assert router.proc is not None
    pid = router.proc.pid
    duration = minutes * 60
    warmup = max(30.0, 0.2 * duration)
    samples: list[dict[str, float]] = []
    restarts: list[dict[str, Any]] = []
    traffic = Traffic(router.url, seed=7)
    baseline = sample_process(pid)
    t0 = time.monotonic()
    stop_at = t0 + duration
    try:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients + 8)) as client:

            async def sampler() -> None:
                async with httpx.AsyncClient(timeout=10) as probe:
                    while time.monotonic() < stop_at:
                        s = sample_process(pid)
                        parsed = parse_prometheus((await probe.get(router.url + "/metrics")).text)
                        s["t"] = time.monotonic() - t0
                        s["loop_lag_s"] = metric_sum(parsed, "kvroute_event_loop_lag_seconds")
                        s["inflight"] = metric_sum(parsed, "kvroute_worker_inflight")
                        s["requests"] = metric_sum(parsed, "kvroute_requests_total")
                        samples.append(s)
                        await asyncio.sleep(sample_s)

            async def chaos() -> None:
                i = 0
                while time.monotonic() + restart_every_s < stop_at:
                    await asyncio.sleep(restart_every_s)
                    victim = workers[i % len(workers)]
                    how = "SIGKILL" if i % 2 == 0 else "SIGTERM"
                    if how == "SIGKILL":
                        await asyncio.to_thread(victim.kill)
                    else:
                        await asyncio.to_thread(victim.stop)
                    await asyncio.sleep(2.0)
                    await asyncio.to_thread(victim.start)
                    restarts.append({"t": round(time.monotonic() - t0, 1), "worker": victim.name, "how": how})
                    i += 1

            await asyncio.gather(sampler(), chaos(), *(traffic.client_loop(client, u, stop_at) for u in range(clients)))
        # The clients are gone (their connections closed); let the router settle.
        await asyncio.sleep(3.0)
        after = sample_process(pid)
        parsed = parse_prometheus(httpx.get(router.url + "/metrics", timeout=10).text)
        inflight_after = metric_sum(parsed, "kvroute_worker_inflight")
    finally:
        await asyncio.to_thread(router.stop)
        for w in workers:
            await asyncio.to_thread(w.stop)

    warm = [s for s in samples if s["t"] >= warmup]
    at_warmup = warm[0] if warm else samples[-1]
    tail = warm[-max(len(warm) // 5, 1):]
    rss_end = statistics.mean(s["rss_mb"] for s in tail)
    lags = [s["loop_lag_s"] for s in samples]
    return {
        "minutes": minutes,
        "clients": clients,
        "workers": n_workers,
        "warmup_s": warmup,
        "requests": traffic.counts,
        "requests_total": sum(traffic.counts.values()),
        "worker_restarts": restarts,
        "ttfb_s": {"p50": percentile(traffic.ttfb, 50), "p99": percentile(traffic.ttfb, 99)},
        "router": {
            "rss_mb_baseline": baseline["rss_mb"],
            "rss_mb_at_warmup": at_warmup["rss_mb"],
            "rss_mb_end": rss_end,
            "rss_mb_max": max(s["rss_mb"] for s in samples),
            "rss_growth_pct": 100 * (rss_end - at_warmup["rss_mb"]) / at_warmup["rss_mb"],
            "fds_baseline": baseline["fds"],
            "fds_at_warmup": at_warmup["fds"],
            "fds_max": max(s["fds"] for s in samples),
            "fds_after": after["fds"],
            "tcp_after": after["tcp"],
            "fd_leak": after["fds"] > at_warmup["fds"] + FD_SLACK,
            "inflight_after": inflight_after,
            "loop_lag_s": {"p50": percentile(lags, 50), "p99": percentile(lags, 99), "max": max(lags, default=None)},
        },
        "samples": [{k: round(v, 4) for k, v in s.items()} for s in samples],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.e2e.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--out", required=True)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--restart-every-s", type=float, default=30.0)
    p.add_argument("--sample-s", type=float, default=5.0)
    args = p.parse_args(argv)
    require_bench_extra("python -m loadtests.e2e.soak", ("psutil",))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with stop_children_on_signals():
        result = asyncio.run(soak(args.minutes, args.clients, args.workers, args.restart_every_s, args.sample_s))
    result["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    (out / "soak.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
