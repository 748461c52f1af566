"""A conversation evicted from its node continues on the other node from the remote tier
(`python -m loadtests.measure.tier_eviction`, on a fast clock): routed as a remote hit, loaded from
there by the worker; without a remote tier, a recompute."""

from __future__ import annotations

import pytest

from loadtests.measure.tier_eviction import run_fleet

pytestmark = pytest.mark.slow


async def test_an_evicted_conversation_is_loaded_from_the_remote_tier_on_another_node() -> None:
    remote = await run_fleet(True, 20_000, 0.05)
    assert remote["first_turn_on_n0"] and remote["continued_on_n1"]
    assert remote["reason"] == "remote_hit"
    served = remote["served_tokens_by_tier"]
    # Every full 256-token chunk of the history from the remote tier, nothing from a GPU.
    assert served["gpu"] == served["pool"] == 0 and remote["prompt_tokens"] - 256 < served["remote"] <= remote["prompt_tokens"]
    recompute = await run_fleet(False, 20_000, 0.05)
    assert recompute["continued_on_n1"] and recompute["reason"] == "miss"
    assert sum(recompute["served_tokens_by_tier"].values()) == 0
