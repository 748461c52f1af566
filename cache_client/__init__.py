"""The prefix index (memory and Redis backends) and KV-event ingestion."""

from cache_client.base import EMPTY_VIEW, POOL, IndexView, PrefixIndex, key_tokens_of
from cache_client.memory import MemoryIndex

__all__ = ["EMPTY_VIEW", "POOL", "IndexView", "MemoryIndex", "PrefixIndex", "key_tokens_of"]
