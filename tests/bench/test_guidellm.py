"""The GuideLLM recipe: its derived scenario, its report parser, and a short real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.benchmark.guidellm_recipe import (
    guidellm_scenario,
    run_recipe,
    seed_shape,
    summarize_report,
)
from loadtests.benchmark.workload import SCENARIOS, derive_rates


def test_shape_mirrors_the_seed_scenario() -> None:
    shape = seed_shape(8)
    rates = derive_rates(SCENARIOS["seed"], 8)
    assert shape["sessions_per_s"] == pytest.approx(rates.arrival_rate_per_s)
    assert shape["turns"] == round(rates.requests_per_session)
    assert shape["prefix_count"] == SCENARIOS["seed"].groups
    assert shape["prefix_tokens"] > 3_000  # tools + a multi-kB system prompt
    # Contexts grow by roughly one tool result plus one reply per turn.
    growth = shape["prompt_tokens"] + shape["output_tokens"]
    assert growth * shape["turns"] == pytest.approx(rates.prompt_tokens_per_request * 2 - shape["prefix_tokens"], rel=0.6)


def test_scenario_file_converts_to_wall_time() -> None:
    shape = {"turns": 5, "prefix_tokens": 100, "prefix_count": 2, "first_prompt_tokens": 50,
             "prompt_tokens": 40, "output_tokens": 10, "delay_s": 2.0, "sessions_per_s": 3.0}  # fmt: skip
    sc = guidellm_scenario("http://127.0.0.1:1", shape, time_scale=0.5, duration_s=60, seed=7)["spec"]
    assert sc["backend"]["target"] == "http://127.0.0.1:1"
    assert sc["profile"] == {"kind": "poisson", "rate": [6.0]}
    data = sc["data"][0]
    assert data["delay"] == 1.0 and data["turns"] == 5 and data["prefix_count"] == 2
    assert sc["constraints"] == [{"kind": "max_duration", "seconds": 30.0}]


def test_report_figures_become_simulated_seconds() -> None:
    def dist(mean: float, median: float, p99: float) -> dict:
        return {"successful": {"mean": mean, "median": median, "count": 10, "percentiles": {"p99": p99}}}

    report = {
        "benchmarks": [
            {
                "metrics": {
                    "request_totals": {"successful": 10, "errored": 0},
                    "time_to_first_token_ms": dist(50.0, 40.0, 200.0),
                    "inter_token_latency_ms": dist(8.0, 8.0, 9.0),
                    "output_tokens_per_second": dist(60.0, 60.0, 70.0),
                    "prompt_token_count": dist(1000.0, 900.0, 3000.0),
                }
            }
        ]
    }
    s = summarize_report(report, time_scale=0.5)
    assert s["ttft_mean_s"] == pytest.approx(0.1)
    assert s["ttft_p50_s"] == pytest.approx(0.08)
    assert s["ttft_p99_s"] == pytest.approx(0.4)
    assert s["itl_mean_s"] == pytest.approx(0.016)
    assert s["output_tok_per_s"] == pytest.approx(30.0)
    assert s["requests_successful"] == 10


@pytest.mark.slow
@pytest.mark.guidellm
def test_guidellm_drives_the_simulated_cluster_through_kvroute(tmp_path: Path) -> None:
    """Installs GuideLLM on first use, trains the tokenizer, runs 20 simulated seconds."""
    results = run_recipe(tmp_path, workers=2, time_scale=0.5, policies=("cache_aware",), duration_s=20)
    assert 3.6 < results["tokenizer"]["bytes_per_token"] < 4.4
    ca = results["policies"]["cache_aware"]
    assert "error" not in ca, ca
    assert ca["requests_successful"] > 5
    assert ca["ttft_mean_s"] > 0 and ca["ttft_p99_s"] >= ca["ttft_p50_s"]
    report = json.loads((tmp_path / "cache_aware.guidellm.json").read_text())
    assert report["benchmarks"]
