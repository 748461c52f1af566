"""The cost model behind cache-aware routing: predicted time to first token.

Defaults are derived from `shared/calibration/h200_kv_costs.json` (one H200, bf16,
Llama-3-8B-shaped layers, 32 layers):

* prefill cost per token grows with context (attention is quadratic). The calibration gives
  the whole prompt's prefill time T(N) for N = 1k..32k tokens (32 layers): 92 ms at 4k,
  474 ms at 16k, 1210 ms at 32k. T(N) = base·N + ctx·N²/2 with base = 20.3 µs and
  ctx = 1.01 ns fits 4k..32k within 1.5% (below 4k fixed overheads dominate: 28 ms at 1k,
  which a router can ignore). The marginal cost of token x is base + ctx·x, so prefilling
  tokens start..end with start already cached costs base·(end-start) + ctx·(end²-start²)/2.
* a pool hit is charged the host→device copy instead: 128 KiB of K and V per token
  (32 layers · 8 KV heads · 128 dims · 2 · bf16) over 55 GB/s pinned ≈ 2.4 µs/token.

Queued prefill is tracked separately (`WorkerLoad.queued_prefill_s`); the in-flight penalty
only covers the batch steps that running decodes lengthen.

Another model is described with the same five numbers (`--cost-*` flags). Those are priors:
unless `--cost-learning off`, each worker's coefficients are learned online from its answers
(`router/calibration.py`, issue 15), except the ones set explicitly by flag, which stand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.routing import WorkerLoad


DEFAULTS = {"prefill_base_us": 20.3, "prefill_ctx_ns": 1.01, "pool_load_us": 2.4, "inflight_penalty_ms": 0.3, "step_ms": 15.0}
"""The `--cost-*` defaults (the H200 Llama-3-8B calibration above)."""
_SETTING_OF = {
    "prefill_base_s": "prefill_base_us", "prefill_ctx_s": "prefill_ctx_ns", "pool_load_s_per_token": "pool_load_us",
    "inflight_penalty_s": "inflight_penalty_ms", "step_s": "step_ms",
}  # fmt: skip
"""CostModel field -> the setting that gives it."""


@dataclass(frozen=True)
class CostSettings:
    """The `cost` section of the router's config (`--cost-*`): `CostModel`'s numbers in the
    units they are measured in. None: not set, so the default (`DEFAULTS`) is the prior
    and learning may move it; a value set explicitly is held fixed."""

    prefill_base_us: float | None = None
    prefill_ctx_ns: float | None = None
    pool_load_us: float | None = None
    inflight_penalty_ms: float | None = None
    step_ms: float | None = None
    learning: str = "on"
    """on: learn each worker's coefficients online (router/calibration.py); off: fixed costs."""

    def __post_init__(self) -> None:
        if self.learning not in ("on", "off"):
            raise ValueError(f"cost learning must be on or off, not {self.learning!r}")

    def value(self, name: str) -> float:
        v = getattr(self, name)
        return DEFAULTS[name] if v is None else v

    def model(self) -> CostModel:
        return CostModel(
            prefill_base_s=self.value("prefill_base_us") * 1e-6,
            prefill_ctx_s=self.value("prefill_ctx_ns") * 1e-9,
            pool_load_s_per_token=self.value("pool_load_us") * 1e-6,
            inflight_penalty_s=self.value("inflight_penalty_ms") * 1e-3,
            step_s=self.value("step_ms") * 1e-3,
        )

    def fixed(self) -> frozenset[str]:
        """CostModel fields set explicitly: learning leaves them alone."""
        return frozenset(f for f, setting in _SETTING_OF.items() if getattr(self, setting) is not None)


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_base_s: float = 20.3e-6
    """Seconds per prompt token at zero context."""
    prefill_ctx_s: float = 1.01e-9
    """Extra seconds per prompt token for each token of context before it."""
    pool_load_s_per_token: float = 2.4e-6
    """Seconds to load one token's KV from the shared CPU pool."""
    inflight_penalty_s: float = 0.3e-3
    """TTFT added by each request already running on a worker. A running sequence adds its
    KV reads to every batch step: 4k tokens × 128 KiB over the H200's 4.8 TB/s HBM ≈ 0.11 ms
    a step, and a new request's first token waits one to a few steps."""

    step_s: float = 15e-3
    """One engine step under load (a batch-64 decode step at 4k context on the same
    bandwidth model: ≈14 ms). Predicted TTFT differences smaller than a step are below the
    scheduler's resolution — a request waits for the step in progress wherever it lands —
    so cache-aware routing only moves a conversation off the worker holding most of its
    prefix for a predicted gain of more than one step."""

    overhead_s: float = 0.0
    """Fixed seconds per request before its first token beyond its prefill (tokenization,
    scheduling, the step in progress): 0 by default, learned per worker (a slower worker's
    is longer)."""

    def prefill_s(self, start: int, end: int) -> float:
        """Seconds to prefill prompt tokens start..end given start tokens already cached."""
        if end <= start:
            return 0.0
        return self.prefill_base_s * (end - start) + self.prefill_ctx_s * (end * end - start * start) / 2

    def pool_load_s(self, tokens: int) -> float:
        return self.pool_load_s_per_token * max(tokens, 0)

    def predicted_ttft_s(
        self, load: WorkerLoad, gpu_tokens: int, pool_tokens: int, total_tokens: int
    ) -> tuple[float, float]:
        """(prefill seconds, time to first token) of a prompt of total_tokens on a worker at
        `load` whose GPU holds the prompt's first gpu_tokens, with its first pool_tokens in
        the shared pool. The longer of the two is reused, and what the pool holds beyond
        the GPU is charged its copy instead of its prefill; the TTFT adds the prefill
        already queued on the worker, the batch steps its running requests lengthen, and
        how far behind these predictions the worker's queue is running (`lag_s`)."""
        prefill = (
            self.overhead_s
            + self.pool_load_s(pool_tokens - gpu_tokens)
            + self.prefill_s(max(gpu_tokens, pool_tokens), total_tokens)
        )
        return prefill, load.queued_prefill_s + load.inflight * self.inflight_penalty_s + load.lag_s + prefill
