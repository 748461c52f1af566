"""The real-vLLM stage's reuse check, on its own arithmetic (no vLLM needed)."""

from __future__ import annotations

from loadtests.vllm_e2e.run_e2e import BLOCK, Result, reusable_tokens


def _r(conversation: int, prompt_tokens: int) -> Result:
    return Result(0.0, "w1", "miss", prompt_tokens, conversation)


def test_reusable_tokens_are_each_previous_prompt_in_whole_blocks() -> None:
    answered = [_r(0, 100), _r(1, 70), _r(0, 150), _r(1, 130), _r(0, 200)]
    # First turns: nothing. Then 100 -> 96 and 150 -> 128 for conversation 0, 70 -> 64 for 1.
    assert reusable_tokens(answered) == 96 + 64 + 128
    assert BLOCK == 32


def test_an_engine_always_computes_the_last_prompt_token() -> None:
    # The same 64-token prompt twice: at most 63 tokens are served from cache, i.e. 32.
    assert reusable_tokens([_r(0, 64), _r(0, 64)]) == 32
