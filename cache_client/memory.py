"""In-process prefix index: the default for a single router."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from cache_client.base import IndexView
from normalizer.prefix import PrefixKey

_NOBODY: frozenset[str] = frozenset()

DEFAULT_CAPACITY_TOKENS = 840_000
"""Used for locations with no configured capacity: one H200's KV for Llama-3-8B at 0.85
memory utilisation ((0.85 × 141 GB − 16 GB weights) ÷ 128 KiB a token)."""


class _Location:
    __slots__ = ("capacity", "lru", "used")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[PrefixKey, int] = OrderedDict()
        self.used = 0


class MemoryIndex:
    """Prefix key → locations, with one LRU capacity model per location.

    Memory is bounded by the capacity models: a key lives only while some location's LRU
    holds it, and each LRU is bounded in tokens (and so in keys, since every key charges at
    least one token).
    """

    def __init__(self, default_capacity_tokens: int = DEFAULT_CAPACITY_TOKENS) -> None:
        self._default_capacity = default_capacity_tokens
        self._holders: dict[PrefixKey, set[str]] = {}
        self._locations: dict[str, _Location] = {}

    def _location(self, name: str) -> _Location:
        loc = self._locations.get(name)
        if loc is None:
            loc = self._locations[name] = _Location(self._default_capacity)
        return loc

    def lookup_sync(self, keys: Sequence[PrefixKey]) -> IndexView:
        depths: dict[str, int] = {}
        alive: set[str] | None = None
        for i, key in enumerate(keys):
            holders = self._holders.get(key, _NOBODY)
            if alive is None:
                alive = set(holders)
            elif not holders >= alive:  # usual case: the same holders, no sets built per key
                for name in alive - holders:
                    depths[name] = i
                alive &= holders
            if not alive:
                return IndexView(depths)
        for name in alive or ():
            depths[name] = len(keys)
        return IndexView(depths)

    async def lookup(self, keys: Sequence[PrefixKey]) -> IndexView:
        return self.lookup_sync(keys)

    def record_sync(self, location: str, keys: Sequence[PrefixKey], key_tokens: Sequence[int]) -> None:
        loc = self._location(location)
        # Insert the chain tail first so the head ends up most recent: like vLLM, evict a
        # conversation's last blocks before its shared head.
        for key, tokens in zip(reversed(keys), reversed(key_tokens), strict=True):
            charge = max(tokens, 1)
            old = loc.lru.get(key)
            if old is None:
                loc.lru[key] = charge
                loc.used += charge
                self._holders.setdefault(key, set()).add(location)
            else:
                loc.lru.move_to_end(key)
        while loc.used > loc.capacity and loc.lru:
            key, charge = loc.lru.popitem(last=False)
            loc.used -= charge
            self._unhold(key, location)

    async def record(self, location: str, keys: Sequence[PrefixKey], key_tokens: Sequence[int]) -> None:
        self.record_sync(location, keys, key_tokens)

    async def written(self) -> None:
        return  # one process's index: a write is visible as soon as it is made

    def _unhold(self, key: PrefixKey, location: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(location)
            if not holders:
                del self._holders[key]

    async def evict(self, location: str, keys: Sequence[PrefixKey]) -> None:
        loc = self._locations.get(location)
        if loc is None:
            return
        for key in keys:
            charge = loc.lru.pop(key, None)
            if charge is not None:
                loc.used -= charge
                self._unhold(key, location)

    async def drop_location(self, location: str) -> None:
        loc = self._locations.pop(location, None)
        if loc is None:
            return
        for key in loc.lru:
            self._unhold(key, location)

    def set_capacity(self, location: str, tokens: int) -> None:
        self._location(location).capacity = max(int(tokens), 1)

    async def usage(self) -> Mapping[str, int]:
        return {name: loc.used for name, loc in self._locations.items()}

    def usage_sync(self) -> Mapping[str, int]:
        return {name: loc.used for name, loc in self._locations.items()}

    def key_count(self) -> int:
        return len(self._holders)

    async def close(self) -> None:
        return None
