"""Cache-aware routing: each request goes where it costs the fleet the least waiting.

For a request r and each candidate worker w the policy prices, in seconds of waiting,

    J(w) = T(w) + D(w) + F(w) + H(w)

* T(w) = Q_w + n_w·π + L_w + P_w: r's own time to first token (`CostModel.predicted_ttft_s`):
  the prefill queued on w, its n running requests × the step time each adds, the lag by
  which w runs behind these predictions (measured), and P_w, r's prefill of what w lacks
  (a run a tier w reaches holds is charged its copy, not its prefill).
* D(w) = P_w · k_w: the wait r's prefill adds to the k requests queued on w for a first
  token; by Little's law about as many will queue behind r there.
* F(w) = ρ/(1-ρ) · R_w: the wait r's recompute adds to later arrivals. R_w is the prefill of
  the prompt tokens that w lacks and exactly one other worker holds (work done twice while
  the copy there goes unused); ρ/(1-ρ) is how many requests an M/M/1 queue at the fleet's
  busy share ρ holds (`recompute_weight`): 0 while nothing queues.
* H(w) = one engine step if w holds less of the prompt than the best holder: differences
  smaller than a step are below the model's resolution, and a move duplicates the KV.

It sends r to the w of least J, within two bounds. Bounded loads (`bounded.within_bounds`)
cap each worker's share of the requests while the fleet shows no queue for J to price (a
hot system prompt makes its first holder cheapest for every new session); the worker that
served the conversation's previous turn is exempt while it is quiet (`conversation_homes`).
And on a fleet of mixed speeds the trade of r's own time for others' is bounded
(`own_time_guarded`): a faster worker as well cached answers r instead when the choice
would make it wait over a quarter longer there.

Every candidate's prices are on the decision (`RouteDecision.scores`, /debug/route). Each
term can be switched off by name (`TERMS`, `--policy-ablate`) to measure what it is worth;
docs/policy.md has the reasons behind each and the measurements.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import ClassVar

from cache_client.base import IndexView
from cache_client.tiers import REMOTE, disk_location, pool_location
from normalizer.prefix import PrefixChain
from router.cost import CostModel, Held
from router.policies.bounded import within_bounds
from router.policies.weights import (
    BUSY_SHORTFALL,
    DEFAULT_LOAD_FACTOR,
    HYSTERESIS_STEPS,
    SLOWER_WORKER_SLACK,
)
from router.routing import CandidateScore, RouteDecision, RouteRequest, WorkerLoad

# Builds a CandidateScore from a plain tuple, skipping the NamedTuple's Python-level __new__:
# one score is built per candidate on every request (measured: 0.2 µs less per candidate).
_new_score = tuple.__new__

TERMS = ("lag", "delay", "recompute", "hysteresis", "caps", "quiet_home", "slower_guard")
"""The policy's terms, each of which `ablate` can switch off to measure what it is worth:
`lag` (the measured lag in the own-TTFT term), `delay` (the Little's-law charge),
`recompute` (the recompute charge), `hysteresis` (the step charged for leaving the best
holder), `caps` (bounded loads), `quiet_home` (the caps' exemption for a quiet home),
`slower_guard` (`own_time_guarded`)."""


def check_ablate(terms: Collection[str]) -> frozenset[str]:
    """`terms` as a set, if every one is a term of the policy (`TERMS`)."""
    unknown = sorted(set(terms) - set(TERMS))
    if unknown:
        raise ValueError(f"unknown cache_aware terms {', '.join(unknown)}; known: {', '.join(TERMS)}")
    return frozenset(terms)


class CacheAwarePolicy:
    name: ClassVar[str] = "cache_aware"
    uses_index: ClassVar[bool] = True

    def __init__(self, load_factor: float = DEFAULT_LOAD_FACTOR, ablate: Collection[str] = ()) -> None:
        """`ablate`: terms (`TERMS`) switched off, for measuring what each is worth."""
        self._load_factor = load_factor
        self.ablate = check_ablate(ablate)
        on = {t: t not in self.ablate for t in TERMS}
        self._lag, self._caps, self._quiet_home, self._slower_guard = (
            on["lag"], on["caps"], on["quiet_home"], on["slower_guard"]
        )
        # Multipliers of the score's charges: 1.0 on, 0.0 ablated (one multiply per candidate).
        self._delay = float(on["delay"])
        self._recompute = float(on["recompute"])
        self._hysteresis_steps = HYSTERESIS_STEPS * on["hysteresis"]

    def choose(
        self, request: RouteRequest, view: IndexView, loads: Sequence[WorkerLoad], cost: CostModel
    ) -> RouteDecision:
        if not self._lag:
            loads = [replace(w, lag_s=0.0) for w in loads]
        chain = request.chain
        total = chain.total_tokens
        eligible = self._eligible(request, view, loads, cost)

        gpu_of = {w.name: chain.tokens_at_depth(view.depth(w.name)) for w in loads}
        held_of = _held(chain, view, loads, gpu_of)
        most_cached = max(gpu_of.values())
        # What only one worker's GPU holds: a conversation's own turns. A prefix on two or
        # more GPUs is shared and replicated already (spreading it further is the bounded
        # loads' job, and a copy made of it stays in use); one a candidate can copy from a
        # tier it reaches is no recompute there.
        second_gpu = sorted(gpu_of.values())[-2] if len(gpu_of) > 1 else 0
        weight = self._recompute * recompute_weight(loads, cost.step_s)
        delay = self._delay
        hysteresis_s = self._hysteresis_steps * cost.step_s
        scores: list[CandidateScore] = []
        for w in loads:
            gpu = gpu_of[w.name]
            # The worker's own learned costs where there are some (a slower GPU prices higher).
            w_cost = w.cost or cost
            prefill, ttft, reuse = w_cost.predicted_ttft_s(w, held_of[w.name], total)
            # What the placement costs the others: its prefill delays the requests that will
            # queue behind it there, about as many as queue there now (Little's law), and
            # what it recomputes of a prefix one other worker holds delays later arrivals.
            # Hysteresis: leaving the worker that holds most of the prefix must win a step.
            score = (
                ttft
                + delay * prefill * w.prefilling
                + weight * w_cost.prefill_s(max(reuse.tokens, second_gpu), most_cached)
                + (hysteresis_s if gpu < most_cached else 0.0)
            )
            within = eligible is None or w.name in eligible
            scores.append(_new_score(CandidateScore, (score, w.recent, w.name, gpu, reuse, prefill, ttft, within, w)))
        scores.sort()  # best first (see CandidateScore)

        chosen = next(s for s in scores if s.within_bound)
        if self._slower_guard:
            chosen = own_time_guarded(chosen, scores, cost.step_s)
        return _decision(chosen, scores)

    def _eligible(
        self, request: RouteRequest, view: IndexView, loads: Sequence[WorkerLoad], cost: CostModel
    ) -> set[str] | None:
        """The workers under the bounded-load caps (None: no caps)."""
        if not self._caps:
            return None
        homes: set[str] = set()
        if self._quiet_home:
            homes = conversation_homes(request, view, loads)
        return {w.name for w in within_bounds(loads, self._load_factor, homes=homes, quiet_prefill_s=cost.step_s)}


def conversation_homes(request: RouteRequest, view: IndexView, loads: Sequence[WorkerLoad]) -> set[str]:
    """The workers that served the previous turn of the request's conversation: those
    holding the chain up to its last reply, else the worker a prompt it extends went to."""
    depth = request.chain.reply_depth
    if depth:
        return {w.name for w in loads if view.depth(w.name) >= depth}
    return {request.continues} if request.continues is not None else set()


def _decision(chosen: CandidateScore, scores: list[CandidateScore]) -> RouteDecision:
    """`chosen` as the decision: its reason, and the others in order as the fallbacks."""
    reuse = chosen.reuse
    # Passing over a worker that reuses more of the prefix is a choice made for load (its
    # bound, or a queue longer than the recompute), not an index that knew nothing: the
    # reason says which, for operators reading misses as lost prefixes.
    if max(s.reuse.tokens for s in scores) > reuse.tokens:
        reason = "overload"
    else:
        reason = _HIT_REASON[reuse.tier]
    others = [s for s in scores if s is not chosen]
    ranking = tuple(s.worker for s in others if s.within_bound) + tuple(s.worker for s in others if not s.within_bound)
    return RouteDecision(
        chosen.worker, reason, cached_tokens=reuse.tokens, reuse=reuse, prefill_s=chosen.prefill_s,
        ranking=ranking, scores=tuple(scores),
    )


_HIT_REASON = {"none": "miss", "gpu": "gpu_hit", "pool": "pool_hit", "disk": "disk_hit", "remote": "remote_hit"}
"""The route reason of a choice reusing as much as any candidate could, by its farthest tier."""


def _held(chain: PrefixChain, view: IndexView, loads: Sequence[WorkerLoad], gpu_of: dict[str, int]) -> dict[str, Held]:
    """What each candidate can reach of the prompt: its GPU's, and its node's pool and disk
    and the remote tier's (another node's pool or disk is out of its reach)."""
    remote = chain.tokens_at_depth(view.depth(REMOTE))
    by_node: dict[str, tuple[int, int]] = {}
    held = {}
    for w in loads:
        tiers = by_node.get(w.node)
        if tiers is None:
            tiers = by_node[w.node] = (
                chain.tokens_at_depth(view.depth(pool_location(w.node))),
                chain.tokens_at_depth(view.depth(disk_location(w.node))),
            )
        held[w.name] = Held(gpu_of[w.name], tiers[0], tiers[1], remote)
    return held


def own_time_guarded(chosen: CandidateScore, scores: Sequence[CandidateScore], step_s: float) -> CandidateScore:
    """`chosen`, unless a faster worker reusing as much of the prompt would answer it sooner.

    The charges for others (D and F) and the caps trade one request's time for the fleet's.
    On a fleet of mixed speeds that trade can send a long new prompt to an idle worker at
    half speed, where it takes twice its prefill: a fast worker finishing one prefill
    doubles its Little's-law charge there, or sits over its in-flight cap with decodes that
    barely delay a prefill. So where `chosen`'s prefill is more than `SLOWER_WORKER_SLACK`
    longer than another candidate's that reuses as much of the prompt, the faster one with
    the lowest predicted TTFT is taken instead when `chosen`'s TTFT is longer by more than
    that slack and more than one engine step. Among workers of one speed the charges
    decide, and moving a request to a worker holding more of it is the caps' and the
    hysteresis' call.
    """
    reuse = chosen.reuse.tokens
    limit = chosen.prefill_s / (1 + SLOWER_WORKER_SLACK)
    faster = [s for s in scores if s.prefill_s < limit and s.reuse.tokens == reuse]
    if not faster:
        return chosen
    quickest = min(faster, key=lambda s: s.ttft_s)
    if chosen.ttft_s - quickest.ttft_s > max(SLOWER_WORKER_SLACK * quickest.ttft_s, step_s):
        return quickest
    return chosen


def recompute_weight(loads: Sequence[WorkerLoad], busy_prefill_s: float) -> float:
    """How many requests a second of recomputed prefill delays: ρ/(1-ρ), the mean number in
    an M/M/1 queue at utilisation ρ, where ρ is the share of workers with at least
    `busy_prefill_s` (one engine step) of prefill queued. With every worker busy, ρ is
    `BUSY_SHORTFALL` of a worker short of full (2W-1 for W workers)."""
    n = len(loads)
    if n == 0:
        return 0.0
    busy = min(sum(1 for w in loads if w.queued_prefill_s >= busy_prefill_s), n - BUSY_SHORTFALL)
    return busy / (n - busy)
