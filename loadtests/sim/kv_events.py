"""vLLM-format KV cache events over ZMQ PUB.

Wire format, as vLLM's `ZmqEventPublisher` sends it (vllm/distributed/kv_events.py,
vllm-project/vllm@b4e69e0a and later): multipart `[topic, seq, payload]` where `seq` is an
8-byte big-endian counter and `payload` is a msgpack-encoded `KVEventBatch`. The structs
are msgspec `array_like=True` and events are tagged unions (`tag=True`), so everything is
positional, the tag (class name) first:

  batch          [ts, [event, ...], data_parallel_rank]
  BlockStored    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                  lora_id, medium, lora_name]
  BlockRemoved   ["BlockRemoved", block_hashes, medium]
  AllBlocksCleared ["AllBlocksCleared"]

`medium` was added after lora_id, `lora_name` after medium (vLLM 0.11); msgspec decoders
built for older layouts ignore the extra trailing fields. (vLLM main at 0181ea31 has
dropped `array_like` from the event structs and sends maps; we keep the positional layout
of the released versions and of vLLM's examples/online_serving/kv_events_subscriber.py.)
Block hashes are ints below 2**63.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgpack
import zmq

from loadtests.sim.engine import BLOCK_SIZE, KVEvent

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


def encode_event(event: KVEvent, medium: str = MEDIUM_GPU) -> list[Any]:
    if event.kind == "stored":
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent,
            list(event.token_ids),
            BLOCK_SIZE,
            None,
            medium,
            None,
        ]
    if event.kind == "removed":
        return ["BlockRemoved", list(event.block_hashes), medium]
    if event.kind == "cleared":
        return ["AllBlocksCleared"]
    raise ValueError(f"unknown KV event kind {event.kind!r}")


def encode_batch(events: Iterable[list[Any]], ts: float, dp_rank: int = 0) -> bytes:
    return msgpack.packb([ts, list(events), dp_rank], use_bin_type=True)


class KVEventPublisher:
    """Binds a PUB socket at `endpoint` (routers connect to the worker, as to vLLM)."""

    def __init__(self, endpoint: str, topic: str = "", hwm: int = 100_000) -> None:
        self.endpoint = endpoint
        self.topic = topic.encode()
        self._sock = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.set_hwm(hwm)
        self._sock.bind(endpoint)
        self._seq = 0
        self.dropped = 0

    def publish(self, events: list[list[Any]]) -> None:
        if not events:
            return
        payload = encode_batch(events, time.time())
        try:
            self._sock.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        self._seq += 1

    @property
    def sent(self) -> int:
        return self._seq

    def close(self) -> None:
        self._sock.close(linger=0)
