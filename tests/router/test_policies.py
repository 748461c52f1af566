"""The routing decision is a pure function: tested here without HTTP."""

from __future__ import annotations

from collections import Counter

import pytest

from cache_client import POOL, IndexView
from normalizer import chat_segments, prefix_chain
from router.cost import CostModel, Held
from router.policies import POLICIES, make_policy
from router.policies.bounded import within_bounds
from router.policies.cache_aware import recompute_weight
from router.routing import RouteRequest, WorkerLoad

COST = CostModel()


def chain(*contents: str):
    body = {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}
    return prefix_chain("m", chat_segments(body))


def loads(*names: str, **overrides: dict) -> list[WorkerLoad]:
    return [WorkerLoad(n, **overrides.get(n, {})) for n in names]


def test_cost_grows_faster_than_linearly() -> None:
    assert COST.prefill_s(0, 32_000) > 2 * COST.prefill_s(0, 16_000)
    assert COST.prefill_s(16_000, 32_000) > COST.prefill_s(0, 16_000)
    assert COST.prefill_s(100, 100) == 0
    # Loading from the pool is about ten times cheaper than recomputing (H200 calibration).
    assert 5 < COST.prefill_s(0, 8000) / COST.pool_load_s(8000) < 20


def test_cache_aware_prefers_the_worker_holding_the_prefix() -> None:
    c = chain("x" * 8000, "y" * 40)
    view = IndexView({"b": 1 + 1})  # tools segment + first message
    d = make_policy("cache_aware").choose(RouteRequest(c), view, loads("a", "b", "c"), COST)
    assert d.worker == "b"
    assert d.reason == "gpu_hit"
    assert d.cached_tokens == c.tokens_at_depth(2)
    assert d.ranking[0] in ("a", "c") and set(d.ranking) == {"a", "c"}


def test_cache_aware_leaves_a_worker_whose_queue_costs_more_than_recompute() -> None:
    c = chain("x" * 400, "y" * 40)  # ~110 tokens: cheap to recompute
    view = IndexView({"b": 3})
    busy = {"b": {"inflight": 1, "queued_prefill_s": 2.0}}
    d = make_policy("cache_aware").choose(RouteRequest(c), view, loads("a", "b", **busy), COST)
    assert d.worker == "a"
    # The prefix was known and set aside for b's queue: a choice made for load, not a miss.
    assert (d.reason, d.cached_tokens) == ("overload", 0)
    # Where no worker holds it, recomputing is a miss.
    d = make_policy("cache_aware").choose(RouteRequest(c), IndexView({}), loads("a", "b", **busy), COST)
    assert (d.worker, d.reason) == ("a", "miss")


def test_cache_aware_prices_a_worker_running_behind_its_predictions() -> None:
    """A pool-held conversation goes to the worker whose queue runs on time, not to the one
    whose oldest request still waits 3 s longer than predicted (an engine out of KV
    space), though the model's own queue figures favour the latter."""
    c = chain("x" * 40_000, "y" * 40)
    view = IndexView({POOL: 3})
    behind = {"a": {"lag_s": 3.0}, "b": {"inflight": 4, "queued_prefill_s": 0.2}}
    d = make_policy("cache_aware").choose(RouteRequest(c), view, loads("a", "b", **behind), COST)
    assert d.worker == "b"
    by_worker = {s.worker: s for s in d.scores}
    assert by_worker["a"].ttft_s == pytest.approx(3.0 + by_worker["a"].prefill_s)
    d = make_policy("cache_aware").choose(RouteRequest(c), view, loads("a", "b", b=behind["b"]), COST)
    assert d.worker == "a"  # without the lag, a looks the cheaper

def test_cache_aware_pool_hit_charged_transfer_cost() -> None:
    c = chain("x" * 40_000, "y" * 40)
    view = IndexView({POOL: 3})
    d = make_policy("cache_aware").choose(RouteRequest(c), view, loads("a", "b"), COST)
    assert d.reason == "pool_hit"
    assert d.cached_tokens == c.total_tokens
    assert d.prefill_s == pytest.approx(COST.pool_load_s(c.total_tokens))
    # The GPU copy wins over the pool when both hold it.
    d = make_policy("cache_aware").choose(RouteRequest(c), IndexView({POOL: 3, "b": 3}), loads("a", "b"), COST)
    assert (d.worker, d.reason, d.prefill_s) == ("b", "gpu_hit", 0.0)


def test_cache_aware_overload_spills_the_hot_worker() -> None:
    c = chain("x" * 8000, "y" * 40)
    view = IndexView({"a": 3})
    hot = {"a": {"recent": 10.0}, "b": {"recent": 1.0}, "c": {"recent": 1.0}}
    d = make_policy("cache_aware").choose(RouteRequest(c), view, loads("a", "b", "c", **hot), COST)
    assert d.worker in ("b", "c")
    assert d.reason == "overload"
    assert d.ranking[-1] == "a"


def test_cache_aware_decision_carries_the_prices_it_ranked_by() -> None:
    c = chain("x" * 8000, "y" * 40)
    view = IndexView({"a": 3, "b": 1, POOL: 2})
    state = {"a": {"recent": 10.0}, "b": {"inflight": 2, "queued_prefill_s": 0.01, "prefilling": 1}, "c": {"recent": 1.0}}
    candidates = loads("a", "b", "c", **state)
    d = make_policy("cache_aware").choose(RouteRequest(c), view, candidates, COST)
    assert sorted(s.worker for s in d.scores) == ["a", "b", "c"]
    assert [s.score_s for s in d.scores] == sorted(s.score_s for s in d.scores)  # best first
    eligible = {w.name for w in within_bounds(candidates)}
    for s, load in ((s, next(w for w in candidates if w.name == s.worker)) for s in d.scores):
        gpu, pool = c.tokens_at_depth(view.depth(load.name)), c.tokens_at_depth(view.depth(POOL))
        assert (s.gpu_tokens, s.load, s.within_bound) == (gpu, load, load.name in eligible)
        assert (s.prefill_s, s.ttft_s, s.reuse) == COST.predicted_ttft_s(load, Held(gpu, pool), c.total_tokens)
        assert s.reuse.tokens == max(gpu, pool)  # a pool copy is always cheaper than its prefill
        # The delay its prefill adds to the requests queued there, and the hysteresis: only
        # the worker holding most of the prefix is ranked without a step added. (No worker
        # has an engine step of prefill queued: recomputing is not charged; the test below.)
        others = s.prefill_s * load.prefilling
        assert s.score_s == pytest.approx(s.ttft_s + others + (0 if load.name == "a" else COST.step_s))
    chosen = next(s for s in d.scores if s.within_bound)
    assert (d.worker, d.prefill_s, d.reason) == (chosen.worker, chosen.prefill_s, "overload")
    assert not next(s for s in d.scores if s.worker == "a").within_bound
    # Policies that do not price candidates leave the scores empty.
    assert make_policy("round_robin").choose(RouteRequest(c), view, candidates, COST).scores == ()


def test_new_sessions_spread_when_nothing_is_cached() -> None:
    policy = make_policy("cache_aware")
    counts: Counter[str] = Counter()
    recent = {"a": 0.0, "b": 0.0, "c": 0.0}
    for i in range(30):
        ls = [WorkerLoad(n, recent=recent[n]) for n in recent]
        d = policy.choose(RouteRequest(chain(f"session {i}")), IndexView(), ls, COST)
        counts[d.worker] += 1
        recent[d.worker] += 1
    assert counts == {"a": 10, "b": 10, "c": 10}


def test_cache_aware_charges_a_placement_the_delay_it_adds_to_the_queue() -> None:
    """Recomputing a conversation on a less busy worker must save more than the prefill it
    adds to that worker's queue: greedy TTFT alone moves it."""
    document, question = "x" * 40_000, "y" * 4_000
    c = chain(document, question)
    view = IndexView({"a": len(chain(document))})  # a holds the document (10k tokens)
    policy = make_policy("cache_aware")

    def place(a_waiting: int, others_waiting: int) -> str:
        # Seven others alike, each with less than an engine step queued: only a is busy, so
        # the recompute itself is charged little (1/7 of its prefill; the test below).
        others = {n: {"queued_prefill_s": 0.01, "prefilling": others_waiting} for n in "bcdefgh"}
        state = {"a": {"queued_prefill_s": 0.4, "prefilling": a_waiting}, **others}
        return policy.choose(RouteRequest(c), view, loads("a", *others, **state), COST).worker

    # With nothing queued, b's shorter queue outweighs the recompute: greedy TTFT moves it.
    assert place(0, 0) == "b"
    # With requests queued, each waits behind the placement's prefill: the 11k-token
    # recompute on b costs more than a's 1k new tokens three times over.
    assert place(3, 1) == "a"
    # Where many more wait on the holder, the move still pays.
    assert place(12, 1) == "b"


def test_a_long_prompt_is_not_sent_to_a_slow_worker_for_the_sake_of_others() -> None:
    """On a fleet of mixed speeds the charges for others and the caps traded a long new
    prompt's own time for the fleet's: an idle worker at half speed beat a fast one
    finishing a prefill, or one over its in-flight cap with decodes (the mixed
    fleet's tail). A request may be made to wait a quarter longer for others, not twice."""
    slow_cost = CostModel(prefill_base_s=2 * COST.prefill_base_s, prefill_ctx_s=2 * COST.prefill_ctx_s)
    names = ("f0", "f1", "s0", "s1")

    def place(prompt: str, **fast_load: float) -> str:
        ls = [WorkerLoad(n, cost=COST, **fast_load) for n in names[:2]]
        ls += [WorkerLoad(n, cost=slow_cost) for n in names[2:]]
        return make_policy("cache_aware").choose(RouteRequest(chain(prompt)), IndexView(), ls, COST).worker

    document = "x" * 32_000  # 8k new tokens: 0.2 s on a fast worker, 0.4 s on a slow one
    # Each fast worker finishing one short prefill: its Little's-law charge doubles the
    # document's price there, and the idle slow workers price lower.
    assert place(document, prefilling=1, queued_prefill_s=0.02) in ("f0", "f1")
    # Each fast worker over the in-flight cap with decodes, which delay a prefill little.
    assert place(document, inflight=9) in ("f0", "f1")
    # A short prompt's difference is below one engine step: the charge still decides (two
    # requests prefilling on each fast worker triple its price there, against double).
    assert place("y" * 400, prefilling=2) in ("s0", "s1")
    assert place(document, prefilling=2) in ("f0", "f1")

    # Among workers of one speed the charge decides as before: b answers sooner, but three
    # requests would wait behind this prefill there, one on a.
    busy = {"a": {"queued_prefill_s": 0.1, "prefilling": 1}, "b": {"queued_prefill_s": 0.05, "prefilling": 3}}
    d = make_policy("cache_aware").choose(RouteRequest(chain("z" * 8_000)), IndexView(), loads("a", "b", **busy), COST)
    assert d.worker == "a" and d.scores[0].ttft_s > d.scores[1].ttft_s + COST.step_s


def test_recomputing_a_held_prefix_is_charged_by_how_busy_the_fleet_is() -> None:
    """Recomputed prefill is work the fleet does twice: near saturation it delays the
    requests that arrive before the fleet catches up, not only those queued now
    (on the Mooncake conversation trace the moves that looked right one request at a time
    reused 0.13 of the prompts where the trace allows 0.20, and raised the mean TTFT)."""
    step = COST.step_s
    names = [f"w{i}" for i in range(8)]
    assert recompute_weight(loads(*names), step) == 0.0
    # Requests awaiting their first byte with less than a step of prefill queued: not busy.
    assert recompute_weight(loads(*names, **{n: {"prefilling": 1, "queued_prefill_s": step / 2} for n in names}), step) == 0.0
    half = loads(*names, **{n: {"queued_prefill_s": step} for n in names[:4]})
    assert recompute_weight(half, step) == pytest.approx(1.0)  # rho = 1/2
    full = loads(*names, **{n: {"queued_prefill_s": 1.0} for n in names})
    assert recompute_weight(full, step) == pytest.approx(15.0)  # half a worker short of full
    assert recompute_weight([], step) == 0.0

    # w0 holds a 10k-token document and has 1.2 s of prefill queued; w1 holds nothing and
    # has none. With no other queues the move to w1 pays; when the other six workers queue
    # too, recomputing the document costs the fleet more than w0's queue.
    document, question = "x" * 40_000, "y" * 400
    c = chain(document, question)
    policy = make_policy("cache_aware")

    def place(others_queue_s: float, pool: bool = False) -> str:
        state = {"w0": {"queued_prefill_s": 1.2, "prefilling": 1}}
        state.update({n: {"queued_prefill_s": others_queue_s, "prefilling": 1 if others_queue_s else 0} for n in names[2:]})
        held = {"w0": len(chain(document))} | ({POOL: len(chain(document))} if pool else {})
        return policy.choose(RouteRequest(c), IndexView(held), loads(*names, **state), COST).worker

    assert place(0.0) == "w1"
    assert place(3.0) == "w0"
    # The pool holds the document: nothing is recomputed, and the move pays again.
    assert place(3.0, pool=True) == "w1"
    # A prefix two workers hold is shared (a hot system prompt): a third copy is not charged.
    state = {"w0": {"queued_prefill_s": 1.2, "prefilling": 1}, "w7": {"queued_prefill_s": 1.2, "prefilling": 1}}
    state.update({n: {"queued_prefill_s": 3.0, "prefilling": 1} for n in names[2:7]})
    shared = IndexView({"w0": len(chain(document)), "w7": len(chain(document))})
    assert policy.choose(RouteRequest(c), shared, loads(*names, **state), COST).worker == "w1"


def test_caps_are_lifted_once_the_fleet_queues() -> None:
    """The caps stand in for load nothing prices yet; queues the policy prices end them."""
    step = COST.step_s
    skewed = {"a": {"recent": 8.0, "inflight": 9}, "b": {"recent": 2.0}}
    assert [w.name for w in within_bounds(loads("a", "b", "c", **skewed), quiet_prefill_s=step)] == ["b", "c"]
    queued = {n: {**skewed.get(n, {}), "queued_prefill_s": step} for n in "abc"}
    assert [w.name for w in within_bounds(loads("a", "b", "c", **queued), quiet_prefill_s=step)] == ["a", "b", "c"]
    # Without the policy's step (the session policy prices nothing), the caps always apply.
    assert [w.name for w in within_bounds(loads("a", "b", "c", **queued))] == ["b", "c"]


def test_within_bounds_never_empty_and_caps_the_hot_worker() -> None:
    ls = loads("a", "b", **{"a": {"inflight": 9}})
    assert [w.name for w in within_bounds(ls)] == ["b"]
    assert within_bounds(loads("a")) == loads("a")
    # A small burst is not overload: the leader must also exceed the least loaded by the slack.
    burst = loads("a", "b", **{"a": {"inflight": 3}})
    assert [w.name for w in within_bounds(burst)] == ["a", "b"]
    assert [w.name for w in within_bounds(burst, abs_slack=2)] == ["b"]
    # Sustained sequential traffic shows in the recent counts instead.
    sequential = loads("a", "b", "c", **{"a": {"recent": 8.0}, "b": {"recent": 2.0}})
    assert [w.name for w in within_bounds(sequential)] == ["b", "c"]


def test_session_policy_is_sticky_and_bounded() -> None:
    policy = make_policy("session")
    ls = loads("a", "b", "c")
    first = policy.choose(RouteRequest(chain("q"), session_key="s-1"), IndexView(), ls, COST)
    again = policy.choose(RouteRequest(chain("other"), session_key="s-1"), IndexView(), ls, COST)
    assert first.worker == again.worker and first.reason == "session"
    homes = {policy.choose(RouteRequest(chain("q"), session_key=f"s-{i}"), IndexView(), ls, COST).worker for i in range(50)}
    assert homes == {"a", "b", "c"}
    crowded = [WorkerLoad(n, inflight=20 if n == first.worker else 0) for n in ("a", "b", "c")]
    spilled = policy.choose(RouteRequest(chain("q"), session_key="s-1"), IndexView(), crowded, COST)
    assert spilled.worker != first.worker and spilled.reason == "overload"


def test_round_robin_random_least_loaded() -> None:
    rr = make_policy("round_robin")
    picks = [rr.choose(RouteRequest(chain("q")), IndexView(), loads("b", "a", "c"), COST).worker for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    rnd = make_policy("random")
    assert {rnd.choose(RouteRequest(chain("q")), IndexView(), loads("a", "b"), COST).worker for _ in range(50)} == {"a", "b"}
    ll = make_policy("least_loaded")
    d = ll.choose(RouteRequest(chain("q")), IndexView(), loads("a", "b", **{"a": {"inflight": 2}}), COST)
    assert d.worker == "b" and d.ranking == ("a",)


def test_every_policy_is_registered_and_unknown_is_rejected() -> None:
    assert set(POLICIES) == {"random", "round_robin", "least_loaded", "session", "cache_aware"}
    with pytest.raises(ValueError):
        make_policy("fastest")


def test_seeded_random_places_each_request_alike_in_any_order() -> None:
    """Common random numbers: with --random-seed a request's worker is a function of the seed
    and the request's identity (its session and how many of that session's requests came
    before, else its chain), so two runs place each request alike whatever order requests
    arrive in, while distinct requests still spread uniformly and independently."""
    workers = loads("w0", "w1", "w2", "w3")
    turns = [(f"session-{i}", t) for i in range(1000) for t in range(4)]

    def place(policy, order):
        out = {}
        for session, t in order:
            request = RouteRequest(chain(session, f"turn {t}"), session_key=session)
            out[(session, t)] = policy.choose(request, IndexView({}), workers, COST).worker
        return out

    placed = place(make_policy("random", random_seed=7), turns)
    # Sessions interleaved otherwise (each session's own turns still in order), and the
    # loads listed otherwise: the same placements.
    interleaved = sorted(turns, key=lambda st: (st[1], -int(st[0].split("-")[1])))
    again = make_policy("random", random_seed=7)
    for session, t in interleaved:
        request = RouteRequest(chain("other text", f"turn {t}"), session_key=session)  # another API's chain
        assert again.choose(request, IndexView({}), list(reversed(workers)), COST).worker == placed[(session, t)]
    counts = Counter(placed.values())
    assert all(850 < n < 1150 for n in counts.values()), counts  # 1000 each ± ~5 sigma
    moved = sum(a != b for a, b in zip(place(make_policy("random", random_seed=8), turns).values(),
                                       placed.values(), strict=True))
    assert 2700 < moved < 3300  # another seed is an independent draw: 3/4 move
    # Consecutive turns of one session are independent draws too.
    assert 2700 < sum(placed[(s, t)] != placed[(s, t + 1)] for s, t in turns if t < 3) * 4 / 3 < 3300


def test_seeded_random_without_a_session_keys_on_the_chain() -> None:
    workers = loads("a", "b", "c", "d")
    requests = [RouteRequest(chain(f"prompt {i}")) for i in range(2000)]
    first = [make_policy("random", random_seed=3).choose(r, IndexView({}), workers, COST).worker for r in requests]
    second = make_policy("random", random_seed=3)
    assert [second.choose(r, IndexView({}), workers, COST).worker for r in reversed(requests)] == first[::-1]
    assert all(400 < n < 600 for n in Counter(first).values())


def test_unseeded_random_varies_for_one_request() -> None:
    policy, request = make_policy("random"), RouteRequest(chain("the same prompt"))
    seen = {policy.choose(request, IndexView({}), loads("a", "b", "c", "d"), COST).worker for _ in range(200)}
    assert len(seen) == 4
