"""Cache-aware routing: the lowest predicted time to first token, under bounded loads.

For each candidate: predicted TTFT (`CostModel.predicted_ttft_s`) = the prefill work already
queued on it + the requests running on it × their share of each batch step + the prefill of
the prompt tokens it does not hold (tokens held in the shared pool are charged their PCIe
copy instead). The decision carries every candidate's numbers (`RouteDecision.scores`),
which is what `/debug/route` shows. Like
NVIDIA Dynamo's KV router, cache overlap and load are weighed in one currency, so a long
cached conversation stays on its worker unless that worker's queue costs more than
recomputing the conversation elsewhere.

Hot prefixes: a system prompt shared by every session is cached on whichever worker served
it first and would make that worker the cheapest for everyone. Bounded loads cap each
worker's share; spilled requests compute the prefix once on another worker, which then
holds it too — the hot prefix is replicated exactly as far as load requires, while each
conversation's own turns still follow its longer cached prefix. A conversation leaves the
worker holding most of its prefix only for a predicted gain of more than one engine step
(`CostModel.step_s`): smaller differences are noise in the router's view of the queues, and
moving duplicates the conversation's KV on a second worker.

A placement also delays others: its prefill holds up every request that queues behind it
on that worker, about as many as are queued there now (Little's law: requests waiting =
arrival rate × wait). So a candidate's score adds its prefill of this request times the
requests waiting there for their first byte (`WorkerLoad.prefilling`). With no queues this
is zero and the score is the request's own TTFT; under load, recomputing a conversation on
a less busy worker must save more than the work it adds to that worker's queue, which is
what a single request's TTFT does not see (on the Mooncake conversation trace,
greedy TTFT moved 151 of 193 continuing conversations and reused half of what the peers
did; the fleet paid for the recomputes in queueing).

The queue figures are the router's model; the load board also measures how far behind it
each worker runs (`WorkerLoad.lag_s`: how much longer than predicted its oldest streamed
request has been waiting for a first token), and the predicted TTFT adds that lag. Seen
at saturation (`seed` at 9.99 sessions/s): an engine whose KV is full admits a
waiting request only as running ones finish, a wait the model does not see; the worker
holding the shared system prompt looked cheapest for every new session, took 515 of the
window's 1,645 requests and answered 10x later than predicted. Priced with its lag, the
busiest worker took 328, and the run's mean TTFT fell from 0.79–1.13 s to 0.69 s.

Recomputing is also work the fleet does twice. Moving a conversation off its busy holder
recomputes what the holder already has and leaves that copy unused; when the fleet is near
saturation the work delays more than the requests queued at the new worker now: every
request arriving before the fleet catches up waits for it. So a candidate is also charged
the prefill of the tokens it lacks that exactly one worker holds (a conversation's own
turns), weighted by ρ/(1-ρ), the number of requests an M/M/1 queue at utilisation ρ holds,
with ρ the share of workers with at least one engine step of prefill queued
(`recompute_weight`: 0 on a fleet without queues, so at low load nothing changes; 2W-1
when every worker queues). A prefix that two or more workers hold, or the pool, is not
charged: it is shared and replicated already (a hot system prompt), a further copy stays in
use, and spreading it is the bounded loads' job. (Charging it too piled new sessions onto
the first holders of a shared system prompt in a closed loop of 20 conversations on 3
workers, and their later turns then moved: affinity 0.78–0.82.) Measured (the
Mooncake conversation trace as completions without the pool, 8 workers at the speed where
random saturates): the Little's-law charge alone moved 95–126 conversations holding 2k+
tokens and reused 0.13–0.14 of the prompt tokens (the trace allows 0.204); with this charge
0.167, and the mean TTFT fell from 1.67–1.75 s to 1.26 s: the moves looked right one
request at a time and cost the fleet more than they saved.

Those charges and the caps trade one request's time for the fleet's, and on a fleet of
mixed speeds the trade has a bound (`own_time_guarded`): a request is not sent to a worker
whose prefill of it is over a quarter longer than a faster one's, equally cached, when the
faster one would answer it more than a quarter sooner. Without it the longest new prompts
of a mixed fleet went to idle half-speed workers and were its tail.

A conversation's home is a worker holding the prompt of its previous turn: while that
worker's queues are negligible the recent-count cap does not move the conversation
(`bounded.within_bounds`), however much of the recent traffic is the conversation's own.
The previous turn is found
* by its reply: a worker holding the chain up to `reply_depth` (the keys before the last
  assistant message) served the turn that message answers;
* else, for requests without one (completions agents resending a growing prompt, one-message
  chat replays, precise token chains), by `RouteRequest.continues`: the worker a prompt
  this request extends went to, if the index still shows it holding that prompt (the
  proxy's memory of where the prompts it sent ended, `cache_client/served_ends.py`,
  answers it before the decision: the policy itself keeps no state).
A shared prefix is neither: new sessions on a hot system prompt carry no reply, extend no
placed prompt (the first session's prompt went on past the shared part, so the sessions
fork inside it), have no home and are spread as before.
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
        reuse = chosen.reuse
        # Passing over a worker that reuses more of the prefix is a choice made for load
        # (its bound, or a queue longer than the recompute), not an index that knew nothing:
        # the reason says which, for operators reading misses as lost prefixes.
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

    The charges for others (the Little's-law delay, the recompute weight) and the caps
    trade one request's time for the fleet's. On a fleet of mixed speeds that trade sent
    the longest new prompts to idle workers at half speed, where they took twice their
    prefill: a fast worker finishing one prefill doubled a long prompt's Little's-law
    charge there, or sat over its in-flight cap with decodes that barely delay a prefill
    (26 of the slowest 63 requests of five mixed-fleet runs). So on a worker
    whose prefill of this request is more than `SLOWER_WORKER_SLACK` longer than another's
    that reuses as much of it, the trade is bounded: the faster one with the lowest
    predicted TTFT is taken instead when `chosen`'s TTFT is longer by more than that slack
    and more than one engine step. Among workers of one speed the charges decide as before,
    and moving a request to a worker holding more of it stays the caps' and the
    hysteresis' call (they spread hot prefixes).
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
    `busy_prefill_s` (one engine step) of prefill queued. With every worker busy, ρ is taken
    as half a worker short of full (2W-1 for W workers), the largest value W can show."""
    n = len(loads)
    if n == 0:
        return 0.0
    busy = min(sum(1 for w in loads if w.queued_prefill_s >= busy_prefill_s), n - BUSY_SHORTFALL)
    return busy / (n - busy)
