"""The measuring side of `kvroute bench`: a streaming client and honest-harness monitors.

* `drive()` plays a `Workload` against an OpenAI-compatible endpoint: one asyncio task per
  session, each request streamed over SSE (with router.proxy.upstream's HTTP/1.1 client), timing
  the first token and the decode. Every duration is taken on the wall clock and divided by
  the time scale, so all figures are in simulated seconds.
* `LoopLag`, `HttpProbe` and `ProcessMonitor` record what this machine is doing meanwhile:
  the client's event-loop lag, the latency of a trivial request to the simulator and to
  the router (their event-loop lag plus a loopback round trip), and CPU use of each process
  and of the machine. `bottleneck_verdict()` turns those readings into the flag that says
  a run measured this machine rather than the simulated GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from loadtests.benchmark.agent_wire import WIRE, StreamReader, chat_event
from loadtests.benchmark.workload import Conversation, Workload
from router.aio import cancel_and_wait
from router.proxy.upstream import RawUpstreamClient, UpstreamError

if TYPE_CHECKING:
    import psutil

# -- Prometheus text ------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def metric_sum(parsed: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str) -> float:
    return sum(v for labels, v in parsed.get(name, []) if all(labels.get(k) == x for k, x in match.items()))


TIERS = ("gpu", "pool", "disk", "remote")
"""Where a simulated worker's reused prompt tokens came from (`kvroute_sim:cached_tokens_total`)."""
COPY_TIERS = TIERS[1:]
"""The tiers a worker copies KV from (all but its own GPU)."""
TIER_COUNTER = "kvroute_sim:cached_tokens_total"

WORKER_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "sim:computed_prompt_tokens_total",
    "sim:busy_seconds_total",
    "sim:simulated_seconds",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "kvroute_sim:nixl_pulls_total",
    "kvroute_sim:nixl_pulled_tokens_total",
    "kvroute_sim:pd_local_prefills_total",
)


async def scrape_workers(client: httpx.AsyncClient, urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per worker: the counters above plus the queue gauges, and steps from /sim/state."""

    async def one(url: str) -> dict[str, float]:
        parsed = parse_prometheus((await client.get(url + "/metrics", timeout=10)).text)
        values = {name: metric_sum(parsed, name) for name in WORKER_COUNTERS}
        values.update({f"cached:{tier}": metric_sum(parsed, TIER_COUNTER, tier=tier) for tier in TIERS})
        values["waiting"] = metric_sum(parsed, "vllm:num_requests_waiting")
        values["running"] = metric_sum(parsed, "vllm:num_requests_running")
        try:
            state = (await client.get(url + "/sim/state", timeout=10)).json()
            values["steps"] = float(state.get("steps", 0))
        except (httpx.HTTPError, ValueError):
            values["steps"] = float("nan")
        return values

    names = list(urls)
    results = await asyncio.gather(*(one(urls[n]) for n in names))
    return dict(zip(names, results, strict=True))


def counters_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    """Fleet totals of every counter over the run."""
    total: dict[str, float] = {}
    for name, values in after.items():
        base = before.get(name, {})
        for key, value in values.items():
            if key in ("waiting", "running", "sim:simulated_seconds"):
                continue
            total[key] = total.get(key, 0.0) + value - base.get(key, 0.0)
    return total


def sim_clock_ratio(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], wall_s: float, time_scale: float
) -> float | None:
    """Simulated seconds the slowest worker advanced ÷ those the wall clock allowed.

    A worker's runner keeps its simulated clock on schedule, and when its process falls
    too far behind (CPU starved) it gives the lost time up rather than counting it: its
    clock then advances less than wall ÷ time scale, and the client, which keeps the wall
    clock, has in effect sent it more load than the scenario specifies.
    """
    if wall_s <= 0:
        return None
    ratios = []
    for name, values in after.items():
        if name in before and "sim:simulated_seconds" in values:
            ratios.append((values["sim:simulated_seconds"] - before[name]["sim:simulated_seconds"]) / (wall_s / time_scale))
    return min(ratios) if ratios else None


def worker_hit_ratio(delta: dict[str, float]) -> float | None:
    queries = delta.get("vllm:prefix_cache_queries_total", 0.0)
    if queries <= 0:
        return None
    hits = delta.get("vllm:prefix_cache_hits_total", 0.0) + delta.get("vllm:external_prefix_cache_hits_total", 0.0)
    return hits / queries


def moves_from_previous_turn(
    worker_of: Mapping[tuple[int, int], str | None], turns: Iterable[tuple[int, int, str | None]]
) -> tuple[int, int]:
    """(moved, counted) over `turns` as (session, turn, worker): those whose session's
    previous turn is in `worker_of` are counted, and moved if they went to another worker."""
    moved = counted = 0
    for session, turn, worker in turns:
        previous = (session, turn - 1)
        if previous in worker_of:
            counted += 1
            moved += worker_of[previous] != worker
    return moved, counted


def moved_share(records: Sequence[RequestRecord]) -> float | None:
    """Share of the measured later turns sent to another worker than their session's
    previous turn (warm-up turns count as previous turns). A move reuses the history only
    from the pool, at its copy's cost, or recomputes it; None if no later turn has a
    previous one with a known worker."""
    worker_of = {(r.session, r.turn): r.worker for r in records if r.worker}
    measured = ((r.session, r.turn, r.worker) for r in records if r.measured and r.worker)
    moved, later = moves_from_previous_turn(worker_of, measured)
    return moved / later if later else None


# -- monitors -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class LoopLag:
    """Lateness of this event loop: a task asks to wake every `interval_s` and records by
    how much it overslept. Anything the client times is late by as much."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.interval_s)
            self.samples.append(max(loop.time() - t - self.interval_s, 0.0))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def summary(self) -> dict[str, float | None]:
        return {"p50_s": percentile(self.samples, 50), "p99_s": percentile(self.samples, 99), "max_s": max(self.samples, default=None)}


def _probe_loop(urls: dict[str, str], interval_s: float, stop: Any, out: Any) -> None:
    """Child process body: GET each URL in turn, timing the round trip."""
    import http.client
    from urllib.parse import urlsplit

    samples: dict[str, list[float]] = {name: [] for name in urls}
    errors: dict[str, int] = {name: 0 for name in urls}
    conns: dict[str, http.client.HTTPConnection] = {}
    while not stop.is_set():
        for name, url in urls.items():
            parts = urlsplit(url)
            try:
                conn = conns.get(name)
                if conn is None:
                    conn = conns[name] = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
                t = time.perf_counter()
                conn.request("GET", parts.path or "/")
                conn.getresponse().read()
                samples[name].append(time.perf_counter() - t)
            except (OSError, http.client.HTTPException):
                errors[name] += 1
                conns.pop(name, None)
        stop.wait(interval_s)
    out.send({"samples": samples, "errors": errors})


class HttpProbes:
    """Latency of a trivial GET to other processes (the simulator, the router), repeated:
    their event-loop lag as seen from outside, plus one loopback round trip.

    Runs in its own process so that the client's own loop lag does not count twice.
    """

    def __init__(self, urls: dict[str, str], interval_s: float = 0.1) -> None:
        import multiprocessing

        self.urls = urls
        self._ctx = multiprocessing.get_context("spawn")
        self._stop = self._ctx.Event()
        self._recv, send = self._ctx.Pipe(duplex=False)
        self._proc = self._ctx.Process(target=_probe_loop, args=(urls, interval_s, self._stop, send), daemon=True)
        self.samples: dict[str, list[float]] = {name: [] for name in urls}
        self.errors: dict[str, int] = {name: 0 for name in urls}

    def start(self) -> None:
        self._proc.start()

    def stop(self) -> None:
        self._stop.set()
        if self._recv.poll(15):
            got = self._recv.recv()
            self.samples, self.errors = got["samples"], got["errors"]
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        return {
            name: {
                "p50_s": percentile(xs, 50),
                "p99_s": percentile(xs, 99),
                "max_s": max(xs, default=None),
                "samples": len(xs),
                "errors": self.errors.get(name, 0),
            }
            for name, xs in self.samples.items()
        }


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and its descendants; empty once it is gone."""
    # psutil is the `bench` extra: imported where it is used, so that importing this module
    # does not need it and the commands can say which extra is missing before they start.
    import psutil

    try:
        proc = psutil.Process(pid)
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def process_trees(pids: dict[str, int]) -> dict[str, list[psutil.Process]]:
    """Each named process with its descendants, minus the other named trees: the client
    starts the simulator and the router, which must not count as the client's CPU."""
    trees = {name: process_tree(pid) for name, pid in pids.items()}
    claimed: dict[int, str] = {}
    # Smallest trees claim first: a named tree nested in another is smaller than it, so a
    # process belongs to its nearest named ancestor.
    for name, procs in sorted(trees.items(), key=lambda kv: len(kv[1])):
        for p in procs:
            claimed.setdefault(p.pid, name)
    return {name: [p for p in procs if claimed[p.pid] == name] for name, procs in trees.items()}


def tree_cpu_seconds(procs: Iterable[psutil.Process]) -> float:
    """User + system CPU seconds of the processes still alive."""
    import psutil

    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def tree_rss_sizes(pid: int) -> list[int]:
    """Resident set size of each process of the tree rooted at `pid`."""
    import psutil

    sizes = []
    for p in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            sizes.append(p.memory_info().rss)
    return sizes


TREE_REFRESH_S = 10.0
"""Process trees (router workers, simulator children) are fixed after start-up."""


class ProcessMonitor:
    """CPU of named process trees and of the whole machine, sampled in a thread so that a
    busy event loop cannot hide its own saturation."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.5) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.system_samples: list[float] = []
        self.peak_cores: dict[str, float] = {name: 0.0 for name in pids}
        self._cpu0: dict[str, float] = {}
        self._t0 = 0.0
        self._cpu1: dict[str, float] = {}
        self._t1 = 0.0
        self._stop = False
        self._thread: Any = None

    def _sample(self) -> None:
        import psutil

        # Listing a tree's children reads every process's /proc entry: done once in a while,
        # not per sample, or this thread holds the client's GIL for a third of the time.
        trees = process_trees(self.pids)
        trees_at = time.monotonic()
        last = {name: tree_cpu_seconds(trees[name]) for name in self.pids}
        last_t = time.monotonic()
        psutil.cpu_percent(interval=None)
        while not self._stop:
            time.sleep(self.interval_s)
            now = time.monotonic()
            self.system_samples.append(psutil.cpu_percent(interval=None))
            if now - trees_at >= TREE_REFRESH_S:
                trees, trees_at = process_trees(self.pids), now
            for name in self.pids:
                cpu = tree_cpu_seconds(trees[name])
                self.peak_cores[name] = max(self.peak_cores[name], (cpu - last[name]) / max(now - last_t, 1e-9))
                last[name] = cpu
            last_t = now

    def start(self) -> None:
        import threading

        self._cpu0 = {name: tree_cpu_seconds(procs) for name, procs in process_trees(self.pids).items()}
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._cpu1 = {name: tree_cpu_seconds(procs) for name, procs in process_trees(self.pids).items()}
        self._t1 = time.monotonic()
        self._stop = True
        if self._thread is not None:
            self._thread.join(timeout=5)

    def summary(self) -> dict[str, Any]:
        wall = max(self._t1 - self._t0, 1e-9)
        busy = [s for s in self.system_samples if s >= SYSTEM_SATURATED_PERCENT]
        return {
            "wall_s": wall,
            "machine_cores": os.cpu_count(),
            "system_cpu_mean_percent": sum(self.system_samples) / len(self.system_samples) if self.system_samples else None,
            "system_cpu_saturated_fraction": len(busy) / len(self.system_samples) if self.system_samples else None,
            "process_cores_mean": {n: (self._cpu1.get(n, 0.0) - self._cpu0.get(n, 0.0)) / wall for n in self.pids},
            "process_cores_peak": dict(self.peak_cores),
        }


# -- the bottleneck verdict -------------------------------------------------------------------

LAG_FRACTION = 1.0
"""A process lagging by more than one mean simulated engine step (in wall time) delivers
tokens a step late: it, not the simulated GPU, sets the pace of what is measured."""
LOOP_PROCESS_SATURATED_CORES = 0.9
"""One asyncio process (the simulator, kvroute, this client) can use one core; at 90% of it
on average its loop is queueing work."""
SIM_CLOCK_MIN_RATIO = 0.97
"""The simulator must keep at least 97% of real time (see `sim_clock_ratio`)."""
SYSTEM_SATURATED_PERCENT = 95.0
SYSTEM_SATURATED_FRACTION = 0.25
"""The machine is saturated if a quarter of the samples show every core busy."""


def bottleneck_verdict(
    *,
    time_scale: float,
    mean_step_s: float | None,
    client_lag: dict[str, Any],
    probes: dict[str, dict[str, Any]],
    cpu: dict[str, Any],
    event_loop_processes: Sequence[str],
    sim_clock: float | None = None,
) -> dict[str, Any]:
    reasons: list[str] = []
    if sim_clock is not None and sim_clock < SIM_CLOCK_MIN_RATIO:
        reasons.append(f"the simulator's clock fell behind: it simulated {sim_clock:.1%} of the run's time")
    threshold = LAG_FRACTION * mean_step_s * time_scale if mean_step_s else None
    if threshold is not None:
        lag = client_lag.get("p99_s")
        if lag is not None and lag > threshold:
            reasons.append(f"client event-loop lag p99 {lag * 1e3:.1f} ms > {threshold * 1e3:.1f} ms")
        for name, reading in probes.items():
            p99 = reading.get("p99_s")
            if p99 is not None and p99 > threshold:
                reasons.append(f"{name} probe latency p99 {p99 * 1e3:.1f} ms > {threshold * 1e3:.1f} ms")
    for name in event_loop_processes:
        cores = cpu.get("process_cores_mean", {}).get(name)
        if cores is not None and cores >= LOOP_PROCESS_SATURATED_CORES:
            reasons.append(f"{name} used {cores:.2f} cores on average (one event loop saturates at 1)")
    warnings: list[str] = []
    frac = cpu.get("system_cpu_saturated_fraction")
    if frac is not None and frac >= SYSTEM_SATURATED_FRACTION:
        # Other work on the machine (other benchmarks, builds) shows up here. It distorts
        # this run only if our processes were late, which the lag readings above measure
        # directly; so it is reported, and flags the run only together with some lag.
        warnings.append(f"all cores busy in {frac:.0%} of CPU samples")
        lag = client_lag.get("p99_s")
        if threshold is not None and lag is not None and lag > threshold / 2 and not reasons:
            reasons.append(f"machine saturated and client lag p99 {lag * 1e3:.1f} ms > half the threshold")
    return {
        "flag": bool(reasons),
        "reasons": reasons,
        "warnings": warnings,
        "lag_threshold_s": threshold,
        "sim_clock_ratio": sim_clock,
        "rule": (
            f"flag if a simulated worker's clock advanced less than {SIM_CLOCK_MIN_RATIO:.0%} of wall time ÷ time "
            f"scale, if the client's loop lag p99 or a probe's latency p99 exceeds {LAG_FRACTION} × mean simulated "
            f"step × time scale, if an event-loop process averages ≥ {LOOP_PROCESS_SATURATED_CORES} cores, or if "
            f"≥ {SYSTEM_SATURATED_FRACTION:.0%} of CPU samples show ≥ {SYSTEM_SATURATED_PERCENT}% machine-wide "
            "while the client's lag p99 exceeds half that threshold"
        ),
    }


# -- the streaming client -------------------------------------------------------------------


@dataclass
class RequestRecord:
    session: int
    turn: int
    """Index of this request within its session (0-based)."""
    kind: str
    measured: bool
    sent_s: float
    """Simulated seconds since the start of the run."""
    status: int = 0
    ttft_s: float | None = None
    decode_s: float | None = None
    """From the first to the last token."""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker: str | None = None
    reason: str | None = None
    error: str | None = None
    censored: bool = False
    """Still waiting for its first token when the run ended: ttft_s is a lower bound."""

    @property
    def itl_s(self) -> float | None:
        if self.decode_s is None or self.completion_tokens < 2:
            return None
        return self.decode_s / (self.completion_tokens - 1)


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    sessions_started: int
    sessions_completed: int
    """Sessions whose last response ended between the end of the warm-up and the end of the run."""
    sessions_failed: int
    wall_s: float
    sim_s: float
    window_s: float
    grace_expired: bool
    """Requests were still in flight when the grace period ended (they were cancelled)."""
    client_lag: dict[str, Any] = field(default_factory=dict)
    itl_gaps_s: list[float] = field(default_factory=list)
    """With `drive(record_gaps=True)`: every gap between two streamed token events of the
    measured requests that finished without error, in simulated seconds."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(replace(self, records=[], itl_gaps_s=[]))
        d.pop("records")
        d.pop("itl_gaps_s")
        return d


Progress = Callable[[dict[str, Any]], None]


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for k, v in headers:
        if k == name:
            return v.decode("latin-1")
    return None


def sse_data(event: bytes) -> bytes | None:
    """The `data:` payload of one SSE event: chat events are a bare `data:` line,
    Responses and Messages events open with an `event:` line."""
    if event.startswith(b"data:"):
        return event[5:].strip()
    at = event.find(b"\ndata:")
    return event[at + 6 :].strip() if at >= 0 else None


async def _stream_one(
    client: RawUpstreamClient,
    base_url: str,
    path: str,
    payload: bytes,
    headers: list[tuple[bytes, bytes]],
    record: RequestRecord,
    t0: float,
    scale: float,
    stop_at: list[float],
    reader: StreamReader = chat_event,
    gaps: list[float] | None = None,
) -> None:
    """Stream one request into `record`; with `gaps`, append the wall seconds between its
    token events once it has ended without error."""
    loop = asyncio.get_running_loop()
    sent = t0 + record.sent_s * scale
    first: float | None = None
    last: float | None = None
    resp = None
    mine: list[float] | None = [] if gaps is not None else None
    try:
        resp = await client.post(base_url, path, headers, payload)
        record.status = resp.status
        record.worker = _header(resp.headers, b"x-kvroute-worker")
        record.reason = _header(resp.headers, b"x-kvroute-route-reason")
        if resp.status != 200:
            body = await resp.read()
            record.error = f"HTTP {resp.status}: {body[:200].decode(errors='replace')}"
            return
        buf = b""
        async for chunk in resp.chunks():
            now = loop.time()
            buf += chunk
            pos = 0
            while (cut := buf.find(b"\n\n", pos)) >= 0:
                event, pos = buf[pos:cut], cut + 2
                data = sse_data(event)
                if data is None or data == b"[DONE]":
                    continue
                if first is not None and b'"usage"' not in data and b'"error"' not in data:
                    # A token chunk after the first: its arrival time is all we need
                    # (parsing every chunk would make the client the bottleneck).
                    if mine is not None and last is not None:
                        mine.append(now - last)
                    last = now
                    continue
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError:
                    continue
                if reader(obj, record):
                    if first is None:
                        first = now
                        record.ttft_s = (now - sent) / scale
                    elif mine is not None and last is not None:
                        mine.append(now - last)
                    last = now
            buf = buf[pos:]
    except asyncio.CancelledError:
        if first is None:
            # Cancelled when the run stopped: the wait so far is a lower bound of its TTFT.
            # Measured to the stop time, not to when this task got round to handling its
            # cancellation (hundreds of streams are torn down at once).
            record.censored = True
            record.ttft_s = (min(loop.time(), stop_at[0]) - sent) / scale
        raise
    except UpstreamError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if resp is not None:
            await resp.aclose()
        if first is not None and last is not None:
            record.decode_s = (last - first) / scale
    if gaps is not None and mine and record.error is None:
        # Only a stream that ended: one cut short by the run's end lacks its usage, so its
        # decode is not in the ITL mean either.
        gaps.extend(mine)
    if record.ttft_s is None and record.error is None:
        record.error = "stream ended without a token"


async def drive(
    workload: Workload,
    base_url: str,
    time_scale: float,
    *,
    progress: Progress | None = None,
    api: str = "chat",
    record_gaps: bool = False,
) -> RunOutcome:
    """Play the workload (see `Workload` for the timeline) and return every request's record,
    sent through `api` (chat, responses or messages: see loadtests/benchmark/agent_wire.py); with
    `record_gaps`, also the measured requests' inter-token gaps (`RunOutcome.itl_gaps_s`)."""
    path, convert, reader = WIRE[api]
    loop = asyncio.get_running_loop()
    scale = time_scale
    warmup, window_end = workload.warmup_s, workload.window_end_s
    records: list[RequestRecord] = []
    gaps: list[float] = []
    stop_at = [math.inf]
    state = {"completed": 0, "failed": 0, "started": 0, "in_flight_measured": 0}
    drained = asyncio.Event()
    lag = LoopLag()
    # Not httpx: its connection pool scans and polls every open connection on each request,
    # and hundreds of concurrent sessions made this process, not the simulated GPUs, the
    # run's bottleneck (client lag p99 0.7 s). The router's own HTTP/1.1 client has an O(1)
    # keep-alive pool and parses with httptools.
    client = RawUpstreamClient(connect_timeout_s=30.0, keepalive_expiry_s=60.0)
    try:
        t0 = loop.time() + 0.05

        def sim_now() -> float:
            return (loop.time() - t0) / scale

        async def run_session(session: Any) -> None:
            await asyncio.sleep(max(t0 + session.start_s * scale - loop.time(), 0.0))
            state["started"] += 1
            group = workload.groups.get(session.group) if session.group is not None else None
            conv = Conversation(session, group)
            for turn in session.turns[: session.start_turn]:
                conv.request(turn)  # history of a session already under way at time 0
                conv.answered(turn)
            for i in range(session.start_turn, len(session.turns)):
                turn = session.turns[i]
                if i > session.start_turn and turn.think_s > 0:
                    await asyncio.sleep(turn.think_s * scale)
                now = sim_now()
                if now >= window_end:
                    return  # no request starts after the window
                body = convert(conv.request(turn))
                measured = workload.measures(session, i, now)
                rec = RequestRecord(session.index, i, turn.kind, measured, now)
                records.append(rec)
                headers = [(b"x-session-id", session.id.encode()), (b"content-type", b"application/json")]
                if measured:
                    state["in_flight_measured"] += 1
                try:
                    await _stream_one(
                        client, base_url, path, orjson.dumps(body), headers, rec, t0, scale, stop_at, reader,
                        gaps if record_gaps and measured else None,
                    )
                finally:
                    if measured:
                        state["in_flight_measured"] -= 1
                        if state["in_flight_measured"] == 0 and sim_now() >= window_end:
                            drained.set()
                if rec.error is not None:
                    # An agent whose model call failed stops there.
                    state["failed"] += 1
                    return
                conv.answered(turn)
            if sim_now() >= warmup:
                state["completed"] += 1

        async def report() -> None:
            while True:
                await asyncio.sleep(0.5)
                if progress is not None:
                    ttfts = [r.ttft_s for r in records if r.ttft_s is not None and r.measured]
                    progress(
                        {
                            "sim_s": sim_now(),
                            "end_s": window_end,
                            "requests": len(records),
                            "completed": state["completed"],
                            "ttft_p50_s": percentile(ttfts, 50),
                        }
                    )

        lag.start()
        reporter = asyncio.create_task(report())
        tasks = [asyncio.create_task(run_session(s)) for s in workload.sessions]
        await asyncio.sleep(max(t0 + window_end * scale - loop.time(), 0.0))
        if state["in_flight_measured"] == 0:
            drained.set()
        grace_expired = False
        try:
            await asyncio.wait_for(drained.wait(), timeout=workload.grace_s * scale)
        except TimeoutError:
            grace_expired = True
        end = stop_at[0] = loop.time()
        # Stop the lag probe first: tearing hundreds of streams down stalls the loop, and
        # that happens after everything measured.
        await lag.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await cancel_and_wait(reporter)
    finally:
        await client.aclose()
    return RunOutcome(
        records=records,
        sessions_started=state["started"],
        sessions_completed=state["completed"],
        sessions_failed=state["failed"],
        wall_s=end - t0,
        sim_s=(end - t0) / scale,
        window_s=workload.window_s,
        grace_expired=grace_expired,
        client_lag=lag.summary(),
        itl_gaps_s=[g / scale for g in gaps],
    )


class QueueSampler:
    """Engine queue depths (`vllm:num_requests_waiting` / `_running`) of every worker,
    scraped once a second during a run, with the engines' busy and KV-held seconds (the
    simulator's `sim:busy_seconds_total`, `sim:kv_held_seconds_total`) at each scrape, so
    that the share of a stretch of the run spent waiting for KV can be read afterwards."""

    def __init__(self, client: httpx.AsyncClient, urls: dict[str, str], interval_s: float = 1.0) -> None:
        self.client = client
        self.urls = urls
        self.interval_s = interval_s
        self.waiting: dict[str, list[float]] = {n: [] for n in urls}
        self.running: dict[str, list[float]] = {n: [] for n in urls}
        self.engine_seconds: dict[str, list[tuple[float, float, float]]] = {n: [] for n in urls}
        """Per worker: (wall seconds since start(), busy seconds, KV-held seconds) per scrape."""
        self._started = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _one(self, name: str, url: str) -> None:
        try:
            parsed = parse_prometheus((await self.client.get(url + "/metrics", timeout=5)).text)
        except httpx.HTTPError:
            return
        self.waiting[name].append(metric_sum(parsed, "vllm:num_requests_waiting"))
        self.running[name].append(metric_sum(parsed, "vllm:num_requests_running"))
        busy, held = metric_sum(parsed, "sim:busy_seconds_total"), metric_sum(parsed, "sim:kv_held_seconds_total")
        self.engine_seconds[name].append((time.monotonic() - self._started, busy, held))

    async def _run(self) -> None:
        while True:
            await asyncio.gather(*(self._one(n, u) for n, u in self.urls.items()))
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._started = time.monotonic()
        self._task = asyncio.create_task(self._run())

    def kv_held_share(self, from_wall_s: float, to_wall_s: float) -> float | None:
        """The fleet's engine time between two moments (wall seconds since start()) during
        which a waiting request waited for KV blocks, as a share of its busy time: near 1,
        the engines are out of KV rather than compute. From the first and last scrape of
        each worker inside the stretch; None if no worker was scraped twice in it or none
        was busy."""
        busy = held = 0.0
        for samples in self.engine_seconds.values():
            inside = [s for s in samples if from_wall_s <= s[0] <= to_wall_s]
            if len(inside) >= 2:
                busy += inside[-1][1] - inside[0][1]
                held += inside[-1][2] - inside[0][2]
        return held / busy if busy > 0 else None

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def summary(self) -> dict[str, Any]:
        def mean(xs: list[float]) -> float | None:
            return sum(xs) / len(xs) if xs else None

        n = min((len(v) for v in self.waiting.values()), default=0)
        fleet_waiting = [sum(self.waiting[w][i] for w in self.waiting) for i in range(n)]
        return {
            "samples": n,
            "waiting_mean_per_worker": {w: mean(v) for w, v in self.waiting.items()},
            "waiting_max_per_worker": {w: max(v, default=None) for w, v in self.waiting.items()},
            "running_mean_per_worker": {w: mean(v) for w, v in self.running.items()},
            "fleet_waiting_mean": mean(fleet_waiting),
            "fleet_waiting_max": max(fleet_waiting, default=None),
        }
