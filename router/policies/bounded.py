"""Bounded loads, shared by the session and cache-aware policies.

Consistent hashing with bounded loads (Mirrokni et al.) caps every worker at a factor
above the mean; affinity is kept until a worker reaches the cap, then the request spills to
the next choice. Two loads are capped: requests in flight (bursts) and the decayed count of
recent requests (sustained traffic, which is invisible in flight when clients are
sequential).
"""

from __future__ import annotations

from collections.abc import Sequence

from router.routing import WorkerLoad

DEFAULT_LOAD_FACTOR = 1.25


def within_bounds(loads: Sequence[WorkerLoad], load_factor: float = DEFAULT_LOAD_FACTOR) -> list[WorkerLoad]:
    """Workers whose load, counting the request being placed, stays under the caps."""
    n = len(loads)
    inflight_cap = load_factor * (sum(w.inflight for w in loads) + 1) / n + 1
    recent_cap = load_factor * (sum(w.recent for w in loads) + 1) / n + 1
    eligible = [w for w in loads if w.inflight + 1 <= inflight_cap and w.recent + 1 <= recent_cap]
    # The least-loaded worker is always under the mean, so this only trips on float edge cases.
    return eligible or [min(loads, key=lambda w: (w.inflight, w.recent))]
