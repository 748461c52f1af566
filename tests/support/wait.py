"""Polling until a condition holds, for tests that watch background work (pollers, event
ingestion, Redis reconnects, simulated workers) settle."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0, interval_s: float = 0.02) -> None:
    """Block until `predicate()` is true; AssertionError after `timeout_s`. For sync tests."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError("condition not reached in time")


async def wait_for_async(
    predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float = 5.0, interval_s: float = 0.01
) -> None:
    """Await until `predicate()` is true, yielding to the event loop between checks (the work
    being waited for usually runs on it); AssertionError after `timeout_s`. `predicate` may
    be a plain function or return an awaitable (an index lookup)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval_s)
