"""The constants of cache-aware routing and its bounded loads, each with the figure that set it.

The policy's prices are in seconds from the cost model (`router.cost.CostModel`); these are
the few numbers that are not: the caps' factors and the trade's bounds.
"""

from __future__ import annotations

DEFAULT_LOAD_FACTOR = 1.25
"""A worker's cap, × the fleet's mean load: consistent hashing with bounded loads' c = 1 + ε
at ε = 0.25 (Mirrokni et al.), not tuned here: the caps bind only while no queue shows."""

RECENT_HEADROOM = 2.0
"""The recent-count cap's excess over the mean, in multiples of the in-flight cap's
(1 + 2 × 0.25 = 1.5× the mean): recent counts drift apart as conversations progress at
different speeds, where counts in flight do not."""

DEFAULT_ABS_SLACK = 4
"""Requests in flight a worker must lead the least-loaded one by before its in-flight cap
binds, as SGLang's `balance_abs_threshold`: at 4 in flight over 3 workers the relative
cap alone is 3, and spilling there only duplicates a conversation's KV."""

REFERENCE_PROMPT_TOKENS = 4096
"""The prompt whose learned prefill time sets each worker's speed share of the caps: the
calibration's smallest size past the fixed overheads (`router/cost.py`: 92 ms at 4k)."""

SLOWER_WORKER_SLACK = 0.25
"""How much longer than its quickest placement on a faster worker, equally cached, a request
may be made to wait on a slower one for the sake of others: without a bound, 26 of the
63 slowest requests of five mixed-fleet runs were long new prompts on idle half-speed
workers (twice their prefill). A quarter, not tuned: with it the mixed fleet's p99 was 1.08×
its floors' (`seed`, h200-qwen2.5-72b-tp8, speeds 1,1,1,1,0.5,0.5,0.5,0.5)."""

HYSTERESIS_STEPS = 1.0
"""Engine steps (`CostModel.step_s`) a candidate holding less of the prefix than the best
holder is charged: four steps removed a tenth of the moves on `seed` (seeds 1-3) and moved
neither the mean nor the p99 beyond the runs' noise."""

BUSY_SHORTFALL = 0.5
"""With every worker busy, ρ = (W - this) / W: half a worker short of full, so the recompute
weight ρ/(1-ρ) stays finite at 2W - 1 (15 on 8 workers), the largest value W workers show."""
