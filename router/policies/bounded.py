"""Bounded loads, shared by the session and cache-aware policies.

Consistent hashing with bounded loads (Mirrokni et al.) caps every worker at a factor above
the mean; affinity is kept until a worker reaches the cap, then the request spills to the
next choice. Two loads are capped:

* requests in flight (bursts), and only once a worker also leads the least-loaded one by an
  absolute slack, as SGLang's `balance_abs_threshold`: an engine batches a few more
  sequences at almost no cost, and spilling then only duplicates a conversation's KV;
* the decayed count of recent requests (sustained traffic, invisible in flight when clients
  are sequential), with more headroom: recent counts drift apart as conversations progress
  at different speeds.

The caps stand in for load a policy cannot price: bursts and sequential traffic that queue
nothing yet. A policy that prices queues passes its engine step (`quiet_prefill_s`): once
the fleet's mean queued prefill reaches it the caps are lifted, and below it a worker
holding the conversation being placed (its *home*, named by the policy) is exempt from the
recent cap while it is quiet, since one conversation alone is always over a cap relative to
the mean. Requests no worker holds as a conversation (new sessions on a hot system prompt)
are spread by the recent cap however quiet the fleet.

On a fleet of mixed speeds each worker's caps scale with its speed relative to the mean
(from the learned costs every candidate carries, `WorkerLoad.cost`): a worker twice as fast
serves twice the share. The reasons and measurements are in docs/policy.md.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from router.policies.weights import (
    DEFAULT_ABS_SLACK,
    DEFAULT_LOAD_FACTOR,
    RECENT_HEADROOM,
    REFERENCE_PROMPT_TOKENS,
)
from router.routing import WorkerLoad


def within_bounds(
    loads: Sequence[WorkerLoad],
    load_factor: float = DEFAULT_LOAD_FACTOR,
    abs_slack: int = DEFAULT_ABS_SLACK,
    homes: Collection[str] = (),
    quiet_prefill_s: float = 0.0,
) -> list[WorkerLoad]:
    """Workers whose load, counting the request being placed, stays under the caps.

    `homes`: the workers holding the conversation being placed; each is exempt from the
    recent cap while it is quiet (see the module docstring). `quiet_prefill_s` is one engine
    step, `CostModel.step_s`: the queued prefill below which a worker is quiet, and at or
    above which (as the fleet's mean) the caps are lifted; the default 0 does neither.
    """
    n = len(loads)
    # Load the queues show is priced by the policy: the caps stand in for it only while the
    # fleet's queues are negligible (see the module docstring).
    if quiet_prefill_s > 0 and sum(w.queued_prefill_s for w in loads) / n >= quiet_prefill_s:
        return list(loads)
    share = speed_shares(loads)
    inflight_mean = (sum(w.inflight for w in loads) + 1) / n
    least_inflight = min(w.inflight for w in loads)
    recent_mean = (sum(w.recent for w in loads) + 1) / n

    def quiet_home(w: WorkerLoad) -> bool:
        return (
            w.name in homes
            and w.inflight + 1 <= abs_slack
            and w.queued_prefill_s < quiet_prefill_s
            and w.engine_waiting == 0
        )

    def over(w: WorkerLoad) -> bool:
        f = share.get(w.name, 1.0)
        busy = w.inflight + 1 > load_factor * inflight_mean * f + 1 and w.inflight + 1 - least_inflight > abs_slack
        recent_cap = (1 + RECENT_HEADROOM * (load_factor - 1)) * recent_mean * f + 1
        return busy or (w.recent + 1 > recent_cap and not quiet_home(w))

    eligible = [w for w in loads if not over(w)]
    # The least-loaded worker is always under the mean, so this only trips on float edge cases.
    return eligible or [min(loads, key=lambda w: (w.inflight, w.recent))]


def speed_shares(loads: Sequence[WorkerLoad]) -> dict[str, float]:
    """Each worker's speed relative to the candidates' mean (mean 1), from their learned
    costs; empty (all equal) unless every candidate has one."""
    if not loads or any(w.cost is None for w in loads):
        return {}
    speeds = {w.name: 1.0 / max(w.cost.prefill_s(0, REFERENCE_PROMPT_TOKENS), 1e-9) for w in loads}  # type: ignore[union-attr]
    mean = sum(speeds.values()) / len(speeds)
    return {name: v / mean for name, v in speeds.items()}
