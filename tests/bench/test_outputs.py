"""`kvroute bench` writes its results before its plots: a plot that fails loses nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.benchmark import bench, plots
from loadtests.benchmark.harness import RequestRecord


def _results() -> dict:
    return {
        "scenario": {
            "name": "seed", "arrival_rate_per_s": 0.5,
            "rates": {"load": 0.8, "capacity_sessions_per_s_random_lb": 0.6},
        },
        "config": {"workers": 2, "profile": "h200-llama3-8b", "time_scale": 0.2, "seed": 3},
        "routers": {}, "failed": {}, "comparison": {}, "plots": [], "wall_s": 1.0,
    }  # fmt: skip


def _records() -> dict[str, list[RequestRecord]]:
    return {"random": [RequestRecord(0, t, "chat", True, float(t), 200, ttft_s=0.1 * (t + 1)) for t in range(4)]}


def test_a_failing_plot_is_logged_and_the_results_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken() -> None:
        raise RuntimeError("no display, no fonts, no luck")

    monkeypatch.setattr(plots, "_pyplot", broken)
    results = _results()
    bench.write_outputs(tmp_path, results, _records(), "seed, 2 workers")
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["scenario"]["name"] == "seed" and written["plots"] == []
    assert (tmp_path / "results.md").read_text().startswith("# kvroute bench")
    assert not list(tmp_path.glob("*.png"))
    assert "no plots (RuntimeError: no display, no fonts, no luck)" in capsys.readouterr().err


def test_plots_are_listed_once_drawn(tmp_path: Path) -> None:
    results = _results()
    bench.write_outputs(tmp_path, results, _records(), "seed, 2 workers")
    written = json.loads((tmp_path / "results.json").read_text())
    assert [Path(p).name for p in written["plots"]] == ["ttft_cdf.png", "ttft_by_turn.png"]
    assert (tmp_path / "ttft_cdf.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob("*.tmp"))


def test_a_capacity_search_adds_the_load_curve(tmp_path: Path) -> None:
    results = _results()
    results["config"]["slo_p99_ttft_s"] = 2.0
    trial = {"time_scale": 1.0, "ttft_mean_s": 0.1, "requests_failed": 0, "bottleneck": False}
    results["routers"] = {
        "random": {"capacity": {"trials": [{**trial, "rate_per_s": r, "ttft_p99_s": p} for r, p in ((1, 1.5), (2, 3.0))]}},
        "cache_aware": {"capacity": {"trials": [{**trial, "rate_per_s": 4, "ttft_p99_s": 0.5, "bottleneck": True}]}},
    }
    drawn = bench._plots(tmp_path, results, _records(), "seed, 2 workers")
    assert [Path(p).name for p in drawn] == ["ttft_cdf.png", "ttft_by_turn.png", "capacity.png"]
    assert (tmp_path / "capacity.png").read_bytes()[:4] == b"\x89PNG"
