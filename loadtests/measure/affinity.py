"""Conversation affinity and load spread through a router, measured from response headers.

`python -m loadtests.measure.affinity` runs the two routing checks kvroute exists for (turns
follow their conversation; load spreads) against a fresh simulated cluster (3 workers, 20 conversations x 4 turns, interleaved) and prints JSON: once with a
system prompt per conversation, once with one ~6,000-character prompt shared by all.
`run_agent` plays one conversation turn after turn, alone or beside others (one
agent against the router must keep its worker).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import openai
import orjson

MODEL = "sim-llama3-8b"
SHARED_SYSTEM = ("You are a careful coding agent. Follow the repository's conventions. " * 90)[:6000]


@dataclass
class AffinityResult:
    affinity: float
    """Share of turns 2+ served by the worker that served the conversation's turn 1."""
    served: dict[str, int]
    reasons: dict[str, int]
    later_cached: list[int] = field(default_factory=list)
    """`usage.prompt_tokens_details.cached_tokens` of each turn 2+."""

    @property
    def max_over_mean(self) -> float:
        return max(self.served.values()) / (sum(self.served.values()) / len(self.served))

    @property
    def max_share(self) -> float:
        return max(self.served.values()) / sum(self.served.values())


async def run_conversations(
    urls: list[str] | str,
    system_for: Callable[[int], str],
    n_conv: int = 20,
    turns: int = 4,
    model: str = MODEL,
    pick_url: Callable[[int, int], int] | None = None,
) -> AffinityResult:
    """n_conv concurrent conversations through the openai SDK, turns in order within each.

    With several router URLs, `pick_url(conversation, turn)` says which one a turn goes to.
    """
    urls = [urls] if isinstance(urls, str) else urls
    clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="unused", max_retries=0) for u in urls]
    served: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    sticky = [0, 0]
    later_cached: list[int] = []

    async def conversation(c: int) -> None:
        messages = [{"role": "system", "content": system_for(c)}]
        first = None
        for t in range(turns):
            messages.append({"role": "user", "content": f"Conversation {c}, turn {t}: " + "please continue the task " * 20})
            client = clients[pick_url(c, t) if pick_url else 0]
            raw = await client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=16)
            worker = raw.headers["x-kvroute-worker"]
            reasons[raw.headers["x-kvroute-route-reason"]] += 1
            served[worker] += 1
            reply = raw.parse()
            if first is None:
                first = worker
            else:
                sticky[1] += 1
                sticky[0] += worker == first
                later_cached.append(cached_tokens(reply))
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})

    await asyncio.gather(*(conversation(c) for c in range(n_conv)))
    for client in clients:
        await client.close()
    return AffinityResult(sticky[0] / max(sticky[1], 1), dict(served), dict(reasons), sorted(later_cached))


@dataclass(frozen=True)
class AgentTurn:
    worker: str
    reason: str
    cached_tokens: int
    """`usage.prompt_tokens_details.cached_tokens` of the answer."""


async def run_agent(url: str, turns: int, agent: int = 0, model: str = MODEL) -> list[AgentTurn]:
    """One conversation, each turn sent after the previous answer, through the openai SDK."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": own_system(agent)}]
    out: list[AgentTurn] = []
    try:
        for t in range(turns):
            messages.append({"role": "user", "content": f"Agent {agent}, step {t}: " + "run the next check " * 25})
            raw = await client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=24)
            reply = raw.parse()
            out.append(AgentTurn(raw.headers["x-kvroute-worker"], raw.headers["x-kvroute-route-reason"], cached_tokens(reply)))
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    finally:
        await client.close()
    return out


def cached_tokens(reply: Any) -> int:
    """`usage.prompt_tokens_details.cached_tokens` of an openai SDK answer (chat or
    completions), 0 where the engine reports none."""
    details = reply.usage.prompt_tokens_details if reply.usage else None
    return (details.cached_tokens or 0) if details else 0


def own_system(c: int) -> str:
    return f"You are agent number {c}. " * 30


def shared_system(_c: int) -> str:
    return SHARED_SYSTEM


def main(argv: list[str] | None = None) -> int:
    from loadtests.sim.cluster import SimCluster
    from loadtests.support.routerproc import RouterProcess

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--workers", type=int, default=3)
    args = p.parse_args(argv)
    out = {}
    for name, system_for in (("own_system_prompts", own_system), ("shared_6000_char_system_prompt", shared_system)):
        with SimCluster(workers=args.workers, time_scale=0.02) as cluster, RouterProcess(cluster.worker_urls, policy=args.policy) as router:
            result = asyncio.run(run_conversations(router.url, system_for))
        summary = asdict(result) | {"later_cached": {"min": min(result.later_cached), "max": max(result.later_cached)}}
        out[name] = summary | {"max_over_mean": round(result.max_over_mean, 3), "max_share": round(result.max_share, 3)}
    print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
