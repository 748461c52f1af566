"""A simulated fleet in one process: the shared pool and N workers on one event loop.

`kvroute sim-cluster --workers N --base-port P [--pool-port Q] [--time-scale S]
[--profile ...] [--kv-capacity-tokens N] [--no-pool] [--kv-events-base-port Z]
[--speed F | --speeds F0,F1,...]`

Workers are named w0..w{N-1} and listen on P..P+N-1; the pool listens on Q (default
P+N). With --kv-events-base-port Z, worker i publishes KV events on tcp://127.0.0.1:Z+i.
One line `READY` is printed to stdout once everything listens.

`SimCluster` (and `SimWorkerProcess`) start that command as a subprocess on free loopback
ports for tests and benchmarks, and kill its whole process group on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from types import TracebackType
from typing import Any

from loadtests.processes import spawn, stop_group
from loadtests.routerproc import port_free
from loadtests.sim.pool import DEFAULT_CAPACITY_TOKENS, ChunkStore, LocalPoolClient, build_pool_app
from loadtests.sim.serving import QuietServer, Teardown, run_servers, server_for
from loadtests.sim.worker import DEFAULT_MODEL, SimWorker, add_engine_args, config_from_args


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvroute sim-cluster", description="a pool and N simulated workers")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--base-port", type=int, required=True)
    p.add_argument("--pool-port", type=int, default=None)
    p.add_argument("--pool-capacity-tokens", type=int, default=DEFAULT_CAPACITY_TOKENS)
    p.add_argument("--no-pool", action="store_true")
    p.add_argument(
        "--pool-in-process", action="store_true",
        help="workers call the pool they share this process with directly instead of over HTTP",
    )
    p.add_argument("--kv-events-base-port", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument(
        "--speeds", default=None,
        help="per-worker relative speed F0,F1,... (one per worker; 0.5 = steps take twice as long); default --speed",
    )  # fmt: skip
    add_engine_args(p)
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be at least 1")
    try:
        args.speed_list = _speeds(args.speeds, args.workers, args.speed)
    except ValueError as exc:
        p.error(f"--speeds: {exc}")
    return args


def _speeds(text: str | None, workers: int, default: float) -> list[float]:
    if not text:
        return [default] * workers
    speeds = [float(x) for x in text.split(",")]
    if len(speeds) != workers:
        raise ValueError(f"{len(speeds)} speeds for {workers} workers")
    if not all(f > 0 for f in speeds):
        raise ValueError("every speed must be positive")
    return speeds


def cli(argv: list[str]) -> int:
    args = parse_args(argv)
    pool_port = args.pool_port if args.pool_port is not None else args.base_port + args.workers
    pool_url = None if args.no_pool else f"http://{args.host}:{pool_port}"

    async def build() -> tuple[list[QuietServer], Teardown]:
        servers: list[QuietServer] = []
        local_pool = None
        if not args.no_pool:
            store = ChunkStore(args.pool_capacity_tokens)
            local_pool = LocalPoolClient(store) if args.pool_in_process else None
            servers.append(server_for(build_pool_app(store), args.host, pool_port))
        workers = []
        for i in range(args.workers):
            events = None
            if args.kv_events_base_port is not None:
                events = f"tcp://{args.host}:{args.kv_events_base_port + i}"
            config = config_from_args(args, f"w{i}", args.base_port + i, pool_url, events, speed=args.speed_list[i])
            worker = SimWorker(config, pool=local_pool)
            workers.append(worker)
            servers.append(server_for(worker.app, args.host, config.port))

        async def teardown() -> None:
            for worker in workers:
                await worker.close()

        return servers, teardown

    return run_servers(build, on_ready=lambda: print("READY", flush=True))


# -- subprocess helpers for tests and benchmarks ----------------------------------------


def free_port_range(n: int, low: int = 20_000, high: int = 32_000) -> int:
    """First port of `n` consecutive ports free on loopback right now (below Linux's
    ephemeral range, so outgoing connections do not take them before the child binds)."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        base = rng.randrange(low, high - n)
        if all(port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found")


class _SimProcess:
    """A `kvroute sim-*` subprocess that prints READY; started in its own process group."""

    ready_timeout_s = 30.0
    attempts = 4

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _choose_ports(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        last = ""
        for _ in range(self.attempts):
            self._choose_ports()
            cmd = [sys.executable, "-m", "router.cli", *self._command()]
            self.proc = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert self.proc.stdout is not None
            deadline = time.monotonic() + self.ready_timeout_s
            self.output = []
            while time.monotonic() < deadline:
                line = self.proc.stdout.readline()
                if not line:
                    break  # exited (port taken between our check and its bind?)
                self.output.append(line)
                if line.strip() == "READY":
                    self._drain_output()
                    return
            last = "".join(self.output[-20:])
            self.stop()
        raise RuntimeError(f"simulator did not become ready:\n{last}")

    def _drain_output(self) -> None:
        """Keep reading the pipe so a chatty child never blocks on a full pipe."""
        import threading

        proc = self.proc
        assert proc is not None and proc.stdout is not None

        def pump() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                if len(self.output) < 1000:
                    self.output.append(line)

        threading.Thread(target=pump, daemon=True).start()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        stop_group(proc, timeout_s=5.0)

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    async def __aenter__(self) -> Any:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await asyncio.to_thread(self.stop)


class SimCluster(_SimProcess):
    """`kvroute sim-cluster` on free loopback ports.

    with SimCluster(workers=2, time_scale=0.01) as c:
        c.worker_urls   # {"w0": "http://127.0.0.1:P", "w1": ...}
        c.pool_url      # None with pool=False
        c.kv_event_endpoints  # {"w0": "tcp://127.0.0.1:Z", ...} with kv_events=True
    """

    def __init__(
        self,
        workers: int = 2,
        time_scale: float = 0.01,
        profile: str | None = None,
        kv_capacity_tokens: int | None = None,
        pool: bool = True,
        pool_capacity_tokens: int | None = None,
        kv_events: bool = False,
        model: str | None = None,
        extra_args: list[str] | None = None,
        pool_in_process: bool = False,
        speeds: list[float] | None = None,
    ) -> None:
        super().__init__()
        self.pool_in_process = pool_in_process
        self.speeds = speeds
        self.workers = workers
        self.time_scale = time_scale
        self.profile = profile
        self.kv_capacity_tokens = kv_capacity_tokens
        self.pool = pool
        self.pool_capacity_tokens = pool_capacity_tokens
        self.kv_events = kv_events
        self.model = model or DEFAULT_MODEL
        self.extra_args = extra_args or []
        self.base_port = 0
        self.worker_urls: dict[str, str] = {}
        self.pool_url: str | None = None
        self.kv_event_endpoints: dict[str, str] = {}

    def _choose_ports(self) -> None:
        n = self.workers + (1 if self.pool else 0) + (self.workers if self.kv_events else 0)
        self.base_port = free_port_range(n)
        self.worker_urls = {f"w{i}": f"http://127.0.0.1:{self.base_port + i}" for i in range(self.workers)}
        self.pool_url = f"http://127.0.0.1:{self.base_port + self.workers}" if self.pool else None
        ev_base = self.base_port + self.workers + (1 if self.pool else 0)
        self.kv_event_endpoints = (
            {f"w{i}": f"tcp://127.0.0.1:{ev_base + i}" for i in range(self.workers)} if self.kv_events else {}
        )

    def _command(self) -> list[str]:
        cmd = [
            "sim-cluster",
            "--workers", str(self.workers),
            "--base-port", str(self.base_port),
            "--time-scale", str(self.time_scale),
            "--model", self.model,
        ]  # fmt: skip
        if self.pool:
            cmd += ["--pool-port", str(self.base_port + self.workers)]
            if self.pool_capacity_tokens is not None:
                cmd += ["--pool-capacity-tokens", str(self.pool_capacity_tokens)]
            if self.pool_in_process:
                cmd.append("--pool-in-process")
        else:
            cmd.append("--no-pool")
        if self.kv_events:
            cmd += ["--kv-events-base-port", str(self.base_port + self.workers + (1 if self.pool else 0))]
        if self.profile:
            cmd += ["--profile", self.profile]
        if self.kv_capacity_tokens is not None:
            cmd += ["--kv-capacity-tokens", str(self.kv_capacity_tokens)]
        if self.speeds:
            cmd += ["--speeds", ",".join(str(f) for f in self.speeds)]
        return cmd + self.extra_args


class SimWorkerProcess(_SimProcess):
    """One `kvroute sim-worker` on a free loopback port; `.url`, `.kv_events_endpoint`."""

    def __init__(
        self,
        name: str = "w0",
        time_scale: float = 0.01,
        pool_url: str | None = None,
        kv_events: bool = False,
        extra_args: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self.time_scale = time_scale
        self.pool_url = pool_url
        self.kv_events = kv_events
        self.extra_args = extra_args or []
        self.port = 0
        self.url = ""
        self.kv_events_endpoint: str | None = None

    def _choose_ports(self) -> None:
        self.port = free_port_range(2 if self.kv_events else 1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_events_endpoint = f"tcp://127.0.0.1:{self.port + 1}" if self.kv_events else None

    def _command(self) -> list[str]:
        cmd = ["sim-worker", "--name", self.name, "--port", str(self.port), "--time-scale", str(self.time_scale)]
        if self.pool_url:
            cmd += ["--pool", self.pool_url]
        if self.kv_events_endpoint:
            cmd += ["--kv-events", self.kv_events_endpoint]
        return cmd + self.extra_args
