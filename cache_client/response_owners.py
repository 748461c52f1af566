"""Which worker holds each stored Responses-API response (`ResponseOwners`).

vLLM keeps a stored response (`VLLM_ENABLE_RESPONSES_API_STORE=1`) in the memory of the
worker that produced it: a request with `previous_response_id` can only be served there,
and that worker also holds the conversation's KV cache. The router records, per response
id, an `OwnerRecord`: the worker, and how many tokens the conversation holds after that
response (so a chained request is priced as a GPU hit on its owner).

`MemoryResponseOwners`: one replica's map, bounded and with a TTL. `RedisResponseOwners`:
shared by every replica using the same key prefix, one round trip per call (GET, SET EX,
DEL) on the index's connection; while Redis is away it answers from, and writes to, a
local map like the index's fallback view, and a Redis failure never fails a request.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cache_client.redact import exc_summary
from cache_client.redis_conn import REDIS_ERRORS, RedisBackend

log = logging.getLogger("kvroute.redis")

DEFAULT_MAX_ENTRIES = 100_000
OWNER_LOOKUP_TIMEOUT_S = 0.25
OWNER_RETRY_AFTER_S = 1.0
"""After a failed owner call, this long on the local map before Redis is tried again."""
"""Longest an owner lookup waits for Redis. Longer than the index's budget: a pinned
request answered "unknown response" because Redis was slow is worse than a late one."""


@dataclass(frozen=True, slots=True)
class OwnerRecord:
    worker: str
    tokens: int = 0
    """Tokens of the conversation after this response (prompt + output, when known)."""

    def encode(self) -> bytes:
        return f"{self.tokens}:{self.worker}".encode()

    @staticmethod
    def decode(raw: bytes | str) -> OwnerRecord | None:
        text = raw.decode() if isinstance(raw, bytes) else raw
        tokens, sep, worker = text.partition(":")
        if not sep or not worker or not tokens.isdigit():
            return None
        return OwnerRecord(worker, int(tokens))


class ResponseOwners(Protocol):
    async def remember(self, response_id: str, record: OwnerRecord, ttl_s: float) -> None: ...
    async def owner(self, response_id: str) -> OwnerRecord | None: ...
    async def forget(self, response_id: str) -> None: ...
    async def close(self) -> None: ...


class MemoryResponseOwners:
    """Response id -> owner in this process: entries expire after their TTL; past
    `max_entries` the oldest recorded goes first."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self._clock = clock
        self._entries: collections.OrderedDict[str, tuple[OwnerRecord, float]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, record: OwnerRecord, ttl_s: float) -> None:
        entries = self._entries
        entries.pop(response_id, None)
        entries[response_id] = (record, self._clock() + ttl_s)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def get(self, response_id: str) -> OwnerRecord | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            del self._entries[response_id]
            return None
        return entry[0]

    def delete(self, response_id: str) -> None:
        self._entries.pop(response_id, None)

    async def remember(self, response_id: str, record: OwnerRecord, ttl_s: float) -> None:
        self.put(response_id, record, ttl_s)

    async def owner(self, response_id: str) -> OwnerRecord | None:
        return self.get(response_id)

    async def forget(self, response_id: str) -> None:
        self.delete(response_id)

    async def close(self) -> None:
        self._entries.clear()


class RedisResponseOwners:
    """Owners in Redis under `{prefix}:resp:ID`, on the index's `RedisBackend`."""

    def __init__(self, backend: RedisBackend, prefix: str = "kvroute", local: MemoryResponseOwners | None = None) -> None:
        self._backend = backend
        self.tag = "{" + prefix + "}"
        self.local = local if local is not None else MemoryResponseOwners()
        """Every record this replica made, and the answers while Redis is away."""
        self.unshared = MemoryResponseOwners()
        """Records whose write did not reach Redis: still ours once Redis is back."""
        self.stats = {"remote": 0, "fallback": 0}
        self._skip_until = 0.0
        """Monotonic time before which calls skip Redis (it failed an owner call just now)."""

    def key(self, response_id: str) -> str:
        return f"{self.tag}:resp:{response_id}"

    async def _call(self, *command: object) -> tuple[bool, object]:
        """(answered, result): one command, or (False, None) when Redis is away or fails."""
        # Not gated on the backend's "up": the index marks it down when lookups run over
        # their few-millisecond budget, a latency verdict. An owner is a correctness
        # matter (another replica's record, or a 404), worth a slower answer; only a call
        # that failed sends this replica to its local map, for a moment.
        backend = self._backend
        backend.start()
        if time.monotonic() < self._skip_until:
            self.stats["fallback"] += 1
            return False, None
        try:
            result = await asyncio.wait_for(backend.client().execute_command(*command), OWNER_LOOKUP_TIMEOUT_S)
        except REDIS_ERRORS as exc:
            backend.failed(exc)
            self._skip_until = time.monotonic() + OWNER_RETRY_AFTER_S
            self.stats["fallback"] += 1
            return False, None
        except Exception as exc:  # a bug in the client: logged, never the request's failure
            log.error("response owner call failed unexpectedly: %s", exc_summary(exc))
            self.stats["fallback"] += 1
            return False, None
        self.stats["remote"] += 1
        return True, result

    async def remember(self, response_id: str, record: OwnerRecord, ttl_s: float) -> None:
        self.local.put(response_id, record, ttl_s)
        answered, _ = await self._call("SET", self.key(response_id), record.encode(), "EX", max(int(ttl_s), 1))
        if not answered:
            self.unshared.put(response_id, record, ttl_s)

    async def owner(self, response_id: str) -> OwnerRecord | None:
        answered, raw = await self._call("GET", self.key(response_id))
        if not answered:
            return self.local.get(response_id)
        if raw is None:
            # Recorded here while Redis was away (so never written there): still ours.
            return self.unshared.get(response_id)
        return OwnerRecord.decode(raw)  # type: ignore[arg-type]

    async def forget(self, response_id: str) -> None:
        self.local.delete(response_id)
        self.unshared.delete(response_id)
        await self._call("DEL", self.key(response_id))

    async def close(self) -> None:
        # The backend belongs to the index, which closes it.
        await self.local.close()
        await self.unshared.close()
