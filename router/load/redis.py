"""In-flight load shared by router replicas through Redis.

Each replica keeps its own counts exactly as `LocalLoadBoard` does (acquire, first byte and
release change them at once, no I/O) and, every `sync_interval_s`, publishes them whole
under a lease and reads every other live replica's counts in the same script call
(`loads.lua`). `snapshot()` adds the two: it never waits on Redis.

Publishing absolute per-replica counts rather than deltas to shared counters makes every
sync idempotent: a lost or repeated message cannot leave a counter wrong, and a replica
that crashes stops counting when its lease expires instead of leaving its in-flight
requests behind forever. The decayed recent-traffic counts add up across replicas the same
way (a sum of exponentially decayed counts is the decayed count of the union).

The board rides on the prefix index's connection (`RedisIndex.backend`): one client, one
health state for both.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from cache_client.redact import exc_summary
from cache_client.redis_conn import REDIS_ERRORS, RedisBackend, Script
from cache_client.served_ends import ServedEnds
from router.calibration import Calibrator
from router.load.board import DEFAULT_RECENT_HALF_LIFE_S, LocalLoadBoard, Ticket
from router.routing import WorkerLoad

log = logging.getLogger("kvroute.redis")

LOADS_SCRIPT = Script("router.load", "loads.lua")
ENDS_PER_SYNC = 1024
"""Prompt-end records one sync passes on (20k requests/s at the 50 ms sync)."""


class _Remote:
    __slots__ = ("at", "inflight", "prefilling", "queued_prefill_s", "recent")

    def __init__(self, at: float) -> None:
        self.inflight = 0
        self.prefilling = 0
        self.queued_prefill_s = 0.0
        self.recent = 0.0
        self.at = at


class RedisLoadBoard(LocalLoadBoard):
    """`LoadBoard` whose snapshot counts every live replica's requests."""

    replicas: int
    """Live replicas (this one included) at the last sync: kept while Redis is away, for
    the share of the tenant limits each replica enforces meanwhile."""
    calibrator: Calibrator | None
    """Learned cost models (router/calibration.py): their statistics ride on every
    `cost_every`-th sync, and the other replicas' come back with it."""
    ends: ServedEnds | None
    """Where the prompts sent ended (cache_client/served_ends.py): each sync passes this
    replica's new records on and takes in the others'."""
    writes_events: bool
    """This replica is the one that writes the workers' KV events to the shared index
    (precise mode): the live replica with the smallest id at the last sync. Every replica
    ingests the events into its local mirror; one writing them to Redis is enough (the
    writes are the same), and N replicas writing them would be N times the write load. True
    until the first sync says otherwise: a duplicate write is harmless, a missing one is
    not."""
    on_writer: list[Callable[[], None]]
    """Called when this replica becomes the events' writer after another was: the index
    pushes its mirror, which holds what was applied while nobody wrote (a writer that
    died leaves its lease to run out first)."""

    def __init__(
        self,
        backend: RedisBackend,
        *,
        prefix: str = "kvroute",
        replica_id: str,
        half_life_s: float = DEFAULT_RECENT_HALF_LIFE_S,
        sync_interval_s: float = 0.05,
        lease_s: float = 2.0,
        clock=time.monotonic,
    ) -> None:
        super().__init__(half_life_s, clock)
        self._backend = backend
        self._tag = "{" + prefix + "}"
        self._registry = self._tag + ":lb"
        self.replica_id = replica_id
        self._interval = sync_interval_s
        self._lease_ms = int(lease_s * 1000)
        self._lease_s = lease_s
        self._remote: dict[str, _Remote] = {}
        self._synced_at = -math.inf
        self._task: asyncio.Task | None = None
        self.syncs = 0
        self._sync_lock = asyncio.Lock()
        """One sync at a time: the background loop's and a caller's (the startup's first)
        would otherwise read the same stream position and both take in its records."""
        self.replicas = 1
        self.calibrator = None
        self.cost_every = max(1, round(1.0 / sync_interval_s))
        self.ends = None
        self._ends_seen = "0-0"
        self.writes_events = True
        self.on_writer = []
        backend.on_close.append(self._leave)
        # Heartbeat from the moment Redis answers, not from this replica's first request:
        # other replicas (and operators) see every live replica.
        backend.on_up.append(self._start)

    # -- background sync -------------------------------------------------------------------
    def _start(self) -> None:
        if self._task is not None or self._backend.closed:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._backend.start()
        self._task = self._backend.spawn(self._sync_loop())

    def _payload(self) -> bytes:
        now = self._clock()
        counts: dict[str, list[float]] = {}
        for name, c in self._counts.items():
            recent = self._recent(c, now)
            if c.inflight or c.queued_prefill_s > 1e-9 or recent > 1e-6:
                counts[name] = [c.inflight, max(c.queued_prefill_s, 0.0), recent, c.prefilling]
        return orjson.dumps(counts)

    async def sync(self) -> bool:
        """Publish this replica's counts and take in the others'. False if Redis failed."""
        async with self._sync_lock:
            return await self._sync()

    async def _sync(self) -> bool:
        calibrator = self.calibrator
        costs = b""
        if calibrator is not None and self.syncs % self.cost_every == 0:
            costs = orjson.dumps(calibrator.export())
        ends = self.ends
        # At most ENDS_PER_SYNC records a sync: after an outage the backlog goes in pieces.
        sent = ends.take_sent(ENDS_PER_SYNC) if ends is not None else []
        args = [self._tag, self.replica_id, self._lease_ms, self._payload(), costs,
                orjson.dumps(sent) if sent else b"", self._ends_seen if ends is not None else ""]
        try:
            others, stats, *shared = await self._backend.script(LOADS_SCRIPT, self._registry, args)
        except Exception as exc:
            if not isinstance(exc, REDIS_ERRORS):
                log.error("load board sync failed unexpectedly: %s", exc_summary(exc))
            self._backend.failed(exc)
            if ends is not None:
                ends.give_back(sent)
            return False
        now = self._clock()
        remote: dict[str, _Remote] = {}
        for raw in others:
            for name, (inflight, queued, recent, *rest) in orjson.loads(raw).items():
                r = remote.get(name)
                if r is None:
                    r = remote[name] = _Remote(now)
                r.inflight += int(inflight)
                r.queued_prefill_s += float(queued)
                r.recent += float(recent)
                r.prefilling += int(rest[0]) if rest else 0  # a replica of an earlier version sends three
        self._remote = remote
        self.replicas = 1 + len(others)
        self._synced_at = now
        self.syncs += 1
        if costs and calibrator is not None:
            calibrator.absorb(_merge_stats(stats))
        if ends is not None and len(shared) >= 2:
            blobs, seen = shared[0], shared[1]
            self._ends_seen = seen.decode() if isinstance(seen, bytes) else str(seen)
            for blob in blobs:
                ends.absorb(orjson.loads(blob))
        if len(shared) == 3:
            self._elect(shared[2])
        return True

    def _elect(self, live: list[bytes]) -> None:
        """The events' writer is the live replica with the smallest id: every replica reads
        the same registry, so they agree within a sync (briefly two writing, or none, while
        one joins or its lease runs out; the next writer's mirror push covers the latter)."""
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in live]
        writes = min([*ids, self.replica_id]) == self.replica_id
        if writes and not self.writes_events:
            log.info("this replica now writes the workers' KV events to the shared index")
            for callback in self.on_writer:
                callback()
        self.writes_events = writes

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            if self._backend.up:
                await self.sync()
            elif self._remote and self._clock() - self._synced_at > self._lease_s:
                # Counts older than a lease may belong to replicas that died meanwhile.
                self._remote = {}

    async def _leave(self) -> None:
        if self._backend.up:
            await self._backend.script(LOADS_SCRIPT, self._registry, [self._tag, self.replica_id, self._lease_ms, "", ""])

    # -- LoadBoard -------------------------------------------------------------------------
    def snapshot(self, names: Iterable[str]) -> list[WorkerLoad]:
        self._start()
        now = self._clock()
        costs = self.costs
        out = []
        for name in names:
            c = self._get(name)
            r = self._remote.get(name)
            inflight, queued, recent, prefilling = c.inflight, c.queued_prefill_s, self._recent(c, now), c.prefilling
            if r is not None:
                inflight += r.inflight
                queued += r.queued_prefill_s
                recent += r.recent * math.exp(-self._decay * (now - r.at))
                prefilling += r.prefilling
            # The lag is this replica's own: its requests wait in the same engine queues.
            out.append(WorkerLoad(
                name, inflight, max(queued, 0.0), recent, c.engine_waiting, costs.get(name), prefilling, c.lag_s(now),
            ))  # fmt: skip
        return out

    def acquire(self, worker: str, prefill_s: float, modelled_s: float | None = None) -> Ticket:
        self._start()
        return super().acquire(worker, prefill_s, modelled_s)

    def inflight(self, worker: str) -> int:
        r = self._remote.get(worker)
        return super().inflight(worker) + (r.inflight if r is not None else 0)

    def local_inflight(self, worker: str) -> int:
        return super().inflight(worker)

    def forget(self, worker: str) -> None:
        super().forget(worker)
        self._remote.pop(worker, None)

    def remote_view(self) -> dict[str, Any]:
        """The other replicas' counts as last synced (for tests and debugging)."""
        return {n: (r.inflight, r.queued_prefill_s, r.recent) for n, r in self._remote.items()}


def _merge_stats(raws: list[bytes]) -> dict[str, list[list[float]]]:
    """Other replicas' cost statistics, {worker: [one export per replica]}."""
    merged: dict[str, list[list[float]]] = {}
    for raw in raws:
        for worker, flat in orjson.loads(raw).items():
            merged.setdefault(worker, []).append(flat)
    return merged
