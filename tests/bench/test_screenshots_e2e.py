"""`kvroute bench --scenario screenshots` end to end on 2 simulated workers: megabyte
requests go through, and kvroute's predicted reuse is what the workers reused, screenshots
counted alike on both sides (`--image-rule qwen2_vl` for both)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from loadtests.benchmark.bench import cli
from loadtests.benchmark.workload import SCENARIOS, build_workload, session_tokens

pytestmark = pytest.mark.slow

SEED = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("screenshots")
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(
            [
                "--scenario", "screenshots", "--workers", "2", "--time-scale", "0.2", "--warmup", "12",
                "--window", "24", "--policies", "random,cache_aware", "--seed", str(SEED), "--out", str(out),
            ]
        )  # fmt: skip
    assert code == 0
    return out, json.loads((out / "results.json").read_text())


def test_every_request_is_served_and_measured(run) -> None:
    _, results = run
    assert set(results["routers"]) == {"random", "cache_aware"} and not results["failed"]
    assert results["scenario"]["spec"]["image_rule"] == "qwen2_vl"
    assert results["scenario"]["rates"]["request_bytes_per_s"] > 1e6
    for key, r in results["routers"].items():
        assert r["requests_measured"] > 40, key
        assert r["requests_failed"] == 0, key
        assert r["sessions_failed"] == 0, key
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]


def test_kvroute_predicts_the_reuse_the_workers_report(run) -> None:
    _, results = run
    rnd, ca = results["routers"]["random"], results["routers"]["cache_aware"]
    assert abs(ca["predicted_hit_ratio"] - ca["worker_hit_ratio"]) < 0.1
    assert ca["worker_hit_ratio"] > 0.5
    assert ca["worker_hit_ratio"] > rnd["worker_hit_ratio"]
    assert ca["computed_prompt_tokens"] < rnd["computed_prompt_tokens"]
    assert ca["route_reasons"].get("gpu_hit", 0) > 0


def test_the_workers_count_each_request_as_the_workload_does(run) -> None:
    """usage.prompt_tokens of every request is the derivation's count: the screenshots at
    Qwen2-VL's tokens (the client's system-prompt styling adds a few)."""
    out, results = run
    sc = results["scenario"]
    wl = build_workload(SCENARIOS["screenshots"], SEED, sc["arrival_rate_per_s"], warmup_s=sc["warmup_s"], window_s=sc["window_s"])
    sessions = {s.index: s for s in wl.sessions}
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    served = [x for x in rows if x["error"] is None and x["prompt_tokens"]]
    assert len(served) > 100
    for x in served:
        s = sessions[x["session"]]
        toks = session_tokens(s, wl.groups[s.group])
        expected = toks.prompts[x["turn"]]
        assert 0 <= x["prompt_tokens"] - expected <= 0.05 * toks.shared, x
