"""The hot path, one module per stage of a request:

    handler.py    the ASGI entry; rank the candidates (`Proxy.decide`), then attempt each in turn
    exchange.py   one request's state (`Exchange`): its body, payload, headers, flags
    attempt.py    one try on one worker (`Attempt`): load ticket, breaker verdict, fleet health
    relay.py      the answer from the first byte on: whole, or a stream relayed chunk by chunk
    upstream.py   the HTTP/1.1 client to the workers
    deadlines.py  one sweeper for every first-byte, idle and total timeout
    admission.py  per-worker in-flight limits and the wait queue (429 beyond)
    settings.py   `ProxySettings` and the proxied paths
"""

from router.proxy.handler import Proxy
from router.proxy.settings import PROXIED_PATHS, ProxySettings

__all__ = ["PROXIED_PATHS", "Proxy", "ProxySettings"]
