"""Screenshots in a simulated worker's prompt: counted as kvroute counts them, and cached
by content like any other prefix."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loadtests.benchmark.screens import screenshot_part
from loadtests.sim.cluster import SimCluster
from normalizer.media import MediaReader, MediaSettings, qwen2_vl
from router.chain import EstimateChainBuilder
from tests.sim.test_worker import MODEL, metric

pytestmark = pytest.mark.sim_cluster(workers=1, time_scale=0.002, pool=False, extra_args=["--image-rule", "qwen2_vl"])

BLOCK = 16
"""The simulated engine's KV block in tokens: what it caches comes in whole blocks."""


@pytest.fixture
def url(cluster: SimCluster) -> str:
    return cluster.worker_urls["w0"]


def first_turn(seed: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You operate a computer. Answer with one action. " * 8},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Open the settings page and turn on dark mode."},
                    screenshot_part(1920, 1080, seed=seed),
                    {"type": "text", "text": "The screen before that, for comparison:"},
                    screenshot_part(1280, 800, seed=seed + 1),
                ],
            },
        ],
        "max_tokens": 5,
    }


def second_turn(first: dict[str, Any]) -> dict[str, Any]:
    return {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "Action: click(start_box='(1800,40)')"},
            {"role": "user", "content": [{"type": "text", "text": "The menu opened."}, screenshot_part(1920, 1080, seed=99)]},
        ],
    }


def kvroute_tokens(body: dict[str, Any]) -> int:
    return EstimateChainBuilder(MediaReader(MediaSettings(image_rule="qwen2_vl"))).build(body, "chat").total_tokens


def usage(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_prompt_tokens_are_kvroutes_count_and_a_resent_screenshot_is_cached(url: str) -> None:
    first = first_turn(seed=1)
    images = qwen2_vl(1920, 1080) + qwen2_vl(1280, 800)
    assert images == 2693 + 1336
    got = usage(url, first)
    # Counted as the model counts the images, not as 800 KB of base64 text.
    assert abs(got["prompt_tokens"] - kvroute_tokens(first)) <= 2
    assert got["prompt_tokens"] > images
    assert got["prompt_tokens_details"]["cached_tokens"] == 0

    hits_before = metric(httpx.get(f"{url}/metrics").text, "vllm:prefix_cache_hits_total")
    second = second_turn(first)
    again = usage(url, second)
    assert abs(again["prompt_tokens"] - kvroute_tokens(second)) <= 2
    assert again["prompt_tokens"] - got["prompt_tokens"] >= qwen2_vl(1920, 1080)
    # The first turn, both screenshots included, comes back from the cache (in whole blocks).
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached >= got["prompt_tokens"] // BLOCK * BLOCK
    assert cached < again["prompt_tokens"]
    hits = metric(httpx.get(f"{url}/metrics").text, "vllm:prefix_cache_hits_total") - hits_before
    assert hits == cached


def test_a_different_screenshot_of_the_same_size_is_not_cached(url: str) -> None:
    """Keyed by content, not by size: only the text before the first image is reused."""
    usage(url, first_turn(seed=10))
    other = usage(url, first_turn(seed=20))
    assert other["prompt_tokens"] == usage(url, first_turn(seed=10))["prompt_tokens"]
    cached = other["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < 200  # the system prompt and the instruction, before the first image
