"""A simulated fleet in one process: the nodes' pools and N workers on one event loop.

`kvroute sim-cluster --workers N --base-port P [--nodes M] [--pool-port Q] [--time-scale S]
[--profile ...] [--kv-capacity-tokens N] [--no-pool] [--kv-events-base-port Z]
[--speed F | --speeds F0,F1,...] [--disk-capacity-tokens N] [--disk-gbytes-s G]
[--remote-capacity-tokens N] [--remote-gbps G] [--no-remote-write-through]
[--roles prefill:2,decode:6 | --roles prefill,decode,...] [--kv-link-gbps G]
[--nixl-abort-timeout-s T]`

Workers are named w0..w{N-1} and listen on P..P+N-1. They are split in order over M nodes
n0..n{M-1} (N/M each); node i's pool (its LMCache server: the CPU pool, and a disk tier
under it with --disk-capacity-tokens) listens on Q+i (Q defaults to P+N). With
--remote-capacity-tokens, one remote tier serves every node. With --kv-events-base-port Z,
worker i publishes KV events on tcp://127.0.0.1:Z+i. One line `READY` is printed to stdout
once everything listens. `--print-topology` prints the router's `--node` flags for that
split and exits; `--print-roles` prints its `--role` flags for `--roles` and exits.

`--roles` gives the workers their part in a prefill/decode-disaggregated fleet, in worker
order: counts (`prefill:2,decode:6`: w0-w1 prefill, w2-w7 decode) or one role per worker
(`prefill,decode,both`). Default: every worker `both` (an aggregated fleet). The workers of
one process read each other's KV directly (a shared `NixlPeers`), not over HTTP.

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

from loadtests.sim.costs import DISK_GBYTES_S, REMOTE_GBPS
from loadtests.sim.nixl import ROLES, NixlPeers
from loadtests.sim.pool import (
    DEFAULT_CAPACITY_TOKENS,
    ChunkStore,
    LocalPoolClient,
    NodeStore,
    build_pool_app,
)
from loadtests.sim.serving import QuietServer, Teardown, run_servers, server_for
from loadtests.sim.worker import (
    DEFAULT_MODEL,
    SimWorker,
    add_engine_args,
    config_from_args,
    positive_float,
)
from loadtests.support.processes import spawn, stop_group
from loadtests.support.routerproc import port_free


def topology(workers: int, nodes: int) -> dict[str, list[str]]:
    """Node name -> its workers: w0..w{N-1} split in order over n0..n{M-1}, N/M each."""
    if workers < 1 or nodes < 1:
        raise ValueError("workers and nodes must be at least 1")
    if workers % nodes:
        raise ValueError(f"{workers} workers do not split evenly over {nodes} nodes")
    per = workers // nodes
    return {f"n{j}": [f"w{i}" for i in range(j * per, (j + 1) * per)] for j in range(nodes)}


def node_flags(topo: dict[str, list[str]]) -> list[str]:
    """The router's flags for a topology: `--node n0=w0,w1 --node n1=w2,w3`."""
    out: list[str] = []
    for node, workers in topo.items():
        out += ["--node", f"{node}={','.join(workers)}"]
    return out


def parse_roles(text: str | list[str] | None, workers: int) -> list[str]:
    """Each worker's role, in worker order, from counts (`prefill:2,decode:6`, assigned in
    the order given) or one role per worker (`prefill,decode,...`, or a list). None or
    empty: every worker `both`."""
    if not text:
        return ["both"] * workers
    items = [x.strip() for x in text.split(",")] if isinstance(text, str) else [x.strip() for x in text]
    counted = [":" in x for x in items]
    if any(counted) and not all(counted):
        raise ValueError("give either counts (prefill:2,decode:6) or one role per worker, not both")
    roles: list[str] = []
    for item in items:
        role, _, count = item.partition(":")
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
        n = 1
        if count:
            try:
                n = int(count)
            except ValueError:
                raise ValueError(f"{item!r}: the count must be an integer") from None
            if n < 0:
                raise ValueError(f"{item!r}: the count must not be negative")
        roles += [role] * n
    if len(roles) != workers:
        raise ValueError(f"{len(roles)} roles for {workers} workers")
    return roles


def role_flags(roles: dict[str, str]) -> list[str]:
    """The router's flags for the workers' roles: `--role w0=prefill --role w2=decode`;
    `both` is the router's default and is left out (a fleet of `both` gives none)."""
    out: list[str] = []
    for worker, role in roles.items():
        if role != "both":
            out += ["--role", f"{worker}={role}"]
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvroute sim-cluster", description="the nodes' pools and N simulated workers")
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--base-port", type=int, default=None, help="required unless --print-topology")
    p.add_argument("--nodes", type=int, default=1, help="split the workers in order over this many nodes, one pool each")
    p.add_argument("--print-topology", action="store_true", help="print the router's --node flags and exit")
    p.add_argument(
        "--roles", default=None,
        help="roles in worker order: counts prefill:2,decode:6 or one per worker prefill,decode,...; default all both",
    )  # fmt: skip
    p.add_argument("--print-roles", action="store_true", help="print the router's --role flags for --roles and exit")
    p.add_argument("--pool-port", type=int, default=None, help="node i's pool listens on this + i (default: base port + workers)")
    p.add_argument("--pool-capacity-tokens", type=int, default=DEFAULT_CAPACITY_TOKENS, help="per node")
    p.add_argument("--disk-capacity-tokens", type=int, default=0, help="a disk tier under each node's pool (0: none)")
    p.add_argument("--disk-gbytes-s", type=positive_float, default=DISK_GBYTES_S, help="the disk tier's read bandwidth, GB/s")
    p.add_argument("--remote-capacity-tokens", type=int, default=0, help="one remote tier every node reads (0: none)")
    p.add_argument("--remote-gbps", type=positive_float, default=REMOTE_GBPS, help="network bandwidth to the remote tier, Gb/s")
    p.add_argument(
        "--no-remote-write-through", dest="remote_write_through", action="store_false",
        help="workers do not store what they compute in the remote tier (something else fills it)",
    )  # fmt: skip
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
    if args.nodes < 1:
        p.error("--nodes must be at least 1")
    if args.workers % args.nodes:
        p.error(f"--workers {args.workers} must be divisible by --nodes {args.nodes} (workers split evenly over nodes)")
    if args.base_port is None and not (args.print_topology or args.print_roles):
        p.error("--base-port is required")
    if args.disk_capacity_tokens < 0 or args.remote_capacity_tokens < 0:
        p.error("tier capacities must be non-negative")
    if args.no_pool and (args.disk_capacity_tokens > 0 or args.remote_capacity_tokens > 0):
        p.error("--disk-capacity-tokens and --remote-capacity-tokens need a pool (LMCache loads through it)")
    try:
        args.speed_list = _speeds(args.speeds, args.workers, args.speed)
    except ValueError as exc:
        p.error(f"--speeds: {exc}")
    try:
        args.role_list = parse_roles(args.roles, args.workers)
    except ValueError as exc:
        p.error(f"--roles: {exc}")
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


def node_stores(args: argparse.Namespace, nodes: list[str]) -> dict[str, NodeStore]:
    """Each node's LMCache server: its own pool and disk tier, and the one remote tier."""
    remote = ChunkStore(args.remote_capacity_tokens) if args.remote_capacity_tokens > 0 else None
    return {
        node: NodeStore(
            ChunkStore(args.pool_capacity_tokens),
            disk=ChunkStore(args.disk_capacity_tokens) if args.disk_capacity_tokens > 0 else None,
            remote=remote,
            remote_write_through=args.remote_write_through,
            node=node,
        )
        for node in nodes
    }


def cli(argv: list[str]) -> int:
    args = parse_args(argv)
    topo = topology(args.workers, args.nodes)
    if args.print_topology or args.print_roles:
        flags = node_flags(topo) if args.print_topology else []
        if args.print_roles:
            flags += role_flags({f"w{i}": role for i, role in enumerate(args.role_list)})
        print(" ".join(flags), flush=True)
        return 0
    node_of = {worker: node for node, workers in topo.items() for worker in workers}
    pool_port = args.pool_port if args.pool_port is not None else args.base_port + args.workers
    pool_urls = {node: f"http://{args.host}:{pool_port + i}" for i, node in enumerate(topo)}

    async def build() -> tuple[list[QuietServer], Teardown]:
        servers: list[QuietServer] = []
        stores: dict[str, NodeStore] = {}
        if not args.no_pool:
            stores = node_stores(args, list(topo))
            for i, node in enumerate(topo):
                servers.append(server_for(build_pool_app(stores[node]), args.host, pool_port + i))
        workers = []
        peers = NixlPeers()
        for i in range(args.workers):
            name = f"w{i}"
            node = node_of[name]
            events = None
            if args.kv_events_base_port is not None:
                events = f"tcp://{args.host}:{args.kv_events_base_port + i}"
            pool_url = None if args.no_pool else pool_urls[node]
            config = config_from_args(
                args, name, args.base_port + i, pool_url, events, speed=args.speed_list[i], node=node,
                role=args.role_list[i],
            )  # fmt: skip
            local_pool = LocalPoolClient(stores[node]) if stores and args.pool_in_process else None
            worker = SimWorker(config, pool=local_pool, peers=peers)
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
        c.pool_url      # node n0's pool (the only one with nodes=1); None with pool=False
        c.pool_urls     # {"n0": "http://127.0.0.1:Q", "n1": ...}; {} with pool=False
        c.topology      # {"n0": ["w0", ...], ...};  c.node_of: {"w0": "n0", ...}
        c.kv_event_endpoints  # {"w0": "tcp://127.0.0.1:Z", ...} with kv_events=True
        c.router_node_args()  # ["--node", "n0=w0,...", ...] for the router
        c.worker_roles        # {"w0": "prefill", ...} (roles="prefill:1,decode:1"); all "both" by default
        c.router_role_args()  # ["--role", "w0=prefill", "--role", "w1=decode"] for the router
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
        nodes: int = 1,
        disk_capacity_tokens: int = 0,
        remote_capacity_tokens: int = 0,
        remote_gbps: float | None = None,
        disk_gbytes_s: float | None = None,
        remote_write_through: bool = True,
        roles: str | list[str] | None = None,
        kv_link_gbps: float | None = None,
        nixl_abort_timeout_s: float | None = None,
    ) -> None:
        super().__init__()
        # Checked here, like the topology: bad roles would otherwise fail every start attempt.
        role_list = parse_roles(roles, workers)
        self.roles = ",".join(role_list) if roles else None
        self.worker_roles = {f"w{i}": role for i, role in enumerate(role_list)}
        self.kv_link_gbps = kv_link_gbps
        self.nixl_abort_timeout_s = nixl_abort_timeout_s
        # Checked here, not by the child: a bad split would otherwise fail every start attempt.
        self.topology = topology(workers, nodes)
        self.node_of = {worker: node for node, names in self.topology.items() for worker in names}
        if not pool and (disk_capacity_tokens > 0 or remote_capacity_tokens > 0):
            raise ValueError("disk and remote tiers need a pool")
        self.nodes = nodes
        self.disk_capacity_tokens = disk_capacity_tokens
        self.remote_capacity_tokens = remote_capacity_tokens
        self.remote_gbps = remote_gbps
        self.disk_gbytes_s = disk_gbytes_s
        self.remote_write_through = remote_write_through
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
        self.pool_urls: dict[str, str] = {}
        self.kv_event_endpoints: dict[str, str] = {}

    @property
    def _pool_ports(self) -> int:
        return self.nodes if self.pool else 0

    def router_node_args(self) -> list[str]:
        """The router's `--node` flags for this cluster's topology."""
        return node_flags(self.topology)

    def router_role_args(self) -> list[str]:
        """The router's `--role` flags for this cluster's roles (none for an all-`both` fleet)."""
        return role_flags(self.worker_roles)

    def _choose_ports(self) -> None:
        n = self.workers + self._pool_ports + (self.workers if self.kv_events else 0)
        self.base_port = free_port_range(n)
        self.worker_urls = {f"w{i}": f"http://127.0.0.1:{self.base_port + i}" for i in range(self.workers)}
        pool_base = self.base_port + self.workers
        self.pool_urls = (
            {node: f"http://127.0.0.1:{pool_base + i}" for i, node in enumerate(self.topology)} if self.pool else {}
        )
        self.pool_url = self.pool_urls.get("n0")
        ev_base = self.base_port + self.workers + self._pool_ports
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
            if self.disk_capacity_tokens > 0:
                cmd += ["--disk-capacity-tokens", str(self.disk_capacity_tokens)]
            if self.remote_capacity_tokens > 0:
                cmd += ["--remote-capacity-tokens", str(self.remote_capacity_tokens)]
            if not self.remote_write_through:
                cmd.append("--no-remote-write-through")
        else:
            cmd.append("--no-pool")
        if self.nodes != 1:
            cmd += ["--nodes", str(self.nodes)]
        if self.disk_gbytes_s is not None:
            cmd += ["--disk-gbytes-s", str(self.disk_gbytes_s)]
        if self.remote_gbps is not None:
            cmd += ["--remote-gbps", str(self.remote_gbps)]
        if self.kv_events:
            cmd += ["--kv-events-base-port", str(self.base_port + self.workers + self._pool_ports)]
        if self.profile:
            cmd += ["--profile", self.profile]
        if self.kv_capacity_tokens is not None:
            cmd += ["--kv-capacity-tokens", str(self.kv_capacity_tokens)]
        if self.speeds:
            cmd += ["--speeds", ",".join(str(f) for f in self.speeds)]
        if self.roles:
            cmd += ["--roles", self.roles]
        if self.kv_link_gbps is not None:
            cmd += ["--kv-link-gbps", str(self.kv_link_gbps)]
        if self.nixl_abort_timeout_s is not None:
            cmd += ["--nixl-abort-timeout-s", str(self.nixl_abort_timeout_s)]
        return cmd + self.extra_args


class SimWorkerProcess(_SimProcess):
    """One `kvroute sim-worker` on a free loopback port; `.url`, `.kv_events_endpoint`;
    `role` is its `--role`."""

    def __init__(
        self,
        name: str = "w0",
        time_scale: float = 0.01,
        pool_url: str | None = None,
        kv_events: bool = False,
        extra_args: list[str] | None = None,
        role: str | None = None,
    ) -> None:
        super().__init__()
        if role is not None and role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        self.role = role
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
        if self.role:
            cmd += ["--role", self.role]
        return cmd + self.extra_args
