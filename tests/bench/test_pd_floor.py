"""`loadtests.benchmark.pd_floor`: what any split decision must give up to meet an inter-token target,
from an aggregated run's own requests."""

from __future__ import annotations

import pytest

from loadtests.benchmark.pd_floor import split_floor

ROLES = {"w0": "prefill", "w1": "decode", "w2": "decode"}


def record(i: int, prompt: int, cached: int, ttft: float = 0.05, tokens: int = 101) -> dict:
    return {"sent_s": float(i), "prompt_tokens": prompt, "cached_tokens": cached, "ttft_s": ttft,
            "completion_tokens": tokens}  # fmt: skip


def floor(records: list[dict], itl_p99: float, running: float = 4.0) -> dict:
    agg = {"itl_p99_s": itl_p99, "itl_p50_s": 0.008}
    split = {"roles": ROLES, "queues": {"running_mean_per_worker": {"w0": 1.0, "w1": running, "w2": running}}}
    return split_floor(agg, records, split)


def test_short_new_turns_need_no_split() -> None:
    f = floor([record(i, 20_000, 19_800) for i in range(100)], itl_p99=0.04)
    assert f["local_prefills_over_target"] == 0 and f["min_split_share"] == 0
    assert f["ttft_floor_over_agg"] == pytest.approx(1.0)


def test_long_new_prompts_beyond_the_allowance_must_split_and_pay_a_step_and_the_transfer() -> None:
    # 100 requests of 100 gaps each: 1% is 100 stalled gaps, 25 local prefills at 4 running decodes.
    f = floor([record(i, 8_000, 0) for i in range(100)], itl_p99=0.04)
    assert f["local_prefills_over_target"] == 100 and f["min_split_share"] == pytest.approx(0.75)
    per_split = 0.008 + 8_000 * 131_072 * 8 / 400e9
    assert f["ttft_floor_mean_s"] == pytest.approx(0.05 + 0.75 * per_split)
    assert f["prefill_worker_utilisation"] > 0 and f["ttft_floor_with_queue_mean_s"] > f["ttft_floor_mean_s"]
    # A looser target lets every prefill stay local.
    assert floor([record(i, 8_000, 0) for i in range(100)], itl_p99=1.0)["min_split_share"] == 0
