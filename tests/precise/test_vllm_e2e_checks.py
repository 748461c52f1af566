"""The real-vLLM stage's reuse check, on its own arithmetic, its choice of dtype, and phase `nodes`'s
verdict on made-up rows (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtests.e2e.vllm.run_e2e import (
    BLOCK,
    CHECKS,
    LMCACHE_CHUNK,
    Result,
    candidate_view,
    kv_bytes_per_token,
    lmcache_counters,
    native_dtype,
    node_row_ok,
    nodes_verdict,
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


def test_lmcache_counters_read_the_servers_own_hits_and_loads() -> None:
    text = "\n".join([
        "# HELP lmcache_mp_lookup_hit_tokens_total Total tokens found in L1+L2 during lookup",
        'lmcache_mp_lookup_hit_tokens_total{model_name="tiny"} 512.0',
        'lmcache_mp_lookup_hit_tokens_total{model_name="other"} 256.0',
        'lmcache_mp_lookup_hit_l1_tokens_total{model_name="tiny"} 512.0',
        'lmcache_mp_num_chunks_loaded_total{worker_id="0"} 3.0',
        "lmcache_mp_lookup_requested_tokens_total 1024.0",
    ])
    assert lmcache_counters(text) == {"lookup_hit_tokens": 768.0, "chunks_loaded": 3.0}
    assert lmcache_counters("") == {"lookup_hit_tokens": 0.0, "chunks_loaded": 0.0}


POOL_OF = {"w1": "lmcache", "w2": "lmcache-b"}


def _row(step: str, worker: str, view: dict[str, tuple[str, int]], loaded: dict[str, int],
         external: dict[str, int], fleet: dict[str, tuple[str, int]] | None = None) -> dict[str, Any]:
    """A request of phase `nodes`: per candidate (tier, predicted pool tokens)."""
    def as_view(v: dict[str, tuple[str, int]]) -> dict[str, dict[str, Any]]:
        return candidate_view({"candidates": [
            {"worker": w, "node": {"w1": "n0", "w2": "n1"}[w], "tier": tier, "cached_tokens_gpu": 0,
             "cached_tokens_pool": pool} for w, (tier, pool) in v.items()]})
    row = {"step": step, "worker": worker, "candidates": as_view(view),
           "candidates_all": as_view(fleet) if fleet else None,
           "lmcache_loaded_tokens": {"lmcache": 0, "lmcache-b": 0, **loaded},
           "external_hits": {"w1": 0, "w2": 0, **external}}
    row["ok"] = node_row_ok(row, POOL_OF)
    return row


def _run(cross_pool: int, cross_loaded: int, same_pool: int, same_loaded: int) -> list[dict[str, Any]]:
    return [
        _row("n0-turn1", "w1", {"w1": ("none", 0)}, {}, {}),
        _row("cross-node", "w2", {"w2": ("pool" if cross_pool else "none", cross_pool)},
             {"lmcache-b": cross_loaded}, {"w2": cross_loaded},
             fleet={"w1": ("gpu", 0), "w2": ("pool" if cross_pool else "none", cross_pool)}),
        _row("same-node", "w1", {"w1": ("pool", same_pool)}, {"lmcache": same_loaded}, {"w1": same_loaded},
             fleet={"w1": ("pool", same_pool), "w2": ("gpu", 0)}),
    ]


def test_nodes_passes_when_pool_hits_are_predicted_only_on_the_holding_node() -> None:
    chunk = LMCACHE_CHUNK
    verdict = nodes_verdict(_run(0, 0, 2 * chunk, 2 * chunk))
    assert verdict == {"cross_node": True, "same_node": True, "ok": True}
    assert "nodes" in CHECKS


def test_nodes_fails_on_a_pool_hit_predicted_across_nodes() -> None:
    # The router treating n0's pool as w2's: predicted, though n1's server loads nothing.
    verdict = nodes_verdict(_run(2 * LMCACHE_CHUNK, 0, 2 * LMCACHE_CHUNK, 2 * LMCACHE_CHUNK))
    assert not verdict["cross_node"] and not verdict["ok"]


def test_nodes_is_exact_and_needs_a_pool_hit_on_the_holding_node() -> None:
    # One chunk more predicted than n0's server loaded: no slack.
    verdict = nodes_verdict(_run(0, 0, 3 * LMCACHE_CHUNK, 2 * LMCACHE_CHUNK))
    assert verdict["cross_node"] and not verdict["same_node"] and not verdict["ok"]
    # Nothing predicted and nothing loaded is consistent, but not the pool hit phase `nodes` exists for.
    assert not nodes_verdict(_run(0, 0, 0, 0))["same_node"]
    # The engine loaded from the other node's server: that row is wrong.
    rows = _run(0, 0, 2 * LMCACHE_CHUNK, 2 * LMCACHE_CHUNK)
    rows[2]["lmcache_loaded_tokens"] = {"lmcache": 0, "lmcache-b": 2 * LMCACHE_CHUNK}
    assert not node_row_ok(rows[2], POOL_OF)
