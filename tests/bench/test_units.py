"""Pieces of `kvroute bench` that need no cluster: entries, scaling, verdicts, summaries."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import cast

import httpx
import pytest

from loadtests.benchmark.bench import (
    MAX_AUTO_TIME_SCALE,
    MIN_AUTO_TIME_SCALE,
    Entry,
    RunSetup,
    _kvroute_args,
    auto_time_scale,
    comparison,
    parse_entries,
    summarize,
    with_ablations,
)
from loadtests.benchmark.harness import (
    QueueSampler,
    RequestRecord,
    RunOutcome,
    bottleneck_verdict,
    counters_delta,
    metric_sum,
    parse_prometheus,
    percentile,
    process_trees,
    worker_hit_ratio,
)
from loadtests.benchmark.traces import ENGINE_TOKEN_BUDGET
from loadtests.sim.costs import DEFAULT_PROFILE
from router.policies.cache_aware import TERMS


def test_cache_blind_policies_run_without_the_pool_unless_told() -> None:
    entries = {e.key: e for e in parse_entries("random,cache_aware,random+pool,cache_aware-nopool", "")}
    assert entries["random"].pool is False
    assert entries["cache_aware"].pool is True
    assert entries["random+pool"].pool is True and entries["random+pool"].policy == "random"
    assert entries["cache_aware-nopool"].pool is False


def test_a_queue_suffix_runs_kvroute_with_the_prefill_queue() -> None:
    entries = {e.key: e for e in parse_entries("cache_aware,cache_aware+queue,cache_aware@learned+queue-nopool", "")}
    assert not entries["cache_aware"].prefill_queue
    queued = entries["cache_aware+queue"]
    assert queued.prefill_queue and queued.policy == "cache_aware" and queued.pool
    learned = entries["cache_aware@learned+queue-nopool"]
    assert learned.prefill_queue and learned.cost == "learned" and not learned.pool
    setup = RunSetup(workers=2, profile=DEFAULT_PROFILE, time_scale=1.0, kv_capacity_tokens=1000,
                     pool_capacity_tokens=0, logs=Path("."))  # fmt: skip
    assert [("--prefill-queue-tokens" in _kvroute_args(setup, e)) for e in entries.values()] == [False, True, True]
    assert queued.prefill_queue == ENGINE_TOKEN_BUDGET
    # `+queueN`: the mark in tokens, for sweeps.
    (marked,) = parse_entries("cache_aware+queue2048", "")
    assert marked.key == "cache_aware+queue2048" and marked.policy == "cache_aware" and marked.prefill_queue == 2048
    args = _kvroute_args(setup, marked)
    assert args[args.index("--prefill-queue-tokens") + 1] == "2048"
    with pytest.raises(ValueError):
        parse_entries("cache_aware+queuefast", "")


def test_ablated_entries_run_cache_aware_with_terms_switched_off() -> None:
    entries = {e.key: e for e in parse_entries("cache_aware~lag,cache_aware~recompute~delay-nopool", "")}
    lag = entries["cache_aware~lag"]
    assert (lag.policy, lag.ablate, lag.pool) == ("cache_aware", ("lag",), True)
    both = entries["cache_aware~recompute~delay-nopool"]
    assert (both.policy, both.ablate, both.pool) == ("cache_aware", ("delay", "recompute"), False)
    setup = RunSetup(workers=2, profile=DEFAULT_PROFILE, time_scale=1.0, kv_capacity_tokens=1000,
                     pool_capacity_tokens=0, logs=Path("."))  # fmt: skip
    args = _kvroute_args(setup, both)
    assert args[args.index("--policy-ablate") + 1] == "delay,recompute"
    assert "--policy-ablate" not in _kvroute_args(setup, parse_entries("cache_aware", "")[0])
    for bad in ("cache_aware~nope", "random~lag"):
        with pytest.raises(ValueError):
            parse_entries(bad, "")


def test_ablate_adds_an_entry_per_term_after_each_full_cache_aware_entry() -> None:
    expanded = with_ablations("random,cache_aware-nopool,cache_aware~caps", "lag,delay")
    assert expanded.split(",") == [
        "random", "cache_aware-nopool", "cache_aware~lag-nopool", "cache_aware~delay-nopool", "cache_aware~caps",
    ]  # fmt: skip
    keys = [e.key for e in parse_entries(with_ablations("cache_aware", "all"), "")]
    assert keys == ["cache_aware", *(f"cache_aware~{t}" for t in TERMS)]
    assert with_ablations("cache_aware", "") == "cache_aware"
    with pytest.raises(ValueError):
        with_ablations("cache_aware", "nope")


def test_peers_expand_to_their_policies() -> None:
    keys = [e.key for e in parse_entries("", "sglang-router,vllm-router")]
    assert keys == ["sglang-router", "vllm-router", "vllm-router/consistent_hash"]
    one = parse_entries("", "vllm-router/consistent_hash")
    assert [(e.peer, e.policy, e.pool) for e in one] == [("vllm-router", "consistent_hash", True)]


@pytest.mark.parametrize("bad", ["nope", "random,random", "random+pool,random+pool"])
def test_bad_or_duplicate_entries_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_entries(bad, "")
    with pytest.raises(ValueError):
        parse_entries("", "haproxy")


def test_auto_time_scale_follows_offered_tokens_within_bounds() -> None:
    assert auto_time_scale(1.0) == MIN_AUTO_TIME_SCALE
    assert auto_time_scale(1e9) == MAX_AUTO_TIME_SCALE
    assert auto_time_scale(6000) > auto_time_scale(3000)


def test_prometheus_parsing_sums_labelled_series() -> None:
    text = (
        "# HELP x\n"
        'vllm:prefix_cache_hits_total{model_name="m",engine="0"} 30\n'
        'vllm:prefix_cache_hits_total{model_name="m",engine="1"} 12.5\n'
        'kvroute_requests_total{worker="w0",reason="gpu_hit",status="200"} 4\n'
        'kvroute_requests_total{worker="w1",reason="miss",status="200"} 1\n'
    )
    parsed = parse_prometheus(text)
    assert metric_sum(parsed, "vllm:prefix_cache_hits_total") == 42.5
    assert metric_sum(parsed, "kvroute_requests_total", reason="gpu_hit") == 4


def test_worker_hit_ratio_counts_gpu_and_pool_hits_over_the_run() -> None:
    before = {"w0": {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 50.0}}
    after = {
        "w0": {
            "vllm:prefix_cache_queries_total": 1100.0,
            "vllm:prefix_cache_hits_total": 650.0,
            "vllm:external_prefix_cache_hits_total": 200.0,
            "waiting": 3.0,
        }
    }
    delta = counters_delta(before, after)
    assert "waiting" not in delta
    assert worker_hit_ratio(delta) == pytest.approx((600 + 200) / 1000)
    assert worker_hit_ratio({}) is None


def test_kv_held_share_reads_each_worker_between_its_first_and_last_scrape_in_the_stretch() -> None:
    sampler = QueueSampler(cast(httpx.AsyncClient, None), {"w0": "", "w1": ""})
    sampler.engine_seconds = {  # (wall s since start, busy s, KV-held s) per scrape
        "w0": [(0.0, 0.0, 0.0), (10.0, 9.0, 0.0), (20.0, 19.0, 9.0), (30.0, 29.0, 19.0)],
        "w1": [(0.5, 0.0, 0.0), (10.5, 10.0, 1.0), (20.5, 20.0, 3.0)],
    }
    # From 5 to 25 s: w0 from its 10 s scrape to its 20 s one, w1 from 10.5 to 20.5.
    assert sampler.kv_held_share(5.0, 25.0) == pytest.approx((9.0 + 2.0) / (10.0 + 10.0))
    # A worker scraped once in the stretch adds nothing; none scraped twice: nothing to say.
    assert sampler.kv_held_share(15.0, 35.0) == pytest.approx(1.0)
    assert sampler.kv_held_share(40.0, 50.0) is None


def test_percentile_is_nearest_rank() -> None:
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


def _verdict(lag: float, probe: float, cores: float, busy: list[float] | None = None) -> dict:
    cpu = {
        "process_cores_mean": {"client": cores, "simulator": 0.2},
        "system_cpu_saturated_fraction": (sum(1 for b in (busy or []) if b >= 95) / len(busy)) if busy else 0.0,
    }
    return bottleneck_verdict(
        time_scale=0.5,
        mean_step_s=0.04,
        client_lag={"p99_s": lag},
        probes={"simulator": {"p99_s": probe}},
        cpu=cpu,
        event_loop_processes=["client", "simulator"],
    )


def test_bottleneck_flag_follows_lag_cpu_and_machine_saturation() -> None:
    # threshold = 1.0 × 40 ms × 0.5 = 20 ms of wall time
    clean = _verdict(lag=0.002, probe=0.004, cores=0.3)
    assert clean["flag"] is False and clean["lag_threshold_s"] == pytest.approx(0.02)
    assert _verdict(lag=0.03, probe=0.004, cores=0.3)["flag"] is True
    assert _verdict(lag=0.002, probe=0.05, cores=0.3)["flag"] is True
    assert _verdict(lag=0.002, probe=0.004, cores=0.97)["flag"] is True
    # A machine kept busy by others is a warning; it flags only with lag to show for it.
    busy = _verdict(lag=0.002, probe=0.004, cores=0.3, busy=[100.0] * 3 + [50.0])
    assert busy["flag"] is False and busy["warnings"]
    assert _verdict(lag=0.015, probe=0.004, cores=0.3, busy=[100.0] * 3 + [50.0])["flag"] is True


def _record(turn: int, ttft: float, measured: bool = True, tokens: int = 11, decode: float = 0.5, **kw) -> RequestRecord:
    return RequestRecord(0, turn, "tool_call", measured, float(turn), 200, ttft, decode, tokens, **kw)


def test_summary_figures_come_from_measured_requests_only() -> None:
    records = [
        _record(0, 1.0),
        _record(1, 3.0),
        _record(2, 100.0, measured=False),
        _record(3, 2.0, censored=True, decode=None, tokens=0, error="cancelled"),
    ]
    outcome = RunOutcome(records, 3, 2, 0, 10.0, 20.0, 30.0, False, {"p99_s": 0.001})
    delta = {"vllm:prefix_cache_queries_total": 10.0, "vllm:prefix_cache_hits_total": 5.0}
    entry = Entry("cache_aware", "kvroute", "cache_aware", None, True)
    router = parse_prometheus("kvroute_prompt_tokens_total 1000\nkvroute_predicted_cached_tokens_total 400\n")
    s = summarize(entry, outcome, delta, {}, router)
    assert s["requests_measured"] == 3
    assert s["ttft_censored"] == 1
    assert s["ttft_mean_s"] == pytest.approx(2.0)  # 1, 3 and the censored lower bound 2
    assert s["itl_mean_s"] == pytest.approx(0.05)  # 0.5 s over 10 intervals
    assert s["output_tok_per_s"] == pytest.approx(20.0)
    assert s["predicted_hit_ratio"] == pytest.approx(0.4)
    assert s["worker_hit_ratio"] == pytest.approx(0.5)
    assert s["ttft_by_turn"]["1"]["mean_s"] == pytest.approx(3.0)


def test_moved_share_counts_later_turns_sent_away_from_their_previous_worker() -> None:
    from loadtests.benchmark.harness import moved_share

    def turn(session: int, t: int, worker: str | None, measured: bool = True) -> RequestRecord:
        return RequestRecord(session, t, "answer", measured, float(t), 200 if worker else 502, worker=worker)

    records = [
        turn(0, 0, "w0", measured=False),  # a warm-up turn still names the previous worker
        turn(0, 1, "w0"),
        turn(0, 2, "w1"),  # moved
        turn(0, 3, "w1"),
        turn(1, 0, "w2"),  # a first turn has no previous one
        turn(1, 1, None),  # failed: no worker
        turn(1, 2, "w0"),  # its previous turn failed: not counted
    ]
    assert moved_share(records) == pytest.approx(1 / 3)
    assert moved_share(records[:1]) is None


def test_comparison_ratios() -> None:
    def r(kind: str, mean: float, p99: float, **extra) -> dict:
        return {"kind": kind, "ttft_mean_s": mean, "ttft_p99_s": p99, **extra}

    routers = {
        "random": r("kvroute", 4.0, 13.0, capacity_sessions_per_s=1.0),
        "cache_aware": r("kvroute", 0.25, 1.0, capacity_sessions_per_s=3.5, predicted_hit_ratio=0.8, worker_hit_ratio=0.78),
        "sglang-router": r("peer", 0.5, 2.0),
    }
    c = comparison(routers)
    assert c["random_over_cache_aware_ttft_mean"] == pytest.approx(16.0)
    assert c["random_over_cache_aware_ttft_p99"] == pytest.approx(13.0)
    assert c["cache_aware_over_random_capacity"] == pytest.approx(3.5)
    assert c["cache_aware_ttft_p99_le_sglang-router"] is True
    assert c["cache_aware_p99_over_best_peer_p99"] == pytest.approx(0.5)
    assert c["cache_aware_predicted_minus_worker_hit_ratio"] == pytest.approx(0.02)


def test_progress_bar_draws_only_when_enabled(capsys: pytest.CaptureFixture[str]) -> None:
    from loadtests.benchmark.bench import ProgressBar

    info = {"sim_s": 45.0, "end_s": 90.0, "requests": 120, "ttft_p50_s": 0.05}
    off = ProgressBar(enabled=False)
    off(info)
    off.done()
    assert capsys.readouterr().err == ""
    on = ProgressBar(enabled=True)
    on.set("[1/2] random")
    on(info)
    err = capsys.readouterr().err
    assert err.startswith("\r[1/2] random") and "50%" in err and "0.05s" in err


def test_a_simulator_falling_behind_real_time_flags_the_run() -> None:
    from loadtests.benchmark.harness import sim_clock_ratio

    before = {"w0": {"sim:simulated_seconds": 10.0}, "w1": {"sim:simulated_seconds": 10.0}}
    after = {"w0": {"sim:simulated_seconds": 110.0}, "w1": {"sim:simulated_seconds": 90.0}}
    # 50 wall seconds at time scale 0.5 allow 100 simulated seconds; w1 managed 80.
    assert sim_clock_ratio(before, after, 50.0, 0.5) == pytest.approx(0.8)
    verdict = bottleneck_verdict(
        time_scale=0.5, mean_step_s=0.04, client_lag={"p99_s": 0.001}, probes={}, cpu={},
        event_loop_processes=[], sim_clock=0.8,
    )  # fmt: skip
    assert verdict["flag"] is True and "fell behind" in verdict["reasons"][0]
    ok = bottleneck_verdict(
        time_scale=0.5, mean_step_s=0.04, client_lag={"p99_s": 0.001}, probes={}, cpu={},
        event_loop_processes=[], sim_clock=0.995,
    )  # fmt: skip
    assert ok["flag"] is False


def test_a_child_process_counts_for_its_own_name_not_its_parent() -> None:
    """The client starts the router and the simulator: their CPU is theirs, not the client's."""
    import os
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        trees = process_trees({"client": os.getpid(), "router": child.pid})
        assert [p.pid for p in trees["router"]] == [child.pid]
        client_pids = {p.pid for p in trees["client"]}
        assert os.getpid() in client_pids and child.pid not in client_pids
    finally:
        child.kill()
        child.wait()


def test_cost_variants_speeds_and_speed_changes_parse() -> None:
    """The learned-cost bench options: policy@variant entries, --speeds, --speed-change."""
    from loadtests.benchmark.bench import parse_entries
    from loadtests.benchmark.cost_learning import cost_args, parse_speed_changes, parse_speeds
    from loadtests.sim.costs import build_cost_model

    entries = parse_entries("cache_aware@learned,cache_aware@exact-nopool,random@static", "")
    assert [(e.key, e.policy, e.cost, e.pool) for e in entries] == [
        ("cache_aware@learned", "cache_aware", "learned", True),
        ("cache_aware@exact-nopool", "cache_aware", "exact", False),
        ("random@static", "random", "static", False),
    ]
    with pytest.raises(ValueError):
        parse_entries("cache_aware@clever", "")
    cost = build_cost_model("h200-qwen2.5-72b-tp8")
    exact = cost_args("exact", cost, 2.0)
    base = float(exact[exact.index("--cost-prefill-base-us") + 1])
    assert base == pytest.approx(cost.marginal_prefill_s(0) * 1e6 * 2.0, rel=1e-3)  # wall seconds
    assert cost_args("static", cost, 1.0) == ["--cost-learning", "off"]
    assert parse_speeds("1,0.5", 2) == [1.0, 0.5]
    with pytest.raises(ValueError):
        parse_speeds("1,0.5", 3)
    (change,) = parse_speed_changes("w3=0.5@120")
    assert (change.worker, change.speed, change.at_s) == ("w3", 0.5, 120.0)
    with pytest.raises(ValueError):
        parse_speed_changes("w3=0.5")


def test_learned_costs_converge_from_the_first_sample_that_stays_within_tolerance() -> None:
    from loadtests.benchmark.cost_learning import learning_summary
    from loadtests.sim.costs import build_cost_model

    cost = build_cost_model("h200-qwen2.5-72b-tp8")
    scale = 2.0  # router seconds per simulated second
    # A learned model with no context growth, exact at 4k: off by the profile's growth at 16k.
    base_4k = cost.marginal_prefill_s(4096) * scale

    def sample(t: float, routed: float, factor: float, error_sum: float, answered: float) -> dict:
        w0 = {"prefill_base_s": base_4k * factor, "prefill_ctx_s": 0.0, "observations": t,
              "prediction_error_log2_sum": error_sum, "prediction_error_log2_count": answered}  # fmt: skip
        return {"t_sim_s": t, "routed": routed, "workers": {"w0": w0}}

    samples = [
        sample(2, 40, 1.5, 30.0, 10), sample(4, 90, 1.0, 31.0, 40), sample(6, 130, 1.3, 32.0, 80),
        sample(8, 170, 1.05, 33.0, 120), sample(-1, 200, 1.0, 34.0, 160),
    ]  # fmt: skip
    summary = learning_summary(samples, cost, scale, speeds=None, measured_from_s=4)["w0"]
    # The 40 answers of the warm-up (31 log2 units off in all) are left out of the bias.
    assert summary["prediction_error_log2_mean"] == pytest.approx(3.0 / 120)
    # 4k: inside at 4 s, out at 6 s, inside again from 8 s: convergence counts from 8 s.
    assert summary["within_tolerance_from"]["4096"] == {"t_sim_s": 8, "routed": 170, "observations": 8}
    assert summary["learned_over_sim_marginal"]["4096"] == pytest.approx(1.0)
    growth = cost.marginal_prefill_s(16384) / cost.marginal_prefill_s(4096)
    assert summary["learned_over_sim_marginal"]["16384"] == pytest.approx(1 / growth)
    assert growth > 1.2 and summary["within_tolerance_from"]["16384"] is None


def test_the_ideal_floor_bounds_the_mean_and_the_p99_from_below() -> None:
    from loadtests.benchmark.cost_learning import ideal_floor
    from loadtests.benchmark.traces import ENGINE_TOKEN_BUDGET, ideal_ttft_s
    from loadtests.benchmark.workload import SCENARIOS, build_workload, session_tokens
    from loadtests.sim.costs import build_cost_model

    workload = build_workload(SCENARIOS["seed"], 3, 1.0, warmup_s=5, window_s=20)
    cost = build_cost_model("h200-llama3-8b")
    sessions = workload.sessions[:40]
    records = [
        RequestRecord(session=s.index, turn=t, kind="answer", measured=True, sent_s=0.0)
        for s in sessions for t in range(len(s.turns))
    ]  # fmt: skip
    records.append(RequestRecord(session=sessions[0].index, turn=0, kind="answer", measured=False, sent_s=0.0))
    floor = ideal_floor(workload, records, cost)
    assert floor["requests"] == len(records) - 1  # the unmeasured one is left out
    # By hand: each turn prefills what its previous prompt (a first turn: the shared prefix)
    # did not hold; the p99 is nearest-rank over those floors.
    floors = []
    for s in sessions:
        toks = session_tokens(s, workload.groups.get(s.group) if s.group is not None else None)
        for t, prompt in enumerate(toks.prompts):
            held = toks.prompts[t - 1] if t else toks.shared
            floors.append(ideal_ttft_s(min(held, prompt), prompt, cost, ENGINE_TOKEN_BUDGET))
    assert floor["mean_s"] == pytest.approx(sum(floors) / len(floors))
    assert floor["p99_s"] == percentile(floors, 99)
    assert floor["mean_s"] < floor["p99_s"] <= max(floors)


def test_a_learned_router_is_compared_with_both_uncalibrated_ones_and_their_floor_bound() -> None:
    from loadtests.benchmark.cost_learning import comparison as cost_comparison
    from loadtests.benchmark.cost_learning import markdown_lines

    def r(mean: float, p99: float, floor_p99: float) -> dict:
        return {"kind": "kvroute", "ttft_mean_s": mean, "ttft_p99_s": p99, "ideal_floor_p99_s": floor_p99}

    routers = {
        "cache_aware@learned": r(0.07, 0.36, 0.33),
        "cache_aware@exact": r(0.08, 0.48, 0.33),
        "cache_aware@static": r(0.08, 0.44, 0.32),
    }
    c = cost_comparison(routers)
    assert c["cache_aware@learned_over_exact_p99"] == pytest.approx(0.75)
    assert c["cache_aware@learned_over_static_mean"] == pytest.approx(0.875)
    # No request beats its floor, so against @static no router's p99 ratio is below 0.33 / 0.44.
    assert c["cache_aware@learned_over_static_p99_floor_bound"] == pytest.approx(0.75)
    assert c["cache_aware@learned_over_exact_p99_floor_bound"] == pytest.approx(0.6875)
    # The references are not compared with each other.
    assert not [k for k in c if k.startswith(("cache_aware@exact_over", "cache_aware@static_over"))]
    lines = markdown_lines(routers, c)
    assert "- cache_aware@learned ÷ @static: TTFT mean 0.88, p99 0.82 (no router's p99 below 0.75: its floors' p99 over @static's)" in lines


def _probe_summary(p99: float, flagged: bool = False, halves: tuple[float, float] = (0.1, 0.1)) -> dict:
    """What `run_entry` returns of a run, as far as the capacity search reads it."""
    return {"ttft_p99_s": p99, "ttft_mean_s": 0.1, "requests_failed": 0,
            "ttft_mean_first_half_s": halves[0], "ttft_mean_second_half_s": halves[1],
            "harness": {"bottleneck": {"flag": flagged}}, "client_minus_worker_ttft_mean_s": 0.0}  # fmt: skip


def test_capacity_search_brackets_the_limit_and_journals_every_probe(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The search against a router whose p99 crosses the SLO at 3 sessions/s (no cluster: the
    # run answers from that rule), each probe journalled as it ends.
    from loadtests.benchmark import bench

    probed: list[float] = []

    def build(scenario: object, seed: int, rate: float, **kwargs: object) -> None:
        probed.append(rate)

    async def run(entry: Entry, workload: object, setup: object, progress: object) -> tuple[dict, None]:
        return _probe_summary(1.0 if probed[-1] <= 3.0 else 4.0), None

    monkeypatch.setattr(bench, "build_workload", build)
    monkeypatch.setattr(bench, "run_entry", run)
    entry = parse_entries("random", "")[0]
    setup = bench.RunSetup(8, "h200-llama3-8b", 1.0, 10**6, 0, tmp_path)
    journal = tmp_path / "capacity.jsonl"
    found = asyncio.run(bench.find_capacity(entry, "seed", 1, 1.0, 2.0, setup, 100.0, 1.0, 3, None, journal=journal))
    lo, hi = found["bracket"]
    assert lo <= 3.0 < hi and hi / lo < 1.1 and found["capacity_sessions_per_s"] == lo
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [(x["rate_per_s"], x["meets_slo"]) for x in lines] == [(t["rate_per_s"], t["meets_slo"]) for t in found["trials"]]
    # Doubling from 1: 1 and 2 meet it, 4 does not; then 2.83 meets it, 3.36 and 3.08 do not.
    assert all(x["router"] == "random" for x in lines) and len(lines) == 6


def test_capacity_search_takes_the_base_run_and_repeats_a_flagged_probe_slower(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The entry's own run at the base rate is the search's first probe; a probe the host
    # could not keep up with (flagged at time scale 1) is repeated at 2, then trusted.
    from loadtests.benchmark import bench

    probed: list[tuple[float, float]] = []
    rates: list[float] = []

    def build(scenario: object, seed: int, rate: float, **kwargs: object) -> None:
        rates.append(rate)

    async def run(entry: Entry, workload: object, setup: bench.RunSetup, progress: object) -> tuple[dict, None]:
        rate = rates[-1]
        probed.append((rate, setup.time_scale))
        return _probe_summary(1.0 if rate <= 3.0 else 4.0, flagged=rate == 2.0 and setup.time_scale < 2), None

    monkeypatch.setattr(bench, "build_workload", build)
    monkeypatch.setattr(bench, "run_entry", run)
    entry = parse_entries("random", "")[0]
    setup = bench.RunSetup(8, "h200-llama3-8b", 1.0, 10**6, 0, tmp_path)
    base_run = (_probe_summary(0.9), 1.0, 20.0)
    found = asyncio.run(bench.find_capacity(entry, "seed", 1, 1.0, 2.0, setup, 100.0, 1.0, 1, None, base_run=base_run))
    assert probed[:3] == [(2.0, 1.0), (2.0, 2.0), (4.0, 1.0)]
    trials = [(t["rate_per_s"], t["time_scale"], t["bottleneck"]) for t in found["trials"]]
    assert trials[:4] == [(1.0, 1.0, False), (2.0, 1.0, True), (2.0, 2.0, False), (4.0, 1.0, False)]
    assert found["bracket"][0] == pytest.approx(2.83, abs=0.01) and found["bracket"][1] == 4.0


def test_capacity_search_repeats_a_probe_still_draining_its_cold_start_with_a_longer_warm_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # At 4/s the 20 s warm-up does not absorb the cold start: the window's first half is 4x
    # its second and p99 misses the SLO; with 40 s it meets it. At 8/s the fleet is
    # overloaded (the second half is the worse): that verdict stands, once.
    from loadtests.benchmark import bench

    calls: list[tuple[float, float]] = []
    pending: list[tuple[float, float]] = []

    def build(scenario: object, seed: int, rate: float, **kwargs: float) -> None:
        pending.append((rate, kwargs["warmup_s"]))

    async def run(entry: Entry, workload: object, setup: bench.RunSetup, progress: object) -> tuple[dict, None]:
        rate, warmup = pending.pop()
        calls.append((rate, warmup))
        if rate >= 8.0:
            return _probe_summary(9.0, halves=(1.0, 3.0)), None
        if rate > 2.0 and warmup < 40.0:
            return _probe_summary(3.0, halves=(2.0, 0.5)), None
        return _probe_summary(1.0), None

    monkeypatch.setattr(bench, "build_workload", build)
    monkeypatch.setattr(bench, "run_entry", run)
    entry = parse_entries("random", "")[0]
    setup = bench.RunSetup(8, "h200-llama3-8b", 1.0, 10**6, 0, tmp_path)
    found = asyncio.run(bench.find_capacity(entry, "seed", 1, 2.0, 2.0, setup, 100.0, 1.0, 0, None,
                                            base_run=(_probe_summary(1.0), 1.0, 20.0)))  # fmt: skip
    assert calls == [(4.0, 20.0), (4.0, 40.0), (8.0, 20.0)]
    assert [(t["rate_per_s"], t["warmup_s"], t["unsettled"], t["meets_slo"]) for t in found["trials"]] == [
        (2.0, 20.0, False, True), (4.0, 20.0, True, False), (4.0, 40.0, False, True), (8.0, 20.0, False, False),
    ]  # fmt: skip
    assert found["bracket"] == [4.0, 8.0]
