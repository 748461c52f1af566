"""Routing policies, one per module, all behind `base.Policy`."""

from __future__ import annotations

from dataclasses import dataclass

from router.policies.base import Policy
from router.policies.cache_aware import CacheAwarePolicy, check_ablate
from router.policies.least_loaded import LeastLoadedPolicy
from router.policies.random import RandomPolicy
from router.policies.round_robin import RoundRobinPolicy
from router.policies.session import SessionPolicy

POLICIES: dict[str, type] = {
    p.name: p for p in (RandomPolicy, RoundRobinPolicy, LeastLoadedPolicy, SessionPolicy, CacheAwarePolicy)
}


@dataclass(frozen=True)
class RoutingSettings:
    """The `routing` section of the router's config."""

    policy: str = "cache_aware"
    load_factor: float = 1.25
    """Bounded loads (router/policies/bounded.py): no worker takes more than this × the mean
    (in flight and recent)."""
    recent_half_life_s: float = 30.0
    """Half-life of each worker's decayed count of recent requests (the load board)."""
    random_seed: int | None = None
    """`random` only: choose by a hash of this seed and the request's prefix chain (the same
    request goes to the same worker in every run with this seed; router/policies/random.py)."""
    ablate: tuple[str, ...] = ()
    """`cache_aware` only: terms of the policy switched off (`cache_aware.TERMS`), to measure
    what each is worth (docs/policy.md); empty in production."""

    def __post_init__(self) -> None:
        if self.ablate and self.policy != CacheAwarePolicy.name:
            raise ValueError(f"ablate applies to cache_aware, not {self.policy}")
        # A tuple however given (a YAML list, the JSON handed to --processes children).
        object.__setattr__(self, "ablate", tuple(sorted(check_ablate(self.ablate))))


def make_policy(
    name: str, load_factor: float | None = None, random_seed: int | None = None, ablate: tuple[str, ...] = ()
) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    if cls is CacheAwarePolicy:
        return CacheAwarePolicy(**({} if load_factor is None else {"load_factor": load_factor}), ablate=ablate)
    if load_factor is not None and cls is SessionPolicy:
        return cls(load_factor=load_factor)
    if cls is RandomPolicy:
        return RandomPolicy(seed=random_seed)
    return cls()


__all__ = ["POLICIES", "Policy", "RoutingSettings", "make_policy"]
