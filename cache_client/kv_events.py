"""vLLM KV-cache events → the prefix index (precise mode).

With `--kv-events-config '{"enable_kv_cache_events": true, ...}'` every vLLM worker
publishes, over a ZMQ PUB socket, each KV block it stores or evicts. A message is three
frames: `[topic, seq (8-byte big-endian), msgpack batch]`; the batch is
`[ts, [event, ...], data_parallel_rank]` and each event is one of

* `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...)`
* `BlockRemoved(block_hashes, medium, ...)`
* `AllBlocksCleared()`

encoded either as a map with a `type` key (vLLM ≥ 0.11: tagged structs) or as a positional
array whose first item is the tag (earlier releases). Block hashes are 64-bit integers by
default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`) or raw digests; both are normalised to the
64-bit form `normalizer.vllm_hash.external_hash` gives, which is the router's `PrefixKey`.

Locations (see docs/precise.md):

* `medium` GPU (or absent) → the worker itself: its events are authoritative, so the
  router records nothing on its own in precise mode.
* `medium` CPU → by default the pool of the publishing worker's node (`pool_of`: `POOL` in
  a one-node fleet). With LMCache's multi-process connector every worker relays its node's
  LMCache server's CPU store/evict events (in its `lmcache_driven` transfer mode), so all
  workers of a node report the same pool and duplicates are harmless. LMCache
  hashes 256-token chunks with its own algorithm (blake3 by default); each CPU event
  carries the chunk's tokens and its parent chunk hash, so `PoolTranslator` re-hashes the
  chunk with vLLM's block hasher, continuing from the parent chunk's last vLLM hash, and
  records the resulting vLLM block keys. With vLLM's native CPU offloading instead
  (`cpu_medium="worker"`), CPU events describe that worker's own CPU tier and go to
  f"{worker}@cpu".

Reliability: every batch's sequence number is checked. A gap is filled from the worker's
replay socket (ROUTER; ask for "all batches from seq N", get them back followed by an
end marker) when one is configured; otherwise, or when the replay buffer no longer reaches
back far enough, the worker's entries are dropped and rebuilt from the events that follow
(blocks it keeps without re-announcing them are then missed until they are stored again:
the cost of the gap). A sequence number going backwards means the worker restarted with
an empty cache: its entries are dropped. `AllBlocksCleared` empties the worker.

Everything runs on the event loop with `zmq.asyncio`; the per-message work is a msgpack
decode and dictionary updates (pool translation hashes 8 blocks per 256-token chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import msgpack

from cache_client.base import POOL, PrefixIndex
from cache_client.redact import exc_summary
from normalizer.prefix import PrefixKey
from normalizer.vllm_hash import BlockHasher, external_hash

log = logging.getLogger("kvroute.kv_events")

_MASK64 = (1 << 64) - 1
END_SEQ = -1
"""The replay socket's end-of-replay marker (seq -1 as a signed 8-byte integer)."""

EventKind = Literal["stored", "removed", "cleared"]
CpuMedium = Literal["pool", "worker", "ignore"]


# -- decoding (pure) ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KvEvent:
    kind: EventKind
    block_hashes: tuple[int, ...] = ()
    parent: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int | None = None
    medium: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class KvBatch:
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None
    topic: bytes = b""


class KvEventDecodeError(ValueError):
    pass


def wire_hash(value: Any) -> int:
    """A block hash as events carry it (int, or digest bytes) → the 64-bit key form."""
    if isinstance(value, bool):
        raise KvEventDecodeError("boolean block hash")
    if isinstance(value, int):
        return value & _MASK64
    if isinstance(value, (bytes, bytearray)):
        return external_hash(bytes(value))
    raise KvEventDecodeError(f"block hash of type {type(value).__name__}")


def _opt_hash(value: Any) -> int | None:
    return None if value is None else wire_hash(value)


_TAGS: dict[str, EventKind] = {
    "BlockStored": "stored",
    "BlockRemoved": "removed",
    "AllBlocksCleared": "cleared",
}


def decode_event(raw: Any) -> KvEvent | None:
    """One event in either encoding; None for event types this router does not use."""
    if isinstance(raw, Mapping):
        tag = raw.get("type")
        kind = _TAGS.get(tag) if isinstance(tag, str) else None
        if kind is None:
            return None
        if kind == "cleared":
            return KvEvent("cleared")
        hashes = tuple(wire_hash(h) for h in raw.get("block_hashes") or ())
        if kind == "removed":
            return KvEvent("removed", hashes, medium=raw.get("medium"))
        return KvEvent(
            "stored",
            hashes,
            parent=_opt_hash(raw.get("parent_block_hash")),
            token_ids=tuple(raw.get("token_ids") or ()),
            block_size=raw.get("block_size"),
            medium=raw.get("medium"),
            lora_name=raw.get("lora_name"),
        )
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        # Positional: [tag, *fields in declaration order]; trailing defaults may be omitted.
        kind = _TAGS.get(raw[0])
        if kind is None:
            return None
        f = list(raw[1:])
        if kind == "cleared":
            return KvEvent("cleared")
        if kind == "removed":
            return KvEvent("removed", tuple(wire_hash(h) for h in f[0] or ()), medium=f[1] if len(f) > 1 else None)
        f += [None] * (7 - len(f))
        # block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
        return KvEvent(
            "stored",
            tuple(wire_hash(h) for h in f[0] or ()),
            parent=_opt_hash(f[1]),
            token_ids=tuple(f[2] or ()),
            block_size=f[3],
            medium=f[5],
            lora_name=f[6],
        )
    raise KvEventDecodeError(f"unrecognised event encoding: {type(raw).__name__}")


def decode_payload(payload: bytes) -> tuple[float, list[KvEvent], int | None]:
    """A msgpack `KVEventBatch`: `[ts, events, dp_rank]` (or a map, defensively)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KvEventDecodeError(f"bad msgpack: {exc}") from exc
    if isinstance(batch, Mapping):
        ts, raw_events, rank = batch.get("ts", 0.0), batch.get("events", []), batch.get("data_parallel_rank")
    elif isinstance(batch, (list, tuple)) and len(batch) >= 2:
        ts, raw_events = batch[0], batch[1]
        rank = batch[2] if len(batch) > 2 else None
    else:
        raise KvEventDecodeError("batch is neither [ts, events, rank] nor a map")
    events = [e for e in (decode_event(r) for r in raw_events or ()) if e is not None]
    return float(ts or 0.0), events, rank


def decode_message(frames: Sequence[bytes]) -> KvBatch:
    """A PUB message `[topic, seq, payload]` (older publishers sent `[seq, payload]`)."""
    if len(frames) == 3:
        topic, seq_b, payload = frames
    elif len(frames) == 2:
        topic, (seq_b, payload) = b"", frames
    else:
        raise KvEventDecodeError(f"expected 3 frames, got {len(frames)}")
    if len(seq_b) != 8:
        raise KvEventDecodeError("sequence frame is not 8 bytes")
    ts, events, rank = decode_payload(payload)
    return KvBatch(int.from_bytes(seq_b, "big", signed=True), ts, tuple(events), rank, bytes(topic))


# -- LMCache pool chunks → vLLM block keys --------------------------------------------------
class PoolTranslator:
    """Maps LMCache chunk events onto the vLLM block keys the router's chains use.

    Keeps, per chunk hash (wire form), the vLLM digest at the chunk's last full block, the
    tokens past it (chunk sizes need not be block multiples) and the keys recorded for the
    chunk. Bounded: the oldest chunks are forgotten first (`max_chunks`).
    """

    def __init__(self, hasher: BlockHasher, max_chunks: int = 1 << 18) -> None:
        self.hasher = hasher
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[int, tuple[bytes | None, tuple[int, ...], tuple[int, ...]]] = OrderedDict()

    def stored(self, chunk: int, parent: int | None, token_ids: Sequence[int]) -> tuple[int, ...] | None:
        """vLLM keys of a stored chunk; None when its parent chunk is unknown."""
        if parent is None:
            digest, carry = None, ()
        else:
            entry = self._chunks.get(parent)
            if entry is None:
                return None
            digest, carry, _ = entry
        tokens = (*carry, *token_ids)
        digests = self.hasher.digests(tokens, parent=digest)
        keys = tuple(external_hash(d) for d in digests)
        used = len(digests) * self.hasher.block_size
        self._chunks[chunk] = (digests[-1] if digests else digest, tuple(tokens[used:]), keys)
        self._chunks.move_to_end(chunk)
        while len(self._chunks) > self.max_chunks:
            self._chunks.popitem(last=False)
        return keys

    def removed(self, chunk: int) -> tuple[int, ...]:
        # Keep the chain entry (a later sibling chunk may still name it as parent); only
        # report which keys left the pool.
        entry = self._chunks.get(chunk)
        return entry[2] if entry else ()

    def __len__(self) -> int:
        return len(self._chunks)


# -- sources --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KvEventSource:
    worker: str
    endpoint: str
    """PUB endpoint to SUBscribe to, e.g. tcp://10.0.0.5:5557."""
    replay_endpoint: str | None = None
    topic: str = ""
    dp_rank: int = 0

    @property
    def key(self) -> str:
        return f"{self.worker}#{self.dp_rank}"


def parse_kv_events_arg(arg: str) -> KvEventSource:
    """`NAME=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,topic=T]` (the `--kv-events` flag)."""
    name, sep, rest = arg.partition("=")
    if not sep or not name or "://" in name:
        raise ValueError(f"--kv-events wants NAME=tcp://HOST:PORT, got {arg!r}")
    parts = rest.split(",")
    endpoint, replay, topic = parts[0], None, ""
    for opt in parts[1:]:
        k, _, v = opt.partition("=")
        if k == "replay":
            replay = v
        elif k == "topic":
            topic = v
        else:
            raise ValueError(f"unknown --kv-events option {k!r} in {arg!r}")
    for ep in (endpoint, replay):
        if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"KV-event endpoint must be a ZMQ address (tcp://...): {ep!r}")
    return KvEventSource(name, endpoint, replay, topic)


def _connectable(endpoint: str | None, host: str) -> str | None:
    """A publisher's bind address (tcp://*:5557) as a subscriber must connect to it."""
    if not endpoint:
        return None
    scheme, _, addr = endpoint.partition("://")
    if scheme != "tcp":
        return endpoint
    bind_host, _, port = addr.rpartition(":")
    if bind_host in ("*", "0.0.0.0", "::", "[::]", ""):
        bind_host = f"[{host}]" if ":" in host else host
    return f"tcp://{bind_host}:{port}"


def sources_from_kv_event_sources(worker: str, worker_url: str, doc: Mapping[str, Any]) -> list[KvEventSource]:
    """Sources from a worker's `GET /kv_event_sources` answer ({dp_rank: KVEventsConfig})."""
    host = urlsplit(worker_url).hostname or "127.0.0.1"
    out = []
    for rank, cfg in sorted(doc.items(), key=lambda kv: int(kv[0])):
        if not isinstance(cfg, Mapping) or not cfg.get("enable_kv_cache_events") or cfg.get("publisher") != "zmq":
            continue
        ep = _connectable(cfg.get("endpoint"), host)
        if ep is None:
            continue
        out.append(
            KvEventSource(worker, ep, _connectable(cfg.get("replay_endpoint"), host), cfg.get("topic") or "", int(rank))
        )
    return out


async def discover_sources(client: Any, worker: str, worker_url: str, timeout: float = 5.0) -> list[KvEventSource]:
    """Ask a worker where it publishes (vLLM's `/kv_event_sources`); [] if it does not say."""
    try:
        r = await client.get(worker_url.rstrip("/") + "/kv_event_sources", timeout=timeout)
        if r.status_code != 200:
            return []
        doc = r.json()
    except Exception as exc:  # an old vLLM or a non-vLLM worker: no discovery, not an error
        log.info("no KV-event discovery for %s: %s", worker, exc_summary(exc))
        return []
    return sources_from_kv_event_sources(worker, worker_url, doc) if isinstance(doc, Mapping) else []


# -- stats ----------------------------------------------------------------------------------
@dataclass(slots=True)
class SourceStats:
    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    cleared: int = 0
    gaps: int = 0
    replayed_batches: int = 0
    dropped_batches: int = 0
    """Batches lost for good (no replay, or the replay buffer did not reach back)."""
    resyncs: int = 0
    """Times this worker's entries were dropped to rebuild from later events."""
    restarts: int = 0
    decode_errors: int = 0
    hash_mismatches: int = 0
    hash_checks: int = 0
    pool_untranslated: int = 0
    last_seq: int = -1
    last_lag_s: float = 0.0
    max_lag_s: float = 0.0
    last_event_at: float = 0.0


@dataclass
class KvEventStats:
    """Counters per source, rendered by `register_metrics` (or read directly)."""

    sources: dict[str, SourceStats] = field(default_factory=dict)

    def of(self, key: str) -> SourceStats:
        s = self.sources.get(key)
        if s is None:
            s = self.sources[key] = SourceStats()
        return s

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {k: {f: float(getattr(s, f)) for f in SourceStats.__slots__} for k, s in self.sources.items()}


ReadSeries = Callable[[], dict[tuple[str, ...], float]]
"""Read at scrape time: {label values: value}."""


class MetricsRegistry(Protocol):
    """Where `register_metrics` puts the stats (the router's `router.metrics.Registry`)."""

    def callback_counter(self, name: str, help_: str, labels: Iterable[str], read: ReadSeries) -> Any: ...
    def callback_gauge(self, name: str, help_: str, labels: Iterable[str], read: ReadSeries) -> Any: ...


# -- ingestion ------------------------------------------------------------------------------
def _one_pool(worker: str) -> str:
    return POOL


class KvEventIngestor:
    """Applies KV events from every worker to a `PrefixIndex`."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        hasher: BlockHasher | None = None,
        cpu_medium: CpuMedium = "pool",
        pool_of: Callable[[str], str] | None = None,
        verify_hashes: int = 64,
        context: Any = None,
        clock: Callable[[], float] = time.time,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.index = index
        self.hasher = hasher
        self.cpu_medium = cpu_medium
        self.pool_of: Callable[[str], str] = pool_of if pool_of is not None else _one_pool
        """Worker name -> the location of its node's pool (where its CPU events go)."""
        self.translator = PoolTranslator(hasher) if hasher is not None else None
        self.verify_hashes = verify_hashes
        self.stats = KvEventStats()
        self._clock = clock
        self._ctx = context
        self._replay_timeout_s = replay_timeout_s
        self._sources: dict[str, KvEventSource] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._expected: dict[str, int] = {}
        self._replayed: dict[str, dict[int, float]] = {}
        self._running = False
        self._warned: set[str] = set()
        self.salts: Callable[[], Sequence[str]] | None = None
        """With tenants, every prefix is salted (vLLM's `cache_salt`): the salts the router
        uses, which the self-check tries on a prefix's first block."""
        self._salted_ok = False
        self._unknown_salts = 0
        self._local: PrefixIndex | None = None
        self._writes: Callable[[], bool] = lambda: True

    def follow(self, local: PrefixIndex, writes: Callable[[], bool]) -> None:
        """With an index shared by router replicas: apply the events to `local` (this
        replica's own view of the shared index) only, while `writes()` says another replica
        writes them to the shared one. Every replica receives the same events; one writing
        them is enough, and each replica writing them multiplied the index's write load by
        the number of replicas. The local view stays whole, for when this replica routes
        without the shared index or becomes the writer."""
        self._local = local
        self._writes = writes

    def _sink(self) -> PrefixIndex:
        """Where events are applied now: the index, or this replica's view of it alone."""
        local = self._local
        return self.index if local is None or self._writes() else local

    # -- locations --
    def _location(self, source: KvEventSource, medium: str | None) -> str | None:
        if medium is None or medium.upper() == "GPU":
            return source.worker
        if medium.upper() == "CPU":
            if self.cpu_medium == "pool":
                return self.pool_of(source.worker)
            if self.cpu_medium == "worker":
                return f"{source.worker}@cpu"
        return None

    # -- applying --
    async def apply(self, source: KvEventSource, events: Iterable[KvEvent]) -> None:
        st = self.stats.of(source.key)
        for ev in events:
            st.events += 1
            if ev.kind == "cleared":
                st.cleared += 1
                await self._drop_worker(source.worker)
                continue
            loc = self._location(source, ev.medium)
            if loc is None:
                continue
            pooled = self.cpu_medium == "pool" and loc != source.worker
            if ev.kind == "stored":
                keys: Sequence[int] = ev.block_hashes
                block = ev.block_size or (self.hasher.block_size if self.hasher else 1)
                if pooled and ev.token_ids:
                    # Pool chunks are keyed by the pool's own hashes: translate them to vLLM
                    # block keys (impossible until the block size is known).
                    translated = self._translate_stored(ev) if self.translator is not None else None
                    if translated is None:
                        st.pool_untranslated += 1
                        continue
                    keys = translated
                    block = self.hasher.block_size  # type: ignore[union-attr]
                elif loc == source.worker:
                    self._verify(source, ev, st)
                if keys:
                    st.blocks_stored += len(keys)
                    await self._sink().record(loc, [PrefixKey(k) for k in keys], [block] * len(keys))
            else:
                keys = ev.block_hashes
                if pooled and self.translator is not None:
                    keys = [k for chunk in ev.block_hashes for k in self.translator.removed(chunk)]
                if keys:
                    st.blocks_removed += len(keys)
                    await self._sink().evict(loc, [PrefixKey(k) for k in keys])

    def _translate_stored(self, ev: KvEvent) -> tuple[int, ...] | None:
        assert self.translator is not None
        if len(ev.block_hashes) == 1:
            return self.translator.stored(ev.block_hashes[0], ev.parent, ev.token_ids)
        # Several chunks in one event: tokens split evenly, each chained to the previous.
        n = len(ev.block_hashes)
        if n == 0 or len(ev.token_ids) % n:
            return None
        size = len(ev.token_ids) // n
        out: list[int] = []
        parent = ev.parent
        for i, chunk in enumerate(ev.block_hashes):
            keys = self.translator.stored(chunk, parent, ev.token_ids[i * size : (i + 1) * size])
            if keys is None:
                return None
            out += keys
            parent = chunk
        return tuple(out)

    def _verify(self, source: KvEventSource, ev: KvEvent, st: SourceStats) -> None:
        """Self-check: recompute a prefix's first blocks from their tokens.

        Only events that start a prefix (no parent) can be checked without state; a
        mismatch means the router's --block-size/--hash-algo/seed differ from the worker's,
        and precise routing would silently find nothing.
        """
        if self.hasher is None or ev.parent is not None or st.hash_checks >= self.verify_hashes:
            return
        if not ev.token_ids or ev.lora_name or (ev.block_size and ev.block_size != self.hasher.block_size):
            if ev.block_size and ev.block_size != self.hasher.block_size:
                st.hash_mismatches += 1
                self._warn(source.worker, f"worker block size {ev.block_size} != router {self.hasher.block_size}")
            return
        st.hash_checks += 1
        mine = self.hasher.keys(ev.token_ids)
        if not mine or mine == list(ev.block_hashes[: len(mine)]):
            return
        if self.salts is not None and self._salted(ev):
            return
        # Salted requests legitimately differ; a steady stream of mismatches does not.
        st.hash_mismatches += 1
        if st.hash_mismatches >= 3:
            self._warn(source.worker, "block hashes differ from the router's: check --hash-algo and PYTHONHASHSEED")

    def _salted(self, ev: KvEvent) -> bool:
        """Whether the prefix is salted with a salt the router knows, or may be with one it
        does not know yet (another replica's tenant): not a mismatch, unless no salted
        prefix ever matched (then the hash settings are what differ)."""
        assert self.hasher is not None and self.salts is not None
        first = ev.token_ids[: self.hasher.block_size]
        for salt in self.salts():
            if self.hasher.keys(first, cache_salt=salt)[:1] == list(ev.block_hashes[:1]):
                self._salted_ok = True
                return True
        self._unknown_salts += 1
        return self._salted_ok or self._unknown_salts < self.verify_hashes

    def _warn(self, worker: str, msg: str) -> None:
        if worker not in self._warned:
            self._warned.add(worker)
            log.warning("KV events from %s: %s", worker, msg)

    async def _drop_worker(self, worker: str) -> None:
        sink = self._sink()
        await sink.drop_location(worker)
        if self.cpu_medium == "worker":
            await sink.drop_location(f"{worker}@cpu")

    # -- sequencing --
    async def handle(self, source: KvEventSource, batch: KvBatch, replay: Callable[[int], Any] | None = None) -> None:
        """Apply one live batch, filling a sequence gap first (from `replay(start_seq)`)."""
        st = self.stats.of(source.key)
        expected = self._expected.get(source.key)
        if expected is not None and batch.seq < expected:
            if self._replayed.get(source.key, {}).get(batch.seq) == batch.ts:
                return  # queued on the SUB socket while the same batch came by replay
            # Sequence went backwards: a new engine process, whose cache starts empty.
            st.restarts += 1
            log.info("KV events from %s restarted at seq %d (expected %d)", source.key, batch.seq, expected)
            await self._drop_worker(source.worker)
        elif expected is not None and batch.seq > expected:
            st.gaps += 1
            filled = False
            if replay is not None:
                filled = await self._fill(source, expected, batch.seq, replay)
            if not filled:
                st.dropped_batches += batch.seq - expected
                st.resyncs += 1
                log.warning(
                    "KV events from %s: batches %d..%d lost; dropping its entries to rebuild",
                    source.key, expected, batch.seq - 1,
                )
                await self._drop_worker(source.worker)
        await self._apply_batch(source, batch)

    async def _apply_batch(self, source: KvEventSource, batch: KvBatch, live: bool = True) -> None:
        st = self.stats.of(source.key)
        st.batches += 1
        st.last_seq = batch.seq
        self._expected[source.key] = batch.seq + 1
        now = self._clock()
        if batch.ts and live:  # a replayed batch's age says nothing about the live stream
            st.last_lag_s = max(now - batch.ts, 0.0)
            st.max_lag_s = max(st.max_lag_s, st.last_lag_s)
        st.last_event_at = now
        await self.apply(source, batch.events)

    async def _fill(self, source: KvEventSource, start: int, stop: int, replay: Callable[[int], Any]) -> bool:
        """Apply batches start..stop-1 from the replay socket; False if they are not all there."""
        st = self.stats.of(source.key)
        try:
            batches: list[KvBatch] = await replay(start)
        except Exception as exc:
            log.warning("KV-event replay from %s failed: %s", source.key, exc_summary(exc))
            return False
        wanted = [b for b in batches if start <= b.seq < stop]
        if [b.seq for b in wanted] != list(range(start, stop)):
            return False
        self._remember_replayed(source, batches)
        for b in wanted:
            await self._apply_batch(source, b, live=False)
        st.replayed_batches += len(wanted)
        return True

    def _remember_replayed(self, source: KvEventSource, batches: Sequence[KvBatch]) -> None:
        self._replayed[source.key] = {b.seq: b.ts for b in batches}

    async def _catch_up(self, source: KvEventSource, replay: Callable[[int], Any]) -> None:
        """Joining a running worker: apply everything its replay buffer still holds.

        Called after subscribing, so batches published meanwhile wait on the SUB socket
        (and are recognised as already applied). Blocks stored before the buffer's oldest
        batch stay unknown until stored again; nothing was known about the worker before,
        so nothing is dropped.
        """
        try:
            batches: list[KvBatch] = sorted(await replay(0), key=lambda b: b.seq)
        except Exception as exc:
            log.info("KV-event catch-up from %s failed: %s", source.key, exc_summary(exc))
            return
        for b in batches:
            await self._apply_batch(source, b, live=False)
        self.stats.of(source.key).replayed_batches += len(batches)
        self._remember_replayed(source, batches)

    # -- sockets --
    def _context(self):
        if self._ctx is None:
            import zmq.asyncio

            self._ctx = zmq.asyncio.Context.instance()
        return self._ctx

    async def replay(self, source: KvEventSource, start: int) -> list[KvBatch]:
        """Ask the worker's replay socket for every buffered batch from `start` on."""
        import zmq

        if not source.replay_endpoint:
            return []
        sock = self._context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(source.replay_endpoint)
        out: list[KvBatch] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(self._replay_timeout_s * 1000)):
                    raise TimeoutError("replay socket did not answer")
                frames = await sock.recv_multipart()
                frames = frames[1:] if frames and frames[0] == b"" else frames
                if len(frames) >= 2 and int.from_bytes(frames[1], "big", signed=True) == END_SEQ:
                    break
                try:
                    out.append(decode_message(frames))
                except KvEventDecodeError:
                    self.stats.of(source.key).decode_errors += 1
        finally:
            sock.close(linger=0)
        return out

    async def _run(self, source: KvEventSource) -> None:
        import zmq

        sub = self._context().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        sub.connect(source.endpoint)
        st = self.stats.of(source.key)
        replay = (lambda start: self.replay(source, start)) if source.replay_endpoint else None
        try:
            if replay is not None and source.key not in self._expected:
                await self._catch_up(source, replay)
            while True:
                frames = await sub.recv_multipart()
                try:
                    batch = decode_message(frames)
                except KvEventDecodeError as exc:
                    st.decode_errors += 1
                    self._warn(source.worker, f"undecodable message: {exc}")
                    continue
                try:
                    await self.handle(source, batch, replay)
                except Exception as exc:  # one bad batch must not stop ingestion for this worker
                    log.error("applying KV events from %s failed: %s", source.key, exc_summary(exc))
        finally:
            sub.close(linger=0)

    def add_source(self, source: KvEventSource) -> None:
        if source.key in self._sources:
            return
        self._sources[source.key] = source
        self.stats.of(source.key)
        if self._running:
            self._tasks[source.key] = asyncio.create_task(self._run(source), name=f"kv-events-{source.key}")

    async def remove_worker(self, worker: str) -> None:
        for key in [k for k, s in self._sources.items() if s.worker == worker]:
            self._sources.pop(key)
            self._expected.pop(key, None)
            self._replayed.pop(key, None)
            task = self._tasks.pop(key, None)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self._drop_worker(worker)

    def sources(self) -> list[KvEventSource]:
        return list(self._sources.values())

    async def start(self) -> None:
        self._running = True
        for key, source in self._sources.items():
            if key not in self._tasks:
                self._tasks[key] = asyncio.create_task(self._run(source), name=f"kv-events-{key}")

    async def stop(self) -> None:
        self._running = False
        tasks, self._tasks = list(self._tasks.values()), {}
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    # -- metrics --
    def register_metrics(self, registry: MetricsRegistry) -> None:
        """Expose the stats through the router's registry."""

        def reader(attr: str) -> ReadSeries:
            return lambda: {(k,): float(getattr(s, attr)) for k, s in self.stats.sources.items()}

        counters = {
            "batches": "KV-event batches applied",
            "events": "KV events applied",
            "blocks_stored": "Blocks recorded from BlockStored events",
            "blocks_removed": "Blocks evicted from BlockRemoved events",
            "gaps": "Sequence gaps detected",
            "replayed_batches": "Batches recovered from the replay socket",
            "dropped_batches": "Batches lost for good (entries dropped and rebuilt)",
            "resyncs": "Times a worker's entries were dropped to rebuild",
            "restarts": "Publisher restarts (sequence went backwards)",
            "decode_errors": "Undecodable KV-event messages",
            "hash_mismatches": "Block hashes the router could not reproduce",
            "pool_untranslated": "Pool chunk events whose parent chunk was unknown",
        }
        for attr, help_ in counters.items():
            registry.callback_counter(f"kvroute_kv_events_{attr}_total", help_, ("source",), reader(attr))
        registry.callback_gauge(
            "kvroute_kv_events_writer", "1 if this replica writes the KV events to the index (with replicas "
            "sharing one, a single replica does), 0 if it applies them to its own view only",
            (), lambda: {(): 1.0 if self._local is None or self._writes() else 0.0},
        )
        registry.callback_gauge(
            "kvroute_kv_events_lag_seconds", "Age of the last KV-event batch when it was applied",
            ("source",), reader("last_lag_s"),
        )
        registry.callback_gauge(
            "kvroute_kv_events_max_lag_seconds", "Largest KV-event batch age seen",
            ("source",), reader("max_lag_s"),
        )
