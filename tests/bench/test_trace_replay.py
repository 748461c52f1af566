"""The late-binding replay (loadtests/benchmark/trace_replay.py): a trace window on the simulator's own
engines, fed from one queue by a scheduler that sees their state."""

from __future__ import annotations

import pytest

from loadtests.benchmark.trace_replay import late_binding_replay
from loadtests.benchmark.traces import TraceRequest, _floors, ideal_ttft_s, replay_prompts
from loadtests.sim.costs import build_cost_model

COST = build_cost_model()
BUDGET = 8192
KV = COST.default_capacity_tokens


def _replay(requests: list[TraceRequest], workers: int = 2, pool: int = 0, kv: int = KV) -> dict:
    return late_binding_replay(replay_prompts(requests), COST, workers, kv, pool, BUDGET)


def test_requests_that_never_overlap_reach_the_trace_floor() -> None:
    """A conversation's turns far apart, with and without the pool: each prefills only its
    new blocks, on an idle engine: the ideal floor exactly, the prefix found where it is.
    (Whole 512-token blocks: the floor counts a block seen once any of it was.)"""
    turns = [TraceRequest(i, 30.0 * i, 512 * (i + 2), 1, tuple(range(i + 2))) for i in range(4)]
    floor = sum(_floors(turns, COST, BUDGET)) / len(turns)
    for pool in (0, 10**7):
        r = _replay(turns, pool=pool)
        assert r["requests"] == 4 and r["pool"] is (pool > 0)
        assert r["mean_s"] == pytest.approx(floor)
        assert r["worker_hit_ratio"] > 0.4 and r["preemptions"] == 0 and r["kv_held_share"] == 0.0


def test_a_burst_queues_and_the_shorter_prefill_goes_first() -> None:
    """One engine, a long prompt, then a long and a short one sent together while it runs:
    the short one is taken before the second long one (arrival + prefill order), so it
    waits only for the first."""
    cold = ideal_ttft_s(0, 30_000, COST, BUDGET)
    short = ideal_ttft_s(0, 1024, COST, BUDGET)
    requests = [
        TraceRequest(0, 0.0, 30_000, 1, tuple(range(100, 159))),
        TraceRequest(1, 0.01, 30_000, 1, tuple(range(200, 259))),
        TraceRequest(2, 0.01, 1024, 1, (300, 301)),
    ]
    assert _replay(requests[:1], workers=1)["mean_s"] == pytest.approx(cold)
    total = _replay(requests, workers=1)["mean_s"] * 3
    # Short first: cold, about cold + short, about 2 cold + short (4 cold + 2 short in all);
    # the second long one first would make it cold, 2 cold, 2 cold + short (5 cold + short).
    assert 4 * cold < total < 4.5 * cold
    assert short < 0.1 * cold


def test_a_second_engine_takes_what_the_first_cannot() -> None:
    """Two long prompts at once on two engines: each starts at once (its floor)."""
    requests = [TraceRequest(0, 0.0, 30_000, 1, tuple(range(59))), TraceRequest(1, 0.0, 30_000, 1, tuple(range(500, 559)))]
    assert _replay(requests, workers=2)["mean_s"] == pytest.approx(ideal_ttft_s(0, 30_000, COST, BUDGET))
    assert _replay(requests, workers=1)["mean_s"] > 1.4 * ideal_ttft_s(0, 30_000, COST, BUDGET)


def test_an_engine_short_of_kv_holds_requests_back() -> None:
    """KV for little more than one request: the rest wait for blocks, and the replay says so."""
    requests = [TraceRequest(i, 0.001 * i, 6_000, 200, tuple(range(1000 * i, 1000 * i + 12))) for i in range(4)]
    r = _replay(requests, workers=1, kv=8_000)
    assert r["requests"] == 4
    assert r["kv_held_share"] > 0 or r["preemptions"] > 0
