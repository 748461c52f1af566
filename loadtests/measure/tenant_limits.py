"""Per-tenant limits across replicas, and fair share under
overload, on simulated vLLM workers. JSON on stdout (and in `--out`).

    python -m loadtests.measure.tenant_limits [--scenario limits|fairness|all] [--duration 60] [--out FILE]

`limits`: four `kvroute serve` replicas share a Redis of their own (`--redis-port`, default
6390, never the system Redis) in front of two simulated workers. Tenant `capped`
(requests_per_s 10) offers 50 requests/s (Poisson) spread round-robin over the replicas;
tenant `steady` (no limits) offers `--steady-rate` at the same time. The Redis server is
killed for `--outage-s` in the middle of the run and started again. Reported: capped's
accepted rate, its 429s (each must carry Retry-After), any other status (a failure);
steady's 429s and failures; the same counts inside the outage window. Then steady's TTFT
alone against beside the capped tenant, in `--ab-blocks` alternating blocks (alone, beside,
alone, ...) so that drift on a shared machine falls on both alike.

`fairness`: one replica, `--max-inflight-per-worker` slots per simulated worker. The
fleet's capacity is measured first (a closed loop holding every slot busy for
`--probe-s`), then, for each of `--seeds`, tenant `y` sends at 0.2 × capacity alone
(Poisson arrivals, or evenly spaced with `--y-arrivals steady`), then again (the same
arrivals) while `x` bursts at 5 × capacity from `--lead-s` seconds in; y is measured from
that moment in both phases (a tenant already there when the burst comes). Reported per
seed: y's TTFT (p50/p99/mean) alone and under the burst and their ratio, y's 429s, x's
accepted rate and TTFT, and a sanity bound (x's mean TTFT of accepted requests must stay
under the queue timeout + the service time). With `--compare-fifo` the
burst phase runs again without tenants (the FIFO queue), to show what the fair queue
changes.

Every call of the load generator names its prompts afresh: no phase resends an earlier
phase's prompts (which the workers may still hold: it would measure cache hits).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from loadtests.e2e.replicas import RedisServer
from loadtests.sim.cluster import SimCluster
from loadtests.support.processes import stop_children_on_signals
from loadtests.support.routerproc import RouterProcess
from router.proxy.upstream import UpstreamClient, UpstreamError, make_upstream_client

TENANTS = """\
tenants:
  capped: {keys: [sk-capped], limits: {requests_per_s: 10}}
  steady: {keys: [sk-steady]}
  control: {keys: [sk-control]}
  x: {keys: [sk-x]}
  y: {keys: [sk-y]}
"""


@dataclass
class Sample:
    sent_at: float
    """Seconds since the phase started."""
    status: int
    ttft_s: float | None = None
    total_s: float | None = None
    retry_after: str | None = None
    error: str | None = None


@dataclass
class Flow:
    name: str
    key: str
    rate: float
    prompt: str
    max_tokens: int
    start_s: float = 0.0
    """When the flow's first arrivals may come, seconds into the phase."""
    steady: bool = False
    """Evenly spaced arrivals, one every 1/rate s from a seeded offset, instead of Poisson."""
    samples: list[Sample] = field(default_factory=list)


def prompt_of(tokens: int, tag: str) -> str:
    """~`tokens` tokens (4 bytes a token), unique per request so no cache hit hides work."""
    return f"[{tag}] " + ("Summarise the quarterly report's risk section in detail. " * (tokens // 14 + 1))[: tokens * 4]


def make_client() -> UpstreamClient:
    """The router's own raw asyncio client: O(1) per request however many connections are
    open. (httpx costs O(open connections) per request: with a burst's hundreds of queued
    requests it became the bottleneck and its TTFTs ran tens of seconds past the router's.)"""
    return make_upstream_client(connect_timeout_s=30.0, max_connections=100_000, kind="raw")


async def one(client: UpstreamClient, url: str, flow: Flow, t0: float, seq: int, run: str = "") -> None:
    sent = time.perf_counter()
    # Output lengths vary (uniform over 1..2 × the mean, fixed per flow and sequence number):
    # equal lengths would keep a saturated fleet's slots finishing in synchronized waves.
    max_tokens = random.Random(f"{flow.name}-{seq}").randint(1, 2 * flow.max_tokens - 1)
    body = orjson.dumps({"model": MODEL[0], "stream": True, "max_tokens": max_tokens,
                         "messages": [{"role": "user", "content": f"{flow.name}-{run}-{seq} {flow.prompt}"}]})
    headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {flow.key}".encode())]
    sample = Sample(sent - t0, 0)
    resp = None
    try:
        resp = await client.post(url, "/v1/chat/completions", headers, body)
        sample.status = resp.status
        sample.retry_after = next((v.decode() for k, v in resp.headers if k.lower() == b"retry-after"), None)
        if resp.status == 200:
            async for _ in resp.chunks():
                if sample.ttft_s is None:
                    sample.ttft_s = time.perf_counter() - sent
        else:
            await resp.read()
        sample.total_s = time.perf_counter() - sent
    except (UpstreamError, OSError, asyncio.TimeoutError) as exc:
        sample.error = type(exc).__name__
    finally:
        if resp is not None:
            await resp.aclose()
    flow.samples.append(sample)


MODEL = ["sim-llama3-8b"]


def arrival_times(flow: Flow, duration_s: float, seed: int) -> Iterator[float]:
    """A flow's send times, seconds into the phase: Poisson at its rate, or one every 1/rate s
    from a seeded offset for a `steady` flow. One generator per flow: the times depend only on
    the seed and the flow's name, so a tenant alone and beside a burst sees the same arrivals."""
    rng = random.Random(f"{seed}-{flow.name}")

    def gap() -> float:
        return 1 / flow.rate if flow.steady else rng.expovariate(flow.rate)

    at = flow.start_s + (rng.uniform(0, 1 / flow.rate) if flow.steady else gap())
    while at < duration_s:
        yield at
        at += gap()


async def open_loop(urls: Sequence[str], flows: Sequence[Flow], duration_s: float, seed: int,
                    events: dict[float, Any] | None = None) -> float:
    """Open-loop arrivals per flow for `duration_s` (`arrival_times`), each request to the
    next URL in turn; `events`: {second: callable} run once that second is reached. Returns t0."""
    client = make_client()
    try:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task] = []
        next_url = itertools.cycle(urls)

        async def arrivals(flow: Flow) -> None:
            # Prompts new to the workers in every call: a phase that repeated an earlier
            # phase's prompts (the same names and sequence numbers) would measure cache hits.
            run = uuid.uuid4().hex[:12]
            for seq, at in enumerate(arrival_times(flow, duration_s, seed)):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(client, next(next_url), flow, t0, seq, run)))

        async def timeline() -> None:
            for second, action in sorted((events or {}).items()):
                delay = t0 + second - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                await asyncio.to_thread(action)

        await asyncio.gather(timeline(), *(arrivals(f) for f in flows))
        await asyncio.gather(*tasks)
    finally:
        await client.aclose()
    return t0


async def closed_loop(url: str, flow: Flow, concurrency: int, duration_s: float) -> float:
    """Completed requests per second with `concurrency` clients always waiting on an answer."""
    done = 0
    c = make_client()
    try:
        t0 = time.perf_counter()
        seq = itertools.count()
        run = uuid.uuid4().hex[:12]

        async def user() -> None:
            nonlocal done
            while time.perf_counter() - t0 < duration_s:
                await one(c, url, flow, t0, next(seq), run)
                done += 1

        await asyncio.gather(*(user() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    finally:
        await c.aclose()
    ok = sum(1 for s in flow.samples if s.status == 200)
    flow.samples.clear()
    return ok / elapsed


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(flow: Flow, duration_s: float, window: tuple[float, float] | None = None) -> dict[str, Any]:
    samples = [s for s in flow.samples if window is None or window[0] <= s.sent_at < window[1]]
    span = duration_s if window is None else window[1] - window[0]
    ok = [s for s in samples if s.status == 200]
    limited = [s for s in samples if s.status == 429]
    failed = [s for s in samples if s.status not in (200, 429)]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    return {
        "sent": len(samples),
        "offered_per_s": round(len(samples) / span, 3),
        "accepted": len(ok),
        "accepted_per_s": round(len(ok) / span, 3),
        "rejected_429": len(limited),
        "rejected_429_without_retry_after": sum(1 for s in limited if not s.retry_after),
        "failed": len(failed),
        "failed_statuses": sorted({s.status or -1 for s in failed}),
        "failed_errors": sorted({s.error for s in failed if s.error}),
        "ttft_s": {
            "mean": round(statistics.fmean(ttft), 4) if ttft else None,
            "p50": round(pct(ttft, 0.5) or 0, 4) if ttft else None,
            "p99": round(pct(ttft, 0.99) or 0, 4) if ttft else None,
            "max": round(max(ttft), 4) if ttft else None,
        },
        "total_s_mean": round(statistics.fmean([s.total_s for s in ok if s.total_s]), 4) if ok else None,
        # When the worst TTFTs were sent (seconds into the phase): start-up or steady state.
        "slowest": [[round(s.sent_at, 2), round(s.ttft_s, 3)]
                    for s in sorted(ok, key=lambda s: s.ttft_s or 0.0, reverse=True)[:5] if s.ttft_s is not None],
    }


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- scenario: limits across replicas, Redis outage -----------------------------------------
def run_limits(args: argparse.Namespace, tenants_file: str, log_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"load_average_before": load_average()}
    limit = 10.0  # capped's requests_per_s in TENANTS
    with SimCluster(workers=args.limits_workers, time_scale=args.time_scale, pool=False) as cluster, \
            RedisServer(port=args.redis_port) as redis_server:
        MODEL[0] = cluster.model
        common = ["--tenants", tenants_file, "--redis", redis_server.url, "--redis-prefix", "tenant-limits"]
        routers = [RouterProcess(cluster.worker_urls, extra_args=common, log_path=f"{log_dir}/router{i}.log")
                   for i in range(args.replicas)]
        try:
            for r in routers:
                r.start()
            urls = [r.url for r in routers]
            time.sleep(1.0)  # every replica's load board has seen the others (their count: the local share)

            def steady() -> Flow:
                return Flow("steady", "sk-steady", args.steady_rate, prompt_of(args.prompt_tokens, "steady"), 16)

            # Warm-up (connections, first requests), unmeasured.
            asyncio.run(open_loop(urls, [steady()], 5.0, seed=0))
            capped = Flow("capped", "sk-capped", args.capped_rate, prompt_of(args.prompt_tokens, "capped"), 16)
            together = steady()
            start = args.duration / 2 - args.outage_s / 2
            window = (start, start + args.outage_s)
            events = {window[0]: redis_server.kill, window[1]: redis_server.start}
            asyncio.run(open_loop(urls, [capped, together], args.duration, seed=2, events=events))
            metrics = [r.metrics() for r in routers]
            # Steady's TTFT alone against beside the capped tenant, in alternating blocks:
            # on a shared machine TTFT drifts between runs by more than the 10 % compared.
            # A third block, beside an unlimited tenant sending what capped gets accepted
            # (10/s), separates the cost of the accepted share (the workers are shared) from
            # that of the refused 40/s.
            alone, beside, control = steady(), steady(), steady()
            for block in range(args.ab_blocks):
                asyncio.run(open_loop(urls, [alone], args.ab_block_s, seed=100 + block))
                capped_ab = Flow("capped", "sk-capped", args.capped_rate, capped.prompt, 16)
                asyncio.run(open_loop(urls, [capped_ab, beside], args.ab_block_s, seed=100 + block))
                other = Flow("control", "sk-control", limit, capped.prompt, 16)
                asyncio.run(open_loop(urls, [other, control], args.ab_block_s, seed=100 + block))
        finally:
            for r in routers:
                r.stop()
    accepted = summary(capped, args.duration)
    out.update({
        "replicas": args.replicas,
        "workers": args.limits_workers,
        "duration_s": args.duration,
        "redis_outage_s": list(window),
        "capped": {"limit_requests_per_s": limit, **accepted,
                   "accepted_within_10pct": abs(accepted["accepted_per_s"] - limit) <= 0.1 * limit},
        "capped_during_outage": summary(capped, args.duration, window),
        "steady_with_capped": summary(together, args.duration),
        "steady_during_outage": summary(together, args.duration, window),
        "ab_blocks": {"blocks": args.ab_blocks, "block_s": args.ab_block_s},
        "steady_alone_ab": summary(alone, args.ab_blocks * args.ab_block_s),
        "steady_beside_capped_ab": summary(beside, args.ab_blocks * args.ab_block_s),
        "steady_beside_control_ab": summary(control, args.ab_blocks * args.ab_block_s),
        "router_counters": _counters(metrics, ROUTER_SERIES),
        "load_average_after": load_average(),
    })
    a, b = out["steady_alone_ab"]["ttft_s"], out["steady_beside_capped_ab"]["ttft_s"]
    if a["mean"] and b["mean"]:
        out["steady_ttft_ratio_beside_vs_alone"] = {
            q: round(b[q] / a[q], 3) for q in ("mean", "p50", "p99")
        }
        out["steady_ttft_mean_within_10pct"] = abs(b["mean"] / a["mean"] - 1) <= 0.10
    c = out["steady_beside_control_ab"]["ttft_s"]
    if c["mean"] and b["mean"]:
        out["steady_ttft_ratio_beside_capped_vs_beside_control"] = {
            q: round(b[q] / c[q], 3) for q in ("mean", "p50", "p99")
        }
    return out


ROUTER_SERIES = (
    "kvroute_tenant_rejected_total", "kvroute_rejected_total", "kvroute_tenant_ttft_seconds_sum",
    "kvroute_tenant_ttft_seconds_count", "kvroute_tenant_queue_wait_seconds_sum",
    "kvroute_tenant_queue_wait_seconds_count", "kvroute_event_loop_lag_seconds_sum",
    "kvroute_event_loop_lag_seconds_count",
)
"""The router's own view (server-side TTFT and queue wait per tenant): if the client's
figures disagree with these, the client or the machine is the bottleneck, not the router."""


def _counters(texts: list[str], prefixes: Sequence[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for text in texts:
        for line in text.splitlines():
            if line.startswith(tuple(prefixes)) and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                total[name] = total.get(name, 0.0) + float(value)
    return total


# -- scenario: fair share under overload -----------------------------------------------------
def run_fairness(args: argparse.Namespace, tenants_file: str, log_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"load_average_before": load_average()}
    slots = args.workers * args.max_inflight
    admission = ["--max-inflight-per-worker", str(args.max_inflight), "--queue-size", str(args.queue_size),
                 "--queue-timeout-s", str(args.queue_timeout)]
    with SimCluster(workers=args.workers, time_scale=args.time_scale, pool=False) as cluster:
        MODEL[0] = cluster.model

        def flow(name: str, rate: float, start_s: float = 0.0) -> Flow:
            steady = name == "y" and args.y_arrivals == "steady"
            return Flow(name, f"sk-{name}", rate, prompt_of(args.prompt_tokens, name), args.max_tokens, start_s, steady)

        def phase(tenants: bool, flows: list[Flow], seed: int, span: float) -> str:
            extra = [*admission, "--tenants", tenants_file] if tenants else admission
            with RouterProcess(cluster.worker_urls, extra_args=extra, log_path=f"{log_dir}/fair.log") as r:
                asyncio.run(open_loop([r.url], flows, span, seed=seed))
                return r.metrics()

        with RouterProcess(cluster.worker_urls, extra_args=[*admission, "--tenants", tenants_file]) as r:
            capacity = asyncio.run(closed_loop(r.url, flow("x", 1.0), slots, args.probe_s))
        y_rate, x_rate = 0.2 * capacity, 5.0 * capacity
        out.update({
            "workers": args.workers, "max_inflight_per_worker": args.max_inflight, "slots": slots,
            "time_scale": args.time_scale, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "queue_timeout_s": args.queue_timeout, "queue_size": args.queue_size, "lead_s": args.lead_s,
            "y_arrivals": args.y_arrivals,
            "capacity_per_s": round(capacity, 3), "x_rate_per_s": round(x_rate, 3), "y_rate_per_s": round(y_rate, 3),
            "runs": [],
        })
        # y sends alone for `lead_s` before x's burst starts (a steady tenant already there
        # when a burst comes); y is measured from the burst's start, in both phases over the
        # very same arrivals (one generator per flow and seed).
        span = args.lead_s + args.duration
        window = (args.lead_s, span)
        for seed in (int(v) for v in str(args.seeds).split(",")):
            y_alone = flow("y", y_rate)
            phase(True, [y_alone], seed=seed, span=span)
            x, y = flow("x", x_rate, args.lead_s), flow("y", y_rate)
            metrics = phase(True, [x, y], seed=seed, span=span)
            run = {
                "seed": seed,
                "y_alone": summary(y_alone, span, window),
                "y_with_x_burst": summary(y, span, window),
                "x_burst": summary(x, span, window),
                "router_counters": _counters([metrics], ROUTER_SERIES),
            }
            if args.compare_fifo:
                xf, yf = flow("x", x_rate, args.lead_s), flow("y", y_rate)
                phase(False, [xf, yf], seed=seed, span=span)
                run["fifo_y_with_x_burst"] = summary(yf, span, window)
                run["fifo_x_burst"] = summary(xf, span, window)
            judge_fairness(run, args.queue_timeout)
            out["runs"].append(run)
    ratios = [r["y_p99_ttft_ratio"] for r in out["runs"] if "y_p99_ttft_ratio" in r]
    out["y_p99_ttft_ratios"] = ratios
    out["y_never_refused"] = all(r["y_with_x_burst"]["rejected_429"] == 0 for r in out["runs"])
    out["load_average_after"] = load_average()
    return out


def judge_fairness(run: dict[str, Any], queue_timeout_s: float) -> None:
    """y's p99 under the burst against alone, and a sanity bound on x's accepted TTFTs (under
    the queue timeout plus twice the service time)."""
    ya, yb = run["y_alone"]["ttft_s"], run["y_with_x_burst"]["ttft_s"]
    if ya["p99"] and yb["p99"]:
        run["y_p99_ttft_ratio"] = round(yb["p99"] / ya["p99"], 3)
        run["y_p99_within_1_25x"] = run["y_p99_ttft_ratio"] <= 1.25
    service = run["y_alone"]["total_s_mean"] or 0.0
    x_mean = run["x_burst"]["ttft_s"]["mean"]
    run["x_sanity"] = {
        "bound_s": round(queue_timeout_s + 2 * service, 3),
        "x_mean_ttft_s": x_mean,
        "ok": x_mean is None or x_mean <= queue_timeout_s + 2 * service,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=("limits", "fairness", "all"), default="all")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per phase")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--time-scale", type=float, default=1.0, help="simulated workers: real seconds per simulated second")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--logdir", "--log-dir", dest="logdir", help="keep the tenants file and the routers' logs here (default: a temporary directory)")
    # limits
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--limits-workers", type=int, default=2, help="simulated workers behind the replicas")
    p.add_argument("--redis-port", type=int, default=6390, help="this run's own redis-server (stopped mid-run)")
    p.add_argument("--capped-rate", type=float, default=50.0)
    p.add_argument("--steady-rate", type=float, default=10.0)
    p.add_argument("--outage-s", type=float, default=10.0)
    p.add_argument("--ab-blocks", type=int, default=6, help="alternating blocks: steady alone / beside capped")
    p.add_argument("--ab-block-s", type=float, default=10.0)
    # fairness
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-inflight", type=int, default=4, help="--max-inflight-per-worker of the router")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--queue-timeout", type=float, default=5.0)
    p.add_argument("--queue-size", type=int, default=256)
    p.add_argument("--probe-s", type=float, default=10.0, help="closed-loop capacity probe")
    p.add_argument("--compare-fifo", action="store_true", help="rerun the burst without tenants (FIFO queue)")
    p.add_argument("--lead-s", type=float, default=10.0,
                   help="y sends alone this long before x's burst starts; y is measured from the burst's start")
    p.add_argument("--y-arrivals", choices=("poisson", "steady"), default="poisson",
                   help="y's arrivals: Poisson (clumps up to several times its rate) or evenly spaced")
    p.add_argument("--seeds", default="4", help="arrival seeds, comma-separated: one alone/burst pair each")
    args = p.parse_args(argv)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with stop_children_on_signals(), tempfile.TemporaryDirectory(prefix="tenant-limits-") as tmp0:
        tmp = args.logdir or tmp0
        tenants_file = os.path.join(tmp, "tenants.yaml")
        with open(tenants_file, "w") as fh:
            fh.write(TENANTS)
        if args.scenario in ("limits", "all"):
            results["limits"] = run_limits(args, tenants_file, tmp)
        if args.scenario in ("fairness", "all"):
            results["fairness"] = run_fairness(args, tenants_file, tmp)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
