"""Where a prefix's KV can be loaded from, and which index locations stand for each tier.

A fleet is a set of nodes, each running workers (GPUs) and one LMCache server: its CPU
pool, and optionally a disk tier under it. LMCache moves KV between the GPUs and that
server over CUDA IPC and PCIe, so a node's pool and disk serve that node's workers only.
An optional remote tier (LMCache's remote backends: a store every node reads over the
network) serves them all. So a prefix held in node A's pool is a cheap copy for a worker on
A and a recompute for a worker on B, unless the remote tier holds it too.

Each tier of each node is one index location, beside the workers' own:

    worker name        its GPU's prefix cache
    pool_location(n)   node n's CPU pool     (`POOL` for the default node: a one-node fleet)
    disk_location(n)   node n's disk tier
    REMOTE             the cluster-wide remote tier

A fleet given no nodes is one node, `DEFAULT_NODE`, whose pool is `POOL`: the locations
and their keys in Redis are those of a router that knows no topology.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from cache_client.base import POOL, IndexSettings

DEFAULT_NODE = ""
"""The node of a worker no topology places: every such worker shares one node."""
DISK = "__disk__"
REMOTE = "__remote__"
"""Location name of the cluster-wide remote tier."""


@lru_cache(maxsize=4096)
def pool_location(node: str) -> str:
    """Location of `node`'s CPU pool (names are built once per node: this is on the hot path)."""
    return POOL if node == DEFAULT_NODE else f"{POOL}:{node}"


@lru_cache(maxsize=4096)
def disk_location(node: str) -> str:
    """Location of `node`'s disk tier."""
    return DISK if node == DEFAULT_NODE else f"{DISK}:{node}"


def is_tier_location(location: str) -> bool:
    """A pool, disk or remote location, not a worker's GPU."""
    return location.startswith(("__pool__", DISK, REMOTE))


@dataclass(frozen=True)
class Tiers:
    """Which tiers a fleet has, and their capacity models (from the `index` section)."""

    pool_capacity_tokens: int = 0
    """>0: each node's CPU pool holds this many tokens."""
    disk_capacity_tokens: int = 0
    """>0: each node's disk tier holds this many tokens."""
    remote_capacity_tokens: int = 0
    """>0: the remote tier holds this many tokens."""
    remote_write_through: bool = True
    """Every prefix a worker computes is written to the remote tier too (LMCache stores to
    every backend it has by default); False: the remote tier is filled by something else
    (another deployment, a warm-up job), and only what KV events report is recorded."""

    @classmethod
    def of(cls, index: IndexSettings) -> Tiers:
        return cls(
            index.pool_capacity_tokens, index.disk_capacity_tokens, index.remote_capacity_tokens,
            index.remote_write_through,
        )

    @property
    def any(self) -> bool:
        """Some tier besides the GPUs."""
        return self.pool_capacity_tokens > 0 or self.disk_capacity_tokens > 0 or self.remote_capacity_tokens > 0

    def written(self, worker: str, node: str) -> tuple[str, ...]:
        """Where a prompt `worker` (on `node`) served is held afterwards: its GPU, and the
        tiers its LMCache stores it to."""
        out = [worker]
        if self.pool_capacity_tokens > 0:
            out.append(pool_location(node))
        if self.disk_capacity_tokens > 0:
            out.append(disk_location(node))
        if self.remote_capacity_tokens > 0 and self.remote_write_through:
            out.append(REMOTE)
        return tuple(out)

    def capacities(self, node: str) -> list[tuple[str, int]]:
        """(location, tokens) of every tier location `node` brings."""
        out = []
        if self.pool_capacity_tokens > 0:
            out.append((pool_location(node), self.pool_capacity_tokens))
        if self.disk_capacity_tokens > 0:
            out.append((disk_location(node), self.disk_capacity_tokens))
        if self.remote_capacity_tokens > 0:
            out.append((REMOTE, self.remote_capacity_tokens))
        return out
