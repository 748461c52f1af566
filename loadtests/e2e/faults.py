"""Fault injection through the router in front of simulated workers, with JSON output.

`python -m loadtests.e2e.faults --out DIR [--scenarios sigkill,faults,disconnect,overload]
[--concurrency 300] [--quick]` writes DIR/faults.json; docs/reliability.md quotes it.

* sigkill: single `kvroute sim-worker` processes; a few hundred concurrent streams; one
  worker is SIGKILLed mid-load and restarted on its port. Every request is classified:
  `ok` (complete), `stream_error` (started, then ended with an error event and [DONE]),
  `failed_before_byte` (no byte ever: must be 0, those are retried) and `cut` (started,
  ended without the error event: must be 0). Also: how long until the restarted worker
  serves again.
* faults: five workers in one sim-cluster; one answers 500, one hangs (health included),
  one is 20× slow. Closed-loop clients; every request must succeed through the others.
* disconnect: clients drop requests (mid-stream, during prefill, non-streaming) over raw
  sockets; the delay until the worker notices (polled from `/sim/state`, so an upper
  bound) and the router's in-flight gauges afterwards.
* overload: 3× more concurrent clients than worker slots, no back-off on 429; statuses,
  Retry-After, queue depth and the router's RSS over time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtests.benchmark.harness import metric_sum, parse_prometheus, percentile, tree_rss_sizes
from loadtests.sim.cluster import SimCluster, SimWorkerProcess
from loadtests.support.extras import require_bench_extra
from loadtests.support.processes import kill_group, stop_children_on_signals
from loadtests.support.routerproc import RouterProcess

MODEL = "sim-llama3-8b"
LOG_PATH: dict[str, str] = {}
"""Scenario -> file that receives the router's log (set by --out)."""


class RestartableWorker(SimWorkerProcess):
    """A `kvroute sim-worker` that keeps its port across restarts, and can be SIGKILLed."""

    def _choose_ports(self) -> None:
        if not self.port:
            super()._choose_ports()

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            kill_group(proc)


@dataclass
class Outcome:
    status: int | None = None
    worker: str = ""
    first_byte_at: float | None = None
    ended_at: float = 0.0
    started_at: float = 0.0
    chunks: int = 0
    done: bool = False
    error_event: bool = False
    retry_after: str | None = None
    exception: str | None = None
    trace: list[tuple[str, float]] | None = None
    """httpx/httpcore events of a failed request (connect, send, receive), for diagnosis."""

    @property
    def kind(self) -> str:
        if self.first_byte_at is None:
            return "ok_whole" if self.status == 200 and self.done else "failed_before_byte"
        if self.done and self.error_event:
            return "stream_error"
        if self.done:
            return "ok"
        return "cut"


def chat(prompt: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "stream": stream, "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}]}


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Outcome:
    out = Outcome(started_at=time.monotonic())
    events: list[tuple[str, float]] = []

    async def trace(name: str, info: dict[str, Any]) -> None:
        events.append((name, time.monotonic()))

    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, extensions={"trace": trace}) as resp:
            out.status = resp.status_code
            out.worker = resp.headers.get("x-kvroute-worker", "")
            out.retry_after = resp.headers.get("retry-after")
            if resp.status_code != 200:
                await resp.aread()
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if out.first_byte_at is None:
                    out.first_byte_at = time.monotonic()
                payload = line[6:]
                if payload == "[DONE]":
                    out.done = True
                elif payload.startswith('{"error"'):
                    out.error_event = True
                else:
                    out.chunks += 1
    except httpx.HTTPError as exc:
        out.exception = type(exc).__name__
        out.trace = [(name, round(t - out.started_at, 4)) for name, t in events]
    finally:
        out.ended_at = time.monotonic()
    return out


class RawClient:
    """One keep-alive HTTP/1.1 connection per virtual client, read with asyncio streams.

    A few hundred concurrent httpx streams in one process cost more CPU than the router
    they drive (httpx's pool is O(connections) per request): the load generator, not the
    router, would set the pace and every timing would be its own lag.
    """

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    async def request(self, body: dict[str, Any], path: str = "/v1/chat/completions") -> Outcome:
        out = Outcome(started_at=time.monotonic())
        payload = orjson.dumps(body)
        try:
            if self._writer is None:
                self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            reader, writer = self._reader, self._writer
            assert reader is not None
            writer.write(
                b"POST " + path.encode() + b" HTTP/1.1\r\nhost: " + self.host.encode() + b"\r\n"
                b"content-type: application/json\r\ncontent-length: " + str(len(payload)).encode()
                + b"\r\n\r\n" + payload
            )
            status_line = await reader.readline()
            if not status_line:
                raise ConnectionResetError("closed before the status line")
            out.status = int(status_line.split()[1])
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            out.worker = headers.get("x-kvroute-worker", "")
            out.retry_after = headers.get("retry-after")
            streaming = out.status == 200 and headers.get("content-type", "").startswith("text/event-stream")
            tail = b""
            if headers.get("transfer-encoding") == "chunked":
                while True:
                    size_line = await reader.readline()
                    if not size_line:
                        raise ConnectionResetError("closed mid-body")
                    size = int(size_line.split(b";")[0], 16)
                    data = await reader.readexactly(size + 2)
                    if size == 0:
                        break
                    if streaming and out.first_byte_at is None:
                        out.first_byte_at = time.monotonic()
                    out.chunks += 1
                    tail = (tail + data[:-2])[-512:]
                    if b'data: {"error"' in tail:
                        out.error_event = True
            else:
                tail = await reader.readexactly(int(headers.get("content-length", "0")))
            out.done = b"data: [DONE]" in tail if streaming else True
            if headers.get("connection", "").lower() == "close":
                await self.close()
        except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
            out.exception = type(exc).__name__
            await self.close()
        finally:
            out.ended_at = time.monotonic()
        return out


def metrics(router: RouterProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    return parse_prometheus(httpx.get(router.url + "/metrics", timeout=10).text)


def inflight(router: RouterProcess) -> float:
    return metric_sum(metrics(router), "kvroute_worker_inflight")


def rss_mb(pid: int) -> float:
    return tree_rss_sizes(pid)[0] / 2**20


def log_events(path: str | None) -> list[str]:
    """The router's breaker, ejection and health lines (not the per-request warnings)."""
    if not path or not os.path.exists(path):
        return []
    keep = ("circuit", "ejected", "is down", "is up", "outlier")
    return [line.strip()[24:] for line in open(path, encoding="utf-8") if any(k in line for k in keep)][:60]


def address_lines(path: str | None, urls: Any) -> int:
    """Log lines naming a worker's URL or port: must be 0."""
    if not path or not os.path.exists(path):
        return 0
    needles = [u for u in urls] + [":" + u.rsplit(":", 1)[1] for u in urls]
    return sum(1 for line in open(path, encoding="utf-8") if any(n in line for n in needles))


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in outcomes:
        out[o.kind] = out.get(o.kind, 0) + 1
    return out


# -- sigkill ------------------------------------------------------------------------------


async def scenario_sigkill(concurrency: int, quick: bool) -> dict[str, Any]:
    n_workers = 3
    workers = [RestartableWorker(f"w{i}", time_scale=1.0) for i in range(n_workers)]
    for w in workers:
        await asyncio.to_thread(w.start)
    victim = workers[0]
    args = ["--health-interval-s", "0.5", "--breaker-open-s", "1", "--max-connections", str(4 * concurrency),
            "--log-level", "info"]
    router = RouterProcess({w.name: w.url for w in workers}, policy="cache_aware", extra_args=args,
                           log_path=LOG_PATH.get("sigkill"))
    await asyncio.to_thread(router.start)
    duration = 8.0 if quick else 15.0
    kill_at, restart_at = 2.5, 5.0
    outcomes: list[Outcome] = []
    marks: dict[str, float] = {}
    try:
        t0 = time.monotonic()

        async def client_loop(i: int) -> None:
            raw = RawClient(router.port)
            turn = 0
            while time.monotonic() - t0 < duration:
                outcomes.append(await raw.request(chat(f"client {i} turn {turn} " * 300, 150)))
                turn += 1
            await raw.close()

        def chaos() -> None:
            # A thread of its own: the clients' busy event loop would delay these marks.
            time.sleep(kill_at)
            marks["killed"] = time.monotonic()
            victim.kill()
            time.sleep(restart_at - kill_at)
            victim.start()
            marks["restarted"] = time.monotonic()
            with httpx.Client(timeout=10) as poll:
                while time.monotonic() - t0 < duration + 30:
                    parsed = parse_prometheus(poll.get(router.url + "/metrics").text)
                    if metric_sum(parsed, "kvroute_worker_healthy", worker=victim.name) == 1:
                        marks["healthy_again"] = time.monotonic()
                        return
                    time.sleep(0.02)

        chaos_thread = threading.Thread(target=chaos)
        chaos_thread.start()
        await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
        await asyncio.to_thread(chaos_thread.join)
        killed, restarted = marks["killed"], marks["restarted"]
        in_flight_at_kill = [o for o in outcomes if o.started_at < killed < o.ended_at]
        on_victim_at_kill = [o for o in in_flight_at_kill if o.worker == victim.name and o.first_byte_at and o.first_byte_at < killed]
        served_again = [o.first_byte_at for o in outcomes if o.worker == victim.name and o.first_byte_at and o.first_byte_at > restarted]
        parsed = metrics(router)
        served: dict[str, int] = {}
        for o in outcomes:
            served[o.worker or "-"] = served.get(o.worker or "-", 0) + 1
        return {
            "workers": n_workers,
            "served_by": served,
            "concurrency": concurrency,
            "duration_s": duration,
            "requests": len(outcomes),
            "outcomes": counts(outcomes),
            "in_flight_at_kill": len(in_flight_at_kill),
            "in_flight_at_kill_outcomes": counts(in_flight_at_kill),
            "streaming_on_killed_worker_at_kill": len(on_victim_at_kill),
            "streaming_on_killed_worker_outcomes": counts(on_victim_at_kill),
            "failed_before_first_byte": counts(outcomes).get("failed_before_byte", 0),
            "failures": [
                {"status": o.status, "exception": o.exception, "worker": o.worker, "trace": o.trace,
                 "started_vs_kill_s": round(o.started_at - killed, 3), "ended_vs_kill_s": round(o.ended_at - killed, 3)}
                for o in outcomes if o.kind in ("failed_before_byte", "cut")
            ][:20],
            "cut_without_error_event": counts(outcomes).get("cut", 0),
            "readmitted_healthy_after_restart_s": marks["healthy_again"] - restarted,
            "first_served_after_restart_s": (min(served_again) - restarted) if served_again else None,
            "router_retries": metric_sum(parsed, "kvroute_retries_total"),
            "router_stream_errors": metric_sum(parsed, "kvroute_stream_errors_total"),
            "router_inflight_after": metric_sum(parsed, "kvroute_worker_inflight"),
            "router_log_lines_with_a_worker_address": address_lines(LOG_PATH.get("sigkill"), [w.url for w in workers]),
        }
    finally:
        await asyncio.to_thread(router.stop)
        for w in workers:
            await asyncio.to_thread(w.stop)


# -- 500 / hang / slow ----------------------------------------------------------------------


async def scenario_faults(concurrency: int, quick: bool) -> dict[str, Any]:
    cluster = SimCluster(workers=5, time_scale=0.5, pool=False)
    await asyncio.to_thread(cluster.start)
    args = [
        "--first-byte-timeout-s", "2", "--health-interval-s", "1", "--outlier-interval-s", "5",
        "--outlier-min-requests", "10", "--breaker-open-s", "2", "--breaker-max-open-s", "10",
    ]  # fmt: skip
    router = RouterProcess(cluster.worker_urls, policy="cache_aware", extra_args=[*args, "--log-level", "info"],
                           log_path=LOG_PATH.get("faults"))
    await asyncio.to_thread(router.start)
    faults = {"w0": {"mode": "error500"}, "w1": {"mode": "hang"}, "w2": {"mode": "slow", "slow_factor": 20}}
    duration = 12.0 if quick else 30.0
    outcomes: list[Outcome] = []
    try:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency + 10)) as client:
            for name, fault in faults.items():
                r = await client.post(cluster.worker_urls[name] + "/sim/fault", json=fault)
                r.raise_for_status()
            t0 = time.monotonic()

            async def client_loop(i: int) -> None:
                raw = RawClient(router.port)
                turn = 0
                while time.monotonic() - t0 < duration:
                    outcomes.append(await raw.request(chat(f"user {i} question {turn} " * 10, 32)))
                    turn += 1
                await raw.close()

            await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
            for name in faults:
                await client.post(cluster.worker_urls[name] + "/sim/fault", json={"mode": "none"})
        parsed = metrics(router)
        served: dict[str, int] = {}
        for o in outcomes:
            served[o.worker] = served.get(o.worker, 0) + 1
        ttfb = [o.first_byte_at - o.started_at for o in outcomes if o.first_byte_at]
        total = [o.ended_at - o.started_at for o in outcomes]
        late = [o for o in outcomes if o.started_at - t0 > duration / 2]
        return {
            "workers": {"w0": "error500", "w1": "hang", "w2": "slow x20", "w3": "healthy", "w4": "healthy"},
            "concurrency": concurrency,
            "duration_s": duration,
            "requests": len(outcomes),
            "outcomes": counts(outcomes),
            "failed": sum(1 for o in outcomes if o.kind not in ("ok", "ok_whole")),
            "served_by": served,
            "served_by_second_half": {w: sum(1 for o in late if o.worker == w) for w in sorted(served)},
            "time_to_first_byte_s": {"p50": percentile(ttfb, 50), "p99": percentile(ttfb, 99), "max": max(ttfb, default=None)},
            "time_to_first_byte_p50_by_worker_s": {
                w: percentile([o.first_byte_at - o.started_at for o in outcomes if o.worker == w and o.first_byte_at], 50)
                for w in sorted(served)
            },
            "request_s": {"p50": percentile(total, 50), "p99": percentile(total, 99), "max": max(total, default=None)},
            "router_retries": metric_sum(parsed, "kvroute_retries_total"),
            "worker_healthy": {labels["worker"]: v for labels, v in parsed.get("kvroute_worker_healthy", [])},
            "circuit_open": {labels["worker"]: v for labels, v in parsed.get("kvroute_worker_circuit_open", [])},
            "router_log_events": log_events(LOG_PATH.get("faults")),
            "router_log_lines_with_a_worker_address": address_lines(LOG_PATH.get("faults"), cluster.worker_urls.values()),
        }
    finally:
        await asyncio.to_thread(router.stop)
        await asyncio.to_thread(cluster.stop)


# -- client disconnects -----------------------------------------------------------------------


def _raw_request(port: int, body: dict[str, Any]) -> socket.socket:
    payload = orjson.dumps(body)
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    return sock


def _aborted(client: httpx.Client, cluster: SimCluster) -> int:
    return sum(client.get(u + "/sim/state").json()["aborted"] for u in cluster.worker_urls.values())


def scenario_disconnect(n: int) -> dict[str, Any]:
    with (
        SimCluster(workers=2, time_scale=4.0, pool=False) as cluster,
        RouterProcess(cluster.worker_urls, policy="least_loaded") as router,
        httpx.Client(timeout=5) as poll,  # keep-alive: a poll costs a loopback round trip
    ):
        big = "lorem ipsum " * 5000
        kinds = {
            "mid_stream": lambda i: chat(f"story {i}", 400, True),
            "during_prefill": lambda i: chat(big + str(i), 400, True),
            "non_streaming": lambda i: chat(f"essay {i}", 400, False),
        }
        delays: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(n):
            kind = list(kinds)[i % len(kinds)]
            before = _aborted(poll, cluster)
            sock = _raw_request(router.port, kinds[kind](i))
            if kind == "mid_stream":
                got = b""
                while b"data: " not in got:  # headers, then the first event
                    got += sock.recv(65536)
            else:
                time.sleep(0.2)
            sock.close()
            t0 = time.monotonic()
            while _aborted(poll, cluster) == before:
                if time.monotonic() - t0 > 10:
                    raise RuntimeError(f"{kind}: the worker never noticed the disconnect")
                time.sleep(0.001)
            delays[kind].append(time.monotonic() - t0)
        deadline = time.monotonic() + 5
        while inflight(router) != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        states = [httpx.get(u + "/sim/state").json() for u in cluster.worker_urls.values()]
        everything = [d for ds in delays.values() for d in ds]
        return {
            "disconnects": n,
            "note": "delay from the client's close() to /sim/state counting the abort, polled every ~1 ms over keep-alive: an upper bound",
            "median_ms": statistics.median(everything) * 1000,
            "p90_ms": percentile(everything, 90) * 1000,  # type: ignore[operator]
            "max_ms": max(everything) * 1000,
            "by_kind_median_ms": {k: statistics.median(v) * 1000 for k, v in delays.items() if v},
            "router_inflight_after": inflight(router),
            "worker_running_plus_waiting_after": sum(s["running"] + s["waiting"] for s in states),
            "router_client_disconnects": metric_sum(metrics(router), "kvroute_client_disconnects_total"),
        }


# -- overload ----------------------------------------------------------------------------------


async def scenario_overload(quick: bool) -> dict[str, Any]:
    workers, per_worker, queue = 2, 16, 32
    capacity = workers * per_worker
    clients = 3 * (capacity + queue)
    cluster = SimCluster(workers=workers, time_scale=1.0, pool=False)
    await asyncio.to_thread(cluster.start)
    args = ["--max-inflight-per-worker", str(per_worker), "--queue-size", str(queue), "--queue-timeout-s", "2"]
    router = RouterProcess(cluster.worker_urls, policy="cache_aware", extra_args=args)
    await asyncio.to_thread(router.start)
    assert router.proc is not None
    pid = router.proc.pid
    duration = 15.0 if quick else 40.0
    outcomes: list[Outcome] = []
    rss: list[tuple[float, float]] = []
    depth: list[float] = []
    try:
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients + 10)) as client:

            async def client_loop(i: int) -> None:
                raw = RawClient(router.port)
                turn = 0
                while time.monotonic() - t0 < duration:
                    outcomes.append(await raw.request(chat(f"user {i} turn {turn} " * 30, 64)))
                    turn += 1
                await raw.close()

            async def sample() -> None:
                while time.monotonic() - t0 < duration:
                    rss.append((time.monotonic() - t0, rss_mb(pid)))
                    text = (await client.get(router.url + "/metrics")).text
                    depth.append(metric_sum(parse_prometheus(text), "kvroute_queue_depth"))
                    await asyncio.sleep(1.0)

            await asyncio.gather(sample(), *(client_loop(i) for i in range(clients)))
        statuses: dict[str, int] = {}
        for o in outcomes:
            key = str(o.status) if o.status is not None else f"exception:{o.exception}"
            statuses[key] = statuses.get(key, 0) + 1
        rejected = [o for o in outcomes if o.status == 429]
        third = max(len(rss) // 3, 1)
        early = max(v for _, v in rss[:third])
        late = max(v for _, v in rss[-third:])
        return {
            "workers": workers,
            "max_inflight_per_worker": per_worker,
            "queue_size": queue,
            "concurrent_clients": clients,
            "offered_vs_capacity": clients / (capacity + queue),
            "duration_s": duration,
            "requests": len(outcomes),
            "statuses": statuses,
            "router_5xx": sum(v for k, v in statuses.items() if k.startswith("5")),
            "failed_streams": sum(1 for o in outcomes if o.status == 200 and o.kind not in ("ok", "ok_whole")),
            "rejected_429_without_retry_after": sum(1 for o in rejected if not o.retry_after),
            "accepted_per_s": sum(1 for o in outcomes if o.status == 200) / duration,
            "queue_depth_max": max(depth, default=0.0),
            "rss_mb": {"first_third_max": early, "last_third_max": late, "growth_pct": 100 * (late - early) / early,
                       "samples": [[round(t, 1), round(v, 1)] for t, v in rss]},
        }
    finally:
        await asyncio.to_thread(router.stop)
        await asyncio.to_thread(cluster.stop)


# -- command line ---------------------------------------------------------------------------


def run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.e2e.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for faults.json")
    p.add_argument("--scenarios", default="sigkill,faults,disconnect,overload")
    p.add_argument("--concurrency", type=int, default=300, help="concurrent streams in the sigkill scenario")
    p.add_argument("--disconnects", type=int, default=60)
    p.add_argument("--quick", action="store_true", help="shorter runs")
    args = p.parse_args(argv)
    require_bench_extra("python -m loadtests.e2e.faults", ("psutil",))
    with stop_children_on_signals():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("sigkill", "faults", "overload"):
        LOG_PATH[name] = str(out_dir / f"router-{name}.log")
        Path(LOG_PATH[name]).unlink(missing_ok=True)
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    for name in args.scenarios.split(","):
        t0 = time.monotonic()
        print(f"== {name}", flush=True)
        if name == "sigkill":
            result = run(scenario_sigkill(args.concurrency, args.quick))
        elif name == "faults":
            result = run(scenario_faults(40, args.quick))
        elif name == "disconnect":
            result = scenario_disconnect(args.disconnects)
        elif name == "overload":
            result = run(scenario_overload(args.quick))
        else:
            raise SystemExit(f"unknown scenario {name!r}")
        result["wall_s"] = time.monotonic() - t0
        results[name] = result
        print(orjson.dumps({k: v for k, v in result.items() if k != "rss_mb"}, option=orjson.OPT_INDENT_2).decode(), flush=True)
    with contextlib.suppress(FileNotFoundError):
        previous = orjson.loads((out_dir / "faults.json").read_bytes())
        results = {**previous, **results}
    (out_dir / "faults.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
