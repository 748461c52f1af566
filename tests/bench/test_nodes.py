"""`kvroute bench --nodes`: a fleet of nodes, each with its own pool; kvroute told the
topology against kvroute taking every pool for one (`+onepool`); reuse split by tier."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from loadtests.benchmark.bench import RunSetup, _kvroute_args, cli, parse_entries, tier_split

pytestmark = pytest.mark.slow


def test_onepool_entries_are_kvroute_without_the_topology(tmp_path: Path) -> None:
    entries = {e.key: e for e in parse_entries("cache_aware,cache_aware+onepool,cache_aware@learned+onepool", "")}
    assert not entries["cache_aware"].one_pool
    assert entries["cache_aware+onepool"].one_pool and entries["cache_aware+onepool"].policy == "cache_aware"
    assert entries["cache_aware@learned+onepool"].cost == "learned"
    setup = RunSetup(4, "h200-llama3-8b", 1.0, 1000, 5000, tmp_path, nodes=2, remote_capacity_tokens=7000, remote_gbps=25)
    told = _kvroute_args(setup, entries["cache_aware"])
    assert " ".join(told).count("--node") == 2 and "n0=w0,w1" in told and "n1=w2,w3" in told
    assert told[told.index("--remote-capacity-tokens") + 1] == "7000" and told[told.index("--remote-gbps") + 1] == "25"
    blind = _kvroute_args(setup, entries["cache_aware+onepool"])
    assert "--node" not in blind and "--remote-capacity-tokens" in blind


def test_tier_split_compares_the_prediction_with_what_the_workers_served() -> None:
    delta = {"vllm:prefix_cache_queries_total": 1000.0, "cached:gpu": 500.0, "cached:pool": 200.0, "cached:remote": 50.0}
    split = tier_split(delta, 825.0, {"pool": 300.0, "disk": 0.0, "remote": 50.0})
    assert split["worker_hit_ratio_by_tier"] == {"gpu": 0.5, "pool": 0.2, "disk": 0.0, "remote": 0.05}
    assert split["predicted_over_reported_cached"] == pytest.approx(825 / 750)
    assert "predicted_cached_tokens" not in tier_split(delta, None, {})  # a peer predicts nothing


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench-nodes")
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(
            [
                "--scenario", "seed", "--workers", "4", "--nodes", "2",
                "--policies", "cache_aware,cache_aware+onepool", "--time-scale", "0.2", "--warmup", "12",
                "--window", "24", "--seed", "3", "--out", str(out),
            ]
        )  # fmt: skip
    assert code == 0
    return json.loads((out / "results.json").read_text())


def test_workers_report_reuse_by_tier_and_kvroute_predicts_it(run: dict) -> None:
    assert run["config"]["nodes"] == 2 and not run["failed"]
    for key in ("cache_aware", "cache_aware+onepool"):
        r = run["routers"][key]
        served = r["worker_cached_tokens_by_tier"]
        assert served["gpu"] > 0 and served["disk"] == served["remote"] == 0
        assert r["predicted_cached_tokens"] > 0
    aware, blind = run["routers"]["cache_aware"], run["routers"]["cache_aware+onepool"]
    # Told the topology, kvroute predicts what the workers reuse; taking the other node's
    # pool for its own, it predicts copies the workers cannot make.
    assert abs(aware["predicted_over_reported_cached"] - 1) < 0.1
    assert blind["predicted_over_reported_cached"] > aware["predicted_over_reported_cached"]
    assert "cache_aware_over_onepool_ttft_mean" in run["comparison"]


def test_an_uneven_split_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli(["--workers", "5", "--nodes", "2", "--out", str(tmp_path)]) == 2
    assert "split evenly" in capsys.readouterr().err
