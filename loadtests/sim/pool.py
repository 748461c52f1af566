"""The simulated KV pool (LMCache's CPU backend, shared by the workers of one node), and
the slower tiers under it.

Semantics kept from LMCache: KV is stored in chunks of 256 tokens, each keyed by a hash
chained over the chunks before it (so a key stands for a whole prefix), only full chunks
are stored, and the store is an LRU bounded by capacity. A worker asks for the longest run
of leading chunks present (`/lookup`), loads them instead of recomputing, and stores every
chunk it computes (`/store`) off its critical path.

A node's LMCache server (`NodeStore`) may have a disk tier under its pool, and every node
may reach a cluster-wide remote tier. A lookup then finds the longest run of leading chunks
held by any of them, each chunk answered by the first tier holding it in LMCache's storage
manager's order (its local CPU pool, its local disk, the remote backend); chunks found on
disk or remote are written back into the pool (LMCache promotes what it loads to its local
CPU cache). A store goes to the pool, the disk, and the remote tier unless it is not
written through. Another node's pool and disk are not reachable.

`kvroute sim-pool --port P --capacity-tokens N` serves:
  POST /lookup {"keys": [k0, k1, ...]}  -> {"hits": n}   n leading keys present (touched);
                                           with slower tiers also "runs": [[tier, chunks], ...]
  POST /store  {"keys": [...]}          -> {"stored": n} n keys newly inserted in the pool
  POST /clear                           -> {"cleared": n}
  GET  /stats, GET /health, GET /metrics
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadtests.sim.costs import DISK, LMCACHE_ORDER, POOL, REMOTE
from loadtests.sim.engine import chain_hashes, salted_seed
from normalizer.tokens import CHARS_PER_TOKEN

CHUNK_TOKENS = 256
DEFAULT_CAPACITY_TOKENS = 20_000_000
"""About 2.6 TB of host RAM at the 8B model's 128 KiB per token: a large CPU pool."""

Runs = list[tuple[str, int]]
"""A lookup's answer: the leading chunks held, as (tier, chunks) runs in prompt order."""


def chunk_keys(data: bytes, seed: str, cache_salt: str | None = None) -> list[int]:
    """Pool keys of the full 256-token chunks of a prompt (`seed`: the model name). A
    request's `cache_salt` keys its chunks apart, as it does its GPU blocks."""
    return chain_hashes(data, CHUNK_TOKENS * CHARS_PER_TOKEN, salted_seed(seed.encode(), cache_salt))


class ChunkStore:
    """An LRU of chunk keys bounded by capacity (pure; the HTTP layer wraps it)."""

    def __init__(self, capacity_tokens: int, chunk_tokens: int = CHUNK_TOKENS) -> None:
        self.chunk_tokens = chunk_tokens
        self.capacity_chunks = max(capacity_tokens // chunk_tokens, 1)
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.lookups = 0
        self.lookup_chunks = 0
        self.hit_chunks = 0
        self.stores = 0
        self.evictions = 0

    def held(self, keys: Sequence[int]) -> int:
        """Leading keys present, without touching the LRU or the counters (a peek)."""
        n = 0
        for key in keys:
            if key not in self.lru:
                break
            n += 1
        return n

    def lookup(self, keys: Sequence[int]) -> int:
        """Leading keys present; they become most recently used (the worker loads them)."""
        self.lookups += 1
        self.lookup_chunks += len(keys)
        n = self.held(keys)
        # Touch the run tail first so that the head (shared by more prompts) is newest.
        for key in reversed(keys[:n]):
            self.lru.move_to_end(key)
        self.hit_chunks += n
        return n

    def hit(self, keys: Sequence[int]) -> None:
        """Count `keys` (held) as loaded and make them most recently used, tail first."""
        for key in reversed(keys):
            self.lru.move_to_end(key)
        self.hit_chunks += len(keys)

    def store(self, keys: Sequence[int]) -> int:
        new = 0
        for key in reversed(keys):
            if key in self.lru:
                self.lru.move_to_end(key)
            else:
                self.lru[key] = None
                new += 1
        self.stores += new
        while len(self.lru) > self.capacity_chunks:
            self.lru.popitem(last=False)
            self.evictions += 1
        return new

    def clear(self) -> int:
        n = len(self.lru)
        self.lru.clear()
        return n

    def stats(self) -> dict[str, Any]:
        return {
            "chunk_tokens": self.chunk_tokens,
            "capacity_chunks": self.capacity_chunks,
            "chunks": len(self.lru),
            "tokens": len(self.lru) * self.chunk_tokens,
            "lookups": self.lookups,
            "lookup_chunks": self.lookup_chunks,
            "hit_chunks": self.hit_chunks,
            "stored_chunks": self.stores,
            "evicted_chunks": self.evictions,
        }


class NodeStore:
    """One node's LMCache server as its workers see it: its CPU pool, an optional disk tier
    under it, and the cluster-wide remote tier if there is one (the same `ChunkStore` in
    every node's `NodeStore`). With neither slower tier it is exactly its pool."""

    def __init__(
        self,
        pool: ChunkStore,
        disk: ChunkStore | None = None,
        remote: ChunkStore | None = None,
        remote_write_through: bool = True,
        order: Sequence[str] = LMCACHE_ORDER,
        node: str = "",
    ) -> None:
        self.pool = pool
        self.disk = disk
        self.remote = remote
        self.remote_write_through = remote_write_through
        self.node = node
        held = {POOL: pool, DISK: disk, REMOTE: remote}
        self.tiers: list[tuple[str, ChunkStore]] = [(t, s) for t in order if (s := held[t]) is not None]
        """The tiers it has, in the order LMCache looks in them: a chunk several hold is
        loaded from the first."""
        if [t for t, _ in self.tiers][:1] != [POOL]:
            raise ValueError("the pool must be the first tier")
        self.loaded_chunks = {POOL: 0, DISK: 0, REMOTE: 0}

    @property
    def tiered(self) -> bool:
        return self.disk is not None or self.remote is not None

    def lookup(self, keys: Sequence[int]) -> Runs:
        """The leading run of chunks any tier holds, as runs of the tier each is loaded
        from. Every tier touches what it serves; what disk and remote serve is written
        back into the pool."""
        if not self.tiered:
            n = self.pool.lookup(keys)
            self.loaded_chunks[POOL] += n
            return [(POOL, n)] if n else []
        pool = self.pool
        pool.lookups += 1
        pool.lookup_chunks += len(keys)
        served: dict[str, list[int]] = {}
        runs: Runs = []
        for key in keys:
            tier = next((t for t, store in self.tiers if key in store.lru), None)
            if tier is None:
                break
            served.setdefault(tier, []).append(key)
            if runs and runs[-1][0] == tier:
                runs[-1] = (tier, runs[-1][1] + 1)
            else:
                runs.append((tier, 1))
        held = {POOL: pool, DISK: self.disk, REMOTE: self.remote}
        for tier, tier_keys in served.items():
            store = held[tier]
            assert store is not None
            store.hit(tier_keys)
            self.loaded_chunks[tier] += len(tier_keys)
        n = sum(count for _, count in runs)
        if n > len(served.get(POOL, ())):
            # Promotion: the whole run ends up in the pool, its head most recently used.
            pool.store(keys[:n])
        return runs

    def store(self, keys: Sequence[int]) -> int:
        """Store computed chunks in every tier LMCache writes to; returns the pool's new ones."""
        new = self.pool.store(keys)
        if self.disk is not None:
            self.disk.store(keys)
        if self.remote is not None and self.remote_write_through:
            self.remote.store(keys)
        return new

    def clear(self) -> int:
        """Empty this node's pool and disk (the remote tier is every node's: left alone)."""
        if self.disk is not None:
            self.disk.clear()
        return self.pool.clear()

    def stats(self) -> dict[str, Any]:
        """The pool's figures, plus the node and its slower tiers' when it has them."""
        out = self.pool.stats()
        if not self.tiered:
            return out
        out["node"] = self.node
        out["loaded_chunks"] = dict(self.loaded_chunks)
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        if self.remote is not None:
            out["remote"] = {**self.remote.stats(), "write_through": self.remote_write_through}
        return out


def _keys_of(body: bytes) -> list[int]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ValueError("body is not JSON") from None
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(keys, list) or not all(isinstance(k, int) for k in keys):
        raise ValueError('expected {"keys": [int, ...]}')
    return keys


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def build_pool_app(store_or_node: ChunkStore | NodeStore) -> Starlette:
    """The pool's HTTP service; given a `NodeStore`, the node's LMCache server with its
    slower tiers behind the same endpoints."""
    node = store_or_node if isinstance(store_or_node, NodeStore) else NodeStore(store_or_node)
    store = node.pool

    async def lookup(request: Request) -> Response:
        try:
            keys = _keys_of(await request.body())
        except ValueError as exc:
            return _json({"error": {"message": str(exc), "type": "BadRequestError", "code": 400}}, 400)
        runs = node.lookup(keys)
        hits = sum(n for _, n in runs)
        if not node.tiered:
            return _json({"hits": hits})
        return _json({"hits": hits, "runs": [[tier, n] for tier, n in runs]})

    async def store_(request: Request) -> Response:
        try:
            keys = _keys_of(await request.body())
        except ValueError as exc:
            return _json({"error": {"message": str(exc), "type": "BadRequestError", "code": 400}}, 400)
        return _json({"stored": node.store(keys)})

    async def clear(request: Request) -> Response:
        return _json({"cleared": node.clear()})

    async def stats(request: Request) -> Response:
        return _json(node.stats())

    async def health(request: Request) -> Response:
        return Response(b"", status_code=200)

    async def metrics(request: Request) -> Response:
        s = store.stats()
        lines = [
            "# TYPE lmcache:local_cache_usage_chunks gauge",
            f"lmcache:local_cache_usage_chunks {s['chunks']}",
            "# TYPE lmcache:num_lookup_chunks_total counter",
            f"lmcache:num_lookup_chunks_total {s['lookup_chunks']}",
            "# TYPE lmcache:num_hit_chunks_total counter",
            f"lmcache:num_hit_chunks_total {s['hit_chunks']}",
            "# TYPE lmcache:num_stored_chunks_total counter",
            f"lmcache:num_stored_chunks_total {s['stored_chunks']}",
            "# TYPE lmcache:num_evicted_chunks_total counter",
            f"lmcache:num_evicted_chunks_total {s['evicted_chunks']}",
        ]
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return Starlette(
        routes=[
            Route("/lookup", lookup, methods=["POST"]),
            Route("/store", store_, methods=["POST"]),
            Route("/clear", clear, methods=["POST"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ]
    )


class PoolClient:
    """A worker's connection to the pool: lookups inline, stores batched in the background."""

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, trust_env=False)
        self._pending: list[int] = []
        self._flusher: asyncio.Task[None] | None = None
        self.errors = 0

    async def lookup(self, keys: list[int]) -> Runs:
        """Leading keys the node's tiers hold, as runs by the tier each loads from; none
        if the pool is unreachable (recompute instead)."""
        if not keys:
            return []
        try:
            r = await self._client.post("/lookup", content=orjson.dumps({"keys": keys}))
            r.raise_for_status()
            body = r.json()
            hits = int(body["hits"])
            if "runs" not in body:
                return [(POOL, hits)] if hits else []
            runs = [(str(tier), int(n)) for tier, n in body["runs"]]
            if not all(tier in (POOL, DISK, REMOTE) and n > 0 for tier, n in runs):
                raise ValueError(f"unexpected runs {runs!r}")
            return runs
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            self.errors += 1
            return []

    def store(self, keys: list[int]) -> None:
        self._pending.extend(keys)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending:
            keys, self._pending = self._pending, []
            try:
                r = await self._client.post("/store", content=orjson.dumps({"keys": keys}))
                r.raise_for_status()
            except httpx.HTTPError:
                self.errors += 1

    async def drain(self) -> None:
        """Until every store issued so far has reached the pool."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        await self._client.aclose()


class LocalPoolClient:
    """The same interface on a `ChunkStore` in this process (`kvroute sim-cluster
    --pool-in-process`, which `kvroute bench` uses): an HTTP round trip from the simulator to
    itself per request cost its event loop a seventh of its CPU in `seed` without simulating
    anything. The pool stays reachable over HTTP for anything else (stats, metrics).

    Not the default: tests/router/test_e2e.py's affinity checks run the cluster at time
    scale 0.02, where the HTTP pool's ~1 ms of wall time per lookup is 50 simulated ms, and
    with the instant pool cache_aware's follow-up affinity there fell to 0.82–0.88 (from
    ≥ 0.95) in 3 of 4 runs, for a reason not yet found."""

    def __init__(self, store: ChunkStore | NodeStore) -> None:
        self.store_ = store if isinstance(store, NodeStore) else NodeStore(store)
        self.errors = 0

    async def lookup(self, keys: list[int]) -> Runs:
        return self.store_.lookup(keys) if keys else []

    def store(self, keys: list[int]) -> None:
        self.store_.store(keys)

    async def drain(self) -> None:
        return None

    async def close(self) -> None:
        return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvroute sim-pool", description="simulated shared LMCache CPU pool")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--capacity-tokens", type=int, default=DEFAULT_CAPACITY_TOKENS)
    return p.parse_args(argv)


def cli(argv: list[str]) -> int:
    from loadtests.sim.serving import QuietServer, run_servers, server_for

    args = parse_args(argv)

    async def build() -> tuple[list[QuietServer], None]:
        app = build_pool_app(ChunkStore(args.capacity_tokens))
        return [server_for(app, args.host, args.port)], None

    return run_servers(build, on_ready=lambda: print("READY", flush=True))
