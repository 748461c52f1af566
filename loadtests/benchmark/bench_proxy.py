"""`kvroute bench-proxy`: what the router itself costs, against a direct connection and the
Rust routers, on a deliberately fast upstream.

    kvroute bench-proxy --out DIR [--levels 1,16,256,1024] [--duration S] [--repeats R]
        [--routers direct,kvroute-cache_aware,kvroute-round_robin,sglang-router,vllm-router]
        [--processes-check]

One fast upstream process (`loadtests/benchmark/fast_upstream.py`) plays `--workers` workers on as many
loopback ports. Every router under test is started once, in front of all of them, and stays
up; then, for each concurrency level and mode, the runs alternate
between the routers (the order rotates every repeat) so that the machine's drift and other
people's load spread evenly. Each run is one closed-loop load generator process
(`loadtests/benchmark/loadgen.py`): warm-up, then a measured window during which this harness reads
the router's process-tree CPU time (psutil) and samples its RSS.

Router names: `direct` (the load generator talks to the upstream ports itself),
`kvroute-POLICY` with optional `-pN` (`--processes N`) and `+CLIENT` (the forwarding client,
the `upstream_client` setting, passed as `KVROUTE_UPSTREAM_CLIENT`: `raw`, `httpx` or
`aiohttp`), and the Rust routers `sglang-router`,
`vllm-router` (policy `--peer-policy`, default cache_aware) or `vllm-router/consistent_hash`,
installed on demand into venvs under ~/.cache/kvroute/peers/NAME and launched by
`loadtests/benchmark/peers.py`.

Modes: `nonstream` (whole answers), `stream` (40 SSE chunks as fast as the reader takes them:
relay throughput) and `paced` (40 chunks, one every 25 ms per stream, at levels >= 256: what
a real decode cadence costs the router per chunk, with no chance to coalesce chunks).

Figures per router and level: added latency p50/p99 = the router's percentile minus
direct's in the same repeat (median over repeats); requests/s; relayed SSE chunks/s
(events received by the clients); router CPU seconds per 1,000 requests and SSE chunks per
router CPU second; peak RSS of the router's processes; errors (non-200, broken or short
streams, connection failures, requests unfinished 10 s after the window).

Writes DIR/results.json, DIR/results.md and DIR/results.png.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtests.benchmark.fast_upstream import DEFAULT_MODEL, PACED_MODEL, raise_fd_limit
from loadtests.benchmark.harness import process_tree, tree_cpu_seconds, tree_rss_sizes
from loadtests.benchmark.peers import PEERS, PeerRouter, parse_peer
from loadtests.benchmark.plots import plot_or_log
from loadtests.support.extras import require_bench_extra
from loadtests.support.processes import spawn, stop_children_on_signals, stop_group
from loadtests.support.routerproc import RouterProcess, free_port

DEFAULT_ROUTERS = ("direct", "kvroute-cache_aware", "kvroute-round_robin", "sglang-router", "vllm-router")
DEFAULT_LEVELS = (1, 16, 256, 1024)
_KVROUTE_NAME = re.compile(r"^kvroute-(?P<policy>[a-z_]+?)(?:-p(?P<procs>\d+))?(?:\+(?P<client>[a-z]+))?$")


# -- processes ------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    return tree_cpu_seconds(process_tree(pid))


class RssSampler:
    """Peak RSS of a process tree (sum, and the largest single process) while running."""

    def __init__(self, pid: int | None, interval_s: float = 0.2) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_total = 0
        self.peak_process = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        if self.pid is None:
            return
        sizes = tree_rss_sizes(self.pid)
        if sizes:
            self.peak_total = max(self.peak_total, sum(sizes))
            self.peak_process = max(self.peak_process, max(sizes))

    def __enter__(self) -> RssSampler:
        if self.pid is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


class Upstream:
    """The fast upstream: one process listening on `workers` ports."""

    def __init__(self, workers: int, log_path: Path, paced_ms: float = 25.0) -> None:
        self.ports = [free_port() for _ in range(workers)]
        self.paced_ms = paced_ms
        self.urls = {f"w{i}": f"http://127.0.0.1:{p}" for i, p in enumerate(self.ports)}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> Upstream:
        args = [sys.executable, "-m", "loadtests.benchmark.fast_upstream", "--paced-ms", str(self.paced_ms)]
        for p in self.ports:
            args += ["--port", str(p)]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = spawn(args, stdout=log, stderr=log)
        _wait_http(next(iter(self.urls.values())) + "/health", 20.0, self.proc)
        return self

    def stop(self) -> None:
        stop_group(self.proc)


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:  # loopback only, never a proxy
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def _wait_completion(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Until a chat completion goes through: routers register workers asynchronously."""
    deadline = time.monotonic() + timeout_s
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 2}
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{base_url}: the router exited with {proc.returncode}")
        try:
            ok = 0
            for _ in range(8):  # several processes behind one port: each must be ready
                r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=5.0, trust_env=False)
                last = f"{r.status_code} {r.text[:200]}"
                ok += r.status_code == 200
            if ok == 8:
                return
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.25)
    raise RuntimeError(f"{base_url}: no successful completion within {timeout_s:.0f} s (last: {last})")


# -- routers under test ---------------------------------------------------------------------


@dataclass
class RouterUnderTest:
    name: str
    urls: list[str] = field(default_factory=list)
    pid: int | None = None
    kind: str = "direct"
    processes: int = 1
    _kvroute: RouterProcess | None = None
    _peer: PeerRouter | None = None

    def start(self, upstream: Upstream, out: Path, peer_policy: str) -> None:
        log_path = out / f"{self.name.replace('/', '_')}.log"
        if self.name == "direct":
            self.urls = list(upstream.urls.values())
            return
        m = _KVROUTE_NAME.match(self.name)
        if m:
            self.kind = "kvroute"
            self.processes = int(m.group("procs") or 1)
            env = {"KVROUTE_UPSTREAM_CLIENT": m.group("client")} if m.group("client") else {}
            extra = ["--processes", str(self.processes)] if self.processes > 1 else []
            r = RouterProcess(upstream.urls, policy=m.group("policy"), extra_args=extra, env=env,
                              log_path=str(log_path), ready_timeout_s=60)
            r.start()
            self._kvroute = r
            self.pid = r.proc.pid if r.proc else None
            self.urls = [r.url]
            _wait_completion(r.url, 30.0, r.proc)
            return
        if self.name.split("/")[0] in PEERS:
            # loadtests/benchmark/peers.py installs (once, pinned) and launches the Rust routers.
            self.kind = "peer"
            ((peer, policy),) = parse_peer(self.name if "/" in self.name else f"{self.name}/{peer_policy}")
            p = PeerRouter(peer, policy, list(upstream.urls.values()), log_path=str(log_path), model=DEFAULT_MODEL)
            p.start()
            self._peer = p
            self.pid = p.pid
            self.urls = [p.url]
            _wait_completion(p.url, 30.0, p.proc)
            return
        raise SystemExit(f"bench-proxy: unknown router {self.name!r}")

    def stop(self) -> None:
        if self._kvroute is not None:
            self._kvroute.stop()
        if self._peer is not None:
            self._peer.stop()


# -- one run --------------------------------------------------------------------------------

MODES = ("nonstream", "stream", "paced")


@dataclass
class RunSpec:
    concurrency: int
    mode: str
    duration_s: float
    warmup_s: float
    chunks: int

    @property
    def stream(self) -> bool:
        return self.mode != "nonstream"


def run_once(router: RouterUnderTest, spec: RunSpec, upstream_pid: int | None) -> dict[str, Any]:
    import psutil  # the `bench` extra, checked by cli()

    args = [sys.executable, "-m", "loadtests.benchmark.loadgen", "--concurrency", str(spec.concurrency),
            "--duration", str(spec.duration_s), "--warmup", str(spec.warmup_s), "--chunks", str(spec.chunks),
            "--model", PACED_MODEL if spec.mode == "paced" else DEFAULT_MODEL]
    for url in router.urls:
        args += ["--url", url]
    if spec.stream:
        args.append("--stream")
    fd, name = tempfile.mkstemp(prefix="kvroute-loadgen-", suffix=".json")
    os.close(fd)
    out_file = Path(name)
    args += ["--out", str(out_file)]
    proc = spawn(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        if line.strip() != b"warm":
            raise RuntimeError(f"load generator: {line!r} {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        cpu0 = cpu_seconds(router.pid) if router.pid else 0.0
        up0 = cpu_seconds(upstream_pid) if upstream_pid else 0.0
        machine0 = psutil.cpu_times()
        t0 = time.perf_counter()
        with RssSampler(router.pid) as rss:
            line = proc.stdout.readline()
        window = time.perf_counter() - t0
        cpu1 = cpu_seconds(router.pid) if router.pid else 0.0
        up1 = cpu_seconds(upstream_pid) if upstream_pid else 0.0
        machine1 = psutil.cpu_times()
        if line.strip() != b"done":
            raise RuntimeError(f"load generator: {line!r}")
        _, errors = proc.communicate(timeout=60)
        try:
            result = orjson.loads(out_file.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise RuntimeError(f"load generator exited with {proc.returncode} ({exc}): {errors.decode()[-3000:]}") from None
        finally:
            out_file.unlink(missing_ok=True)
    finally:
        stop_group(proc)
    lat = sorted(result.pop("latency_us"))
    ttfb = sorted(result.pop("ttfb_us"))
    router_cpu = cpu1 - cpu0
    requests = result["requests"]
    busy = (sum(machine1) - machine1.idle - machine1.iowait) - (sum(machine0) - machine0.idle - machine0.iowait)
    return {
        **result,
        "p50_us": _pct(lat, 50), "p90_us": _pct(lat, 90), "p99_us": _pct(lat, 99),
        "ttfb_p50_us": _pct(ttfb, 50), "ttfb_p99_us": _pct(ttfb, 99),
        "router_cpu_s": router_cpu if router.pid else None,
        "router_cores": router_cpu / window if router.pid else None,
        "cpu_s_per_1k": router_cpu / requests * 1000 if router.pid and requests else None,
        "chunks_per_cpu_s": result["events"] / router_cpu if router.pid and router_cpu > 0 and spec.stream else None,
        "upstream_cores": (up1 - up0) / window if upstream_pid else None,
        "loadgen_cores": result["loadgen_cpu_s"] / window,
        "machine_busy_cores": busy / window,
        "rss_mb": rss.peak_total / 2**20 if router.pid else None,
        "rss_max_process_mb": rss.peak_process / 2**20 if router.pid else None,
    }


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


# -- aggregation ----------------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _added(runs: list[dict[str, Any]], direct: list[dict[str, Any]], key: str) -> float | None:
    """Median over repeats of (router percentile − direct percentile of the same repeat), ms."""
    diffs = []
    for r, d in zip(runs, direct, strict=False):
        if r.get(key) is not None and d.get(key) is not None:
            diffs.append((r[key] - d[key]) / 1000)
    return statistics.median(diffs) if diffs else None


def _ms(us: float | None) -> float | None:
    return None if us is None else us / 1000


def summarize_mode(runs: list[dict[str, Any]], direct: list[dict[str, Any]] | None, stream: bool) -> dict[str, Any]:
    s: dict[str, Any] = {
        "repeats": len(runs),
        "req_per_s": _median([r["req_per_s"] for r in runs]),
        "p50_ms": _ms(_median([r["p50_us"] for r in runs])),
        "p99_ms": _ms(_median([r["p99_us"] for r in runs])),
        "added_p50_ms": _added(runs, direct, "p50_us") if direct else None,
        "added_p99_ms": _added(runs, direct, "p99_us") if direct else None,
        "cpu_s_per_1k": _median([r["cpu_s_per_1k"] for r in runs]),
        "router_cores": _median([r["router_cores"] for r in runs]),
        "upstream_cores": _median([r["upstream_cores"] for r in runs]),
        "loadgen_cores": _median([r["loadgen_cores"] for r in runs]),
        "machine_busy_cores": _median([r["machine_busy_cores"] for r in runs]),
        "errors": sum(r["errors"] for r in runs),
        "error_kinds": _merge_kinds(runs),
        "rss_mb": max((r["rss_mb"] for r in runs if r["rss_mb"] is not None), default=None),
        "rss_max_process_mb": max((r["rss_max_process_mb"] for r in runs if r["rss_max_process_mb"] is not None),
                                  default=None),
    }
    if stream:
        s["chunks_per_s"] = _median([r["chunks_per_s"] for r in runs])
        s["chunks_per_cpu_s"] = _median([r["chunks_per_cpu_s"] for r in runs])
        s["ttfb_p50_ms"] = _ms(_median([r["ttfb_p50_us"] for r in runs]))
        s["added_ttfb_p50_ms"] = _added(runs, direct, "ttfb_p50_us") if direct else None
        s["added_ttfb_p99_ms"] = _added(runs, direct, "ttfb_p99_us") if direct else None
    return s


def _merge_kinds(runs: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in runs:
        for k, v in r["error_kinds"].items():
            out[k] = out.get(k, 0) + v
    return out


def summarize_level(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The headline figures of one router at one level, plus each mode's breakdown.

    Latency, requests/s and CPU per 1,000 requests come from the non-streaming runs;
    chunks/s and chunks per CPU second from the unpaced streaming runs (as fast as possible).
    """
    ns = modes.get("nonstream") or {}
    st = modes.get("stream") or {}
    rss = [m["rss_mb"] for m in modes.values() if m.get("rss_mb") is not None]
    rss_proc = [m["rss_max_process_mb"] for m in modes.values() if m.get("rss_max_process_mb") is not None]
    return {
        "added_p50_ms": ns.get("added_p50_ms"),
        "added_p99_ms": ns.get("added_p99_ms"),
        "req_per_s": ns.get("req_per_s"),
        "chunks_per_s": st.get("chunks_per_s"),
        "chunks_per_cpu_s": st.get("chunks_per_cpu_s"),
        "cpu_s_per_1k": ns.get("cpu_s_per_1k"),
        "errors": sum(m.get("errors", 0) for m in modes.values()),
        "rss_mb": max(rss) if rss else None,
        "rss_max_process_mb": max(rss_proc) if rss_proc else None,
        **modes,
    }


# -- report ---------------------------------------------------------------------------------


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


def render_markdown(results: dict[str, Any]) -> str:
    cfg = results["config"]
    m = results["machine"]
    lines = [
        "# kvroute bench-proxy",
        "",
        f"`{cfg['command']}`",
        "",
        f"{cfg['workers']} upstream ports on one fast-upstream process; {cfg['duration_s']} s windows; "
        f"{cfg['repeats']} alternating repeats (medians); streams of {cfg['chunks']} chunks. "
        f"Machine: {m['cpus']} CPUs, load average {m['loadavg_before']} before, {m.get('loadavg_after')} after.",
        "",
        "Added latency = router percentile − direct percentile in the same repeat (non-streaming, whole answer). "
        "CPU = the router's process tree (psutil). chunks/CPU-s = relayed SSE events per router CPU second. "
        "`stream`: chunks as fast as the reader takes them; `paced`: one chunk per stream every "
        f"{cfg['paced_ms']} ms (40 tokens/s). machine cores: all processes' CPU during the window.",
        "",
        "| router | c | added p50 ms | added p99 ms | req/s | CPU s/1k req | stream: added TTFB p50 ms | chunks/s | chunks/CPU-s | router cores | machine cores | paced: chunks/s | chunks/CPU-s | router cores | RSS MB | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, levels in results["routers"].items():
        for level, fig in levels.items():
            st = fig.get("stream") or {}
            pc = fig.get("paced") or {}
            lines.append(
                f"| {name} | {level[1:]} | {_f(fig['added_p50_ms'], '{:.3f}')} | {_f(fig['added_p99_ms'], '{:.3f}')} "
                f"| {_f(fig['req_per_s'], '{:.0f}')} | {_f(fig['cpu_s_per_1k'], '{:.3f}')} "
                f"| {_f(st.get('added_ttfb_p50_ms'), '{:.3f}')} | {_f(fig['chunks_per_s'], '{:.0f}')} "
                f"| {_f(fig['chunks_per_cpu_s'], '{:.0f}')} | {_f(st.get('router_cores'), '{:.2f}')} "
                f"| {_f(st.get('machine_busy_cores'), '{:.2f}')} "
                f"| {_f(pc.get('chunks_per_s'), '{:.0f}')} | {_f(pc.get('chunks_per_cpu_s'), '{:.0f}')} "
                f"| {_f(pc.get('router_cores'), '{:.2f}')} "
                f"| {_f(fig['rss_mb'], '{:.0f}')} | {fig['errors']} |"
            )
    check = results.get("processes_check")
    if check:
        lines += [
            "",
            f"## --processes check (c={check['concurrency']})",
            "",
            "| router | mode | req/s | chunks/s | router cores | machine cores | RSS MB (largest process) | errors |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, per_mode in check["routers"].items():
            for mode, s in per_mode.items():
                lines.append(
                    f"| {name} | {mode} | {_f(s['req_per_s'], '{:.0f}')} | {_f(s.get('chunks_per_s'), '{:.0f}')} "
                    f"| {_f(s['router_cores'], '{:.2f}')} | {_f(s['machine_busy_cores'], '{:.2f}')} "
                    f"| {_f(s['rss_max_process_mb'], '{:.0f}')} | {s['errors']} |"
                )
        lines.append("")
        for mode, speedup in check["speedup"].items():
            lines.append(f"Speed-up of {check['multi']} over {check['single']}, {mode}: **{_f(speedup)}×**  ")
        lines += ["", "Session affinity without a shared index (follow-up turns, each on a new connection):", ""]
        for name, a in check.get("affinity", {}).items():
            lines.append(f"- {name}: {a['same_worker']:.0%} back on the previous turn's worker, "
                         f"{a['predicted_gpu_hit']:.0%} predicted GPU hits ({a['follow_ups']} turns)")
    client = results.get("client_overhead")
    if client:
        lines += [
            "",
            "## Load generator vs httpx (client CPU per request, c=1, direct)",
            "",
            f"loadgen (raw asyncio + httptools): {_f(client['loadgen_us_per_req'], '{:.1f}')} µs; "
            f"httpx.AsyncClient: {_f(client['httpx_us_per_req'], '{:.1f}')} µs.",
        ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (("added_p50_ms",), "added p50 latency, ms (non-streaming)"),
        (("req_per_s",), "requests/s (non-streaming)"),
        (("chunks_per_s",), "relayed SSE chunks/s (unpaced)"),
        (("chunks_per_cpu_s",), "SSE chunks per router CPU second (unpaced)"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    # One colour per router in every panel, whether or not it has a point there.
    colours = {name: f"C{i}" for i, name in enumerate(results["routers"])}
    for ax, ((key,), title) in zip(axes.flat, panels, strict=True):
        for name, levels in results["routers"].items():
            xs, ys = [], []
            for level, figs in levels.items():
                if figs.get(key) is not None:
                    xs.append(int(level[1:]))
                    ys.append(figs[key])
            if xs:
                ax.plot(xs, ys, marker="o", label=name, color=colours[name])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if key == "added_p50_ms":
            ax.set_yscale("symlog", linthresh=0.1)
            ax.set_ylim(bottom=0)
        else:
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("kvroute bench-proxy: router overhead on a fast upstream")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- per-process index: session affinity ---------------------------------------------------


def session_affinity(url: str, sessions: int = 64, turns: int = 6) -> dict[str, Any]:
    """Concurrent multi-turn conversations, every request on a new connection (as from a
    client pool, or behind an L4 load balancer): the share of follow-up turns routed back to
    the worker that served the previous turn, and the share the router predicted as GPU
    hits. With several router processes and no shared index, a turn accepted by another
    process than the one that routed its prefix finds nothing in that process's index."""
    import asyncio

    import uvloop

    async def conversation(client: httpx.AsyncClient, s: int, out: list[tuple[bool, bool]]) -> None:
        history = [{"role": "system", "content": f"You are the assistant of session {s}. " * 30}]
        last = None
        for turn in range(turns):
            history.append({"role": "user", "content": f"turn {turn}: " + "details " * 30})
            r = await client.post(url + "/v1/chat/completions",
                                  json={"model": DEFAULT_MODEL, "messages": history, "max_tokens": 8})
            r.raise_for_status()
            worker = r.headers.get("x-kvroute-worker")
            if turn > 0:
                out.append((worker == last, r.headers.get("x-kvroute-route-reason") == "gpu_hit"))
            last = worker
            history.append({"role": "assistant", "content": "answer " * 20})

    async def main() -> list[tuple[bool, bool]]:
        out: list[tuple[bool, bool]] = []
        limits = httpx.Limits(max_keepalive_connections=0)  # a new connection for every request
        async with httpx.AsyncClient(trust_env=False, timeout=10.0, limits=limits) as client:
            await asyncio.gather(*(conversation(client, s, out) for s in range(sessions)))
        return out

    results = uvloop.run(main())
    n = len(results)
    return {"follow_ups": n, "same_worker": sum(a for a, _ in results) / n,
            "predicted_gpu_hit": sum(b for _, b in results) / n}


# -- httpx client overhead ------------------------------------------------------------------


def httpx_client_overhead(url: str, seconds: float = 2.0) -> float:
    """CPU µs per request of httpx.AsyncClient at c=1 (why the load generator is raw asyncio)."""
    from loadtests.benchmark.loadgen import request_bytes

    body = request_bytes("x", "/", DEFAULT_MODEL, 0, 0, False, 40).split(b"\r\n\r\n", 1)[1]

    async def go() -> float:
        import psutil

        async with httpx.AsyncClient(trust_env=False) as client:
            for _ in range(50):
                await client.post(url + "/v1/chat/completions", content=body)
            p = psutil.Process()
            c0 = sum(p.cpu_times()[:2])
            n = 0
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                r = await client.post(url + "/v1/chat/completions", content=body,
                                      headers={"content-type": "application/json"})
                r.raise_for_status()
                n += 1
            return (sum(p.cpu_times()[:2]) - c0) / n * 1e6

    import uvloop

    return uvloop.run(go())


# -- main -----------------------------------------------------------------------------------


def _levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _progress(prefix: str, name: str, res: dict[str, Any]) -> None:
    print(
        f"bench-proxy: {prefix} {name:<26} req/s {res['req_per_s']:8.0f} p50 {_f(_ms(res['p50_us']), '{:.3f}')} ms "
        f"chunks/s {res['chunks_per_s']:8.0f} router cores {_f(res['router_cores'])} "
        f"machine {res['machine_busy_cores']:.2f} errors {res['errors']}",
        file=sys.stderr, flush=True,
    )


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvroute bench-proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--levels", default=",".join(map(str, DEFAULT_LEVELS)), help="concurrency levels")
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=None, help="warm-up seconds per run (default: by level)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats per level and mode")
    parser.add_argument("--routers", default=",".join(DEFAULT_ROUTERS))
    parser.add_argument("--modes", default="nonstream,stream,paced", help=f"some of {', '.join(MODES)}")
    parser.add_argument("--paced-min-level", type=int, default=256,
                        help="paced streams (1 s each) only at this concurrency and above")
    parser.add_argument("--paced-ms", type=float, default=25.0, help="chunk interval of paced streams")
    parser.add_argument("--workers", type=int, default=8, help="upstream ports (simulated workers)")
    parser.add_argument("--chunks", type=int, default=40, help="SSE chunks per streamed answer")
    parser.add_argument("--peer-policy", default="cache_aware", help="policy of sglang-router and vllm-router")
    parser.add_argument("--processes-check", action="store_true",
                        help="also compare kvroute --processes 2 with one process at the highest level")
    parser.add_argument("--processes-policy", default="cache_aware")
    parser.add_argument("--client-check", action="store_true", help="also measure httpx's client CPU per request")
    args = parser.parse_args(argv)
    require_bench_extra("kvroute bench-proxy")
    with stop_children_on_signals():
        return _run(args, argv)


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    raise_fd_limit()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = _levels(args.levels)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES):
        raise SystemExit(f"bench-proxy: modes are {', '.join(MODES)}")
    names = [n.strip() for n in args.routers.split(",") if n.strip()]
    if "direct" not in names:
        names.insert(0, "direct")  # added latency is measured against it
    check_names: list[str] = []
    if args.processes_check:
        check_names = [f"kvroute-{args.processes_policy}", f"kvroute-{args.processes_policy}-p2"]

    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    upstream = Upstream(args.workers, out / "upstream.log", args.paced_ms).start()
    routers: dict[str, RouterUnderTest] = {}
    try:
        for name in dict.fromkeys([*names, *check_names]):
            print(f"bench-proxy: starting {name}", file=sys.stderr, flush=True)
            r = RouterUnderTest(name)
            r.start(upstream, out, args.peer_policy)
            routers[name] = r
        upstream_pid = upstream.proc.pid if upstream.proc else None

        runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
        for level in levels:
            warmup = args.warmup if args.warmup is not None else (1.0 if level < 256 else 2.5)
            for mode in modes:
                if mode == "paced" and level < args.paced_min_level:
                    continue
                spec = RunSpec(level, mode, args.duration, warmup, args.chunks)
                for rep in range(args.repeats):
                    order = names[rep % len(names):] + names[: rep % len(names)]
                    for name in order:
                        res = run_once(routers[name], spec, upstream_pid)
                        runs.setdefault((name, level, mode), []).append(res)
                        _progress(f"c={level:<5} {mode:<9} rep {rep}", name, res)

        results: dict[str, Any] = {
            "config": {
                "command": "kvroute bench-proxy " + " ".join(argv),
                "levels": levels, "modes": modes, "duration_s": args.duration, "repeats": args.repeats,
                "workers": args.workers, "chunks": args.chunks, "paced_ms": args.paced_ms,
                "peer_policy": args.peer_policy,
            },
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "loadavg_before": loadavg_before},
            "routers": {},
        }
        for name in names:
            per_level: dict[str, Any] = {}
            for level in levels:
                per_mode: dict[str, dict[str, Any]] = {}
                for mode in modes:
                    rs = runs.get((name, level, mode))
                    if rs:
                        direct = runs.get(("direct", level, mode)) if name != "direct" else None
                        per_mode[mode] = summarize_mode(rs, direct, mode != "nonstream")
                figures = summarize_level(per_mode)
                if name == "direct":
                    figures["added_p50_ms"] = figures["added_p99_ms"] = 0.0
                per_level[f"c{level}"] = figures
            results["routers"][name] = per_level

        if check_names:
            level = max(levels)
            check_runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {} for n in check_names}
            for mode in ("stream", "nonstream"):
                spec = RunSpec(level, mode, args.duration, 2.5, args.chunks)
                for rep in range(args.repeats):
                    for name in check_names if rep % 2 == 0 else list(reversed(check_names)):
                        res = run_once(routers[name], spec, upstream_pid)
                        check_runs[name].setdefault(mode, []).append(res)
                        _progress(f"processes-check c={level} {mode:<9} rep {rep}", name, res)
            summaries = {n: {mode: summarize_mode(rs, None, mode != "nonstream") for mode, rs in per.items()}
                         for n, per in check_runs.items()}
            single, multi = check_names
            speedup: dict[str, float | None] = {}
            for mode, key in (("stream", "chunks_per_s"), ("nonstream", "req_per_s")):
                a, b = summaries[single][mode][key], summaries[multi][mode][key]
                speedup[mode] = b / a if a and b else None
            results["processes_check"] = {
                "concurrency": level, "single": single, "multi": multi, "speedup": speedup, "routers": summaries,
                # What a per-process index costs: how often a conversation's next turn goes
                # back to the worker that holds its prefix.
                "affinity": {n: session_affinity(routers[n].urls[0]) for n in check_names},
            }

        if args.client_check:
            loadgen_runs = runs.get(("direct", min(levels), "nonstream")) or []
            loadgen_us = _median([r["loadgen_cpu_s"] / r["requests"] * 1e6 for r in loadgen_runs if r["requests"]])
            results["client_overhead"] = {
                "loadgen_us_per_req": loadgen_us,
                "httpx_us_per_req": httpx_client_overhead(next(iter(upstream.urls.values()))),
            }
        results["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        for r in routers.values():
            r.stop()
        upstream.stop()

    (out / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    (out / "results.md").write_text(render_markdown(results), encoding="utf-8")
    plot_or_log("bench-proxy", lambda: plot(results, out / "results.png"))
    print((out / "results.md").read_text(encoding="utf-8"))
    bad = sorted({n for n, lv in results["routers"].items() for f in lv.values() if f["errors"]})
    if bad:
        print(f"bench-proxy: errors in {', '.join(bad)}", file=sys.stderr)
    return 0
