"""Low-load stickiness (issue 13): one conversation keeps its worker however skewed the
recent counts, while its worker's queues are negligible; hot prefixes still spread."""

from __future__ import annotations

import asyncio
from collections import Counter

from cache_client.base import IndexView, key_tokens_of
from cache_client.memory import MemoryIndex
from loadtests.affinity import run_agent
from loadtests.routerproc import RouterProcess
from loadtests.sim.cluster import SimCluster
from router.chain import EstimateChainBuilder
from router.cost import CostModel
from router.load import LocalLoadBoard
from router.policies import make_policy
from router.policies.bounded import within_bounds
from router.routing import RouteRequest, WorkerLoad

COST = CostModel()
WORKERS = ("w0", "w1", "w2", "w3")
SYSTEM = "You are a careful coding agent. Follow the repository's conventions. " * 90


def _route_turns(policy_name: str, bodies: list[dict], background: dict[str, float] | None = None) -> list:
    """Route each body in turn as a router would: look up, choose, record, acquire, release.

    The board's clock stands still, so recent counts never decay: each routed request stays
    counted on its worker, the worst skew sequential traffic can build.
    """
    policy, index, chains = make_policy(policy_name), MemoryIndex(), EstimateChainBuilder()
    board = LocalLoadBoard(clock=lambda: 0.0)
    for name, count in (background or {}).items():
        for _ in range(int(count)):
            board.release(board.acquire(name, 0.0))
    decisions = []
    for body in bodies:
        chain = chains.build(body, "chat")
        view = index.lookup_sync(chain.keys)
        d = policy.choose(RouteRequest(chain), view, board.snapshot(WORKERS), COST)
        index.record_sync(d.worker, chain.keys, key_tokens_of(chain.cum_tokens))
        board.release(board.acquire(d.worker, d.prefill_s))
        decisions.append(d)
    return decisions


def _conversation(turns: int) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": "You are agent 7. " * 30}]
    bodies = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"step {t}: " + "run the next check " * 25})
        bodies.append({"model": "m", "messages": list(messages)})
        messages.append({"role": "assistant", "content": f"done with step {t}. " * 8})
    return bodies


def test_one_conversation_keeps_its_worker_however_skewed_the_recent_counts() -> None:
    decisions = _route_turns("cache_aware", _conversation(20))
    assert {d.worker for d in decisions} == {decisions[0].worker}
    assert all(d.reason == "gpu_hit" for d in decisions[1:]), [d.reason for d in decisions]


def test_a_quiet_home_is_exempt_from_the_recent_cap_only() -> None:
    skewed = [WorkerLoad("a", recent=20.0), WorkerLoad("b"), WorkerLoad("c")]
    assert [w.name for w in within_bounds(skewed)] == ["b", "c"]
    assert [w.name for w in within_bounds(skewed, homes={"a"}, quiet_prefill_s=COST.step_s)] == ["a", "b", "c"]
    # Queues that cost latency end the exemption: a step of queued prefill, a full batch
    # slack of requests in flight, or requests waiting in the engine.
    for busy in ({"queued_prefill_s": COST.step_s}, {"inflight": 4}, {"engine_waiting": 1}):
        loaded = [WorkerLoad("a", recent=20.0, **busy), WorkerLoad("b"), WorkerLoad("c")]
        assert "a" not in {w.name for w in within_bounds(loaded, homes={"a"}, quiet_prefill_s=COST.step_s)}, busy


def test_new_sessions_on_a_hot_prefix_still_spread_at_low_load() -> None:
    bodies = [
        {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"session {i}"}]}
        for i in range(12)
    ]
    served = Counter(d.worker for d in _route_turns("cache_aware", bodies))
    assert len(served) >= 3 and max(served.values()) <= 6, served


def test_session_policy_keeps_a_session_id_on_its_home_at_low_load() -> None:
    policy, board = make_policy("session"), LocalLoadBoard(clock=lambda: 0.0)
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    chain = EstimateChainBuilder().build(body, "chat")
    workers = set()
    for _ in range(20):
        d = policy.choose(RouteRequest(chain, session_key="agent-1"), IndexView(), board.snapshot(WORKERS), COST)
        board.release(board.acquire(d.worker, 0.0))
        workers.add(d.worker)
        assert d.reason == "session"
    assert len(workers) == 1


def test_agents_keep_their_workers_end_to_end() -> None:
    with SimCluster(workers=4, time_scale=0.02) as cluster, RouterProcess(cluster.worker_urls, policy="cache_aware") as router:
        alone = asyncio.run(run_agent(router.url, 20))

        async def three() -> list:
            return await asyncio.gather(*(run_agent(router.url, 20, agent=a) for a in (1, 2, 3)))

        together = asyncio.run(three())
    assert Counter(t.worker for t in alone).most_common(1)[0][1] == 20, alone
    assert not [t for t in alone if t.reason == "overload"], alone
    assert all(t.cached_tokens > 0 for t in alone[1:]), alone
    for turns in together:
        assert len({t.worker for t in turns}) == 1, turns
        assert not [t for t in turns if t.reason == "overload"], turns
        assert all(t.cached_tokens > 0 for t in turns[1:]), turns
