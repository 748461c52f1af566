"""Precise mode against real vLLM workers and a real LMCache pool (marker `vllm`).

Runs only where the vLLM venv built by loadtests/e2e/vllm/setup_env.sh exists
($KVROUTE_VLLM_VENV or ~/.cache/kvroute/vllm-venv); CI builds it in its own stage
(loadtests/e2e/vllm/ci.sh, which also runs the reuse check). By default this test runs the
sequential checks only (exactness against /tokenize, (a) prediction == engine reuse per
request, (c) pool reuse after a drain, `nodes`: two LMCache servers as two nodes, pool hits
predicted only where the node's server holds the prefix, `vlm`: image conversations on a
tiny Qwen2-VL, the router's predicted prompt and cached tokens against the engine's);
KVROUTE_VLLM_E2E_FULL=1 adds the
reuse check and the random-vs-cache_aware TTFT benchmark (b), whose ratio is then asserted:
a timed comparison, for a quiet machine, which is why CI does not run it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVROUTE_VLLM_VENV", Path.home() / ".cache" / "kvroute" / "vllm-venv"))

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason=f"no vLLM venv at {VENV} (setup_env.sh)"),
]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("tokenizers")
    env = {**os.environ, "KVROUTE_VLLM_VENV": str(VENV)}
    setup = subprocess.run(
        [str(ROOT / "loadtests" / "e2e" / "vllm" / "setup_env.sh")], capture_output=True, text=True, env=env, check=True
    )
    paths = dict(line.split("=", 1) for line in setup.stdout.splitlines() if "=" in line)
    out = tmp_path_factory.mktemp("vllm") / "report.json"
    cmd = [sys.executable, "-m", "loadtests.e2e.vllm.run_e2e", "--venv", paths["VENV"], "--model", paths["MODEL"],
           "--vlm-model", paths["VLM"], "--vlm-site", paths["VLM_SITE"], "--out", str(out)]
    if os.environ.get("KVROUTE_VLLM_E2E_FULL") == "1":
        cmd.append("--ttft-benchmark")
    else:
        cmd.append("--skip-policies")
    subprocess.run(cmd, cwd=ROOT, timeout=1500, check=False)
    assert out.exists(), "the end-to-end run wrote no report"
    return json.loads(out.read_text())


def test_router_tokenizes_exactly_like_the_workers(report: dict) -> None:
    bad = [c for c in report["exactness"]["cases"] if not c["equal"]]
    assert not bad, bad
    assert {c["case"].split("/")[0] for c in report["exactness"]["cases"]} == {"chat", "completion"}


def test_agent_requests_tokenize_and_reuse_exactly(report: dict) -> None:
    agent = report["agent"]
    bad = [c for c in agent["cases"] + agent["reuse"] if not c["equal"]]
    assert not bad, bad
    assert {c["case"].split("/")[0] for c in agent["cases"]} == {"responses", "messages"}
    assert agent["predicted_cached_total"] > 0


def test_predicted_cached_tokens_match_engine_reuse(report: dict) -> None:
    a = report["a"]
    wrong = [r for r in a["requests"] if not r["within_one_block"]]
    assert not wrong, wrong
    assert a["prompt_tokens_match"]
    # Not vacuous: the run reused a lot, and on more than one worker.
    assert a["actual_cached_total"] > 5000
    assert len({r["worker"] for r in a["requests"]}) == 2


def test_moved_conversation_loads_from_the_pool(report: dict) -> None:
    c = report["c"]
    assert c["moved_to"] != c["drained"]
    assert c["external_hits_gained"] > 0
    assert c["moved_predicted_pool_tokens"] == c["external_hits_gained"]
    assert c["moved_ttft_s"] < c["cold_ttft_s"]


def test_pool_hits_are_predicted_only_on_the_node_holding_the_prefix(report: dict) -> None:
    nodes = report["nodes"]
    assert nodes["pools"] == {"n0": "lmcache", "n1": "lmcache-b"}
    steps = {r["step"]: r for r in nodes["requests"]}
    # Every request: the chosen worker's predicted pool tokens are what its engine and its
    # node's LMCache server loaded, exactly; nothing loaded anywhere else.
    wrong = [r for r in nodes["requests"] if not r["ok"]]
    assert not wrong, wrong
    # n0's pool holds the prefix; w2 on n1 is predicted none of it and loads none.
    cross = steps["cross-node"]
    assert cross["worker"] == "w2" and cross["candidates"]["w2"]["node"] == "n1"
    assert cross["candidates"]["w2"]["pool"] == 0 and cross["candidates"]["w2"]["tier"] in ("gpu", "none")
    assert cross["external_hits"]["w2"] == 0 and cross["lmcache_loaded_tokens"]["lmcache"] == 0
    # w1 on n0, its GPU cache reset: a pool hit, as large as n0's server's own count.
    same = steps["same-node"]
    assert same["worker"] == "w1" and same["candidates"]["w1"]["tier"] == "pool"
    assert same["candidates"]["w1"]["pool"] == same["lmcache_loaded_tokens"]["lmcache"] > 0
    assert same["external_hits"]["w1"] == same["candidates"]["w1"]["pool"]
    assert same["lmcache_loaded_tokens"]["lmcache-b"] == 0
    assert nodes["cross_node"] and nodes["same_node"] and nodes["ok"]


def test_router_predicts_image_prompts_and_their_reuse(report: dict) -> None:
    vlm = report["vlm"]
    rows = vlm["requests"]
    # Every request: the router's prompt tokens (images by Qwen2-VL's rule, text estimated)
    # within 10% of the engine's usage.prompt_tokens.
    wrong = [r for r in rows if abs(r["prompt_tokens_router"] - r["prompt_tokens_vllm"]) > 0.1 * r["prompt_tokens_vllm"]]
    assert not wrong, wrong
    # Each image one element of its rule's count; images of several sizes, over several turns.
    assert {tuple(r["image"]) for r in rows} >= {(640, 480), (1280, 800), (1920, 1080)}
    assert all(r["media_tokens_router"] and len(r["media_tokens_router"]) == r["turn"] for r in rows)
    assert max(r["turn"] for r in rows) >= 3
    # Cached tokens over the run: within 10% of what the engine reused, which is most of
    # each follow-up turn (its history, images included).
    predicted, actual = vlm["predicted_cached_total"], vlm["cached_tokens_vllm_total"]
    assert actual > 5000 and abs(predicted - actual) <= 0.1 * actual, (predicted, actual)
    assert all(r["cached_tokens_vllm"] > 0 for r in rows if r["turn"] > 1)
    assert vlm["ok"]


def test_cache_aware_beats_random(report: dict) -> None:
    if "b" not in report:
        pytest.skip("set KVROUTE_VLLM_E2E_FULL=1 for the TTFT comparison")
    assert report["b"]["ttft_ratio"] <= 1 / 3, report["b"]
