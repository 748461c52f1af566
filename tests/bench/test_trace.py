"""`kvroute bench --trace`: request traces replayed through routers, beside the trace's ideal.

Unit tests on tiny traces built here, one replay end to end through two routers (a few
dozen lines), and reads of the real shared Mooncake traces when `../shared/traces` (or
`$KVROUTE_SHARED_DIR/traces`) is there.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from loadtests.benchmark.bench import cli
from loadtests.benchmark.traces import (
    TRACE_BLOCK_BYTES,
    TraceRequest,
    block_text,
    ideal_reuse,
    ideal_ttft_floor,
    ideal_ttft_s,
    load_trace,
    parse_window,
    prompt_text,
    queued_floor,
    random_lb_speed,
    shared_dir,
)
from loadtests.sim.costs import build_cost_model
from normalizer.prefix import chat_segments
from router.chain import EstimateChainBuilder

COST = build_cost_model()


def _write(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    with path.open("w") as fh:
        for ts, n_in, n_out, ids in rows:
            fh.write(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}) + "\n")
    return path


def _conversations(n: int = 36) -> list[tuple[int, int, int, list[int]]]:
    """Six conversations of six turns, interleaved every 250 ms: each turn resends the
    previous prompt's blocks and adds one; all share block 0 (a system prompt)."""
    rows, next_id = [], 1
    history: dict[int, list[int]] = {}
    for i in range(n):
        conv = i % 6
        ids = [*history.get(conv, [0]), next_id]
        next_id += 1
        history[conv] = ids
        rows.append((i * 250, 512 * len(ids) - 100, 8, ids))
    return rows


def test_window_and_speed_select_and_time_the_requests(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", [(1000 + 30_000 * i, 600, 4, [i, i + 100]) for i in range(10)])
    assert parse_window(None) == (0.0, None)
    assert parse_window("1.5,2") == (1.5, 2.0)
    with pytest.raises(ValueError):
        parse_window("1,0")
    whole = load_trace(path)
    assert [r.sent_s for r in whole.requests] == [30.0 * i for i in range(10)]
    assert whole.window_s == 270.0
    part = load_trace(path, 1.0, 2.0, speed=2.0, api="completions")
    assert [r.index for r in part.requests] == [0, 1, 2, 3]  # minutes 1.0, 1.5, 2.0, 2.5
    assert [r.sent_s for r in part.requests] == [0.0, 15.0, 30.0, 45.0]
    assert part.window_s == 60.0
    assert part.output_tokens_per_s == pytest.approx(16 / 60)
    with pytest.raises(ValueError):
        load_trace(path, speed=0)
    # Requests that would not fit the model's context are left out, and counted.
    fits = load_trace(path, max_model_len=604, api="completions")
    assert len(fits.requests) == 10 and fits.over_context == 0
    chat = load_trace(path, max_model_len=604)  # the chat template adds 4 tokens
    assert chat.requests == [] and chat.over_context == 10


def test_each_hash_id_is_a_fixed_block_of_512_tokens() -> None:
    assert block_text(7) == block_text(7)
    assert len(block_text(7).encode()) == TRACE_BLOCK_BYTES == 2048
    assert block_text(7)[0] != block_text(8)[0] or block_text(7)[:4] != block_text(8)[:4]
    text = prompt_text([3, 4, 5], 1300)
    assert len(text) == 1300 * 4
    assert text.startswith(block_text(3) + block_text(4))


def test_shared_hash_ids_are_shared_blocks_for_the_router() -> None:
    """Block keys and trace replay together: a trace replayed as one user message shares, in the
    router's chain, every block its hash ids share (the chain is block-granular)."""
    build = EstimateChainBuilder()

    def chain(ids: list[int]):
        body = {"model": "m", "messages": [{"role": "user", "content": prompt_text(ids, 512 * len(ids))}]}
        return build.build(body, "chat"), body

    (a, body), (b, _) = chain([1, 2, 3, 4]), chain([1, 2, 3, 9])
    shared = next(i for i, (x, y) in enumerate(zip(a.keys, b.keys, strict=True)) if x != y)
    assert a.tokens_at_depth(shared) >= 3 * 512 - 64  # three trace blocks, to within one key
    assert a.total_tokens == len(b"".join(chat_segments(body))) // 4 == 4 * 512 + 4  # + the template


def test_ideal_reuse_counts_leading_blocks_seen_before() -> None:
    reqs = [
        TraceRequest(0, 0.0, 1024, 1, (1, 2)),
        TraceRequest(1, 1.0, 1500, 1, (1, 2, 3)),
        TraceRequest(2, 2.0, 1024, 1, (4, 2)),  # block 2 after a new block is not a prefix
    ]
    assert ideal_reuse(reqs) == {"blocks": pytest.approx(2 / 7), "tokens": pytest.approx(1024 / 3548)}
    # A capacity of one block keeps only the last block seen: nothing is reused.
    assert ideal_reuse(reqs, capacity_tokens=512)["blocks"] == 0.0
    assert ideal_reuse(reqs, capacity_tokens=10 * 512) == ideal_reuse(reqs)


def test_ideal_ttft_floor_prices_only_new_blocks_on_an_idle_worker() -> None:
    cold = ideal_ttft_s(0, 20_000, COST, 8192)
    assert cold == pytest.approx(sum(COST.step_s([(s, min(s + 8192, 20_000))], []) for s in (0, 8192, 16_384)))
    warm = ideal_ttft_s(19_456, 20_000, COST, 8192)
    assert warm == pytest.approx(COST.step_s([(19_456, 20_000)], [])) and warm < cold / 10
    # Everything cached: vLLM still computes the last block.
    assert ideal_ttft_s(1024, 1024, COST, 8192) == pytest.approx(COST.step_s([(1008, 1024)], []))
    floor = ideal_ttft_floor([TraceRequest(0, 0, 20_000, 1, tuple(range(40))), TraceRequest(1, 1, 20_000, 1, tuple(range(40)))], COST, 8192)
    assert floor["mean_s"] == pytest.approx((cold + ideal_ttft_s(20_000, 20_000, COST, 8192)) / 2)


def test_queued_floor_queues_the_floors_work_on_one_queue_of_the_fleet() -> None:
    """The floor's prefills served from one queue by the fleet's engines: equal to the floor
    when no two overlap, above it when they do, and no better in arrival order than
    shortest first."""
    cold = ideal_ttft_s(0, 20_000, COST, 8192)
    short = ideal_ttft_s(0, 1024, COST, 8192)
    apart = [TraceRequest(0, 0.0, 20_000, 1, tuple(range(40))), TraceRequest(1, 10.0, 1024, 1, (99, 98))]
    q = queued_floor(apart, COST, 8192, workers=1)
    assert q["fcfs"]["mean_s"] == pytest.approx((cold + short) / 2) and q["fcfs"]["mean_over_floor"] == pytest.approx(1.0)
    # A long prefill, then a short one and a shorter one arriving during it, on one
    # engine: in arrival order both wait for it and the shorter for the short one too;
    # shortest first serves the shorter one first.
    shorter = ideal_ttft_s(0, 512, COST, 8192)
    bunched = [
        TraceRequest(0, 0.0, 20_000, 1, tuple(range(40))),
        TraceRequest(1, cold / 4, 1024, 1, (101, 102)),
        TraceRequest(2, cold / 2, 512, 1, (103,)),
    ]
    q = queued_floor(bunched, COST, 8192, workers=1)
    fcfs = [cold, cold + short - cold / 4, cold + short + shorter - cold / 2]
    sjf = [cold, cold + shorter + short - cold / 4, cold + shorter - cold / 2]
    assert q["fcfs"]["mean_s"] == pytest.approx(sum(fcfs) / 3)
    assert q["shortest_first"]["mean_s"] == pytest.approx(sum(sjf) / 3)
    assert q["shortest_first"]["mean_s"] < q["fcfs"]["mean_s"]
    assert q["fcfs"]["mean_over_floor"] > 1.5
    # By arrival + prefill (the prefill queue's order): keys cold/4 + short and cold/2 +
    # shorter; the shorter one arrived after the short one by more than their difference in
    # prefill, so the short one goes first, as in arrival order.
    assert cold / 4 + short < cold / 2 + shorter
    assert q["arrival_plus_prefill"]["mean_s"] == pytest.approx(sum(fcfs) / 3)
    close = [*bunched[:2], TraceRequest(2, cold / 4 + 1e-4, 512, 1, (103,))]  # here it passes
    assert queued_floor(close, COST, 8192, workers=1)["arrival_plus_prefill"]["mean_s"] == pytest.approx(
        (cold + (cold + shorter + short - cold / 4) + (cold + shorter - cold / 4 - 1e-4)) / 3
    )
    # Two engines: the short ones take the idle one at their arrival, never before it.
    q2 = queued_floor(bunched, COST, 8192, workers=2)
    assert q2["fcfs"]["mean_s"] == pytest.approx((cold + short + shorter) / 3)
    assert q2["fcfs"]["mean_over_floor"] == pytest.approx(1.0)
    # Two arriving together on engines idle since long before: each starts at its arrival.
    together = [TraceRequest(0, 5.0, 1024, 1, (1, 2)), TraceRequest(1, 5.0, 1024, 1, (3, 4))]
    assert queued_floor(together, COST, 8192, workers=2)["fcfs"]["mean_s"] == pytest.approx(short)


def test_auto_speed_fills_the_fleet_with_a_random_balancers_prefill(tmp_path: Path) -> None:
    """`--trace-speed auto`: the speed at which random placement's prefill work (over
    per-worker block LRUs) equals the fleet's time, as a scenario's load is derived."""
    trace = load_trace(_write(tmp_path / "t.jsonl", _conversations()))
    one = random_lb_speed(trace, 1, 10**7, COST)
    # One worker with room for everything: each request prefills only the blocks not seen
    # before (the trace's ideal floor).
    floor = ideal_ttft_floor(trace.requests, COST, 8192)["mean_s"] * len(trace.requests)
    assert one["prefill_s_at_random_lb"] == pytest.approx(floor)
    assert one["speed"] == pytest.approx(1 * trace.window_s / floor)
    # Many workers: random placement scatters the conversations, so it reuses less, and a
    # fleet of N does N times the work per second.
    eight = random_lb_speed(trace, 8, 10**7, COST)
    assert eight["random_lb_reused_fraction"] < one["random_lb_reused_fraction"]
    assert eight["prefill_s_at_random_lb"] > floor
    assert eight["speed"] == pytest.approx(8 * trace.window_s / eight["prefill_s_at_random_lb"])
    # A cache too small to keep a conversation's blocks reuses nothing.
    assert random_lb_speed(trace, 1, 512, COST)["random_lb_reused_fraction"] == 0.0
    with pytest.raises(ValueError):
        random_lb_speed(load_trace(tmp_path / "t.jsonl", speed=2.0), 1, 10**7, COST)


def test_trace_mode_refuses_what_does_not_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "t.jsonl", _conversations(6))
    out = str(tmp_path / "out")
    assert cli(["--trace", str(path), "--find-capacity", "--out", out]) == 2
    assert cli(["--trace", str(tmp_path / "missing.jsonl"), "--out", out]) == 2
    assert cli(["--trace", str(path), "--trace-speed", "0", "--out", out]) == 2
    assert cli(["--trace", str(path), "--trace-speed", "fast", "--out", out]) == 2
    assert cli(["--api", "completions", "--out", out]) == 2
    assert "applies to --trace" in capsys.readouterr().err
    assert cli(["--trace", str(path), "--api", "messages", "--out", out]) == 2
    assert "applies to a scenario" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_small_trace_replays_through_every_router(tmp_path: Path, api: str) -> None:
    path = _write(tmp_path / "conv.jsonl", _conversations())
    out = tmp_path / "out"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli(["--trace", str(path), "--api", api, "--policies", "random,cache_aware", "--workers", "2",
                    "--time-scale", "0.3", "--out", str(out)])  # fmt: skip
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    trace = results["scenario"]["trace"]
    assert trace["requests"] == 36 and trace["api"] == api
    expected = ideal_reuse(load_trace(path).requests)
    assert trace["ideal_reuse"] == pytest.approx(expected)
    assert trace["ideal_ttft_floor"]["mean_s"] > 0
    queued = trace["queued_floor"]
    assert queued["workers"] == 2 and queued["fcfs"]["mean_s"] >= trace["ideal_ttft_floor"]["mean_s"] * (1 - 1e-9)
    for key, pool in (("pool", True), ("no_pool", False)):
        replay = trace["late_binding_replay"][key]
        assert replay["requests"] == 36 and replay["pool"] is pool
        assert replay["mean_over_floor"] == pytest.approx(replay["mean_s"] / trace["ideal_ttft_floor"]["mean_s"])
        assert replay["mean_over_floor"] >= 1 - 1e-9 and replay["worker_hit_ratio"] > 0.5
    assert "late-binding scheduler" in (out / "results.md").read_text()
    routers = results["routers"]
    for key in ("random", "cache_aware"):
        r = routers[key]
        assert r["requests_measured"] == 36 and r["requests_failed"] == 0, r
        assert r["ttft_mean_s"] >= trace["ideal_ttft_floor"]["mean_s"] * 0.9
        c = results["comparison"]
        assert c[f"{key}_worker_hit_minus_ideal_reuse"] is not None
        assert c[f"{key}_ttft_mean_over_ideal_floor"] == pytest.approx(r["ttft_mean_s"] / trace["ideal_ttft_floor"]["mean_s"])
    # Every turn resends its conversation: the cache-aware router finds nearly all of it.
    ca = routers["cache_aware"]
    assert ca["worker_hit_ratio"] >= trace["ideal_reuse_fleet_kv_and_pool"]["tokens"] - 0.1, ca
    assert ca["worker_hit_ratio"] > routers["random"]["worker_hit_ratio"]
    assert abs(ca["predicted_hit_ratio"] - ca["worker_hit_ratio"]) < 0.05, ca
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 72 and {json.loads(line)["kind"] for line in lines} == {"trace"}
    md = (out / "results.md").read_text()
    assert "Against the trace's ideal" in md and "Ideal reuse" in md and "shortest first" in md
    assert json.loads(buf.getvalue().strip().splitlines()[-1])["scenario"] == "trace conv.jsonl"


@pytest.mark.slow
def test_auto_speed_replays_at_the_derived_speed(tmp_path: Path) -> None:
    path = _write(tmp_path / "conv.jsonl", _conversations())
    out = tmp_path / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(["--trace", str(path), "--policies", "random", "--workers", "2", "--time-scale", "0.3",
                    "--trace-speed", "auto", "--load", "0.5", "--out", str(out)])  # fmt: skip
    assert code == 0
    trace = json.loads((out / "results.json").read_text())["scenario"]["trace"]
    derived = trace["speed_derivation"]
    assert derived == {**random_lb_speed(load_trace(path), 2, derived_kv(out), COST), "load": 0.5}
    assert trace["speed"] == pytest.approx(derived["speed"] * 0.5)
    assert trace["window_s"] == pytest.approx(load_trace(path).window_s / trace["speed"])


def derived_kv(out: Path) -> int:
    return json.loads((out / "results.json").read_text())["config"]["kv_capacity_tokens"]


def _shared_trace(name: str) -> Path:
    path = shared_dir() / "traces" / name
    # CI and every checkout beside ../shared have the traces: their absence is a failure, not a skip.
    assert path.is_file(), f"no shared trace at {path} (set KVROUTE_SHARED_DIR to the shared directory)"
    return path


def test_the_real_traces_first_lines_load() -> None:
    for name in ("mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"):
        trace = load_trace(_shared_trace(name), 0.0, 0.5)
        assert 10 < len(trace.requests) < 1000
        for r in trace.requests[:50]:
            assert (len(r.hash_ids) - 1) * 512 < r.input_length <= len(r.hash_ids) * 512
            assert len(prompt_text(r.hash_ids, r.input_length)) == 4 * r.input_length
        assert [r.sent_s for r in trace.requests] == sorted(r.sent_s for r in trace.requests)
    # The shared README's figure: the synthetic trace's first 12 minutes reuse 0.45 of their blocks.
    first12 = load_trace(_shared_trace("mooncake_synthetic_trace.jsonl"), 0.0, 12.0)
    assert ideal_reuse(first12.requests)["blocks"] == pytest.approx(0.45, abs=0.01)


@pytest.mark.slow
def test_a_trace_replays_on_a_disaggregated_fleet_with_its_inter_token_gaps(tmp_path: Path) -> None:
    path = _write(tmp_path / "conv.jsonl", _conversations())
    out = tmp_path / "out"
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(["--trace", str(path), "--roles", "prefill:1,decode:2", "--workers", "3",
                    "--policies", "cache_aware+always,cache_aware+agg", "--time-scale", "0.3", "--out", str(out)])  # fmt: skip
    assert code == 0
    routers = json.loads((out / "results.json").read_text())["routers"]
    split, agg = routers["cache_aware+always"], routers["cache_aware+agg"]
    for r in (split, agg):
        assert r["requests_measured"] == 36 and r["requests_failed"] == 0, r
        assert r["itl_gaps"] > 0 and 0 <= r["itl_p50_s"] <= r["itl_p99_s"] and r["itl_p99_s"] > 0
    assert split["pd"]["pulls"] == split["route_reasons"]["pd"] == 36 and agg["pd"]["pulls"] == 0
