"""Bounded loads, shared by the session and cache-aware policies.

Consistent hashing with bounded loads (Mirrokni et al.) caps every worker at a factor
above the mean; affinity is kept until a worker reaches the cap, then the request spills to
the next choice. Two loads are capped:

* requests in flight (bursts). At low totals a relative cap is tiny (with 4 requests in
  flight over 3 workers it is 3), and spilling a conversation then only duplicates its KV
  for no latency gain: an engine batches dozens of sequences at almost no cost each. So,
  like SGLang's `balance_abs_threshold`, a worker also has to lead the least-loaded one by
  more than an absolute slack before it counts as over the cap.
* the decayed count of recent requests (sustained traffic, which is invisible in flight
  when clients are sequential). Recent counts drift apart transiently as conversations
  progress at different speeds, so their cap gets twice the relative headroom (1.5x the
  mean for the default factor 1.25).

A cap on recent counts is relative to the fleet's mean, so when one conversation is all the
traffic its worker is always "over" it, idle as it is: one agent alone then moves turn
after turn and recomputes its context each time (8 moves in 20 turns on 4
workers). Bounded loads cap only load that costs latency. So the worker holding the
conversation being placed (its *home*, named by the policy) is exempt from the recent cap
while its queues are negligible in the policy's own units: counting this request, no more
requests in flight than the absolute slack (an engine batches that many at almost no cost),
less queued prefill than one engine step, and nothing waiting in the engine. Above that the
caps apply as before, and requests that no worker holds as a conversation (new sessions
on a hot system prompt) are spread by the recent cap however quiet the fleet.

Both caps stand in for load the policy cannot price: bursts and sequential traffic that
queue nothing yet. Once the fleet's queues are visible (their mean queued prefill is at
least one engine step), the policy prices load directly (each candidate's queued prefill,
and the delay a placement's prefill imposes on the requests queued there), and the caps
are lifted: under sustained load they forced conversations off the worker holding them,
onto workers with seconds more queue, to recompute prefixes of up to 50k tokens
(29 of the 151 moves on the Mooncake conversation trace). At low load, where nothing
queues, they spread hot prefixes as before.

Heterogeneous fleets: the caps are shares of the fleet's load, and a worker twice
as fast serves twice the share. When every candidate carries its learned cost model
(`WorkerLoad.cost`), each worker's caps are scaled by its speed relative to the fleet's
mean (the inverse of its predicted prefill of a reference prompt). Without that, a fast
worker's fair share put it over a speed-blind cap, and new sessions were spread onto the
slow workers, where their prefill took twice as long: the p99 of a mixed fleet.
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
