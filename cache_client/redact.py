"""What kvroute may say about an unexpected exception in a log line or a response.

Exception messages and tracebacks carry worker URLs (httpx puts the request URL in its
messages), header values and request content. Logs get the exception type and where it
was raised instead: enough to find the bug, nothing an operator must not see.

It lives in `cache_client`, the lowest layer that logs unexpected exceptions (the Redis
index, KV-event ingestion); the router imports it from here.
"""

from __future__ import annotations

import os
import traceback


def exc_summary(exc: BaseException) -> str:
    """`TypeError at router/proxy/handler.py:123 (_handle)`: type and innermost frame, no message."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    last = frames[-1]
    parts = os.path.normpath(last.filename).split(os.sep)
    where = "/".join(parts[-2:])
    return f"{type(exc).__name__} at {where}:{last.lineno} ({last.name})"
