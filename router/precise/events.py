"""Precise mode in the running router: the chain builder plus what feeds its index.

`PreciseMode` subscribes to every worker's KV events (`cache_client.kv_events`) and keeps
doing so as workers join and leave; it reads each worker's block size, hash algorithm and
KV capacity from `vllm:cache_config_info` unless they are given.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from cache_client.redact import exc_summary
from cache_client.tiers import DEFAULT_NODE, pool_location
from normalizer.vllm_hash import DEFAULT_NONE_HASH_SEED, BlockHasher
from router.aio import cancel_and_wait
from router.precise.chain import PreciseChainBuilder
from router.precise.tokenizer import ModelTokenizer

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import httpx

    from cache_client.base import PrefixIndex
    from cache_client.kv_events import CpuMedium, KvEventIngestor, KvEventSource
    from router.chain import ChainBuilder
    from router.metrics import Registry
    from router.workers import Fleet

log = logging.getLogger("kvroute.precise")


class PreciseMode(PreciseChainBuilder):
    """The chain builder plus what feeds its index: KV-event ingestion for the fleet.

    Started by the app's lifespan (`start(fleet=..., index=..., registry=...)` after the
    fleet's first health round): reads block size / hash algorithm / KV capacity from each
    worker's `vllm:cache_config_info` unless given, subscribes to every worker's KV events
    (given with --kv-events or discovered from `/kv_event_sources`), and keeps doing so as
    workers join and leave.
    """

    REFRESH_S = 10.0

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        *,
        block_size: int | None = None,
        hash_algo: str | None = None,
        hash_seed: str | None = None,
        sources: list[KvEventSource] | None = None,
        discover: bool = True,
        cpu_medium: CpuMedium = "pool",
        fallback: ChainBuilder | None = None,
    ) -> None:
        self._block_size = block_size
        self._algo = hash_algo
        self._seed = hash_seed or DEFAULT_NONE_HASH_SEED
        hasher = BlockHasher(block_size, hash_algo or "sha256", self._seed) if block_size else None
        super().__init__(tokenizer, hasher, fallback)
        self._given_sources = list(sources or [])
        self._discover = discover
        self._cpu_medium: CpuMedium = cpu_medium
        self.ingestor: KvEventIngestor | None = None
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None
        self._fleet: Fleet | None = None
        self._index: PrefixIndex | None = None
        self._configured: set[str] = set()

    async def _worker_config(self, client: httpx.AsyncClient, index: PrefixIndex, name: str, url: str) -> None:
        from normalizer.vllm_hash import hash_config_from_metrics

        try:
            r = await client.get(url + "/metrics", timeout=5.0)
            cfg = hash_config_from_metrics(r.text) if r.status_code == 200 else None
        except Exception as exc:
            log.info("no cache_config_info from %s: %s", name, exc_summary(exc))
            return
        if cfg is None:
            return
        self._configured.add(name)
        if cfg.capacity_tokens:
            # Events are authoritative; the capacity model only bounds memory, so give it
            # the worker's real KV size (it then never evicts before vLLM does).
            index.set_capacity(name, cfg.capacity_tokens)
        if self.hasher is None:
            self.hasher = BlockHasher(self._block_size or cfg.block_size, self._algo or cfg.algo, self._seed)
            if self.ingestor is not None:
                self._attach_hasher(self.ingestor, self.hasher)
            log.info("precise mode: block size %d, hash %s (from %s)", self.hasher.block_size, self.hasher.algo, name)
        elif (cfg.block_size, cfg.algo) != (self.hasher.block_size, self.hasher.algo):
            log.warning(
                "worker %s hashes %d-token blocks with %s but the router uses %d/%s: its cache will look empty",
                name, cfg.block_size, cfg.algo, self.hasher.block_size, self.hasher.algo,
            )
        if not cfg.prefix_caching:
            log.warning("worker %s has prefix caching off", name)

    @staticmethod
    def _attach_hasher(ingestor: KvEventIngestor, hasher: BlockHasher) -> None:
        from cache_client.kv_events import PoolTranslator

        ingestor.hasher = hasher
        ingestor.translator = PoolTranslator(hasher)

    async def _refresh(self) -> None:
        from cache_client.kv_events import discover_sources

        fleet, index, client, ingestor = self._fleet, self._index, self._client, self.ingestor
        if fleet is None or index is None or client is None or ingestor is None:
            raise RuntimeError("precise mode refreshed before start()")
        present = {w.name: w for w in fleet}
        for w in present.values():
            if w.name not in self._configured:
                await self._worker_config(client, index, w.name, w.url)
        have = {s.worker for s in ingestor.sources()}
        for w in present.values():
            if w.name in have:
                continue
            for src in [s for s in self._given_sources if s.worker == w.name]:
                ingestor.add_source(src)
            if self._discover and not any(s.worker == w.name for s in self._given_sources):
                for src in await discover_sources(client, w.name, w.url):
                    log.info("KV events of %s: subscribed (discovered)", w.name)
                    ingestor.add_source(src)
        for name in have - present.keys():
            await ingestor.remove_worker(name)
            self._configured.discard(name)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.REFRESH_S)
            try:
                await self._refresh()
            except Exception as exc:  # keep ingesting for known workers whatever discovery does
                log.error("precise-mode refresh failed: %s", exc_summary(exc))

    async def start(
        self,
        *,
        fleet: Fleet,
        index: PrefixIndex,
        registry: Registry,
        salts: Callable[[], Sequence[str]] | None = None,
        follow: tuple[PrefixIndex, Callable[[], bool]] | None = None,
    ) -> None:
        """Subscribe to the KV events of `fleet`'s workers, applied to `index`; the
        ingestion counters go to `registry`. `salts`: with tenants, the cache salts in use
        (the events' self-check tries them). `follow`: with an index shared by replicas,
        this replica's own view of it and whether this replica writes the events to it
        (`KvEventIngestor.follow`)."""
        import httpx

        from cache_client.kv_events import KvEventIngestor

        self._fleet = fleet
        self._index = index
        self._client = httpx.AsyncClient(trust_env=False, follow_redirects=False)
        self.ingestor = KvEventIngestor(index, hasher=self.hasher, cpu_medium=self._cpu_medium, pool_of=self._pool_of)
        self.ingestor.salts = salts
        if follow is not None:
            self.ingestor.follow(*follow)
        self.ingestor.register_metrics(registry)
        registry.callback_counter(
            "kvroute_precise_fallbacks_total",
            "Requests precise mode routed on an estimate chain (recorded where sent) instead of vLLM's block hashes, "
            "by reason: media (images, audio, video), unsupported, template_error, block_size_unknown.",
            ("reason",),
            lambda: {(why,): float(n) for why, n in self.fallbacks.items()},
        )
        await self._refresh()
        await self.ingestor.start()
        self._task = asyncio.create_task(self._loop(), name="kvroute-precise-refresh")

    def _pool_of(self, worker: str) -> str:
        """The pool a worker's LMCache publishes CPU events for: its node's."""
        w = self._fleet.get(worker) if self._fleet is not None else None
        return pool_location(w.node if w is not None else DEFAULT_NODE)

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self.ingestor is not None:
            await self.ingestor.stop()
        if self._client is not None:
            await self._client.aclose()
