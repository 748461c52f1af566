"""The cost model behind cache-aware routing: predicted time to first token.

Defaults are derived from `shared/calibration/h200_kv_costs.json` (one H200, bf16,
Llama-3-8B-shaped layers, 32 layers):

* prefill cost per token grows with context (attention is quadratic). Measured per token
  over the whole model: 22.4 µs at 4k tokens, 28.9 µs at 16k, 36.9 µs at 32k. A straight
  line through these, c(x) = 20.3 µs + 0.52 ns · x, fits within 1%; below 4k, fixed
  overheads dominate (27 µs/token at 1k), which a router can ignore. Prefilling tokens
  start..end therefore costs ∫ c(x) dx = base·(end-start) + ctx·(end²-start²)/2.
* a pool hit is charged the host→device copy instead: 128 KiB of K and V per token
  (32 layers · 8 KV heads · 128 dims · 2 · bf16) over 55 GB/s pinned ≈ 2.4 µs/token.

Another model is described with the same four numbers (`--cost-*` flags).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_base_s: float = 20.3e-6
    """Seconds per prompt token at zero context."""
    prefill_ctx_s: float = 0.52e-9
    """Extra seconds per prompt token for each token of context before it."""
    pool_load_s_per_token: float = 2.4e-6
    """Seconds to load one token's KV from the shared CPU pool."""
    inflight_penalty_s: float = 2e-3
    """TTFT added by each request already running on a worker (shared batch steps)."""

    def prefill_s(self, start: int, end: int) -> float:
        """Seconds to prefill prompt tokens start..end given start tokens already cached."""
        if end <= start:
            return 0.0
        return self.prefill_base_s * (end - start) + self.prefill_ctx_s * (end * end - start * start) / 2

    def pool_load_s(self, tokens: int) -> float:
        return self.pool_load_s_per_token * max(tokens, 0)
