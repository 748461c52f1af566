"""The hot path, one module per stage of a request, listed from the top down (each imports
only modules below it; tests/test_layers.py keeps it so):

    handler.py        the ASGI entry; rank the candidates (`Proxy.decide`), then attempt each
    disagg.py         a prefill worker's part before a decode attempt (`PdFlow`), in fleets with roles
    attempt.py        one try on one worker (`Attempt`): load ticket, breaker verdict, fleet health
    stateful.py       which worker stores each Responses-API response (`ResponsesAffinity`)
    relay.py          the answer from the first byte on: whole, or a stream relayed chunk by chunk
    context.py        what the stages see of the proxy (`ProxyContext`) and of each other
    exchange.py       one request's state (`Exchange`): body, payload, headers, flags, P/D split
    admission.py      per-worker in-flight limits and the wait queue (429 beyond)
    fair.py           the wait queue's order: FIFO, or each tenant's weighted fair share
    prefill_queue.py  requests held while every worker has a full step of prefill queued
    upstream.py       the HTTP/1.1 client to the workers
    deadlines.py      one sweeper for every first-byte, idle and total timeout
    settings.py       `ProxySettings` and the proxied paths

router/tracing.py (spans) sits between exchange.py and context.py.
"""

from router.proxy.handler import Proxy
from router.proxy.settings import PROXIED_PATHS, ProxySettings

__all__ = ["PROXIED_PATHS", "Proxy", "ProxySettings"]
