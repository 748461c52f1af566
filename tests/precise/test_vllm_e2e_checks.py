"""The real-vLLM stage's reuse check, on its own arithmetic, and its choice of dtype (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path

from loadtests.vllm_e2e.run_e2e import (
    BLOCK,
    Result,
    kv_bytes_per_token,
    native_dtype,
    parse_args,
    reusable_tokens,
)


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


def _cpuinfo(tmp_path: Path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    return str(path)


def test_the_tiny_model_runs_in_bfloat16_only_where_the_cpu_computes_it(tmp_path: Path) -> None:
    assert native_dtype(_cpuinfo(tmp_path, "fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni")) == "bfloat16"
    assert native_dtype(_cpuinfo(tmp_path, "fpu sse2 avx2 amx_bf16 amx_tile")) == "bfloat16"
    # AVX-512 without its BF16 extension, AVX2 only, or no flags to read: float32.
    assert native_dtype(_cpuinfo(tmp_path, "fpu sse2 avx2 avx512f avx512bw")) == "float32"
    assert native_dtype(_cpuinfo(tmp_path, "fpu sse2 avx2 fma")) == "float32"
    assert native_dtype(str(tmp_path / "missing")) == "float32"
    # `--dtype` chooses another, and the pool's gigabytes follow its bytes per token.
    assert parse_args(["--venv", "v", "--model", "m", "--dtype", "float32"]).dtype == "float32"
    assert kv_bytes_per_token("float32") == 2 * kv_bytes_per_token("bfloat16") == 32 * 1024
