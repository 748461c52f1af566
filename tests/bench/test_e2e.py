"""A small `kvroute bench` end to end: 2 simulated workers, a short window, a fast clock.

Checks the files it writes, the JSON schema, and that the figures agree with each other
and with what the simulated workers counted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.benchmark.bench import cli
from loadtests.benchmark.workload import SCENARIOS, build_workload

pytestmark = pytest.mark.slow

ROUTER_FIELDS = (
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_mean_s",
    "output_tok_per_s",
    "sessions_completed",
    "predicted_hit_ratio",
    "worker_hit_ratio",
    "kv_held_share",
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("bench")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli(
            [
                "--scenario", "seed", "--workers", "2", "--policies", "random,cache_aware",
                "--time-scale", "0.2", "--warmup", "12", "--window", "24", "--seed", "3",
                "--out", str(out),
            ]
        )  # fmt: skip
    assert code == 0
    return out, json.loads((out / "results.json").read_text()), buf.getvalue()


def test_it_writes_every_output(run) -> None:
    out, _, stdout = run
    for name in ("results.json", "results.md", "requests.jsonl", "ttft_cdf.png", "ttft_by_turn.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "ttft_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    last = stdout.strip().splitlines()[-1]
    summary = json.loads(last)
    assert set(summary["routers"]) == {"random", "cache_aware"}


def test_results_json_schema(run) -> None:
    _, results, _ = run
    assert set(results["routers"]) == {"random", "cache_aware"}
    for key, r in results["routers"].items():
        for field in ROUTER_FIELDS:
            assert field in r, (key, field)
        assert r["requests_measured"] > 20
        assert r["requests_failed"] == 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["ttft_max_s"]
        assert r["ttft_mean_s"] > 0 and r["itl_mean_s"] > 0
        assert 0.0 <= r["kv_held_share"] <= 1.0  # the window's engine time held for KV blocks
        assert r["output_tok_per_s"] == pytest.approx(1 / r["itl_mean_s"])
        h = r["harness"]
        assert set(h["bottleneck"]) >= {"flag", "reasons", "lag_threshold_s", "rule"}
        assert h["cpu"]["process_cores_mean"].keys() == {"simulator", "router", "client"}
        assert h["mean_step_s"] > 0
    assert results["routers"]["random"]["pool"] is False
    assert results["routers"]["cache_aware"]["pool"] is True
    assert isinstance(results["bottleneck"], bool)
    assert results["scenario"]["rates"]["workers"] == 2


def test_figures_are_consistent(run) -> None:
    _, results, _ = run
    rnd, ca = results["routers"]["random"], results["routers"]["cache_aware"]
    # Cache-aware routing over a shared pool reuses far more than random over plain workers.
    assert ca["worker_hit_ratio"] > rnd["worker_hit_ratio"]
    assert ca["computed_prompt_tokens"] < rnd["computed_prompt_tokens"]
    # The router's prediction agrees with what the workers reused.
    assert abs(ca["predicted_hit_ratio"] - ca["worker_hit_ratio"]) < 0.1
    # Random does not consult the index, so it predicts nothing.
    assert rnd["predicted_hit_ratio"] == 0.0
    assert ca["route_reasons"].get("gpu_hit", 0) > 0
    assert set(rnd["route_reasons"]) == {"random"}
    assert ca["ttft_mean_s"] < rnd["ttft_mean_s"]
    # Random sends a later turn to the other of two workers about half the time.
    assert 0.25 < rnd["moved_share"] < 0.75
    ratio = results["comparison"]["random_over_cache_aware_ttft_mean"]
    assert ratio == pytest.approx(rnd["ttft_mean_s"] / ca["ttft_mean_s"])


def test_requests_jsonl_matches_the_summary(run) -> None:
    out, results, _ = run
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    # What the window measures is the workload's rule (`Workload.measures`), request by request.
    sc = results["scenario"]
    wl = build_workload(SCENARIOS["seed"], 3, sc["arrival_rate_per_s"], warmup_s=sc["warmup_s"], window_s=sc["window_s"])
    sessions = {s.index: s for s in wl.sessions}
    assert all(x["measured"] == wl.measures(sessions[x["session"]], x["turn"], x["sent_s"]) for x in rows)
    assert any(x["measured"] for x in rows) and any(not x["measured"] for x in rows)
    for key, r in results["routers"].items():
        measured = [x for x in rows if x["router"] == key and x["measured"]]
        assert len(measured) == r["requests_measured"]
        ttfts = sorted(x["ttft_s"] for x in measured if x["ttft_s"] is not None)
        assert sum(ttfts) / len(ttfts) == pytest.approx(r["ttft_mean_s"])
        # Moves: a measured later turn on another worker than its session's previous turn.
        worker_of = {(x["session"], x["turn"]): x["worker"] for x in rows if x["router"] == key and x["worker"]}
        later = [(x["worker"], worker_of[x["session"], x["turn"] - 1]) for x in measured
                 if x["worker"] and (x["session"], x["turn"] - 1) in worker_of]  # fmt: skip
        assert r["moved_share"] == pytest.approx(sum(a != b for a, b in later) / len(later))


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_the_scenario_runs_through_each_agent_api(tmp_path: Path, api: str, run) -> None:
    """`--api responses|messages`: the same sessions as the module's chat run, through
    /v1/responses or /v1/messages; reused as much, as predicted, with usage read back."""
    import contextlib
    import io

    _, chat_results, _ = run
    out = tmp_path / api
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(
            [
                "--scenario", "seed", "--workers", "2", "--policies", "cache_aware",
                "--time-scale", "0.2", "--warmup", "12", "--window", "24", "--seed", "3",
                "--api", api, "--out", str(out),
            ]
        )  # fmt: skip
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["scenario"]["api"] == api
    ca, chat = results["routers"]["cache_aware"], chat_results["routers"]["cache_aware"]
    assert ca["requests_measured"] > 20 and ca["requests_failed"] == 0
    assert ca["route_reasons"].get("gpu_hit", 0) > 0
    assert abs(ca["predicted_hit_ratio"] - ca["worker_hit_ratio"]) < 0.1
    assert abs(ca["worker_hit_ratio"] - chat["worker_hit_ratio"]) < 0.1
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert all(x["prompt_tokens"] > 0 and x["completion_tokens"] > 0 for x in rows if x["error"] is None)
    assert sum(x["cached_tokens"] for x in rows) > 0
