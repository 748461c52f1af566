"""Small asyncio helpers shared by the router's background tasks."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel background tasks and wait until each has finished unwinding."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    for task in live:
        with contextlib.suppress(asyncio.CancelledError):
            await task
