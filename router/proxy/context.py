"""What the stages of a request see of the proxy that runs them, and of each other.

The stages (attempt.py, relay.py, stateful.py, disagg.py) are handed the proxy as a
`ProxyContext`: its parts (settings, fleet, load board, upstream client, metrics, ...) and
the few things it records for them. They never import the handler (handler.py), which
sequences them: the imports of router/proxy point one way, from the handler down to the
request's own state (exchange.py) and the parts below it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from cache_client.base import PrefixIndex
    from normalizer.prefix import PrefixChain
    from router.chain import ChainBuilder
    from router.cost import CostModel
    from router.load import LoadBoard
    from router.metrics import RouterMetrics
    from router.proxy.admission import Admission
    from router.proxy.deadlines import Deadlines
    from router.proxy.exchange import Exchange
    from router.proxy.prefill_queue import PrefillQueue
    from router.proxy.settings import ProxySettings
    from router.proxy.upstream import UpstreamClient
    from router.tracing import AttemptTrace, Tracer
    from router.workers import Fleet, Worker


class AnswerLearner(Protocol):
    """Learns which worker stores a `/v1/responses` answer as it is sent (stateful.py's
    `Learner`): from a whole body, or from a stream's chunks as they pass."""

    async def from_body(self, body: bytes) -> None: ...
    def feed(self, chunk: bytes) -> None: ...
    async def settle(self) -> None: ...


class ProxyContext(Protocol):
    """The proxy's parts a stage uses (handler.py's `Proxy` is one)."""

    settings: ProxySettings
    fleet: Fleet
    index: PrefixIndex
    loads: LoadBoard
    cost: CostModel
    chains: ChainBuilder
    metrics: RouterMetrics
    admission: Admission
    prefill_queue: PrefillQueue
    deadlines: Deadlines
    client: UpstreamClient
    tracer: Tracer | None

    def learner(self, ex: Exchange, worker: str) -> AnswerLearner | None:
        """Records who answered a `/v1/responses` request (None: nothing to record)."""
        ...

    def learn_cost(self, ex: Exchange, worker: str, sent_at: float, first_byte_s: float, tail: bytes) -> None:
        """A stream's first token time and usage, for the worker's cost model."""
        ...

    async def record_sent(self, ex: Exchange, worker: Worker, chain: PrefixChain) -> None:
        """`ex` is sent to `worker`: what routing it teaches the router."""
        ...

    async def record_prefix(self, worker: Worker, chain: PrefixChain) -> None:
        """`chain` is on `worker`'s GPU now, and soon in the tiers it writes to."""
        ...


class RelayedAttempt(Protocol):
    """The try whose stream the relay (relay.py) passes on (attempt.py's `Attempt`): what
    the relay reads of it and reports back to it."""

    proxy: ProxyContext
    worker: Worker
    trace: AttemptTrace | None
    sent_at: float
    first_byte_s: float | None

    def prefilled(self, now: float) -> None:
        """A Responses stream's first output item arrived (its first token)."""
        ...

    def interrupted(self, why: str) -> None:
        """The stream broke after its first byte."""
        ...
