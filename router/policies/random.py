"""Uniform random choice: the baseline a cache-unaware load balancer gives.

With a `seed` (`--random-seed`, for benchmarks) the choice is keyed instead: a hash of the
seed and the request's identity picks the worker, where the identity is (session, how many
requests of that session came before) when the request names a session, else its prefix
chain. Every request still lands on a uniformly random worker, independently of the others,
but the same request lands on the same worker in every run with that seed, whatever order
requests arrive in and whichever API carries them. Two runs of one workload (through
`/v1/chat/completions` and `/v1/responses`, say, whose prompts render differently) then see
the same baseline placements — common random numbers — instead of two independent draws of
its noise. Without a seed, each request gets a fresh pseudo-random choice.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

from cache_client.base import IndexView
from router.cost import CostModel
from router.routing import RouteDecision, RouteRequest, WorkerLoad, rank_rest

SESSIONS_REMEMBERED = 100_000
"""Seeded mode counts requests per session for this many recent sessions (LRU)."""


class RandomPolicy:
    name: ClassVar[str] = "random"
    uses_index: ClassVar[bool] = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self._seed = None if seed is None else str(seed).encode()
        self._session_requests: OrderedDict[str, int] = OrderedDict()

    def choose(
        self, request: RouteRequest, view: IndexView, loads: Sequence[WorkerLoad], cost: CostModel
    ) -> RouteDecision:
        if self._seed is None:
            worker = self._rng.choice(loads).name
        else:
            names = sorted(w.name for w in loads)
            worker = names[self._draw(request) % len(names)]
        return RouteDecision(worker, "random", ranking=rank_rest(worker, loads))

    def _draw(self, request: RouteRequest) -> int:
        """The seeded draw for this request: a hash of the seed and the request's identity."""
        if request.session_key is not None:
            nth = self._session_requests.pop(request.session_key, 0)
            self._session_requests[request.session_key] = nth + 1
            if len(self._session_requests) > SESSIONS_REMEMBERED:
                self._session_requests.popitem(last=False)
            identity = f"s\0{request.session_key}\0{nth}".encode()
        else:
            identity = b"c\0" + b"".join(k.to_bytes(8, "big") for k in request.chain.keys[-1:])
            identity += request.chain.total_tokens.to_bytes(8, "big")
        digest = hashlib.blake2b(identity, digest_size=8, key=self._seed).digest()
        return int.from_bytes(digest, "big")
