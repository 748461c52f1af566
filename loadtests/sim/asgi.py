"""Small ASGI helpers: responses that notice a client leaving while the engine works."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def wait_disconnect(receive: Receive) -> float:
    """Until the client disconnects; returns the loop time it was noticed."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return asyncio.get_running_loop().time()


class WatchedResponse:
    """Runs `body(send)` while watching for the client to go away.

    Starlette's StreamingResponse only notices a disconnect when it next writes (ASGI spec
    2.4), which for a request still in prefill can be seconds later. Here the disconnect
    cancels `body` at once and `on_disconnect(noticed_at)` runs first, so the engine can
    free the request's blocks promptly.
    """

    def __init__(self, body: Callable[[Send], Awaitable[None]], on_disconnect: Callable[[float], None]) -> None:
        self._body = body
        self._on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._body(send))
        watch = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            watch.cancel()
            raise
        if work.done():
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            work.result()
            return
        self._on_disconnect(watch.result())
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await work


async def send_json(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def start_sse(send: Send, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), *(headers or [])],
        }
    )


async def send_chunk(send: Send, data: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})
