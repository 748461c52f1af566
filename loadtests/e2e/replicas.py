"""Throwaway Redis servers, Redis Clusters and router replicas on loopback, for the Redis
tests and `loadtests.measure.bench_index`.

Every server here is our own `redis-server` child on a free port with its files in a
temporary directory; nothing touches the system Redis at 127.0.0.1:6379.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx
import redis

from loadtests.benchmark.harness import moves_from_previous_turn
from loadtests.support.processes import kill_group, spawn
from loadtests.support.routerproc import RouterProcess, port_free

REDIS_SERVER = shutil.which("redis-server") or "redis-server"
REDIS_CLI = shutil.which("redis-cli") or "redis-cli"


def free_ports(n: int, *, with_bus: bool = False) -> list[int]:
    """`n` distinct free loopback ports; with_bus: port + 10000 (the cluster bus) free too."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    ports: list[int] = []
    for _ in range(1000):
        p = rng.randrange(20_000, 50_000)
        if p in ports or not port_free(p) or (with_bus and not port_free(p + 10_000)):
            continue
        ports.append(p)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"could not find {n} free ports")


def wait_for_redis(port: int, timeout_s: float = 10.0, **client_kwargs: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5,
                             **client_kwargs) as c:
                c.ping()
                return
        except redis.RedisError:
            time.sleep(0.02)
    raise RuntimeError(f"redis-server on port {port} did not answer")


def make_test_ca(directory: str) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl), for TLS tests."""
    paths = {n: os.path.join(directory, n) for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt", "san.cnf")}
    with open(paths["san.cnf"], "w", encoding="utf-8") as fh:
        fh.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvroute-test-ca",
        "-keyout", paths["ca.key"], "-out", paths["ca.crt"])
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", paths["server.key"], "-out", paths["server.csr"])
    run("x509", "-req", "-in", paths["server.csr"], "-CA", paths["ca.crt"], "-CAkey", paths["ca.key"],
        "-CAcreateserial", "-days", "2", "-extfile", paths["san.cnf"], "-out", paths["server.crt"])
    return paths


class RedisServer:
    """One `redis-server` child: `kill()` (crash: data gone), `pause()`/`resume()` (hung,
    then back with its data), `start()` again on the same port. With `password`, clients
    must authenticate; with `tls`, it speaks TLS only (certificates from a throwaway CA)."""

    def __init__(
        self, port: int | None = None, extra_args: Sequence[str] = (), *, password: str | None = None,
        tls: bool = False,
    ) -> None:
        self.port = port or free_ports(1)[0]
        self.extra_args = list(extra_args)
        self.password = password
        self.tls = tls
        self.dir = tempfile.mkdtemp(prefix=f"kvroute-redis-{self.port}-")
        self.certs = make_test_ca(self.dir) if tls else {}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.certs['ca.crt']}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _client_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"password": self.password}
        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=self.certs["ca.crt"])
        return kw

    def start(self) -> RedisServer:
        listen = ["--port", str(self.port)]
        if self.tls:
            listen = [
                "--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.certs["server.crt"],
                "--tls-key-file", self.certs["server.key"], "--tls-ca-cert-file", self.certs["ca.crt"],
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        if self.password:
            listen += ["--requirepass", self.password]
        cmd = [
            REDIS_SERVER, *listen, "--bind", "127.0.0.1", "--dir", self.dir,
            "--save", "", "--appendonly", "no", "--logfile", os.path.join(self.dir, "redis.log"),
            *self.extra_args,
        ]  # fmt: skip
        self.proc = spawn(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_redis(self.port, **self._client_kwargs())
        return self

    def kill(self) -> None:
        """SIGKILL: the server and its (unsaved) data are gone."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a paused server must be able to die
            kill_group(proc)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a hung or very slow Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **self._client_kwargs())

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class RedisClusterNodes:
    """A three-master Redis Cluster (no replicas) of our own `redis-server` children."""

    def __init__(self, masters: int = 3) -> None:
        self.ports = free_ports(masters, with_bus=True)
        self.servers = [
            RedisServer(
                p,
                extra_args=[
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "2000",
                ],
            )
            for p in self.ports
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> RedisClusterNodes:
        try:
            for s in self.servers:
                s.start()
            subprocess.run(
                [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-yes"],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60,
            )  # fmt: skip
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                states = []
                for s in self.servers:
                    with s.client() as c:
                        states.append(c.execute_command("CLUSTER", "INFO").decode())
                if all("cluster_state:ok" in st for st in states):
                    return self
                time.sleep(0.1)
            raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
        except BaseException:
            self.close()
            raise

    def node_for_slot(self, slot: int) -> int:
        """The port of the master serving `slot`."""
        with self.servers[0].client() as c:
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise LookupError(slot)

    def close(self) -> None:
        for s in self.servers:
            s.close()

    def __enter__(self) -> RedisClusterNodes:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class RouterReplicas:
    """N `kvroute serve` processes on N ports in front of the same workers, sharing one
    Redis (or, with redis_url None, each with its own in-memory index)."""

    def __init__(
        self,
        workers: Mapping[str, str],
        n: int,
        redis_url: str | None,
        prefix: str = "kvroute",
        extra_args: Sequence[str] = (),
        log_dir: str | None = None,
    ) -> None:
        args = list(extra_args)
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        if redis_url is not None:
            args += ["--redis", redis_url, "--redis-prefix", prefix]
        self.routers = [
            RouterProcess(
                workers, extra_args=args,
                log_path=os.path.join(log_dir, f"router{i}.log") if log_dir else None,
            )
            for i in range(n)
        ]

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.routers]

    def start(self) -> RouterReplicas:
        try:
            for r in self.routers:
                r.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for r in self.routers:
            with contextlib.suppress(Exception):
                r.stop()

    def __enter__(self) -> RouterReplicas:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


# -- multi-turn conversations through several replicas ------------------------------------------
SIM_MODEL = "sim-llama3-8b"


def own_system_prompt(c: int, chars: int = 12_000) -> str:
    """A system prompt of its own per conversation (~3k tokens): long enough that reusing it
    matters more to cache-aware routing than small load differences."""
    return (f"You are agent {c}. Keep to the plan, report every step, cite the files you touch. " * 200)[:chars]


@dataclass
class TurnResult:
    conversation: int
    turn: int
    replica: int
    started: float
    """Seconds since the load started."""
    elapsed: float
    worker: str | None = None
    reason: str | None = None
    error: str | None = None


@dataclass
class ConversationLoad:
    """Conversations arriving at random, each turn sent to a replica chosen per turn."""

    urls: Sequence[str]
    conversations: int = 64
    turns: int = 4
    arrival_rate: float = 8.0
    """Conversations started per second (Poisson)."""
    think_s: float = 0.2
    """Pause between a turn's answer and the next turn."""
    pick: Callable[[random.Random, int, int], int] | None = None
    """(rng, conversation, turn) -> replica index; default: uniformly at random."""
    system_for: Callable[[int], str] = own_system_prompt
    model: str = SIM_MODEL
    timeout_s: float = 60.0
    seed: int = 1
    fresh_connections: bool = False
    """A new connection per request: processes sharing one listening socket (`--processes`)
    each accept some, where kept-alive connections may all have gone to one of them."""
    results: list[TurnResult] = field(default_factory=list)

    async def run(self) -> list[TurnResult]:
        rng = random.Random(self.seed)
        starts, t = [], 0.0
        for _ in range(self.conversations):
            t += rng.expovariate(self.arrival_rate)
            starts.append(t)
        t0 = time.monotonic()
        keepalive = 0 if self.fresh_connections else 1000
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=keepalive)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, trust_env=False) as client:
            await asyncio.gather(*(self._conversation(client, c, starts[c], t0, random.Random(rng.random()))
                                   for c in range(self.conversations)))
        return self.results

    async def _conversation(self, client: httpx.AsyncClient, c: int, start: float, t0: float, rng: random.Random) -> None:
        await asyncio.sleep(max(0.0, start - (time.monotonic() - t0)))
        messages: list[dict[str, str]] = [{"role": "system", "content": self.system_for(c)}]
        for turn in range(self.turns):
            messages.append({"role": "user", "content": f"Conversation {c}, turn {turn}: continue with the next step. " * 8})
            replica = self.pick(rng, c, turn) if self.pick else rng.randrange(len(self.urls))
            began = time.monotonic()
            result = TurnResult(c, turn, replica, began - t0, 0.0)
            try:
                r = await client.post(self.urls[replica] + "/v1/chat/completions",
                                      json={"model": self.model, "messages": messages, "max_tokens": 16})
                result.worker = r.headers.get("x-kvroute-worker")
                result.reason = r.headers.get("x-kvroute-route-reason")
                if r.status_code != 200:
                    result.error = f"HTTP {r.status_code}"
                else:
                    messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                result.error = type(exc).__name__
            result.elapsed = time.monotonic() - began
            self.results.append(result)
            if result.error is not None:
                messages.pop()  # a client would retry the same turn; this one moves on
            await asyncio.sleep(rng.expovariate(1 / self.think_s) if self.think_s > 0 else 0)


def affinity(
    results: Sequence[TurnResult],
    started_in: tuple[float, float] | None = None,
    conversations_from: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """Share of turns 2+ served by the worker of the conversation's turn 1. With started_in,
    only turns sent in that window (seconds since the start of the load); with
    conversations_from, only conversations whose turn 1 was sent in that window."""
    first: dict[int, str] = {}
    for r in results:
        in_window = conversations_from is None or conversations_from[0] <= r.started < conversations_from[1]
        if r.turn == 0 and r.worker is not None and r.error is None and in_window:
            first[r.conversation] = r.worker
    later = [r for r in results if r.turn > 0 and r.error is None and r.conversation in first
             and (started_in is None or started_in[0] <= r.started < started_in[1])]
    same = sum(r.worker == first[r.conversation] for r in later)
    # Stickiness to the previous turn's worker: recovers as soon as routing is shared again.
    by_turn = {(r.conversation, r.turn): r.worker for r in results if r.error is None}
    moved, counted = moves_from_previous_turn(by_turn, ((r.conversation, r.turn, r.worker) for r in later))
    return {
        "turns": len(later),
        "affinity": round(same / len(later), 4) if later else None,
        "previous_turn_stickiness": round((counted - moved) / counted, 4) if counted else None,
    }


def summarize(results: Sequence[TurnResult]) -> dict[str, Any]:
    served: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for r in results:
        if r.worker:
            served[r.worker] = served.get(r.worker, 0) + 1
        if r.reason:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
    return {
        "requests": len(results),
        "failed": sum(r.error is not None for r in results),
        "errors": sorted({r.error for r in results if r.error}),
        **affinity(results),
        "served": dict(sorted(served.items())),
        "reasons": dict(sorted(reasons.items())),
    }
