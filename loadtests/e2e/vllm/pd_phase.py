"""Phase `pd` of the vLLM e2e stage: a prefill/decode split on vLLM's CPU backend.

vLLM's CPU backend has no NIXL. Its example KV connector (`ExampleConnector`) runs there: a
worker writes each new prompt's KV to a directory, keyed by the prompt's tokens, and a
worker given the same prompt loads it from there. This phase starts two workers of its own
on that connector over one temporary directory, P (`kv_producer`, core 0) and D
(`kv_consumer`, core 1), and `kvroute serve --role P=prefill --role D=decode --pd-connector
shared-storage --pd-split always`, and sends a multi-turn chat through the router. Checked,
every one a count:

* every answer is a 200 from D with route reason `pd`, and the router counts one `stored`
  prefill per turn;
* P got every prompt whole (its `vllm:prompt_tokens_total` grew by the turn's prompt);
* D loaded what P wrote: its `vllm:external_prefix_cache_hits_total` grew by exactly what
  the connector loads (the prompt's whole blocks short of its last token, less D's own
  prefix-cache hits), on every turn and more than 0 on every turn but where the connector
  cannot find its own key (below).

The example connector saves a prompt of n tokens under its first (n - 1) // B * B tokens
and looks a prompt up under its first (n - 2) // B * B (B: the block size): where
n - 1 is a multiple of B the two differ and D finds nothing, so such a turn must load 0.
~40 s, most of it the two workers' start; the fleet's own workers stay up, idle.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from loadtests.e2e.vllm.run_e2e import Proc, Stack

CONNECTOR = "ExampleConnector"
"""vLLM 0.32's name for its shared-directory example connector (SharedStorageConnector before)."""
TURNS = 4
USER_WORDS = 40
"""Each turn's new user message: over a block, so D's own cache never covers the prompt."""
ANSWER_TOKENS = 8


def connector_config(role: str, directory: Path) -> str:
    return json.dumps({
        "kv_connector": CONNECTOR, "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(directory)},
    })  # fmt: skip


def start_pd_worker(stack: Stack, name: str, core: int, role: str, directory: Path) -> tuple[Proc, str]:
    """A vLLM worker on the shared-directory connector, pinned to `core`; not waited for."""
    from loadtests.e2e.vllm.run_e2e import MODEL_NAME, WORKER_BLOCKS, free_port, start, vllm_command

    port = free_port()
    flags = ["--kv-transfer-config", connector_config(role, directory)]
    cmd = vllm_command(stack.venv, stack.model, MODEL_NAME, stack.dtype, str(core), WORKER_BLOCKS, port, flags)
    env = {**stack.env(), "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1"}
    return start(name, cmd, stack.logdir, env), f"http://127.0.0.1:{port}"


def start_pd_router(stack: Stack, p_url: str, d_url: str) -> tuple[Proc, str]:
    from loadtests.e2e.vllm.run_e2e import start_kvroute

    args = [
        "--worker", f"P={p_url}", "--worker", f"D={d_url}", "--role", "P=prefill", "--role", "D=decode",
        "--pd-connector", "shared-storage", "--pd-split", "always",
        "--health-interval-s", "1", "--log-level", "warning",
    ]  # fmt: skip
    return start_kvroute("router-pd", args, stack.logdir, {**stack.env(), "PYTHONUNBUFFERED": "1"})


def expected_load(prompt_tokens: int, own_hits: float, block: int) -> int:
    """What the example connector loads into D: the prompt's whole blocks short of its last
    token, less D's own hits; nothing where its save and look-up keys differ (docstring)."""
    if (prompt_tokens - 1) % block == 0:
        return 0
    return max(0, (prompt_tokens - 2) // block * block - int(own_hits))


def chat(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], str, int]:
    """(status, the router's headers, D's answer text, prompt tokens) of one turn, whole or streamed."""
    if not body.get("stream"):
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        out = r.json() if r.status_code == 200 else {}
        text = (out.get("choices") or [{}])[0].get("message", {}).get("content") or ""
        return r.status_code, dict(r.headers), text, (out.get("usage") or {}).get("prompt_tokens", 0)
    text, prompt_tokens = "", 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            text += "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])
            prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens)
        return r.status_code, dict(r.headers), text, prompt_tokens


def prompt_tokens_total(url: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
        if line.split("{", 1)[0] == "vllm:prompt_tokens_total"
    )  # fmt: skip


def turn_row(router_url: str, p_url: str, d_url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """One turn through the router, with the engines' counters around it; and D's answer."""
    from loadtests.e2e.vllm.run_e2e import BLOCK, engine_counters

    d0, p0 = engine_counters(d_url), prompt_tokens_total(p_url)
    status, headers, text, prompt = chat(router_url, body)
    d1, p1 = engine_counters(d_url), prompt_tokens_total(p_url)
    own, loaded = d1["hits"] - d0["hits"], d1["external"] - d0["external"]
    row = {
        "stream": bool(body.get("stream")), "status": status, "worker": headers.get("x-kvroute-worker"),
        "reason": headers.get("x-kvroute-route-reason"), "prompt_tokens": prompt,
        "p_prompt_tokens": int(p1 - p0), "d_own_hits": int(own), "d_loaded": int(loaded),
        "expected_loaded": expected_load(prompt, own, BLOCK),
    }  # fmt: skip
    row["ok"] = (
        status == 200 and row["worker"] == "D" and row["reason"] == "pd" and prompt > 0
        and row["p_prompt_tokens"] == prompt and row["d_loaded"] == row["expected_loaded"]
    )  # fmt: skip
    return row, text


def run_chat(router_url: str, p_url: str, d_url: str) -> list[dict[str, Any]]:
    """The multi-turn chat, whole and streamed turns in turn, D's answers carried forward."""
    from loadtests.e2e.vllm.run_e2e import MODEL_NAME, WORDS

    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse. " + " ".join(WORDS * 3)}]
    rows = []
    for turn in range(TURNS):
        user = " ".join(WORDS[(turn * 7 + i) % len(WORDS)] for i in range(USER_WORDS))
        messages.append({"role": "user", "content": f"Turn {turn}: {user}"})
        body: dict[str, Any] = {"model": MODEL_NAME, "messages": list(messages), "max_tokens": ANSWER_TOKENS,
                                "temperature": 0, "stream": turn % 2 == 1}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        row, text = turn_row(router_url, p_url, d_url, body)
        rows.append(row)
        messages.append({"role": "assistant", "content": text or "ok"})
    return rows


def pd_verdict(rows: list[dict[str, Any]], stored: float, block: int) -> dict[str, Any]:
    """Every turn's counts right, D loading on every turn where the connector finds its key."""
    findable = [r for r in rows if r["prompt_tokens"] and (r["prompt_tokens"] - 1) % block]
    ok = (
        len(rows) == TURNS and all(r["ok"] for r in rows) and stored == TURNS
        and bool(findable) and all(r["d_loaded"] > 0 for r in findable)
    )  # fmt: skip
    return {
        "turns": rows, "router_stored_prefills": stored, "d_loaded_tokens": sum(r["d_loaded"] for r in rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows), "ok": ok,
    }  # fmt: skip


def stored_prefills(router_url: str) -> float:
    """The router's `kvroute_pd_prefills_total{outcome="stored"}`, over its prefill workers."""
    from loadtests.e2e.vllm.run_e2e import router_metrics_text

    return sum(
        float(line.rsplit(" ", 1)[1]) for line in router_metrics_text(router_url).splitlines()
        if line.startswith("kvroute_pd_prefills_total{") and 'outcome="stored"' in line
    )  # fmt: skip


def phase_pd(stack: Stack) -> dict[str, Any]:
    """P and D on the example connector over a temporary directory, a chat split through kvroute."""
    from loadtests.e2e.vllm.run_e2e import BLOCK, wait_http

    directory = Path(tempfile.mkdtemp(prefix="kvroute-pd-kv-", dir=stack.logdir))
    procs: list[Proc] = []
    try:
        (p, p_url), (d, d_url) = (start_pd_worker(stack, "pd-P", 0, "kv_producer", directory),
                                  start_pd_worker(stack, "pd-D", 1, "kv_consumer", directory))
        procs += [p, d]
        for proc, url in ((p, p_url), (d, d_url)):
            wait_http(url + "/health", proc, 300)
        router, router_url = start_pd_router(stack, p_url, d_url)
        procs.append(router)
        rows = run_chat(router_url, p_url, d_url)
        verdict = pd_verdict(rows, stored_prefills(router_url), BLOCK)
        verdict["stored_prompts"] = sum(1 for entry in directory.iterdir() if entry.is_dir())
        return verdict
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(directory, ignore_errors=True)
