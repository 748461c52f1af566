"""`kvroute bench`: the multi-turn benchmark of routing policies and peer routers.

    kvroute bench --scenario seed --policies random,round_robin,least_loaded,cache_aware \
        [--peers sglang-router,vllm-router] [--find-capacity --slo-p99-ttft 2.0] \
        [--workers 8] [--time-scale S|auto] [--seed N] [--api chat|responses|messages] --out DIR
    kvroute bench --roles prefill:2,decode:6 [--kv-link-gbps G] --policies cache_aware,cache_aware+agg \
        [--peers vllm-router/pd] --out DIR
    kvroute bench --trace FILE [--trace-window START,MINUTES] [--trace-speed X] \
        [--api chat|completions] --policies ... [--peers ...] --out DIR

Ablations. `cache_aware~TERM` is cache_aware with one of its terms switched off
(`--policy-ablate TERM`; the terms are `router.policies.cache_aware.TERMS`, docs/policy.md),
`cache_aware~T1~T2` with several; the suffixes follow it (`cache_aware~lag-nopool`).
`--ablate TERM[,TERM...]|all` adds, after each cache_aware entry of `--policies` without
one, an entry per term named so: `--policies cache_aware-nopool --ablate all` runs the full
policy and each term removed, in one run.

With `--via envoy`, kvroute entries receive the requests through Envoy asking `kvroute epp`
where each goes (the Gateway API Inference Extension's picker protocol, loadtests/benchmark/envoy.py);
`--via proxy,envoy` runs each both ways (through Envoy as NAME+envoy).

With `--trace`, a request trace replaces the scenario (`loadtests.benchmark.traces`: its requests at
their times, the trace's ideal reuse and TTFT floor reported beside each router).
A scenario's requests go through `/v1/chat/completions` by default, or with `--api responses`
/ `--api messages` through `/v1/responses` / `/v1/messages`, the same conversations in those
APIs' wire forms (`loadtests.benchmark.agent_wire`).

For every router in turn it starts a fresh simulated cluster (so caches start cold and
equal), the router in front of it, and plays the same workload (`loadtests.benchmark.workload`)
through it with the streaming client (`loadtests.benchmark.harness`). It writes `DIR/results.json`,
`DIR/results.md`, `DIR/requests.jsonl` (one line per request), `DIR/ttft_cdf.png`,
`DIR/ttft_by_turn.png` and the routers' logs under `DIR/logs/`. The last line printed on
stdout is a one-line JSON summary.

Nodes. `--nodes M` splits the simulated workers in order over M nodes, each with its own
LMCache pool (and, with `--disk-capacity-tokens` / `--remote-capacity-tokens`, a disk tier
per node and a remote tier every node reads). kvroute entries are told the topology
(`--node` flags); `NAME+onepool` runs kvroute as if the fleet had one pool every worker
reaches (no `--node` flags: the model a one-node router has); peers see workers only.
results.json reports, per router, the workers' hits split by the tier that served them,
and for kvroute its predicted cached and copied tokens against those.

The shared pool. The incident's fleet was vLLM behind a random load balancer, with no
LMCache; the fix was cache-aware routing plus a shared LMCache CPU pool. So a router entry
says whether its cluster has the pool: cache-blind policies (`random`, `round_robin`,
`least_loaded`) run without it by default (the incident's baseline), cache-aware ones and
the peers with it. Append `+pool` or `-nopool` to change that for one entry, e.g.
`random+pool` (a stronger baseline: LMCache alone) or `cache_aware-nopool` (routing alone).

Disaggregated fleets. `--roles` (sim-cluster's syntax: `prefill:2,decode:6`, or one role per
worker) gives the simulated workers their roles and kvroute entries the matching `--role`
flags; `vllm-router/pd` runs vLLM's router in its prefill/decode mode on the same fleet.
An entry named `NAME+agg` runs on the same workers all `both` (an aggregated fleet, kvroute
without `--role`), so one results file compares the two; `--roles both:8` is the
aggregated fleet for a whole run. Every entry of a `--roles` run also reports the
inter-token latency's p99 from the client's streamed token events, the simulated workers'
decode tokens/s and how many requests were split (results.md: "Disaggregated fleet").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtests.benchmark import cost_learning, envoy, harness, traces
from loadtests.benchmark.agent_wire import SCENARIO_API_PATHS
from loadtests.benchmark.harness import (
    HttpProbes,
    ProcessMonitor,
    QueueSampler,
    RunOutcome,
    bottleneck_verdict,
    counters_delta,
    metric_sum,
    moved_share,
    parse_prometheus,
    percentile,
    scrape_workers,
    sim_clock_ratio,
    worker_hit_ratio,
)
from loadtests.benchmark.peers import (
    PD_POLICY,
    PEERS,
    PeerRouter,
    parse_peer,
    pd_worker_args,
    result_key,
)
from loadtests.benchmark.plots import capacity_curve, plot_or_log, ttft_by_turn, ttft_cdf
from loadtests.benchmark.workload import SCENARIOS, Rates, Workload, build_workload, derive_rates
from loadtests.sim.cluster import node_flags, parse_roles, role_flags, topology
from loadtests.sim.costs import DEFAULT_PROFILE, PROFILES, build_cost_model
from loadtests.sim.pool import DEFAULT_CAPACITY_TOKENS as POOL_CAPACITY_TOKENS
from loadtests.support.extras import require_bench_extra
from loadtests.support.processes import stop_children_on_signals
from loadtests.support.routerproc import RouterProcess
from router.policies import POLICIES
from router.policies.cache_aware import TERMS, check_ablate

DEFAULT_POLICIES = "random,round_robin,least_loaded,cache_aware"
CACHE_BLIND = frozenset({"random", "round_robin", "least_loaded"})
"""Policies a plain load balancer offers; they run without the pool unless told `+pool`."""

HARNESS_TOKENS_PER_WALL_S = 3000.0
"""Streamed tokens per wall second this 2-core machine sustains while also running the
simulator and the router with room to spare (measured in `hot-prefix` with cache_aware at
2,000 tokens/s: client 0.15 cores, simulator 0.38, kvroute 0.21; so ~1.1 of the 2 cores at
3,000). `--time-scale auto` slows simulated time until the workload's offered output stays
under it; the bottleneck flag checks the outcome."""
HARNESS_BODY_BYTES_PER_WALL_S = 20e6
"""Request bytes per wall second this machine moves with room to spare. Screenshot
conversations send megabytes a request, and each megabyte costs CPU whatever its tokens:
`screenshots` on 2 workers at `--time-scale 0.2` sent 65–90 MB/s and took about 2.4–3.4 ms
of the client's CPU, 4.3–4.9 ms of kvroute's and 4.7–5.1 ms of the simulator's per MB (all
their work over the bytes sent), kept the machine 90–95% busy and flagged both runs. At
20 MB/s that is about a quarter core in each.
`--time-scale auto` slows simulated time until the offered bytes stay under it too."""
MIN_AUTO_TIME_SCALE = 0.5
MAX_AUTO_TIME_SCALE = 8.0
MAX_PROBE_TIME_SCALE = 16.0
"""A capacity probe the bottleneck flag marks is repeated at twice its time scale, up to this."""
PROBE_WARMUP_S = 20.0
MAX_PROBE_WARMUP_S = 80.0
UNSETTLED_HALVES_RATIO = 2.0
"""A probe over the SLO whose window's first half had a mean TTFT more than this many times
its second half's was still draining its cold start into the window, not overloaded (an
overloaded fleet's queues grow: its second half is the worse). Runs start with empty caches
and sessions joining mid-conversation, so the first minutes prefill every joining history
once; the more sessions a rate keeps active, the longer that takes. Such a probe is
repeated with twice the warm-up, up to `MAX_PROBE_WARMUP_S`."""


@dataclass(frozen=True)
class Entry:
    key: str
    """Name in results.json: the policy or peer, with `+pool` / `-nopool` if not the default."""
    kind: str
    """'kvroute' or 'peer'."""
    policy: str
    peer: str | None
    pool: bool
    cost: str | None = None
    """kvroute's cost model: None (as configured for the profile), or a variant of
    `loadtests.benchmark.cost_learning.COST_VARIANTS` (`cache_aware@learned`)."""
    prefill_queue: int = 0
    """kvroute with the prefill queue: `--prefill-queue-tokens` set to this (0: off);
    `cache_aware+queue` sets the simulated engines' step budget, `cache_aware+queueN` N."""
    one_pool: bool = False
    """kvroute told nothing of the nodes (`NAME+onepool`): it takes every pool for one that
    every worker reaches, as a router without topology does."""
    via: str = "proxy"
    """How kvroute receives the requests (`--via`): `proxy` (kvroute serve), or `envoy`
    (Envoy asking `kvroute epp`, loadtests/benchmark/envoy.py)."""
    aggregated: bool = False
    """`NAME+agg` in a `--roles` run: the same workers all `both`, the router told no roles."""
    pd_args: tuple[str, ...] = ()
    """The P/D decision's settings of a `--roles` run's entry (`PD_SUFFIXES`)."""
    ablate: tuple[str, ...] = ()
    """cache_aware's terms switched off (`NAME~TERM`; kvroute's `--policy-ablate`)."""


def _split_pool_suffix(item: str) -> tuple[str, bool | None]:
    if item.endswith("+pool"):
        return item[: -len("+pool")], True
    if item.endswith("-nopool"):
        return item[: -len("-nopool")], False
    return item, None


ONE_POOL_SUFFIX = "+onepool"
AGG_SUFFIX = "+agg"


def _split_agg_suffix(item: str) -> tuple[str, bool]:
    """`NAME+agg` (always the last suffix) → (NAME, True)."""
    if item.endswith(AGG_SUFFIX):
        return item[: -len(AGG_SUFFIX)], True
    return item, False


PD_SUFFIXES = {"+itl": "--pd-itl-budget-ms", "+stall": "--pd-stall-weight"}
"""`NAME+itlN`, `NAME+stallN`: kvroute deciding P/D splits with that setting."""
ALWAYS_SUFFIX = "+always"
"""`NAME+always`: kvroute splitting every request (`--pd-split always`: the least a decode
worker can be stalled by prefills)."""


def _split_pd_suffixes(item: str) -> tuple[str, tuple[str, ...]]:
    """`NAME` with its trailing P/D decision suffixes taken off → (NAME, their router flags)."""
    args: list[str] = []
    while True:
        if item.endswith(ALWAYS_SUFFIX):
            item, args = item.removesuffix(ALWAYS_SUFFIX), ["--pd-split", "always", *args]
            continue
        for suffix, flag in PD_SUFFIXES.items():
            base, sep, value = item.rpartition(suffix)
            if sep and value.replace(".", "", 1).isdigit():
                item, args = base, [flag, value, *args]
                break
        else:
            return item, tuple(args)


def _split_queue_suffix(item: str) -> tuple[str, int]:
    """`NAME+queue` (the engines' step budget) or `NAME+queueN` (N tokens) → (NAME, tokens)."""
    base, sep, tokens = item.rpartition("+queue")
    if not sep or (tokens and not tokens.isdigit()):
        return item, 0
    return base, int(tokens) if tokens else traces.ENGINE_TOKEN_BUDGET


ABLATE_MARK = "~"
ABLATED_POLICY = "cache_aware"


def _split_ablate(name: str) -> tuple[str, tuple[str, ...]]:
    """`cache_aware~lag~delay` → ("cache_aware", ("delay", "lag"))."""
    policy, *terms = name.split(ABLATE_MARK)
    if not terms:
        return policy, ()
    if policy != ABLATED_POLICY:
        raise ValueError(f"{name}: only {ABLATED_POLICY} has terms to switch off")
    return policy, tuple(sorted(check_ablate(terms)))


def with_ablations(policies: str, ablate: str) -> str:
    """`policies` with, after each cache_aware entry that switches nothing off, one entry per
    term of `ablate` (comma-separated, or `all`: every term) with that term switched off."""
    if not ablate:
        return policies
    terms = TERMS if ablate.strip() == "all" else tuple(t.strip() for t in ablate.split(",") if t.strip())
    check_ablate(terms)
    out: list[str] = []
    for item in (p.strip() for p in policies.split(",") if p.strip()):
        out.append(item)
        rest = item.removeprefix(ABLATED_POLICY)
        if item.startswith(ABLATED_POLICY) and (not rest or rest[0] in "@+-"):  # its suffixes, or none
            out += [f"{ABLATED_POLICY}{ABLATE_MARK}{term}{rest}" for term in terms]
    return ",".join(out)


def parse_entries(policies: str, peers: str) -> list[Entry]:
    entries: list[Entry] = []
    for item in (p.strip() for p in policies.split(",") if p.strip()):
        raw, agg = _split_agg_suffix(item)
        pd_key = raw
        raw, pd_args = _split_pd_suffixes(raw)
        pd_key = pd_key[len(raw):]
        named, pool = _split_pool_suffix(raw)
        one_pool = named.endswith(ONE_POOL_SUFFIX)
        base, queue = _split_queue_suffix(named.removesuffix(ONE_POOL_SUFFIX))
        name, variant = cost_learning.split_variant(base)
        name, ablate = _split_ablate(name)
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
        default = name not in CACHE_BLIND
        pool = default if pool is None else pool
        key = (named if pool == default else raw) + pd_key + (AGG_SUFFIX if agg else "")
        entries.append(
            Entry(key, "kvroute", name, None, pool, variant, queue, one_pool, aggregated=agg, pd_args=pd_args,
                  ablate=ablate)
        )  # fmt: skip
    for item in (p.strip() for p in peers.split(",") if p.strip()):
        raw, agg = _split_agg_suffix(item)
        name, pool = _split_pool_suffix(raw)
        for peer, policy in parse_peer(name):
            key = result_key(peer, policy)
            use_pool = True if pool is None else pool
            key = (key if use_pool else f"{key}-nopool") + (AGG_SUFFIX if agg else "")
            entries.append(Entry(key, "peer", policy, peer, use_pool, aggregated=agg))
    keys = [e.key for e in entries]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a router is listed twice: {keys}")
    return entries


def auto_time_scale(output_tokens_per_s: float, request_bytes_per_s: float = 0.0) -> float:
    scale = max(output_tokens_per_s / HARNESS_TOKENS_PER_WALL_S, request_bytes_per_s / HARNESS_BODY_BYTES_PER_WALL_S)
    return round(min(max(scale, MIN_AUTO_TIME_SCALE), MAX_AUTO_TIME_SCALE), 2)


# -- progress -------------------------------------------------------------------------------


class ProgressBar:
    """One self-rewriting line on stderr, only on a terminal."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.prefix = ""

    def set(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, info: dict[str, Any]) -> None:
        if not self.enabled:
            return
        frac = min(max(info["sim_s"] / max(info["end_s"], 1e-9), 0.0), 1.0)
        bar = "#" * int(frac * 24) + "-" * (24 - int(frac * 24))
        p50 = info.get("ttft_p50_s")
        p50s = f"{p50:.2f}s" if p50 is not None else "  -  "
        line = (
            f"{self.prefix} [{bar}] {frac:4.0%} sim {info['sim_s']:5.0f}/{info['end_s']:.0f}s"
            f" req {info['requests']:5d} ttft p50 {p50s}"
        )
        sys.stderr.write("\r" + line[:150].ljust(150))
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 150 + "\r")
            sys.stderr.flush()


# -- one run ----------------------------------------------------------------------------------


@dataclass
class RunSetup:
    workers: int
    profile: str
    time_scale: float
    kv_capacity_tokens: int
    pool_capacity_tokens: int
    logs: Path
    api: str = "chat"
    """How a scenario's requests are sent (loadtests.benchmark.agent_wire.WIRE)."""
    seed: int | None = None
    """The run's seed; kvroute's `random` gets it as `--random-seed`, so runs with one seed
    (through different APIs, say) place each request alike: common random numbers."""
    speeds: list[float] | None = None
    """Each simulated worker's speed (None: all at the profile's)."""
    speed_changes: tuple[cost_learning.SpeedChange, ...] = ()
    nodes: int = 1
    """Nodes the workers are split over in order, each with its own pool."""
    disk_capacity_tokens: int = 0
    """Each node's disk tier (0: none)."""
    remote_capacity_tokens: int = 0
    """The remote tier every node reads (0: none)."""
    remote_gbps: float | None = None
    """The remote tier's bandwidth (None: the simulator's and the router's default)."""
    image_rule: str | None = None
    """The scenario's image rule (`ScenarioSpec.image_rule`), or None for none."""
    roles: list[str] | None = None
    """`--roles`: each worker's role, in worker order (None: no roles, the bench as before)."""
    kv_link_gbps: float | None = None
    """The P→D KV link (None: the simulator's and kvroute's default)."""

    def entry_roles(self, entry: Entry) -> dict[str, str] | None:
        """The roles the entry's fleet runs with: None without `--roles`, all `both` for
        `NAME+agg`."""
        if self.roles is None:
            return None
        return {f"w{i}": "both" if entry.aggregated else role for i, role in enumerate(self.roles)}

    def link_args(self) -> list[str]:
        return ["--pd-link-gbps", str(self.kv_link_gbps)] if self.kv_link_gbps is not None else []

    def image_args(self) -> list[str]:
        """`--image-rule`, the same for the simulator and kvroute: the router predicts an
        image's tokens as the workers count them."""
        return ["--image-rule", self.image_rule] if self.image_rule else []

    def tier_args(self, pool: bool) -> list[str]:
        """The slower tiers' flags, the same for the simulator and kvroute."""
        if not pool:
            return []
        args = []
        if self.disk_capacity_tokens:
            args += ["--disk-capacity-tokens", str(self.disk_capacity_tokens)]
        if self.remote_capacity_tokens:
            args += ["--remote-capacity-tokens", str(self.remote_capacity_tokens)]
            if self.remote_gbps is not None:
                args += ["--remote-gbps", str(self.remote_gbps)]
        return args


def _kvroute_args(setup: RunSetup, entry: Entry) -> list[str]:
    args = [
        "--kv-capacity-tokens", str(setup.kv_capacity_tokens),
        "--pool-capacity-tokens", str(setup.pool_capacity_tokens if entry.pool else 0),
        "--log-level", "warning",
    ]  # fmt: skip
    if entry.policy == "random" and entry.kind != "peer" and setup.seed is not None:
        args += ["--random-seed", str(setup.seed)]
    if setup.nodes > 1 and not entry.one_pool:
        args += node_flags(topology(setup.workers, setup.nodes))
    args += setup.tier_args(entry.pool)
    args += setup.image_args()
    roles = setup.entry_roles(entry)
    if roles is not None:
        args += role_flags(roles) + setup.link_args()
        args += [] if entry.aggregated else list(entry.pd_args)
    if entry.prefill_queue:
        args += ["--prefill-queue-tokens", str(entry.prefill_queue)]
    if entry.ablate:
        args += ["--policy-ablate", ",".join(entry.ablate)]
    if entry.cost is not None:
        return args + cost_learning.cost_args(entry.cost, build_cost_model(setup.profile), setup.time_scale)
    if setup.profile != DEFAULT_PROFILE:
        # kvroute's cost defaults describe the 8B model; for another profile configure it
        # the way an operator would: a line through the simulated marginal prefill cost.
        cost = build_cost_model(setup.profile)
        c0, c32 = cost.marginal_prefill_s(0), cost.marginal_prefill_s(32_768)
        args += [
            "--cost-prefill-base-us", f"{c0 * 1e6:.3f}",
            "--cost-prefill-ctx-ns", f"{(c32 - c0) / 32_768 * 1e9:.4f}",
            "--cost-pool-load-us", f"{cost.pool_load_s(1) * 1e6:.4f}",
        ]  # fmt: skip
    return args


async def run_entry(
    entry: Entry, workload: Workload | traces.Trace, setup: RunSetup, progress: ProgressBar | None = None
) -> tuple[dict[str, Any], RunOutcome]:
    from loadtests.sim.cluster import SimCluster

    tiers = setup.tier_args(entry.pool)
    roles = setup.entry_roles(entry)
    cluster = SimCluster(
        workers=setup.workers,
        time_scale=setup.time_scale,
        profile=setup.profile,
        kv_capacity_tokens=setup.kv_capacity_tokens,
        pool=entry.pool,
        pool_capacity_tokens=setup.pool_capacity_tokens if entry.pool else None,
        # An HTTP round trip per request from the simulator to itself costs its loop a
        # seventh of its CPU in `seed` and simulates nothing.
        pool_in_process=True,
        # The workload replays scripted replies and sizes each turn's output with max_tokens:
        # a simulated tool call on "auto" would cut generations short of the trace's lengths.
        extra_args=["--auto-tool-calls", "text", *tiers, *setup.image_args()],
        speeds=setup.speeds,
        nodes=setup.nodes,
        roles=list(roles.values()) if roles else None,
        kv_link_gbps=setup.kv_link_gbps,
    )
    await asyncio.to_thread(cluster.start)
    router: RouterProcess | PeerRouter | envoy.EnvoyPicker
    try:
        log = str(setup.logs / f"{entry.key.replace('/', '_')}.log")
        if entry.kind == "kvroute" and entry.via == "envoy":
            router = envoy.EnvoyPicker(cluster.worker_urls, entry.policy, _kvroute_args(setup, entry), log_path=log)
        elif entry.kind == "kvroute":
            router = RouterProcess(cluster.worker_urls, entry.policy, _kvroute_args(setup, entry), log_path=log)
        else:
            assert entry.peer is not None
            urls = list(cluster.worker_urls.values())
            router = PeerRouter(entry.peer, entry.policy, urls, log_path=log, roles=list(roles.values()) if roles else None)
        await asyncio.to_thread(router.start)
        try:
            return await _measure(entry, workload, setup, cluster, router, progress)
        finally:
            await asyncio.to_thread(router.stop)
    finally:
        await asyncio.to_thread(cluster.stop)


async def _router_metrics(router: RouterProcess | PeerRouter | envoy.EnvoyPicker) -> str:
    try:
        return await asyncio.to_thread(router.metrics)
    except httpx.HTTPError:
        return ""


async def _measure(
    entry: Entry,
    workload: Workload | traces.Trace,
    setup: RunSetup,
    cluster: Any,
    router: RouterProcess | PeerRouter | envoy.EnvoyPicker,
    progress: ProgressBar | None,
) -> tuple[dict[str, Any], RunOutcome]:
    assert cluster.proc is not None and router.proc is not None
    pids = {"simulator": cluster.proc.pid, "router": router.proc.pid, "client": os.getpid()}
    if isinstance(router, envoy.EnvoyPicker) and router.envoy.proc is not None:
        pids["envoy"] = router.envoy.proc.pid
    admin_url = router.admin_url if isinstance(router, envoy.EnvoyPicker) else router.url
    loop_processes = ["simulator", "client"] + (["router"] if entry.kind == "kvroute" else [])
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        before = await scrape_workers(client, cluster.worker_urls)
        t_before = time.monotonic()
        router_before = parse_prometheus(await _router_metrics(router))
        monitor = ProcessMonitor(pids)
        probes = HttpProbes(
            {
                "simulator": next(iter(cluster.worker_urls.values())) + "/health",
                "router": admin_url + ("/health" if entry.kind == "kvroute" else "/liveness"),
            }
        )
        queues = QueueSampler(client, cluster.worker_urls)
        costs = cost_learning.CostSampler(client, admin_url, setup.time_scale) if entry.kind == "kvroute" else None
        monitor.start()
        probes.start()
        queues.start()
        if costs is not None:
            costs.start()
        speed_task = (
            asyncio.create_task(cost_learning.apply_speed_changes(setup.speed_changes, cluster.worker_urls, setup.time_scale))
            if setup.speed_changes else None
        )  # fmt: skip
        try:
            if isinstance(workload, traces.Trace):
                outcome = await traces.drive_trace(
                    workload, router.url, setup.time_scale, progress=progress, record_gaps=setup.roles is not None
                )
            else:
                outcome = await harness.drive(
                    workload, router.url, setup.time_scale, progress=progress, api=setup.api,
                    record_gaps=setup.roles is not None,
                )  # fmt: skip
        finally:
            await queues.stop()
            if costs is not None:
                await costs.stop()
            if speed_task is not None:
                speed_task.cancel()
            await asyncio.to_thread(probes.stop)
            monitor.stop()
        t_after = time.monotonic()
        after = await scrape_workers(client, cluster.worker_urls)
        router_after = parse_prometheus(await _router_metrics(router))
    delta = counters_delta(before, after)
    steps = delta.get("steps", 0.0)
    mean_step = delta.get("sim:busy_seconds_total", 0.0) / steps if steps and not math.isnan(steps) else None
    probe_readings = probes.summary()
    cpu = monitor.summary()
    verdict = bottleneck_verdict(
        time_scale=setup.time_scale,
        mean_step_s=mean_step,
        client_lag=outcome.client_lag,
        probes=probe_readings,
        cpu=cpu,
        event_loop_processes=loop_processes,
        sim_clock=sim_clock_ratio(before, after, t_after - t_before, setup.time_scale),
    )
    summary = summarize(entry, outcome, delta, router_before, router_after)
    roles = setup.entry_roles(entry)
    if roles is not None:
        summary.update(disagg_summary(outcome, delta, before, after, roles))
    summary["queues"] = queues.summary()
    measured_from_s = getattr(workload, "warmup_s", 0.0)
    summary["kv_held_share"] = queues.kv_held_share(
        measured_from_s * setup.time_scale, (measured_from_s + outcome.window_s) * setup.time_scale
    )
    if costs is not None and costs.samples:
        summary["cost_learning"] = cost_learning.learning_summary(
            costs.samples, build_cost_model(setup.profile), setup.time_scale, setup.speeds, setup.speed_changes,
            measured_from_s=measured_from_s,
        )
        summary["cost_samples"] = costs.samples
    if not isinstance(workload, traces.Trace):
        floor = cost_learning.ideal_floor(workload, outcome.records, build_cost_model(setup.profile))
        summary["ideal_floor_mean_s"] = floor["mean_s"]
        summary["ideal_floor_p99_s"] = floor["p99_s"]
        summary["ttft_mean_over_ideal_floor"] = _ratio(summary["ttft_mean_s"], floor["mean_s"])
        summary["ttft_p99_over_ideal_floor"] = _ratio(summary["ttft_p99_s"], floor["p99_s"])
    summary["harness"] = {
        "time_scale": setup.time_scale,
        "mean_step_s": mean_step,
        "client_loop_lag": outcome.client_lag,
        "probes": probe_readings,
        "cpu": cpu,
        "bottleneck": verdict,
    }
    return summary, outcome


def decode_rates(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """Each simulated worker's generated tokens per simulated second between two scrapes."""
    rates: dict[str, float | None] = {}
    for name, values in after.items():
        base = before.get(name, {})
        sim_s = values.get("sim:simulated_seconds", 0.0) - base.get("sim:simulated_seconds", 0.0)
        tokens = values.get("vllm:generation_tokens_total", 0.0) - base.get("vllm:generation_tokens_total", 0.0)
        rates[name] = tokens / sim_s if sim_s > 0 else None
    return rates


def disagg_summary(
    outcome: RunOutcome,
    delta: dict[str, float],
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    roles: dict[str, str],
) -> dict[str, Any]:
    """A `--roles` run's decode side: the inter-token latency's percentiles from the client's
    token events; the workers' own mean ITL, decode tokens/s and prefill/decode splits (from
    the simulator's counters over the whole run, warm-up included)."""
    gaps = outcome.itl_gaps_s
    rates = decode_rates(before, after)
    decoders = [rates.get(w) for w, role in roles.items() if role != "prefill"]
    itl_n = delta.get("vllm:inter_token_latency_seconds_count", 0.0)
    pulls = delta.get("kvroute_sim:nixl_pulls_total", 0.0)
    answered = sum(1 for r in outcome.records if r.ttft_s is not None and r.error is None and not r.censored)
    return {
        "roles": roles,
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "itl_gaps": len(gaps),
        "itl_source": "client: gaps between the streamed token events of the measured requests",
        "worker_itl_mean_s": delta.get("vllm:inter_token_latency_seconds_sum", 0.0) / itl_n if itl_n else None,
        "decode_tok_per_s": sum(r for r in decoders if r is not None),
        "decode_tok_per_s_by_worker": rates,
        "pd": {
            "pulls": pulls,
            "pulled_tokens": delta.get("kvroute_sim:nixl_pulled_tokens_total", 0.0),
            "split_share": pulls / answered if answered else None,
            "decode_local_prefills": delta.get("kvroute_sim:pd_local_prefills_total", 0.0),
        },
    }


COPIED = "kvroute_predicted_copied_tokens_total"


def tier_split(delta: dict[str, float], cached_pred: float | None, copied_pred: dict[str, float]) -> dict[str, Any]:
    """The workers' reused prompt tokens by the tier that served them (GPU, their node's pool
    or disk, the remote tier) and as shares of the prompt tokens; for kvroute, the cached
    and copied tokens it predicted beside them."""
    queries = delta.get("vllm:prefix_cache_queries_total", 0.0)
    served = {tier: delta.get(f"cached:{tier}", 0.0) for tier in harness.TIERS}
    out: dict[str, Any] = {
        "worker_cached_tokens_by_tier": served,
        "worker_hit_ratio_by_tier": {t: v / queries for t, v in served.items()} if queries else None,
    }
    if cached_pred is not None:
        reported = sum(served.values())
        out["predicted_cached_tokens"] = cached_pred
        out["predicted_copied_tokens_by_tier"] = copied_pred
        out["predicted_over_reported_cached"] = cached_pred / reported if reported else None
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(
    entry: Entry,
    outcome: RunOutcome,
    delta: dict[str, float],
    router_before: dict[str, list[tuple[dict[str, str], float]]],
    router_after: dict[str, list[tuple[dict[str, str], float]]],
) -> dict[str, Any]:
    measured = [r for r in outcome.records if r.measured]
    ok = [r for r in measured if r.error is None or r.censored]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    decoding = [r for r in ok if r.decode_s is not None and r.completion_tokens >= 2 and r.error is None]
    decode_time = sum(r.decode_s or 0.0 for r in decoding)
    intervals = sum(r.completion_tokens - 1 for r in decoding)
    itl = decode_time / intervals if intervals else None
    by_turn: dict[int, list[float]] = defaultdict(list)
    for r in ok:
        if r.ttft_s is not None:
            by_turn[r.turn].append(r.ttft_s)
    # Drift check: the window's second half against its first (an overloaded fleet's
    # queues keep growing, so its second half is slower).
    middle = min((r.sent_s for r in ok), default=0.0) + outcome.window_s / 2
    first_half = [r.ttft_s for r in ok if r.ttft_s is not None and r.sent_s < middle]
    second_half = [r.ttft_s for r in ok if r.ttft_s is not None and r.sent_s >= middle]
    prompt = cached_pred = held = None
    copied_pred: dict[str, float] = {}
    reasons: dict[str, float] = {}
    if entry.kind == "kvroute":

        def router_delta(name: str) -> float:
            return metric_sum(router_after, name) - metric_sum(router_before, name)

        held = router_delta("kvroute_prefill_queue_held_total")
        prompt = router_delta("kvroute_prompt_tokens_total")
        cached_pred = router_delta("kvroute_predicted_cached_tokens_total")
        copied_pred = {
            tier: metric_sum(router_after, COPIED, tier=tier) - metric_sum(router_before, COPIED, tier=tier)
            for tier in harness.COPY_TIERS
        }
        for labels, value in router_after.get("kvroute_requests_total", []):
            reasons[labels.get("reason", "?")] = reasons.get(labels.get("reason", "?"), 0.0) + value
        for labels, value in router_before.get("kvroute_requests_total", []):
            reasons[labels.get("reason", "?")] = reasons.get(labels.get("reason", "?"), 0.0) - value
    worker_ttft_n = delta.get("vllm:time_to_first_token_seconds_count", 0.0)
    worker_ttft_mean = delta.get("vllm:time_to_first_token_seconds_sum", 0.0) / worker_ttft_n if worker_ttft_n else None
    all_tokens = sum(r.completion_tokens for r in outcome.records)
    all_ttfts = [r.ttft_s for r in outcome.records if r.ttft_s is not None and not r.censored]
    per_worker: dict[str, int] = defaultdict(int)
    for r in measured:
        if r.worker:
            per_worker[r.worker] += 1
    return {
        "kind": entry.kind,
        "policy": entry.policy,
        "peer": entry.peer,
        "pool": entry.pool,
        **({"ablate": list(entry.ablate)} if entry.ablate else {}),
        "requests_measured": len(measured),
        "requests_failed": sum(1 for r in measured if r.error is not None and not r.censored),
        "ttft_censored": sum(1 for r in measured if r.censored),
        "ttft_mean_s": _mean(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_max_s": max(ttfts, default=None),
        "itl_mean_s": itl,
        "output_tok_per_s": 1.0 / itl if itl else None,
        "aggregate_output_tok_per_s": all_tokens / outcome.sim_s if outcome.sim_s else None,
        "sessions_completed": outcome.sessions_completed,
        "sessions_failed": outcome.sessions_failed,
        "sessions_started": outcome.sessions_started,
        "predicted_hit_ratio": (cached_pred / prompt) if prompt else None,
        "worker_hit_ratio": worker_hit_ratio(delta),
        **tier_split(delta, cached_pred, copied_pred),
        "worker_gpu_hit_ratio": (
            delta.get("vllm:prefix_cache_hits_total", 0.0) / delta["vllm:prefix_cache_queries_total"]
            if delta.get("vllm:prefix_cache_queries_total")
            else None
        ),
        "worker_ttft_mean_s": worker_ttft_mean,
        # Same population on both sides: every request of the run (the workers' histogram
        # cannot tell measured requests from warm-up ones).
        "client_minus_worker_ttft_mean_s": (
            _mean(all_ttfts) - worker_ttft_mean if all_ttfts and worker_ttft_mean is not None else None
        ),
        "ttft_mean_first_half_s": _mean(first_half),
        "ttft_mean_second_half_s": _mean(second_half),
        "computed_prompt_tokens": delta.get("sim:computed_prompt_tokens_total"),
        "preemptions": delta.get("vllm:num_preemptions_total"),
        "route_reasons": {k: v for k, v in sorted(reasons.items()) if v},
        "prefill_queue_held": held,
        "requests_per_worker": dict(sorted(per_worker.items())),
        "moved_share": moved_share(outcome.records),
        "ttft_by_turn": {
            str(t): {"n": len(v), "mean_s": _mean(v), "p99_s": percentile(v, 99)} for t, v in sorted(by_turn.items())
        },
        "run": outcome.to_dict(),
    }


# -- capacity search ----------------------------------------------------------------------------


async def find_capacity(
    entry: Entry,
    scenario_name: str,
    seed: int,
    base_rate: float,
    slo_p99_s: float,
    setup: RunSetup,
    out_per_session: float,
    fixed_scale: float | None,
    steps: int,
    progress: ProgressBar | None,
    journal: Path | None = None,
    base_run: tuple[dict[str, Any], float, float] | None = None,
) -> dict[str, Any]:
    """Highest session arrival rate whose short run keeps TTFT p99 within the SLO.

    Doubles (or halves) from the scenario's rate until the outcome flips, then bisects
    geometrically `steps` times. Every probe is a fresh cluster and router. `base_run`, the
    entry's own run at `base_rate` (its summary, time scale and warm-up), stands for the
    first probe instead of repeating it. A probe the bottleneck flag marks (the host, not the
    simulated fleet, set its pace) is run again at twice the time scale, up to
    `MAX_PROBE_TIME_SCALE`: a flagged verdict is not the router's. A failed probe still
    draining its cold start (`UNSETTLED_HALVES_RATIO`) is run again with twice the warm-up:
    its verdict is the warm-up's, not the steady state's. Each probe's outcome is appended to `journal`
    (JSON lines) as soon as it is known: a search of several routers can take hours, and one
    stopped early keeps what it measured.
    """
    scenario = SCENARIOS[scenario_name]
    trials: list[dict[str, Any]] = []

    def record(rate: float, scale: float, warmup_s: float, summary: dict[str, Any]) -> dict[str, Any]:
        p99 = summary["ttft_p99_s"]
        meets_slo = p99 is not None and p99 <= slo_p99_s and summary["requests_failed"] == 0
        first, second = summary.get("ttft_mean_first_half_s"), summary.get("ttft_mean_second_half_s")
        trial = {
            "rate_per_s": rate,
            "time_scale": scale,
            "warmup_s": warmup_s,
            "ttft_p99_s": p99,
            "ttft_mean_s": summary["ttft_mean_s"],
            "ttft_mean_halves_s": [first, second],
            "requests_failed": summary["requests_failed"],
            "meets_slo": meets_slo,
            "unsettled": not meets_slo and bool(first and second and first > UNSETTLED_HALVES_RATIO * second),
            "bottleneck": summary["harness"]["bottleneck"]["flag"],
            "sim_clock_ratio": summary["harness"]["bottleneck"].get("sim_clock_ratio"),
            "kv_held_share": summary.get("kv_held_share"),
            "client_minus_worker_ttft_mean_s": summary["client_minus_worker_ttft_mean_s"],
        }
        trials.append(trial)
        if journal is not None:
            with journal.open("a") as fh:
                fh.write(json.dumps({"router": entry.key, **trial}) + "\n")
        return trial

    async def probe(rate: float, scale: float, warmup_s: float) -> dict[str, Any]:
        # Short probes: a third of the window (at least 20 s), a shorter warm-up and grace;
        # runs start in steady state, so this still measures a loaded fleet.
        wl = build_workload(
            scenario, seed, rate, warmup_s=warmup_s, window_s=max(scenario.window_s / 3, 20.0),
            grace_s=min(scenario.grace_s, 10.0), profile=setup.profile,
        )  # fmt: skip
        if progress is not None:
            progress.set(f"capacity {entry.key} @ {rate:.2f}/s")
        summary, _ = await run_entry(entry, wl, RunSetup(**{**setup.__dict__, "time_scale": scale}), progress)
        return record(rate, scale, warmup_s, summary)

    async def meets(rate: float) -> bool:
        if base_run is not None and rate == base_rate:
            trial = record(rate, base_run[1], base_run[2], base_run[0])
        else:
            warmup = min(scenario.warmup_s, PROBE_WARMUP_S)
            trial = await probe(rate, fixed_scale or auto_time_scale(rate * out_per_session), warmup)
        while True:
            scale, warmup = trial["time_scale"], trial["warmup_s"]
            if trial["bottleneck"] and scale * 2 <= MAX_PROBE_TIME_SCALE:
                trial = await probe(rate, scale * 2, warmup)
            elif trial["unsettled"] and warmup * 2 <= MAX_PROBE_WARMUP_S:
                trial = await probe(rate, scale, warmup * 2)
            else:
                return trial["meets_slo"]

    lo, hi = 0.0, math.inf
    rate = base_rate
    for _ in range(6):
        if await meets(rate):
            lo = rate
            rate *= 2
        else:
            hi = rate
            rate /= 2
        if lo > 0 and hi < math.inf:
            break
    if lo > 0 and hi < math.inf:
        for _ in range(steps):
            mid = math.sqrt(lo * hi)
            if await meets(mid):
                lo = mid
            else:
                hi = mid
    return {
        "capacity_sessions_per_s": lo if hi < math.inf else None,
        "bracket": [lo, hi if hi < math.inf else None],
        "slo_p99_ttft_s": slo_p99_s,
        "trials": trials,
    }


# -- outputs ------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def agg_comparison(routers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each router on the disaggregated fleet over itself on the aggregated one (`NAME+agg`):
    TTFT mean and p99, inter-token latency mean and p99 (below 1: the split fleet is faster)."""
    out: dict[str, Any] = {}
    for key, r in routers.items():
        agg = routers.get(key + AGG_SUFFIX)
        if agg is None:
            continue
        for field in ("ttft_mean_s", "ttft_p99_s", "itl_mean_s", "itl_p99_s"):
            out[f"{key}_over_agg_{field.removesuffix('_s')}"] = _ratio(r.get(field), agg.get(field))
    return out


def comparison(routers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = cost_learning.comparison(routers)
    out.update(envoy.via_comparison(routers))
    out.update(agg_comparison(routers))
    ca = routers.get("cache_aware")
    if ca is None:
        return out
    for base in ("random", "random+pool", "round_robin", "least_loaded"):
        b = routers.get(base)
        if b is None:
            continue
        out[f"{base}_over_cache_aware_ttft_mean"] = _ratio(b["ttft_mean_s"], ca["ttft_mean_s"])
        out[f"{base}_over_cache_aware_ttft_p99"] = _ratio(b["ttft_p99_s"], ca["ttft_p99_s"])
        if "capacity_sessions_per_s" in b:
            out[f"cache_aware_over_{base}_capacity"] = _ratio(ca.get("capacity_sessions_per_s"), b.get("capacity_sessions_per_s"))
    for key, r in routers.items():
        if r["kind"] == "peer":
            out[f"cache_aware_ttft_mean_le_{key}"] = (
                ca["ttft_mean_s"] is not None and r["ttft_mean_s"] is not None and ca["ttft_mean_s"] <= r["ttft_mean_s"]
            )
            out[f"cache_aware_ttft_p99_le_{key}"] = (
                ca["ttft_p99_s"] is not None and r["ttft_p99_s"] is not None and ca["ttft_p99_s"] <= r["ttft_p99_s"]
            )
    peers_p99 = [r["ttft_p99_s"] for r in routers.values() if r["kind"] == "peer" and r["ttft_p99_s"] is not None]
    if peers_p99:
        out["cache_aware_p99_over_best_peer_p99"] = _ratio(ca["ttft_p99_s"], min(peers_p99))
    peers_mean = [r["ttft_mean_s"] for r in routers.values() if r["kind"] == "peer" and r["ttft_mean_s"] is not None]
    if peers_mean:
        out["cache_aware_mean_over_best_peer_mean"] = _ratio(ca["ttft_mean_s"], min(peers_mean))
    one_pool = routers.get("cache_aware" + ONE_POOL_SUFFIX)
    if one_pool is not None:
        out["cache_aware_over_onepool_ttft_mean"] = _ratio(ca["ttft_mean_s"], one_pool["ttft_mean_s"])
        out["cache_aware_over_onepool_ttft_p99"] = _ratio(ca["ttft_p99_s"], one_pool["ttft_p99_s"])
    if ca.get("predicted_hit_ratio") is not None and ca.get("worker_hit_ratio") is not None:
        out["cache_aware_predicted_minus_worker_hit_ratio"] = ca["predicted_hit_ratio"] - ca["worker_hit_ratio"]
    return out


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def write_markdown(path: Path, results: dict[str, Any]) -> None:
    routers = results["routers"]
    trace_rows: list[str] = []
    if "trace" in results["scenario"]:
        lines, trace_rows = traces.markdown_lines(results)
    else:
        lines = [
            f"# kvroute bench: scenario `{results['scenario']['name']}`",
            "",
            f"{results['config']['workers']} simulated workers ({results['config']['profile']}), "
            f"time scale {results['config']['time_scale']}, seed {results['config']['seed']}, "
            f"arrival rate {results['scenario']['arrival_rate_per_s']:.3f} sessions/s "
            f"(load {results['scenario']['rates']['load']} × a random balancer's prefill capacity "
            f"{results['scenario']['rates']['capacity_sessions_per_s_random_lb']:.3f}/s). "
            "All times are simulated seconds.",
            "",
        ]
    lines += [
        "| router | pool | TTFT mean | p50 | p99 | ITL mean | decode tok/s | sessions done | "
        "predicted hit | worker hit | KV held | capacity/s | bottleneck |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in routers.items():
        lines.append(
            f"| {key} | {_fmt(r['pool'])} | {_fmt(r['ttft_mean_s'])} | {_fmt(r['ttft_p50_s'])} | "
            f"{_fmt(r['ttft_p99_s'])} | {_fmt(r['itl_mean_s'], 4)} | {_fmt(r['output_tok_per_s'], 1)} | "
            f"{r['sessions_completed']} | {_fmt(r['predicted_hit_ratio'])} | {_fmt(r['worker_hit_ratio'])} | "
            f"{_fmt(r.get('kv_held_share'))} | {_fmt(r.get('capacity_sessions_per_s'))} | {_fmt(r['harness']['bottleneck']['flag'])} |"
        )
    for key, f in results.get("failed", {}).items():
        lines.append(f"| {key} | {_fmt(f['pool'])} | failed: {f['error'][:120]} |" + " |" * 10)
    if trace_rows:
        lines += ["", "## Against the trace's ideal", "", *trace_rows]
    lines += disagg_lines(results)
    lines += _tier_lines(routers)
    lines += cost_learning.markdown_lines(routers, results["comparison"])
    lines += ["", "## Comparison", ""]
    lines += [f"- `{k}`: {_fmt(v)}" for k, v in results["comparison"].items()]
    lines += ["", "## Harness", ""]
    for key, r in routers.items():
        h = r["harness"]
        lag = h["client_loop_lag"].get("p99_s")
        reasons = "; ".join(h["bottleneck"]["reasons"]) or "none"
        lines.append(
            f"- {key}: mean step {_fmt(h['mean_step_s'], 4)} s, lag threshold "
            f"{_fmt(h['bottleneck']['lag_threshold_s'], 4)} s, client lag p99 {_fmt(lag, 4)} s, "
            f"probe p99 simulator {_fmt(h['probes']['simulator']['p99_s'], 4)} s / router "
            f"{_fmt(h['probes']['router']['p99_s'], 4)} s, simulator clock kept "
            f"{_fmt(h['bottleneck'].get('sim_clock_ratio'))} of real time, machine CPU mean "
            f"{_fmt(h['cpu']['system_cpu_mean_percent'], 0)}% — flag reasons: {reasons}"
        )
    if results.get("guidellm"):
        lines += ["", "## GuideLLM (independent client)", "", "```", json.dumps(results["guidellm"], indent=1)[:4000], "```"]
    lines += ["", f"Wall time: {results['wall_s']:.0f} s.", ""]
    path.write_text("\n".join(lines))


def fleet_label(roles: dict[str, str]) -> str:
    """`2P+6D`, `8 aggregated`, or with `both` workers among others `1P+2D+1B`."""
    counts = {role: sum(1 for r in roles.values() if r == role) for role in ("prefill", "decode", "both")}
    if counts["both"] == len(roles):
        return f"{len(roles)} aggregated"
    parts = [f"{counts[role]}{role[0].upper()}" for role in ("prefill", "decode", "both") if counts[role]]
    return "+".join(parts)


def disagg_lines(results: dict[str, Any]) -> list[str]:
    """The `--roles` table: per router its fleet, TTFT, inter-token latency, decode
    throughput and splits (nothing for a run without roles)."""
    routers = {k: r for k, r in results["routers"].items() if "roles" in r}
    if not routers:
        return []
    lines = [
        "", "## Disaggregated fleet", "",
        "Simulated seconds. ITL: gaps between the streamed token events the client received (the measured "
        "requests); worker ITL: the simulated workers' own mean. Decode tok/s: per stream (1 ÷ ITL mean), and "
        "the fleet's decode-capable workers' generated tokens per simulated second over the run. Split: "
        "requests whose prompt KV a decode worker pulled from a prefill worker, per answered request.", "",
        "| router | fleet | TTFT mean | TTFT p99 | ITL mean | ITL p99 | worker ITL | decode tok/s per stream | "
        "fleet decode tok/s | split | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for key, r in routers.items():
        lines.append(
            f"| {key} | {fleet_label(r['roles'])} | {_fmt(r['ttft_mean_s'])} | {_fmt(r['ttft_p99_s'])} | "
            f"{_fmt(r['itl_mean_s'], 4)} | {_fmt(r['itl_p99_s'], 4)} | {_fmt(r['worker_itl_mean_s'], 4)} | "
            f"{_fmt(r['output_tok_per_s'], 1)} | {_fmt(r['decode_tok_per_s'], 0)} | {_fmt(r['pd']['split_share'])} | "
            f"{r['requests_failed']} |"
        )
    return lines


def _tier_lines(routers: dict[str, dict[str, Any]]) -> list[str]:
    """Reuse by tier, and kvroute's prediction of it (only where some worker copied KV)."""
    if not any(r.get("worker_hit_ratio_by_tier") and sum(r["worker_cached_tokens_by_tier"].values()) for r in routers.values()):
        return []
    lines = [
        "", "## Reuse by tier", "",
        "Shares of the prompt tokens the workers reused from each tier; for kvroute, the tokens it predicted "
        "reused (its GPU's and copies) over those the workers reported.", "",
        "| router | GPU | pool | disk | remote | predicted ÷ reported cached |", "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for key, r in routers.items():
        by = r.get("worker_hit_ratio_by_tier") or {}
        lines.append(
            f"| {key} | " + " | ".join(_fmt(by.get(t)) for t in harness.TIERS)
            + f" | {_fmt(r.get('predicted_over_reported_cached'))} |"
        )
    return lines


def _plots(out: Path, results: dict[str, Any], records: dict[str, list[harness.RequestRecord]], title: str) -> list[str]:
    ttfts = {k: [r.ttft_s for r in rs if r.measured and r.ttft_s is not None] for k, rs in records.items()}
    by_turn: dict[str, dict[int, list[float]]] = {}
    for k, rs in records.items():
        turns: dict[int, list[float]] = defaultdict(list)
        for r in rs:
            if r.measured and r.ttft_s is not None:
                turns[r.turn].append(r.ttft_s)
        by_turn[k] = turns
    plots = [
        str(ttft_cdf(ttfts, out / "ttft_cdf.png", f"TTFT CDF — {title}")),
        str(ttft_by_turn(by_turn, out / "ttft_by_turn.png", f"TTFT by request index — {title}")),
    ]
    searched = {k: r["capacity"]["trials"] for k, r in results["routers"].items() if r.get("capacity", {}).get("trials")}
    if searched:
        slo = results["config"]["slo_p99_ttft_s"]
        plots.append(str(capacity_curve(searched, slo, out / "capacity.png", f"p99 TTFT against offered load — {title}")))
    return plots


# -- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="seed")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="kvroute policies, optionally NAME+pool / NAME-nopool, NAME+queue (with the prefill queue; NAME+queueN: its mark at N tokens), cache_aware~TERM (that term switched off; see --ablate)")
    p.add_argument(
        "--ablate", default="",
        help="TERM[,TERM...] or all: after each cache_aware entry, one entry per term with that term of the policy "
        f"switched off, named cache_aware~TERM (any entry may also be named so); terms: {', '.join(TERMS)}",
    )  # fmt: skip
    p.add_argument("--peers", default="", help=f"peer routers: {', '.join(PEERS)} (or vllm-router/consistent_hash)")
    p.add_argument("--find-capacity", action="store_true", help="bisect each router's capacity at the SLO")
    p.add_argument("--slo-p99-ttft", type=float, default=2.0, help="p99 TTFT SLO in simulated seconds (capacity)")
    p.add_argument("--capacity-steps", type=int, default=2, help="bisection steps after bracketing")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1, help="split the workers in order over this many nodes, a pool each")
    p.add_argument("--disk-capacity-tokens", type=int, default=0, help="a disk tier of this many tokens per node")
    p.add_argument("--remote-capacity-tokens", type=int, default=0, help="a remote tier of this many tokens")
    p.add_argument("--remote-gbps", type=float, default=None, help="the remote tier's bandwidth (default 100 Gb/s)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    p.add_argument("--time-scale", default="auto", help="wall seconds per simulated second, or 'auto'")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--load", type=float, default=None, help="override the scenario's offered load fraction")
    p.add_argument("--warmup", type=float, default=None, help="override the warm-up (simulated s)")
    p.add_argument("--window", type=float, default=None, help="override the measured window (simulated s)")
    p.add_argument("--kv-capacity-tokens", type=int, default=None, help="per-worker KV capacity (default: profile's)")
    p.add_argument("--guidellm", action="store_true", help="also run the GuideLLM recipe (random, cache_aware)")
    p.add_argument("--trace", default=None, help="replay this request trace (JSONL) instead of the scenario")
    p.add_argument("--trace-window", default=None, help="START,MINUTES of the trace to replay (default: all)")
    p.add_argument(
        "--trace-speed", default="1.0",
        help="replay the trace this many times faster, or 'auto': at the speed where a random balancer's "
        "prefill work fills the fleet (times --load, default 1)",
    )
    p.add_argument(
        "--api",
        choices=sorted({*traces.API_PATHS, *SCENARIO_API_PATHS}),
        default="chat",
        help="how requests are sent: a scenario's as chat, responses or messages; a trace's as chat or completions",
    )
    p.add_argument(
        "--speeds", default=None,
        help="each simulated worker's speed F0,F1,... (0.5: steps take twice as long); the arrival rate is derived "
        "for the fleet's total speed",
    )  # fmt: skip
    p.add_argument(
        "--speed-change", default=None,
        help="WORKER=SPEED@SIM_SECONDS[,...]: change a worker's speed during the run (POST /sim/speed)",
    )  # fmt: skip
    p.add_argument(
        "--roles", default=None,
        help="the workers' roles, as sim-cluster's --roles: prefill:2,decode:6 or one per worker; kvroute gets "
        "the matching --role flags, NAME+agg entries run on the same workers all both",
    )  # fmt: skip
    p.add_argument("--kv-link-gbps", type=float, default=None, help="with --roles: the P→D KV link (default 400 Gb/s)")
    p.add_argument("--via", default="proxy", help="how kvroute entries get requests: proxy, envoy (Envoy asking kvroute "
                   "epp) or proxy,envoy (each both ways; through Envoy as NAME+envoy)")
    p.add_argument("--out", required=True)
    return p


def _prepare_trace(args: argparse.Namespace, cost: Any, kv_capacity: int) -> tuple[traces.Trace, float, dict[str, Any]]:
    """The trace window to replay, its time scale, and its section of results.json."""
    start_min, minutes = traces.parse_window(args.trace_window)
    max_len = min(cost.profile.max_model_len, kv_capacity)  # what a simulated worker accepts
    derived: dict[str, Any] | None = None
    if args.trace_speed == "auto":
        at_1 = traces.load_trace(args.trace, start_min, minutes, 1.0, args.api, max_len)
        derived = traces.random_lb_speed(at_1, args.workers, kv_capacity, cost)
        load = 1.0 if args.load is None else args.load
        derived["load"] = load
        speed = derived["speed"] * load
    else:
        speed = float(args.trace_speed)
    trace = traces.load_trace(args.trace, start_min, minutes, speed, args.api, max_len)
    time_scale = auto_time_scale(trace.output_tokens_per_s) if args.time_scale == "auto" else float(args.time_scale)
    bounds = traces.trace_bounds(trace, cost, args.workers, kv_capacity, POOL_CAPACITY_TOKENS)
    if derived is not None:
        bounds["speed_derivation"] = derived
    name = f"trace {Path(args.trace).name}"
    return trace, time_scale, {"name": name, "description": f"{name} as {args.api}", "trace": bounds}


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    entries = envoy.with_via(parse_entries(with_ablations(args.policies, args.ablate), args.peers), envoy.parse_via(args.via))
    speeds = cost_learning.parse_speeds(args.speeds, args.workers)
    scenario = SCENARIOS[args.scenario]
    cost = build_cost_model(args.profile)
    kv_capacity = args.kv_capacity_tokens or cost.default_capacity_tokens
    rates: Rates | None = None
    workload: Workload | traces.Trace
    if args.trace:
        workload, time_scale, trace_info = _prepare_trace(args, cost, kv_capacity)
    else:
        rates = derive_rates(scenario, args.workers, args.profile, cost, load=args.load, kv_capacity_tokens=kv_capacity)
        if speeds:
            # A fleet of slower GPUs has less capacity: its load is relative to its total speed.
            rates = replace(rates, arrival_rate_per_s=rates.arrival_rate_per_s * sum(speeds) / len(speeds))
        time_scale = (
            auto_time_scale(rates.output_tokens_per_s, rates.request_bytes_per_s)
            if args.time_scale == "auto"
            else float(args.time_scale)
        )
        workload = build_workload(
            scenario, args.seed, rates.arrival_rate_per_s, warmup_s=args.warmup, window_s=args.window, cost=cost
        )
    api = "chat" if args.trace else args.api  # a trace's API is in the Trace itself
    setup = RunSetup(
        args.workers, args.profile, time_scale, kv_capacity, POOL_CAPACITY_TOKENS, out / "logs", api, args.seed,
        speeds, tuple(cost_learning.parse_speed_changes(args.speed_change)), args.nodes, args.disk_capacity_tokens,
        args.remote_capacity_tokens, args.remote_gbps, None if args.trace else scenario.image_rule,
        parse_roles(args.roles, args.workers) if args.roles else None, args.kv_link_gbps,
    )  # fmt: skip
    bar = ProgressBar(sys.stderr.isatty())
    routers: dict[str, dict[str, Any]] = {}
    failed: dict[str, dict[str, Any]] = {}
    records: dict[str, list[harness.RequestRecord]] = {}
    with (out / "requests.jsonl").open("w") as fh:
        for i, entry in enumerate(entries):
            bar.set(f"[{i + 1}/{len(entries)}] {entry.key:<22}")
            entry_started = time.monotonic()
            try:
                summary, outcome = await run_entry(entry, workload, setup, bar)
            except (RuntimeError, OSError, httpx.HTTPError) as exc:
                # One router that cannot start (a peer failing to install, say) must not
                # cost the others' measurements; its entry records why.
                failed[entry.key] = {"kind": entry.kind, "policy": entry.policy, "pool": entry.pool, "error": str(exc)[:2000]}
                continue
            summary["entry_wall_s"] = time.monotonic() - entry_started
            routers[entry.key] = summary
            records[entry.key] = outcome.records
            for r in outcome.records:
                fh.write(orjson.dumps({"router": entry.key, **r.__dict__}).decode() + "\n")
    if args.find_capacity and rates is not None:
        for entry in (e for e in entries if e.key in routers):
            try:
                found = await find_capacity(
                    entry, args.scenario, args.seed, rates.arrival_rate_per_s, args.slo_p99_ttft, setup,
                    rates.output_tokens_per_session,
                    None if args.time_scale == "auto" else time_scale, args.capacity_steps, bar,
                    journal=out / "capacity.jsonl",
                    base_run=(routers[entry.key], time_scale, workload.warmup_s),
                )  # fmt: skip
            except (RuntimeError, OSError, httpx.HTTPError) as exc:
                found = {"capacity_sessions_per_s": None, "error": str(exc)[:2000]}
            routers[entry.key]["capacity_sessions_per_s"] = found["capacity_sessions_per_s"]
            routers[entry.key]["capacity"] = found
    bar.done()
    guide: dict[str, Any] | None = None
    if args.guidellm:
        from loadtests.benchmark.guidellm_recipe import run_recipe

        guide = await asyncio.to_thread(run_recipe, out / "guidellm", args.workers, time_scale, args.profile, args.seed)
    flags = {k: r["harness"]["bottleneck"]["flag"] for k, r in routers.items()}
    if isinstance(workload, traces.Trace):
        scenario_info = trace_info
        compared = {**comparison(routers), **traces.trace_comparison(routers, trace_info["trace"])}
    else:
        assert rates is not None
        scenario_info = {
            "name": scenario.name,
            "description": scenario.description,
            "api": args.api,
            "arrival_rate_per_s": rates.arrival_rate_per_s,
            "sessions": len(workload.sessions),
            "warmup_s": workload.warmup_s,
            "window_s": workload.window_s,
            "grace_s": workload.grace_s,
            "prepopulate_s": workload.prepopulate_s,
            "spec": _spec_dict(scenario),
            "rates": rates.to_dict(),
        }
        compared = comparison(routers)
    results = {
        "scenario": scenario_info,
        "config": {
            "workers": args.workers,
            "profile": args.profile,
            "time_scale": time_scale,
            "seed": args.seed,
            "kv_capacity_tokens": kv_capacity,
            "pool_capacity_tokens": POOL_CAPACITY_TOKENS,
            "slo_p99_ttft_s": args.slo_p99_ttft if args.find_capacity else None,
            "harness_tokens_per_wall_s": HARNESS_TOKENS_PER_WALL_S,
            "speeds": speeds,
            "speed_changes": [c.__dict__ for c in setup.speed_changes],
            "nodes": args.nodes,
            "disk_capacity_tokens": args.disk_capacity_tokens,
            "remote_capacity_tokens": args.remote_capacity_tokens,
            "remote_gbps": args.remote_gbps,
            # Only with --roles: a run without them writes the keys it always wrote.
            **({"roles": setup.roles, "kv_link_gbps": args.kv_link_gbps} if setup.roles else {}),
        },
        "routers": routers,
        "failed": failed,
        "comparison": compared,
        "bottleneck": any(flags.values()),
        "bottleneck_by_router": flags,
        "guidellm": guide,
        "plots": [],
        "wall_s": time.monotonic() - started,
    }
    write_outputs(out, results, records, f"{scenario_info['name']}, {args.workers} workers")
    return results


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)  # a reader (or a kill) never sees half a file


def write_outputs(out: Path, results: dict[str, Any], records: dict[str, list[harness.RequestRecord]], title: str) -> None:
    """results.json and results.md first, then the plots: a plot that fails is logged and
    loses nothing (the run's figures are on disk before matplotlib is even imported)."""
    _write_json(out / "results.json", results)
    write_markdown(out / "results.md", results)
    plots = plot_or_log("kvroute bench", lambda: _plots(out, results, records, title))
    if plots:
        results["plots"] = plots
        _write_json(out / "results.json", results)


def _spec_dict(spec: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(spec)


def one_line_summary(results: dict[str, Any], out: str) -> str:
    # Fields a router lacks are left out: the `--roles` ones appear in `--roles` runs only.
    keep = (
        "ttft_mean_s", "ttft_p99_s", "output_tok_per_s", "worker_hit_ratio", "predicted_hit_ratio",
        "capacity_sessions_per_s", "itl_p99_s", "decode_tok_per_s",
    )  # fmt: skip
    return json.dumps(
        {
            "out": out,
            "scenario": results["scenario"]["name"],
            "wall_s": round(results["wall_s"], 1),
            "bottleneck": results["bottleneck"],
            "failed": sorted(results["failed"]),
            "routers": {
                k: {f: (round(r[f], 4) if isinstance(r.get(f), float) else r.get(f)) for f in keep if f in r}
                for k, r in results["routers"].items()
            },
            "comparison": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in results["comparison"].items()},
        },
        separators=(",", ":"),
    )


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def check_roles(args: argparse.Namespace, entries: list[Entry]) -> None:
    """`--roles` and what depends on it, checked before anything starts."""
    if args.kv_link_gbps is not None and not args.kv_link_gbps > 0:
        raise ValueError("--kv-link-gbps must be positive")
    if not args.roles:
        if any(e.aggregated for e in entries):
            raise ValueError(f"NAME{AGG_SUFFIX} runs an entry on the --roles fleet's workers all both; give --roles")
        if any(e.policy == PD_POLICY and e.kind == "peer" for e in entries):
            raise ValueError(f"a peer's /{PD_POLICY} mode needs a fleet with roles; give --roles")
        if args.kv_link_gbps is not None:
            raise ValueError("--kv-link-gbps applies to --roles")
        return
    roles = parse_roles(args.roles, args.workers)
    if "envoy" in envoy.parse_via(args.via):
        raise ValueError("--roles: kvroute epp does not split requests; use --via proxy")
    for e in entries:
        if e.kind == "peer" and e.policy == PD_POLICY:
            if e.aggregated:
                raise ValueError(f"{e.key}: a peer's /{PD_POLICY} mode needs prefill and decode workers")
            pd_worker_args([""] * len(roles), roles)


def cli(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        entries = parse_entries(with_ablations(args.policies, args.ablate), args.peers)
        envoy.parse_via(args.via)
        if args.nodes < 1 or args.workers % args.nodes:
            raise ValueError(f"--workers {args.workers} must split evenly over --nodes {args.nodes}")
        check_roles(args, entries)
    except ValueError as exc:
        print(f"kvroute bench: {exc}", file=sys.stderr)
        return 2
    if args.trace:
        try:
            traces.parse_window(args.trace_window)
            if args.trace_speed != "auto" and not _positive(args.trace_speed):
                raise ValueError(f"--trace-speed {args.trace_speed!r}: a positive number or 'auto'")
            if not Path(args.trace).is_file():
                raise ValueError(f"--trace {args.trace}: no such file")
            if args.find_capacity:
                raise ValueError("--find-capacity searches a scenario's arrival rate; use --trace-speed with --trace")
            if args.api not in traces.API_PATHS:
                raise ValueError(f"--api {args.api} applies to a scenario; a trace is sent as {' or '.join(traces.API_PATHS)}")
        except ValueError as exc:
            print(f"kvroute bench: {exc}", file=sys.stderr)
            return 2
    elif args.trace_window:
        print("kvroute bench: --trace-window applies to --trace", file=sys.stderr)
        return 2
    elif args.find_capacity and SCENARIOS[args.scenario].sequential:
        print(f"kvroute bench: --scenario {args.scenario} plays one session at a time: it has no arrival rate to search", file=sys.stderr)
        return 2
    elif args.api not in SCENARIO_API_PATHS:
        print(f"kvroute bench: --api {args.api} applies to --trace; a scenario is sent as {', '.join(SCENARIO_API_PATHS)}", file=sys.stderr)
        return 2
    elif SCENARIOS[args.scenario].screenshot_bytes and args.api != "chat":
        # loadtests.benchmark.agent_wire converts text conversations: it would drop the screenshots.
        print(f"kvroute bench: --scenario {args.scenario} is sent as chat only (its screenshots have no {args.api} form here)", file=sys.stderr)
        return 2
    if args.time_scale != "auto":
        try:
            if float(args.time_scale) <= 0:
                raise ValueError
        except ValueError:
            print("kvroute bench: --time-scale must be a positive number or 'auto'", file=sys.stderr)
            return 2
    require_bench_extra("kvroute bench")
    import uvloop

    # The client plays hundreds of concurrent sessions: uvloop's lower cost per callback keeps
    # it from becoming the run's bottleneck.
    with stop_children_on_signals():
        results = uvloop.run(_main(args))
    table = disagg_lines(results)
    if table:
        print("\n".join(table[1:]))
    print(one_line_summary(results, args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
