"""The index interface: which locations (workers, or the shared pool) hold which prefixes.

A *location* is a worker name (its GPU), or a tier a worker may load from: its node's
LMCache CPU pool (`POOL` in a one-node fleet), its node's disk, the remote tier
(`cache_client/tiers.py` names them). Each location has a capacity model: an LRU over the prefix keys
recorded on it, bounded in tokens, so that prefixes a worker has surely evicted stop
attracting traffic. Implementations: `memory.MemoryIndex` (in-process, the default) and
`redis_index.RedisIndex` (shared by router replicas, on a `redis_conn.RedisBackend`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from normalizer.prefix import PrefixKey

POOL = "__pool__"
"""Location name of the shared CPU pool."""


@dataclass(frozen=True)
class IndexSettings:
    """The `index` section of the router's config: the capacity model of each location."""

    kv_capacity_tokens: int = 840_000
    """KV capacity of each worker in tokens, for the LRU capacity model (one H200's KV for
    Llama-3-8B, see `cache_client.memory.DEFAULT_CAPACITY_TOKENS`)."""
    pool_capacity_tokens: int = 0
    """>0: each node's workers share an LMCache CPU pool of this many tokens (one pool for
    a fleet given no nodes)."""
    disk_capacity_tokens: int = 0
    """>0: each node's LMCache server also keeps a disk tier of this many tokens."""
    remote_capacity_tokens: int = 0
    """>0: a cluster-wide remote tier (LMCache's remote backend) of this many tokens, which
    every node reads over the network."""
    remote_write_through: bool = True
    """Workers write what they compute to the remote tier too (LMCache's default with a
    remote backend); off: only KV events report what it holds."""
    responses_owner_ttl_s: float = 3600.0
    """How long the router remembers which worker stores a Responses-API response
    (`previous_response_id` affinity, cache_client/response_owners.py)."""


@dataclass(frozen=True, slots=True)
class IndexView:
    """What the index knows about one request's key chain.

    `depths[location]` is how many leading keys of the chain the location holds; locations
    holding none are absent.
    """

    depths: Mapping[str, int] = field(default_factory=dict)

    def depth(self, location: str) -> int:
        return self.depths.get(location, 0)


EMPTY_VIEW = IndexView()


@runtime_checkable
class PrefixIndex(Protocol):
    async def lookup(self, keys: Sequence[PrefixKey]) -> IndexView:
        """Longest run of leading keys held, per location. One round trip at most."""
        ...

    async def record(self, location: str, keys: Sequence[PrefixKey], key_tokens: Sequence[int]) -> None:
        """`keys` (a chain, in order) are now held by `location`, most recently used.

        `key_tokens[i]` is the number of tokens key i adds on top of key i-1: the capacity
        model charges each key that many tokens.
        """
        ...

    async def written(self) -> None:
        """Returns once every write made so far is visible to whoever shares the index (at
        once for an index nobody shares), or its backend is down, or its lookup budget has
        passed. Awaited before an answer's last byte: the client's next turn may come at
        once, through another replica, and must find this turn's prefix."""
        ...

    async def evict(self, location: str, keys: Sequence[PrefixKey]) -> None:
        """`location` no longer holds `keys` (e.g. a vLLM BlockRemoved event)."""
        ...

    async def drop_location(self, location: str) -> None:
        """Forget everything held by `location` (worker failed, left, or cleared its cache)."""
        ...

    def set_capacity(self, location: str, tokens: int) -> None:
        """Bound the capacity model of `location` to `tokens`."""
        ...

    async def usage(self) -> Mapping[str, int]:
        """Tokens the capacity model believes each location holds."""
        ...

    async def close(self) -> None: ...


class IndexObserver(Protocol):
    """What an index with a remote backend reports about its health (the router's metrics
    implement it). An index without one (`MemoryIndex`) reports nothing."""

    def index_backend_state(self, up: bool) -> None:
        """True while the backend answers; False while the index answers from its local
        fallback. Called when the observer is attached, then at every change."""
        ...


def key_tokens_of(cum_tokens: Sequence[int]) -> list[int]:
    """Per-key token increments from cumulative counts."""
    out, prev = [], 0
    for c in cum_tokens:
        out.append(c - prev)
        prev = c
    return out
