"""Low-load stickiness: one conversation keeps its worker however skewed the
recent counts, while its worker's queues are negligible; hot prefixes still spread."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson
import pytest

from cache_client.base import IndexView, key_tokens_of
from cache_client.memory import MemoryIndex
from cache_client.served_ends import ServedEnds
from loadtests.measure.affinity import MODEL, AgentTurn, cached_tokens, own_system, run_agent
from loadtests.sim.cluster import SimCluster
from loadtests.support.routerproc import RouterProcess
from normalizer.prefix import PrefixChain
from normalizer.vllm_hash import BlockHasher
from router.app import build_app
from router.chain import EstimateChainBuilder
from router.config_loader import flat_config
from router.cost import CostModel
from router.load import LocalLoadBoard
from router.policies import make_policy
from router.policies.bounded import within_bounds
from router.precise.chain import chain_of_tokens
from router.routing import RouteRequest, WorkerLoad
from router.workers import WorkerSpec
from tests.support.system_redis import SYSTEM_REDIS
from tests.support.upstream import RecordingUpstream

COST = CostModel()
WORKERS = ("w0", "w1", "w2", "w3")
SYSTEM = "You are a careful coding agent. Follow the repository's conventions. " * 90


def _route_turns(
    policy_name: str,
    bodies: list,
    background: dict[str, float] | None = None,
    chain_of: Callable[[Any], PrefixChain] | None = None,
) -> list:
    """Route each body in turn as the proxy does: look up (the index, and where the prompts
    sent before ended), choose, record (on the index and the ends memory), acquire, release.

    The board's clock stands still, so recent counts never decay: each routed request stays
    counted on its worker, the worst skew sequential traffic can build. `chain_of`: how a
    body becomes its chain (default: the estimate chain of a chat body).
    """
    policy, index, ends, chains = make_policy(policy_name), MemoryIndex(), ServedEnds(), EstimateChainBuilder()
    board = LocalLoadBoard(clock=lambda: 0.0)
    for name, count in (background or {}).items():
        for _ in range(int(count)):
            board.release(board.acquire(name, 0.0))
    decisions = []
    for body in bodies:
        chain = chain_of(body) if chain_of else chains.build(body, "chat")
        view = index.lookup_sync(chain.keys)
        continues = None if chain.reply_depth else ends.lookup(chain, view)
        d = policy.choose(RouteRequest(chain, continues=continues), view, board.snapshot(WORKERS), COST)
        index.record_sync(d.worker, chain.keys, key_tokens_of(chain.cum_tokens))
        ends.record(d.worker, chain)
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


# -- requests without an assistant message: a growing prompt, one growing message, token
# chains. Their previous turn is found by where the prompts placed before ended
# (cache_client/served_ends.py).

ESTIMATE = EstimateChainBuilder()


def _growing_prompts(turns: int, agent: int = 7) -> list[str]:
    """Prompt N+1 = prompt N + its answer + the next step, as a completions agent sends."""
    text, prompts = own_system(agent), []
    for t in range(turns):
        text += f"\nUser: step {t}: " + "run the next check " * 25 + "\nAssistant:"
        prompts.append(text)
        text += f" done with step {t}." + " ok" * 20
    return prompts


def _completion(prompt: str) -> dict:
    return {"model": "m", "prompt": prompt}


def _one_message(content: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


def _completion_chain(body: dict) -> PrefixChain:
    return ESTIMATE.build(body, "completion")


FORMS = {"completions": (_completion, _completion_chain), "one_message_chat": (_one_message, None)}


@pytest.mark.parametrize("form", FORMS)
def test_a_growing_prompt_keeps_its_worker(form: str) -> None:
    make_body, chain_of = FORMS[form]
    decisions = _route_turns("cache_aware", [make_body(p) for p in _growing_prompts(20)], chain_of=chain_of)
    assert {d.worker for d in decisions} == {decisions[0].worker}, [d.worker for d in decisions]
    assert all(d.reason == "gpu_hit" for d in decisions[1:]), [d.reason for d in decisions]


def test_a_growing_token_chain_keeps_its_worker() -> None:
    """Precise chains have no message boundaries (reply_depth 0): vLLM's full-block hashes."""
    hasher, tokens, prompts = BlockHasher(16), list(range(500)), []
    for t in range(20):
        tokens += [1000 + t] * 150  # the answer and the next step
        prompts.append(list(tokens))
    decisions = _route_turns("cache_aware", prompts, chain_of=lambda p: chain_of_tokens(hasher, p))
    assert {d.worker for d in decisions} == {decisions[0].worker}, [d.worker for d in decisions]
    assert all(d.reason == "gpu_hit" for d in decisions[1:]), [d.reason for d in decisions]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("question", ["session {i}", "session {i}: " + "what does this module do? " * 20])
def test_new_sessions_sharing_a_prefix_inside_one_prompt_still_spread(form: str, question: str) -> None:
    """A hot prefix with no message boundary after it: sessions diverge inside one block
    (short questions) or after whole blocks of their own (long ones)."""
    make_body, chain_of = FORMS[form]
    bodies = [make_body(SYSTEM + question.format(i=i)) for i in range(12)]
    served = Counter(d.worker for d in _route_turns("cache_aware", bodies, chain_of=chain_of))
    assert len(served) >= 3 and max(served.values()) <= 6, served


@pytest.mark.parametrize("form", FORMS)
def test_new_sessions_after_a_request_of_the_bare_prefix_still_spread(form: str) -> None:
    """Each session extends the warm-up's prompt, as a conversation would: the second one
    to continue it shows it to be a shared prefix."""
    make_body, chain_of = FORMS[form]
    question = "session {i}: " + "what does this module do? " * 20
    bodies = [make_body(SYSTEM)] + [make_body(SYSTEM + question.format(i=i)) for i in range(12)]
    served = Counter(d.worker for d in _route_turns("cache_aware", bodies, chain_of=chain_of))
    assert len(served) >= 3 and max(served.values()) <= 6, served


def test_one_prompt_continues_an_end_and_a_second_makes_it_a_fork() -> None:
    ends, base = ServedEnds(), _chain("s" * 2048)
    one, two = _chain("s" * 2048 + "one" * 200), _chain("s" * 2048 + "two" * 200)
    view = IndexView({"w1": len(base)})
    ends.record("w1", base)
    assert ends.lookup(base, view) == "w1"  # the same prompt again continues nothing new
    assert ends.lookup(one, view) == ends.lookup(two, view) == "w1"  # lookups record nothing
    ends.record("w1", one)
    assert ends.lookup(one, view) == "w1"  # its retry
    assert ends.lookup(two, view) is None  # would be a second continuation
    ends.record("w2", two)
    assert ends.lookup(one, view) is None


def _chain(prompt: str) -> PrefixChain:
    return _completion_chain(_completion(prompt))


def test_a_remembered_end_names_its_worker_only_while_the_index_holds_it() -> None:
    ends, first, second = ServedEnds(), _chain("a" * 2000), _chain("a" * 2000 + "b" * 500)
    ends.record("w1", first)
    held = IndexView({"w1": len(first) - 1, "w2": len(first) - 1})
    assert ends.lookup(second, held) == "w1"
    assert ends.lookup(second, IndexView({"w2": len(first) - 1})) is None  # w1 evicted it
    assert ends.lookup(second, IndexView({"w1": len(first) - 2})) is None  # only part of it
    assert ends.lookup(_chain("c" * 2500), IndexView({"w1": 1})) is None  # shares only key 0


@pytest.mark.parametrize("form", FORMS)
def test_a_continuation_names_its_home_wherever_the_prompt_ends_in_its_block(form: str) -> None:
    """Whatever the length of prompt N, including a last block holding only part of the
    closing marker of a rendered message, prompt N + more continues it."""
    make_body, chain_of = FORMS[form]
    build = chain_of or (lambda body: ESTIMATE.build(body, "chat"))
    for extra in range(0, 300, 3):
        ends, index = ServedEnds(), MemoryIndex()
        before, after = build(make_body(SYSTEM[:1000 + extra])), build(make_body(SYSTEM[:1000 + extra] + " next" * 60))
        ends.record("w1", before)
        index.record_sync("w1", before.keys, key_tokens_of(before.cum_tokens))
        assert ends.lookup(after, index.lookup_sync(after.keys)) == "w1", extra


def test_two_prompts_ending_at_one_key_make_it_a_fork() -> None:
    ends, base = ServedEnds(), "s" * 2048
    one, two, later = _chain(base + "question one"), _chain(base + "question two"), _chain(base + "x" * 600)
    view = IndexView({"w1": len(one) - 1})
    ends.record("w1", one)
    ends.record("w1", one)  # a retry of the same prompt is no fork
    assert ends.lookup(later, view) == "w1"
    ends.record("w2", two)
    assert ends.lookup(later, view) is None
    ends.record("w1", one)  # and a fork stays one
    assert ends.lookup(later, view) is None


def _exchange(*replicas: ServedEnds) -> None:
    """What the Redis load board's sync does: each replica's new records, through JSON, to
    every other."""
    sent = [orjson.dumps(r.take_sent()) for r in replicas]
    for i, r in enumerate(replicas):
        for j, blob in enumerate(sent):
            if i != j:
                r.absorb(orjson.loads(blob))


def test_a_replica_learns_the_ends_another_sent() -> None:
    a, b = ServedEnds(), ServedEnds()
    a.share()
    b.share()
    first, again, later = _chain("a" * 2000), _chain("a" * 2000), _chain("a" * 2000 + "b" * 500)
    view = IndexView({"w1": len(first) - 1})
    a.record("w1", first)
    assert b.lookup(again, view) is None and b.lookup(later, view) is None
    _exchange(a, b)
    assert b.lookup(again, view) == b.lookup(later, view) == "w1"
    assert a.take_sent() == b.take_sent() == []  # handed out once


def test_two_replicas_prompts_ending_at_one_key_make_a_fork_on_both() -> None:
    a, b = ServedEnds(), ServedEnds()
    a.share()
    b.share()
    base = "s" * 2048
    one, two, later = _chain(base + "question one"), _chain(base + "question two"), _chain(base + "x" * 600)
    view = IndexView({"w1": len(one) - 1, "w2": len(one) - 1})
    a.record("w1", one)
    b.record("w2", two)
    _exchange(a, b)
    assert a.lookup(later, view) is None and b.lookup(later, view) is None


def test_records_are_kept_for_others_only_when_shared_and_come_back_after_a_failed_sync() -> None:
    alone = ServedEnds()
    alone.record("w1", _chain("a" * 2000))
    assert alone.take_sent() == []
    shared = ServedEnds(capacity=4)
    shared.share()
    for i in range(6):
        shared.record("w1", _chain(f"prompt {i} " * 100))
    assert len(shared.take_sent(limit=1)) == 1  # the oldest first, a piece at a time
    sent = shared.take_sent()
    assert len(sent) == 3  # bounded (4) while nobody takes them
    shared.record("w1", _chain("later " * 100))
    shared.give_back(sent)  # the sync failed
    assert len(shared.take_sent()) == 4  # the three given back and the later one


def test_remembered_ends_are_bounded() -> None:
    ends = ServedEnds(capacity=8)
    for i in range(20):
        ends.record("w0", _chain(f"prompt {i} " * 100))
    assert len(ends) == 8


def test_the_policy_makes_the_continued_worker_a_home_and_keeps_no_state() -> None:
    """`choose` is a function of its inputs: the same request, view and loads give the same
    decision however often it is asked; `continues` makes its worker a quiet home."""
    policy, chain = make_policy("cache_aware"), _chain("a" * 2000 + "b" * 500)
    view = IndexView({"w0": len(chain) - 2})
    loads = [WorkerLoad("w0", recent=20.0), WorkerLoad("w1"), WorkerLoad("w2"), WorkerLoad("w3")]
    spread = [policy.choose(RouteRequest(chain), view, loads, COST) for _ in range(3)]
    assert {(d.worker, d.reason) for d in spread} == {(spread[0].worker, "overload")} and spread[0].worker != "w0"
    home = [policy.choose(RouteRequest(chain, continues="w0"), view, loads, COST) for _ in range(3)]
    assert {(d.worker, d.reason) for d in home} == {("w0", "gpu_hit")}


class EventFedChains(EstimateChainBuilder):
    """Estimate chains, with the index kept by the workers' KV events as in precise mode."""

    records_on_route = False


async def test_a_sent_prompt_is_remembered_when_kv_events_keep_the_index() -> None:
    """Precise mode: the router records nothing on the index, but it alone knows which prompt
    it sent where, so a continuation without a reply still finds its home."""
    base = "You are a careful completions agent. " * 60
    first, then = base + "\nStep 1:", base + "\nStep 1: done." + " check" * 80
    index, chains = MemoryIndex(1_000_000), EventFedChains()
    with RecordingUpstream() as a, RecordingUpstream() as b:
        config = flat_config(workers=[WorkerSpec("a", a.url), WorkerSpec("b", b.url)], policy="cache_aware")
        app = build_app(config, index=index, chains=chains)
        async with app.lifespan(app.api):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:

                async def complete(prompt: str) -> httpx.Response:
                    return await client.post("/v1/completions", json={"model": "rec-model", "prompt": prompt})

                home = (await complete(first)).headers["x-kvroute-worker"]
                sent = chains.build({"model": "rec-model", "prompt": first}, "completion")
                assert index.lookup_sync(sent.keys).depths == {}  # the router did not record it
                index.record_sync(home, sent.keys, key_tokens_of(sent.cum_tokens))  # the worker's KV events
                for _ in range(6):  # its worker's recent count is over the cap: only a home stays
                    app.loads.release(app.loads.acquire(home, 0.0))
                real = await complete(then)
    assert (real.headers["x-kvroute-worker"], real.headers["x-kvroute-route-reason"]) == (home, "gpu_hit")


async def _grow_agent(
    url: str | list[str], turns: int, api: str, agent: int = 0, think_s: float = 0.0
) -> list[AgentTurn]:
    """One agent that resends its whole history each turn, with no assistant message: as a
    completions prompt, or as one user message (a trace replayer's form). Given several
    router URLs (replicas behind a balancer), turn t goes to the t-th in turn; `think_s`
    between turns (an agent's own work between its model calls)."""
    urls = [url] if isinstance(url, str) else url
    clients = [openai.AsyncOpenAI(base_url=u + "/v1", api_key="unused", max_retries=0) for u in urls]
    text, out = own_system(agent), []
    try:
        for t in range(turns):
            client = clients[t % len(clients)]
            text += f"\nUser: Agent {agent}, step {t}: " + "run the next check " * 25 + "\nAssistant:"
            if api == "completions":
                raw: Any = await client.completions.with_raw_response.create(model=MODEL, prompt=text, max_tokens=24)
                reply = raw.parse()
                answer = reply.choices[0].text
            else:
                message = [{"role": "user", "content": text}]
                raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=message, max_tokens=24)
                reply = raw.parse()
                answer = reply.choices[0].message.content
            out.append(AgentTurn(raw.headers["x-kvroute-worker"], raw.headers["x-kvroute-route-reason"], cached_tokens(reply)))
            text += answer
            await asyncio.sleep(think_s)
    finally:
        for client in clients:
            await client.close()
    return out


@pytest.mark.parametrize("api", ["completions", "one_message_chat"])
def test_growing_prompt_agents_keep_their_workers_end_to_end(api: str) -> None:
    # No shared pool: a turn that moves finds nothing cached (with the pool it would load
    # its prefix from the CPU and hide the move).
    with (
        SimCluster(workers=4, time_scale=0.02, pool=False) as cluster,
        RouterProcess(cluster.worker_urls, policy="cache_aware") as router,
    ):
        alone = asyncio.run(_grow_agent(router.url, 20, api))

        async def three() -> list:
            return await asyncio.gather(*(_grow_agent(router.url, 20, api, agent=a) for a in (1, 2, 3)))

        together = asyncio.run(three())
    for turns in (alone, *together):
        assert len({t.worker for t in turns}) == 1, turns
        assert not [t for t in turns if t.reason == "overload"], turns
        assert all(t.cached_tokens > 0 for t in turns[1:]), turns



@pytest.mark.redis
def test_growing_prompts_keep_their_workers_across_replicas(redis_prefix: str) -> None:
    """Four replicas behind a round-robin balancer: each turn reaches another replica, which
    learned where the previous prompt ended from the load board's sync, not from sending it.
    One agent alone, then three at once. The agents think 0.2 s between turns (the sync runs
    every 50 ms; a turn sent sooner than that after the previous one, to another replica,
    may still find no home)."""
    # A lookup over its budget falls back to the replica's own mirror (a miss here): a busy
    # CI machine must not turn that designed degradation into a failure of this test.
    args = ["--redis", SYSTEM_REDIS, "--redis-prefix", redis_prefix, "--redis-lookup-budget-ms", "500"]
    with SimCluster(workers=4, time_scale=0.02, pool=False) as cluster:
        replicas = [RouterProcess(cluster.worker_urls, policy="cache_aware", extra_args=args) for _ in range(4)]
        try:
            for r in replicas:
                r.start()
            urls = [r.url for r in replicas]
            for i, url in enumerate(urls):  # each replica's Redis connection and scripts, ready
                warm = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": f"warm-up {i}"}]}
                assert httpx.post(url + "/v1/chat/completions", json=warm, timeout=30).status_code == 200
            alone = asyncio.run(_grow_agent(urls, 20, "one_message_chat", think_s=0.2))

            async def three() -> list:
                return await asyncio.gather(*(
                    _grow_agent(urls[a:] + urls[:a], 20, "one_message_chat", agent=a, think_s=0.2) for a in (1, 2, 3)
                ))

            together = asyncio.run(three())
        finally:
            for r in replicas:
                r.stop()
    for turns in (alone, *together):
        assert len({t.worker for t in turns}) == 1, turns
        assert not [t for t in turns if t.reason == "overload"], turns
        assert all(t.cached_tokens > 0 for t in turns[1:]), turns
