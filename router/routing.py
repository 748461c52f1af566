"""The routing decision's inputs and output. Pure data; no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from cache_client.base import IndexView
from cache_client.tiers import DEFAULT_NODE
from normalizer.prefix import PrefixChain
from router.cost import NO_REUSE, CostModel, Reuse


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One candidate worker's load, as the router sees it at decision time."""

    name: str
    inflight: int = 0
    """Requests the router has sent to it that have not finished."""
    queued_prefill_s: float = 0.0
    """Predicted prefill seconds of its requests that have not produced a first byte yet."""
    recent: float = 0.0
    """Requests routed to it recently (exponentially decayed count): load that persists
    between requests, so that sequential traffic spreads too."""
    engine_waiting: int = 0
    """`vllm:num_requests_waiting` from its last scraped /metrics (0 if not scraped)."""
    cost: CostModel | None = None
    """Its own cost model, learned online (router/calibration.py); None: the router's."""
    prefilling: int = 0
    """Requests the router has sent to it that have not produced a first byte yet (the
    queue whose prefill `queued_prefill_s` sums)."""
    lag_s: float = 0.0
    """How far behind its prediction the oldest streamed request still awaiting its first
    token there is, now: queueing the cost model does not see (an engine whose KV is full
    admits a waiting request only as running ones finish), measured instead of modelled."""
    node: str = DEFAULT_NODE
    """The node it runs on: which pool and disk tier it can load from."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    chain: PrefixChain
    session_key: str | None = None
    continues: str | None = None
    """For a chain without a reply (`reply_depth` 0): the worker holding a prompt this
    request continues, as the router's memory of where its prompts ended answers it
    (`cache_client.served_ends.ServedEnds.lookup`); None if it continues none it knows."""


class CandidateScore(NamedTuple):
    """One candidate as the cache-aware policy priced it. Scores compare in the policy's
    order of preference (lower score, then fewer recent requests, then name; names are
    unique, so comparison never reaches the later fields). A NamedTuple: the policy builds
    one per candidate on every request, and sorts them as they are."""

    score_s: float
    """What the policy ranks by: `ttft_s`, plus `prefill_s` times the requests queued there
    for their first byte (the delay this placement adds to others), plus the prefill of what
    it would recompute of a prefix only one other worker holds times `recompute_weight` (the
    delay that work adds to the fleet's later arrivals), plus one engine step if the
    candidate is not the worker holding most of the prefix."""
    recent: float
    """Its decayed count of recent requests: the tie-break."""
    worker: str
    gpu_tokens: int
    """Prompt tokens held on its GPU."""
    reuse: Reuse
    """How it would get the cached part: its GPU's, then copies from the tiers it reaches
    (`CostModel.reuse`); `reuse.tier` names the farthest, the tier that priced it."""
    prefill_s: float
    """Predicted prefill seconds of this request on it (`CostModel.predicted_ttft_s`)."""
    ttft_s: float
    """Predicted time to first token on it (`CostModel.predicted_ttft_s`)."""
    within_bound: bool
    """Under the bounded-load caps: only such candidates can be chosen."""
    load: WorkerLoad
    """The load it was priced at (in-flight count, queued prefill)."""


PD, PD_LOCAL = "pd", "pd_local"
"""The route reasons of a disaggregated fleet's generation requests: split, or prefilled on D."""


@dataclass(frozen=True, slots=True)
class PdPlan:
    """How a disaggregated fleet serves one request, and the numbers that chose it."""

    mode: str
    """`pd` (P prefills, D pulls and decodes) or `pd_local` (D prefills what it lacks)."""
    why: str
    prefill_worker: str | None = None
    prefill_ranking: tuple[str, ...] = ()
    """Other prefill-capable workers, best first: where to prefill if P fails."""
    prefill_s: float = 0.0
    """P's predicted prefill of this request."""
    local_prefill_s: float = 0.0
    """D's predicted prefill of what it lacks (the stall a local prefill adds to its decodes)."""
    local_ttft_s: float = 0.0
    pd_ttft_s: float | None = None
    """None: no prefill worker to split with."""
    transfer_s: float = 0.0
    pull_tokens: int = 0
    """Prompt tokens D lacks, pulled from P."""
    running_decodes: int = 0
    itl_budget_s: float = 0.0
    local_excess_stall_s: float = 0.0
    """What a local prefill stalls each of D's running decodes beyond the budget, summed over
    the gaps it stalls."""
    local_cost_s: float = 0.0
    """The local way's price: its TTFT + the stall beyond the budget × D's running decodes × the
    stall's weight +
    its prefill × the prefills waiting on D."""
    pd_cost_s: float | None = None
    """The split's price: its TTFT + P's prefill × the prefills waiting on P."""
    decode_reason: str = ""
    """The policy's own reason for D (gpu_hit, miss, overload, ...)."""
    prefill_scores: tuple[CandidateScore, ...] = ()
    prefill_cached_tokens: int = 0
    """Prompt tokens the prefill worker is predicted to reuse."""

    @property
    def local_stall_s(self) -> float:
        """The stall a local prefill adds to the inter-token gaps of D's running decodes
        (none running: nobody is stalled)."""
        return self.local_prefill_s if self.running_decodes else 0.0


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker: str
    reason: str
    """gpu_hit, pool_hit, disk_hit, remote_hit, miss, overload, session, random,
    round_robin, least_loaded."""
    cached_tokens: int = 0
    """Prompt tokens predicted to be reused on the chosen worker (its GPU or a tier)."""
    reuse: Reuse = NO_REUSE
    """How the chosen worker reuses them, by tier (policies that price candidates)."""
    prefill_s: float = 0.0
    """Predicted prefill seconds of this request on the chosen worker."""
    ranking: tuple[str, ...] = ()
    """Other candidates, best first: where to retry if the chosen worker fails."""
    scores: tuple[CandidateScore, ...] = ()
    """Every candidate as the policy priced it, in its order of preference (the chosen one
    is the first within the bound, unless a faster worker answers it much sooner:
    `cache_aware.own_time_guarded`); empty for policies that do not price candidates."""
    pd: PdPlan | None = None
    """In a disaggregated fleet: the prefill worker and whether to split (`worker` is the
    decode worker; router/policies/disagg.py). None: an aggregated fleet."""

    @property
    def engine_cached_tokens(self) -> int:
        """The prompt tokens the engine computing the prompt is predicted to reuse, what its
        usage reports: the prefill worker's on a split, else `cached_tokens`."""
        return self.pd.prefill_cached_tokens if self.pd is not None and self.pd.mode == PD else self.cached_tokens


class Routed(NamedTuple):
    """`Proxy.decide`'s result: the decision and what it was made from."""

    decision: RouteDecision
    chain: PrefixChain
    view: IndexView
    """The one index lookup's answer (empty if the policy does not read the index)."""
    loads: Sequence[WorkerLoad]
    """The candidates' loads, as the policy saw them."""


def rank_rest(chosen: str, loads: Sequence[WorkerLoad]) -> tuple[str, ...]:
    """Fallback order for retries when a policy has no better opinion: least loaded first."""
    rest = sorted((w for w in loads if w.name != chosen), key=lambda w: (w.inflight, w.recent))
    return tuple(w.name for w in rest)
