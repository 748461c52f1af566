"""Prefill/decode disaggregation: which decode worker, which prefill worker, and whether to
split the request at all, priced by the cost model.

A disaggregated fleet has workers with roles (router/workers.py): `prefill` workers (P)
compute prompts and hand their KV over (vLLM's NixlConnector), `decode` workers (D)
generate, `both` serve either side and whole requests. The decision is one pure function,
`choose_pd`, on the same inputs as every policy (chain, index view, loads, cost model):

1. D first, by the routing policy over the decode-capable workers: a conversation's own
   turns are in the KV of the decode worker that generated them (and pulled their prompts),
   so the cache-aware policy keeps it there unless that worker's load costs more.
2. P by the same policy over the prefill-capable workers (not D): its prefix cache and the
   prefill queued there.
3. Whether to split, by what each way costs everyone it delays. D prefilling what it lacks
   itself (`pd_local`) spares P's queue, the transfer and the second hop, but every step
   that computes a chunk of that prefill (the engine's step budget, `chunk_tokens`) also
   lengthens one inter-token gap of each decode running on D by the chunk's compute. The
   `itl_budget_ms` setting is the stall per gap the fleet accepts for free; beyond it, each
   second a running stream is stalled counts as `stall_weight` seconds of time to first
   token (1 by default: a second lost is a second lost). So:

       local = local TTFT + stall_weight × D's running decodes × Σ over stalled gaps of
               (stall − budget)⁺ + D's waiting prefills × D's prefill of this prompt
       split = split TTFT + P's waiting prefills × P's prefill of this prompt

   (the waiting-prefill terms are the Little's-law delay the cache-aware policy charges: a
   prefill holds up the requests queued behind it). The cheaper one wins. A D running no
   decodes, or a local prefill whose chunks stay within the budget, stalls nobody beyond it,
   so a conversation's short new turn stays on D, and a long new prompt goes to P unless
   P's queue costs more than the stall it spares, which keeps the two P from becoming the
   fleet's queue.

The split's time to first token = P's (its queued prefill, its running requests, its
prefill of what it lacks) + the transfer of what D lacks (its KV bytes over the link) + D's
steps its running requests lengthen and the one step that computes the last token. The
local one is D's own prediction (`CostModel.predicted_ttft_s`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from cache_client.base import IndexView
from router.cost import KV_BYTES_PER_TOKEN, CostModel, Held
from router.policies.base import Policy
from router.routing import PD, PD_LOCAL, PdPlan, RouteDecision, RouteRequest, WorkerLoad
from router.workers import BOTH, DECODE, PREFILL


@dataclass(frozen=True)
class DisaggSettings:
    """The `disagg` section of the router's config (flat keys `pd_*`)."""

    itl_budget_ms: float = 50.0
    """The stall a local prefill may add to one inter-token gap of each decode running on a
    decode worker at no charge; beyond it the stall is priced like time to first token (0:
    every stall is priced)."""
    stall_weight: float = 1.0
    """How many seconds of time to first token one second of stall beyond the budget, in one
    running decode, is worth (large: the budget is a hard limit)."""
    chunk_tokens: int = 8192
    """The decode workers' step budget (vLLM's `max_num_batched_tokens`): a local prefill
    computes at most this many tokens per step, so it stalls one gap per chunk."""
    link_gbps: float = 400.0
    """The KV link between prefill and decode workers, Gb/s (one ConnectX-7 per GPU)."""
    hold_timeout_s: float = 480.0
    """How long a prefill worker holds blocks no decode worker read (vLLM's
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT): params older than this are not sent to a decode worker."""
    split: str = "auto"
    """auto: split where the cost model says it pays (module docstring); always: split every
    request a prefill worker can take (as vLLM's proxy does: a baseline for benchmarks)."""
    connector: str = "nixl"
    """How P's KV reaches D. nixl: vLLM's NixlConnector, P's answer carries the
    `kv_transfer_params` D reads the blocks by; shared-storage: a connector that writes the
    prompt's KV to storage every worker reads, keyed by its tokens (vLLM's ExampleConnector),
    so P's answer carries no params and D gets the client's own body."""

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"pd_split must be one of {', '.join(SPLITS)}, not {self.split!r}")
        if self.connector not in CONNECTORS:
            raise ValueError(f"pd_connector must be one of {', '.join(CONNECTORS)}, not {self.connector!r}")
        if self.itl_budget_ms < 0 or self.stall_weight < 0:
            raise ValueError("pd_itl_budget_ms and pd_stall_weight must be >= 0")
        if self.link_gbps <= 0 or self.hold_timeout_s <= 0 or self.chunk_tokens <= 0:
            raise ValueError("pd_link_gbps, pd_hold_timeout_s and pd_chunk_tokens must be positive")

    def pricing(self, kv_bytes_per_token: int = KV_BYTES_PER_TOKEN) -> PdPricing:
        return PdPricing(
            self.itl_budget_ms * 1e-3, kv_bytes_per_token * 8 / (self.link_gbps * 1e9), self.split == "always",
            self.chunk_tokens, self.stall_weight,
        )  # fmt: skip


SPLITS = ("auto", "always")
NIXL, SHARED_STORAGE = "nixl", "shared-storage"
CONNECTORS = (NIXL, SHARED_STORAGE)


class PdPricing(NamedTuple):
    itl_budget_s: float = 0.05
    transfer_s_per_token: float = KV_BYTES_PER_TOKEN * 8 / 400e9
    always: bool = False
    """Split whenever a prefill worker is available, unpriced."""
    chunk_tokens: int = 8192
    stall_weight: float = 1.0

    def excess_stall_s(self, prefill_s: float, tokens: int) -> float:
        """What a local prefill of `tokens` taking `prefill_s` stalls one running decode
        beyond the budget: each step computing a chunk stalls one gap by its share."""
        gaps = max(-(-tokens // self.chunk_tokens), 1)
        return gaps * max(prefill_s / gaps - self.itl_budget_s, 0.0)


def roles_split(loads: Sequence[WorkerLoad], roles: Mapping[str, str]) -> tuple[list[WorkerLoad], list[WorkerLoad]]:
    """(decode-capable, prefill-capable) candidates. With no decode-capable worker left the
    prefill workers serve whole requests: like vLLM's `kv_both`, any worker can."""
    decoders = [w for w in loads if roles.get(w.name, BOTH) != PREFILL]
    prefillers = [w for w in loads if roles.get(w.name, BOTH) != DECODE]
    return (decoders or list(loads)), prefillers


def _priced(decision: RouteDecision, load: WorkerLoad, view: IndexView, request: RouteRequest, cost: CostModel) -> tuple[float, float, int]:
    """(prefill, TTFT, GPU-held tokens) of the chosen worker: the policy's own figures where
    it priced candidates, else the cost model's for what its GPU holds."""
    score = next((s for s in decision.scores if s.worker == decision.worker), None)
    if score is not None:
        return score.prefill_s, score.ttft_s, score.gpu_tokens
    chain = request.chain
    gpu = chain.tokens_at_depth(view.depth(load.name))
    prefill, ttft, _ = (load.cost or cost).predicted_ttft_s(load, Held(gpu), chain.total_tokens)
    return prefill, ttft, gpu


def choose_pd(
    policy: Policy, request: RouteRequest, view: IndexView, loads: Sequence[WorkerLoad], cost: CostModel,
    roles: Mapping[str, str], pricing: PdPricing,
) -> RouteDecision:
    """D, P, and whether to split (module docstring): D's decision with a `PdPlan`."""
    decoders, prefillers = roles_split(loads, roles)
    d = policy.choose(request, view, decoders, cost)
    d_load = next(w for w in decoders if w.name == d.worker)
    local_prefill, local_ttft, d_gpu = _priced(d, d_load, view, request, cost)
    running = max(d_load.inflight - d_load.prefilling, 0)
    plan = PdPlan(PD_LOCAL, "", local_prefill_s=local_prefill, local_ttft_s=local_ttft, running_decodes=running,
                  itl_budget_s=pricing.itl_budget_s, decode_reason=d.reason)  # fmt: skip
    others = [w for w in prefillers if w.name != d.worker]
    if not others:
        return _decided(d, replace(plan, why="no prefill worker besides the decode worker"), local_prefill)
    p = policy.choose(request, view, others, cost)
    p_load = next(w for w in others if w.name == p.worker)
    p_prefill, p_ttft, _ = _priced(p, p_load, view, request, cost)
    d_cost = d_load.cost or cost
    pull = max(request.chain.total_tokens - d_gpu, 0)
    transfer = pull * pricing.transfer_s_per_token
    pd_ttft = p_ttft + transfer + d_load.inflight * d_cost.inflight_penalty_s + d_cost.step_s
    plan = replace(
        plan, prefill_worker=p.worker, prefill_ranking=p.ranking, prefill_s=p_prefill, pd_ttft_s=pd_ttft,
        transfer_s=transfer, pull_tokens=pull, prefill_scores=p.scores, prefill_cached_tokens=p.cached_tokens,
    )  # fmt: skip
    if pricing.always:
        return _decided(d, replace(plan, mode=PD, why="every request is split (pd_split: always)"), transfer + d_cost.step_s)
    stall = pricing.excess_stall_s(local_prefill, max(request.chain.total_tokens - d.cached_tokens, 0))
    local_cost = local_ttft + pricing.stall_weight * running * stall + d_load.prefilling * local_prefill
    pd_cost = pd_ttft + p_load.prefilling * p_prefill
    plan = replace(plan, local_excess_stall_s=stall, local_cost_s=local_cost, pd_cost_s=pd_cost)
    if pd_cost < local_cost:
        why = "the split answers sooner" if pd_ttft < local_ttft else "the stall a local prefill adds to D's decodes costs more than the split"
        return _decided(d, replace(plan, mode=PD, why=why), transfer + d_cost.step_s)
    if not running or not stall:
        why = "no running decodes to stall" if not running else "the local prefill stays within the inter-token budget"
    else:
        why = "the split's queue costs more than the stall the local prefill adds"
    return _decided(d, replace(plan, why=f"local prefill: {why}"), local_prefill)


def _decided(d: RouteDecision, plan: PdPlan, prefill_s: float) -> RouteDecision:
    """D's decision with the plan: its reason the plan's mode, its prefill what D computes."""
    return replace(d, reason=plan.mode, prefill_s=prefill_s, pd=plan)
