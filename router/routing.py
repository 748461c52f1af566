"""The routing decision's inputs and output. Pure data; no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache_client.base import POOL, IndexView
from normalizer.prefix import PrefixChain


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


@dataclass(frozen=True, slots=True)
class RouteRequest:
    chain: PrefixChain
    session_key: str | None = None


@dataclass(frozen=True, slots=True)
class RouteDecision:
    worker: str
    reason: str
    """gpu_hit, pool_hit, miss, overload, session, random, round_robin, least_loaded."""
    cached_tokens: int = 0
    """Prompt tokens predicted to be reused on the chosen worker (its GPU or the pool)."""
    prefill_s: float = 0.0
    """Predicted prefill seconds of this request on the chosen worker."""
    ranking: tuple[str, ...] = ()
    """Other candidates, best first: where to retry if the chosen worker fails."""


def cached_tokens(chain: PrefixChain, view: IndexView, worker: str) -> tuple[int, int]:
    """(tokens held on the worker's GPU, tokens loadable from the shared pool)."""
    return chain.tokens_at_depth(view.depth(worker)), chain.tokens_at_depth(view.depth(POOL))


def rank_rest(chosen: str, loads: Sequence[WorkerLoad]) -> tuple[str, ...]:
    """Fallback order for retries when a policy has no better opinion: least loaded first."""
    rest = sorted((w for w in loads if w.name != chosen), key=lambda w: (w.inflight, w.recent))
    return tuple(w.name for w in rest)
