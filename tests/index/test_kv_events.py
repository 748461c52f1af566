"""KV-event decoding, index updates, pool translation and gap recovery.

The socket tests run a publisher that speaks vLLM's wire protocol (PUB: `[topic, seq,
msgpack batch]`; ROUTER replay: request `start seq`, answer every buffered batch then an
end marker) on loopback, byte for byte as `vllm/distributed/kv_events.py` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from cache_client.base import POOL
from cache_client.kv_events import (
    KvBatch,
    KvEvent,
    KvEventDecodeError,
    KvEventIngestor,
    KvEventSource,
    PoolTranslator,
    decode_event,
    decode_message,
    decode_payload,
    parse_kv_events_arg,
    sources_from_kv_event_sources,
    wire_hash,
)
from cache_client.memory import MemoryIndex
from normalizer.vllm_hash import BlockHasher, external_hash
from router.metrics import Registry
from tests.support.wait import wait_for_async

BS = 16
HASHER = BlockHasher(BS, "sha256")


def stored_map(hashes, parent=None, tokens=(), medium="GPU", block_size=BS) -> dict:
    return {
        "type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
        "token_ids": list(tokens), "block_size": block_size, "lora_id": None, "medium": medium,
        "lora_name": None, "extra_keys": None,
    }


def payload(events, ts: float | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, events, 0])


def frames(seq: int, events, topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload(events)]


# -- decoding -------------------------------------------------------------------------------
def test_decodes_tagged_map_events() -> None:
    ev = decode_event(stored_map([1, 2], parent=7, tokens=range(32)))
    assert ev == KvEvent("stored", (1, 2), 7, tuple(range(32)), BS, "GPU", None)
    assert decode_event({"type": "BlockRemoved", "block_hashes": [3], "medium": "CPU"}) == KvEvent(
        "removed", (3,), medium="CPU"
    )
    assert decode_event({"type": "AllBlocksCleared"}) == KvEvent("cleared")
    assert decode_event({"type": "SomethingNew", "x": 1}) is None


def test_decodes_positional_array_events() -> None:
    # vLLM before tagged maps: [tag, block_hashes, parent, token_ids, block_size, lora_id, medium]
    assert decode_event(["BlockStored", [5, 6], None, list(range(32)), BS, None, "GPU"]) == KvEvent(
        "stored", (5, 6), None, tuple(range(32)), BS, "GPU"
    )
    # Older still: no medium field at all.
    assert decode_event(["BlockStored", [5], 4, list(range(16)), BS, None]).medium is None
    assert decode_event(["BlockRemoved", [9, 10]]) == KvEvent("removed", (9, 10))
    assert decode_event(["AllBlocksCleared"]) == KvEvent("cleared")


def test_byte_hashes_become_the_64_bit_form() -> None:
    digest = bytes(range(32))
    ev = decode_event(stored_map([digest], parent=digest))
    assert ev is not None and ev.block_hashes == (external_hash(digest),) and ev.parent == external_hash(digest)
    assert wire_hash(-1) == (1 << 64) - 1
    with pytest.raises(KvEventDecodeError):
        wire_hash(1.5)


def test_decode_message_reads_seq_and_batch() -> None:
    batch = decode_message(frames(41, [stored_map([1])]))
    assert (batch.seq, batch.topic, len(batch.events), batch.dp_rank) == (41, b"kv", 1, 0)
    with pytest.raises(KvEventDecodeError):
        decode_message([b"kv", b"\x00", payload([])])
    with pytest.raises(KvEventDecodeError):
        decode_payload(b"\xc1")


# -- configuration ----------------------------------------------------------------------------
def test_parse_kv_events_flag() -> None:
    s = parse_kv_events_arg("w1=tcp://10.0.0.1:5557,replay=tcp://10.0.0.1:5558,topic=kv")
    assert (s.worker, s.endpoint, s.replay_endpoint, s.topic) == ("w1", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558", "kv")
    with pytest.raises(ValueError):
        parse_kv_events_arg("tcp://10.0.0.1:5557")
    with pytest.raises(ValueError):
        parse_kv_events_arg("w1=http://x:1")


def test_sources_from_worker_discovery_answer() -> None:
    doc = {
        "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
              "replay_endpoint": "tcp://*:5567", "topic": "kv"},
        "1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5558",
              "replay_endpoint": None, "topic": "kv"},
        "2": {"enable_kv_cache_events": False, "publisher": "null", "endpoint": "tcp://*:5559"},
    }
    out = sources_from_kv_event_sources("w1", "http://10.1.2.3:8000", doc)
    assert [(s.endpoint, s.replay_endpoint, s.dp_rank) for s in out] == [
        ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5567", 0),
        ("tcp://10.1.2.3:5558", None, 1),
    ]


# -- applying -------------------------------------------------------------------------------
def chain_keys(tokens: list[int]) -> list[int]:
    return HASHER.keys(tokens)


async def test_gpu_events_drive_the_worker_location() -> None:
    index = MemoryIndex()
    ing = KvEventIngestor(index, hasher=HASHER)
    src = KvEventSource("w1", "tcp://127.0.0.1:1")
    tokens = list(range(100, 164))
    keys = chain_keys(tokens)
    await ing.apply(src, [decode_event(stored_map(keys, tokens=tokens))])
    assert (await index.lookup(keys)).depth("w1") == 4
    await ing.apply(src, [KvEvent("removed", (keys[2],))])
    # vLLM's hit is the longest run of leading blocks: removing block 2 caps it at 2.
    assert (await index.lookup(keys)).depth("w1") == 2
    await ing.apply(src, [KvEvent("cleared")])
    assert (await index.lookup(keys)).depth("w1") == 0
    assert ing.stats.of(src.key).hash_checks == 1 and ing.stats.of(src.key).hash_mismatches == 0


async def test_hash_self_check_flags_a_misconfigured_router() -> None:
    ing = KvEventIngestor(MemoryIndex(), hasher=BlockHasher(BS, "sha256_cbor"))
    src = KvEventSource("w1", "tcp://127.0.0.1:1")
    tokens = list(range(32))
    await ing.apply(src, [decode_event(stored_map(chain_keys(tokens), tokens=tokens))])
    assert ing.stats.of(src.key).hash_mismatches == 1


def lmcache_chunks(tokens: list[int], chunk: int) -> list[tuple[int, int | None, list[int]]]:
    """(chunk hash, parent chunk hash, tokens) the way LMCache reports its own chunks."""
    rng = random.Random(len(tokens))
    out, parent = [], None
    for i in range(0, len(tokens) - len(tokens) % chunk, chunk):
        h = rng.getrandbits(64)  # LMCache's blake3 chunk hash: unrelated to vLLM's
        out.append((h, parent, tokens[i : i + chunk]))
        parent = h
    return out


@pytest.mark.parametrize("chunk", [64, 40])
async def test_pool_chunks_translate_to_vllm_block_keys(chunk: int) -> None:
    index = MemoryIndex()
    ing = KvEventIngestor(index, hasher=HASHER)
    src = KvEventSource("w1", "tcp://127.0.0.1:1")
    tokens = [random.Random(3).randrange(4000) for _ in range(200)]
    chunks = lmcache_chunks(tokens, chunk)
    events = [decode_event(stored_map([h], parent=p, tokens=t, medium="CPU", block_size=chunk)) for h, p, t in chunks]
    await ing.apply(src, events)
    keys = chain_keys(tokens)
    pooled_tokens = len(chunks) * chunk
    # Every full vLLM block inside the pooled chunks is found in the pool, even when chunk
    # boundaries fall inside a block (chunk=40, block=16).
    assert (await index.lookup(keys)).depth(POOL) == pooled_tokens // BS
    assert (await index.lookup(keys)).depth("w1") == 0
    # Evicting the second chunk removes its blocks: the pool prefix now ends inside chunk 1.
    await ing.apply(src, [KvEvent("removed", (chunks[1][0],), medium="CPU")])
    assert (await index.lookup(keys)).depth(POOL) == len(ing.translator.removed(chunks[0][0]))


async def test_pool_chunk_with_unknown_parent_is_counted_not_guessed() -> None:
    index = MemoryIndex()
    ing = KvEventIngestor(index, hasher=HASHER)
    src = KvEventSource("w1", "tcp://127.0.0.1:1")
    await ing.apply(src, [decode_event(stored_map([99], parent=12345, tokens=range(64), medium="CPU"))])
    assert ing.stats.of(src.key).pool_untranslated == 1
    assert await index.usage() == {}


async def test_pool_chunks_wait_for_a_block_size() -> None:
    index = MemoryIndex()
    ing = KvEventIngestor(index)  # no hasher yet: the workers' block size is still unknown
    src = KvEventSource("w1", "tcp://127.0.0.1:1")
    await ing.apply(src, [decode_event(stored_map([5], tokens=range(64), medium="CPU"))])
    assert ing.stats.of(src.key).pool_untranslated == 1 and await index.usage() == {}


async def test_cpu_events_per_worker_when_configured() -> None:
    index = MemoryIndex()
    ing = KvEventIngestor(index, hasher=HASHER, cpu_medium="worker")
    src = KvEventSource("w1", "tcp://127.0.0.1:1")
    keys = chain_keys(list(range(32)))
    await ing.apply(src, [KvEvent("stored", tuple(keys), None, (), BS, "CPU")])
    assert (await index.lookup(keys)).depth("w1@cpu") == 2
    await ing.apply(src, [KvEvent("cleared")])
    assert (await index.lookup(keys)).depth("w1@cpu") == 0


def test_translator_is_bounded() -> None:
    tr = PoolTranslator(HASHER, max_chunks=4)
    parent = None
    for i in range(10):
        tr.stored(i, parent, list(range(i * 16, i * 16 + 16)))
        parent = i
    assert len(tr) == 4 and tr.stored(99, 0, list(range(16))) is None


# -- sequencing -----------------------------------------------------------------------------
def batch(seq: int, keys: list[int]) -> KvBatch:
    return KvBatch(seq, time.time(), (KvEvent("stored", tuple(keys), None, (), BS, "GPU"),))


async def test_gap_filled_from_replay() -> None:
    index = MemoryIndex()
    ing = KvEventIngestor(index)
    src = KvEventSource("w1", "tcp://127.0.0.1:1")
    ks = [[i * 10 + j for j in range(2)] for i in range(5)]
    await ing.handle(src, batch(0, ks[0]))

    async def replay(start: int) -> list[KvBatch]:
        return [batch(s, ks[s]) for s in range(start, 5)]

    await ing.handle(src, batch(3, ks[3]), replay)
    st = ing.stats.of(src.key)
    assert (st.gaps, st.replayed_batches, st.dropped_batches, st.last_seq) == (1, 2, 0, 3)
    for k in ks[:4]:
        assert (await index.lookup(k)).depth("w1") == 2


async def test_gap_without_replay_drops_and_rebuilds() -> None:
    index = MemoryIndex()
    ing = KvEventIngestor(index)
    src = KvEventSource("w1", "tcp://127.0.0.1:1")
    await ing.handle(src, batch(0, [1, 2]))
    await ing.handle(src, batch(4, [3, 4]))
    st = ing.stats.of(src.key)
    assert (st.gaps, st.dropped_batches, st.resyncs) == (1, 3, 1)
    assert (await index.lookup([1, 2])).depth("w1") == 0  # dropped: it may have been evicted
    assert (await index.lookup([3, 4])).depth("w1") == 2  # rebuilt from what followed


async def test_replay_that_does_not_reach_back_counts_as_lost() -> None:
    index = MemoryIndex()
    ing = KvEventIngestor(index)
    src = KvEventSource("w1", "tcp://127.0.0.1:1")
    await ing.handle(src, batch(0, [1]))

    async def trimmed(start: int) -> list[KvBatch]:
        return [batch(s, [s + 100]) for s in range(3, 6)]  # the buffer starts at 3

    await ing.handle(src, batch(5, [7]), trimmed)
    st = ing.stats.of(src.key)
    assert (st.replayed_batches, st.dropped_batches, st.resyncs) == (0, 4, 1)


async def test_sequence_restart_means_an_empty_worker() -> None:
    index = MemoryIndex()
    ing = KvEventIngestor(index)
    src = KvEventSource("w1", "tcp://127.0.0.1:1")
    await ing.handle(src, batch(0, [1]))
    await ing.handle(src, batch(1, [2]))
    await ing.handle(src, batch(0, [3]))
    assert ing.stats.of(src.key).restarts == 1
    assert (await index.lookup([1])).depth("w1") == 0 and (await index.lookup([3])).depth("w1") == 1


async def test_catch_up_then_live_duplicates_are_ignored() -> None:
    index = MemoryIndex()
    ing = KvEventIngestor(index)
    src = KvEventSource("w1", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    buffered = [batch(0, [1]), batch(1, [2])]

    async def replay(start: int) -> list[KvBatch]:
        return [b for b in buffered if b.seq >= start]

    await ing._catch_up(src, replay)
    # The SUB socket had queued batch 1 too while the replay ran: same batch, not a restart.
    await ing.handle(src, buffered[1], replay)
    await ing.handle(src, batch(2, [3]), replay)
    st = ing.stats.of(src.key)
    assert (st.restarts, st.replayed_batches, st.batches, st.last_seq) == (0, 2, 3, 2)
    assert (await index.lookup([1])).depth("w1") == 1


def test_metrics_render_through_the_router_registry() -> None:
    reg = Registry()
    ing = KvEventIngestor(MemoryIndex())
    ing.stats.of("w1#0").gaps = 2
    ing.register_metrics(reg)
    text = reg.render()
    assert 'kvroute_kv_events_gaps_total{source="w1#0"} 2' in text
    assert "# TYPE kvroute_kv_events_gaps_total counter" in text
    assert "kvroute_kv_events_lag_seconds" in text


# -- real sockets ---------------------------------------------------------------------------
class Publisher:
    """vLLM's ZmqEventPublisher protocol: PUB stream + ROUTER replay of buffered batches."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[tuple[int, bytes]] = []
        self.task = asyncio.create_task(self._serve_replay())

    async def publish(self, seq: int, events, *, deliver: bool = True) -> None:
        data = payload(events)
        self.buffer.append((seq, data))
        if deliver:
            await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), data])

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, data in self.buffer:
                if seq >= first:
                    await self.router.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), data])
            await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.pub.close(0)
        self.router.close(0)


async def test_socket_ingestion_with_catch_up_and_gap_replay() -> None:
    ctx = zmq.asyncio.Context()
    pub = Publisher(ctx)
    index = MemoryIndex()
    ing = KvEventIngestor(index, hasher=HASHER, context=ctx)
    tokens = list(range(500, 596))
    keys = chain_keys(tokens)
    try:
        # Batches published before the router subscribed: recovered by the catch-up replay.
        await pub.publish(0, [stored_map(keys[:2], tokens=tokens[:32])], deliver=False)
        src = KvEventSource("w1", f"tcp://127.0.0.1:{pub.port}", f"tcp://127.0.0.1:{pub.replay_port}", "kv")
        ing.add_source(src)
        await ing.start()
        await asyncio.sleep(0.3)  # PUB/SUB joins asynchronously: give the subscription time
        await pub.publish(1, [stored_map(keys[2:3], parent=keys[1], tokens=tokens[32:48])])
        await wait_for_async(lambda: _depth(index, keys, "w1", 3))
        # A batch lost on the PUB socket (e.g. high-water mark) is fetched from replay.
        await pub.publish(2, [stored_map(keys[3:4], parent=keys[2], tokens=tokens[48:64])], deliver=False)
        await pub.publish(3, [stored_map(keys[4:6], parent=keys[3], tokens=tokens[64:96])])
        await wait_for_async(lambda: _depth(index, keys, "w1", 6))
        st = ing.stats.of(src.key)
        assert (st.gaps, st.replayed_batches, st.dropped_batches, st.last_seq) == (1, 2, 0, 3)
        assert st.last_lag_s < 5
    finally:
        await ing.stop()
        await pub.close()
        ctx.term()


async def _depth(index: MemoryIndex, keys, loc: str, want: int) -> bool:
    return (await index.lookup(keys)).depth(loc) == want
