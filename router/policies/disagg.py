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
3. Whether to split: D prefilling the part of the prompt it lacks itself (`pd_local`) saves
   P's queue, the transfer and the second hop, but stalls the decodes running on D for that
   prefill (a step mixing a prefill chunk and decodes lasts as long as the chunk). So
   `pd_local` is taken when its predicted time to first token is no worse than the split's
   AND the stall it adds to D's running streams' inter-token latency is within
   `itl_budget_ms`; otherwise `pd`. A D running no decodes is stalled for nobody, so an idle
   fleet prefills locally whenever that is faster, and a conversation's later turns, whose
   new part is short, stay on D while their prefill fits in the budget.

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
from router.routing import PdPlan, RouteDecision, RouteRequest, WorkerLoad
from router.workers import BOTH, DECODE, PREFILL

PD, PD_LOCAL = "pd", "pd_local"
"""The route reasons of a disaggregated fleet's generation requests."""


@dataclass(frozen=True)
class DisaggSettings:
    """The `disagg` section of the router's config (flat keys `pd_*`)."""

    itl_budget_ms: float = 50.0
    """The longest stall a local prefill may add to the inter-token latency of the decodes
    running on a decode worker (0: never prefill on a busy decode worker)."""
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
        if self.itl_budget_ms < 0:
            raise ValueError(f"pd_itl_budget_ms must be >= 0, not {self.itl_budget_ms}")
        if self.link_gbps <= 0 or self.hold_timeout_s <= 0:
            raise ValueError("pd_link_gbps and pd_hold_timeout_s must be positive")

    def pricing(self, kv_bytes_per_token: int = KV_BYTES_PER_TOKEN) -> PdPricing:
        return PdPricing(
            self.itl_budget_ms * 1e-3, kv_bytes_per_token * 8 / (self.link_gbps * 1e9), self.split == "always"
        )


SPLITS = ("auto", "always")
NIXL, SHARED_STORAGE = "nixl", "shared-storage"
CONNECTORS = (NIXL, SHARED_STORAGE)


class PdPricing(NamedTuple):
    itl_budget_s: float = 0.05
    transfer_s_per_token: float = KV_BYTES_PER_TOKEN * 8 / 400e9
    always: bool = False
    """Split whenever a prefill worker is available, unpriced."""


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
        transfer_s=transfer, pull_tokens=pull, prefill_scores=p.scores,
    )  # fmt: skip
    if pricing.always:
        return _decided(d, replace(plan, mode=PD, why="every request is split (pd_split: always)"), transfer + d_cost.step_s)
    if local_ttft > pd_ttft:
        return _decided(d, replace(plan, mode=PD, why="the split answers sooner"), transfer + d_cost.step_s)
    if plan.local_stall_s > pricing.itl_budget_s:
        why = "a local prefill would stall the decode worker's streams beyond the inter-token budget"
        return _decided(d, replace(plan, mode=PD, why=why), transfer + d_cost.step_s)
    why = "no running decodes to stall" if not running else "the local prefill fits in the inter-token budget"
    return _decided(d, replace(plan, why=f"local prefill answers no later; {why}"), local_prefill)


def _decided(d: RouteDecision, plan: PdPlan, prefill_s: float) -> RouteDecision:
    """D's decision with the plan: its reason the plan's mode, its prefill what D computes."""
    return replace(d, reason=plan.mode, prefill_s=prefill_s, pd=plan)
