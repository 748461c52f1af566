"""Several uvicorn servers on one event loop (the simulator's workers and pool).

Each uvicorn.Server would install its own SIGINT/SIGTERM handlers and re-raise them in
turn on exit; with many servers in one loop we install one handler that stops them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn


class QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def server_for(app: Any, host: str, port: int, log_level: str = "warning") -> QuietServer:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        # Streams end when the engine says so; a long keep-alive lets clients reuse
        # connections between turns like they would with vLLM.
        timeout_keep_alive=30,
        # Hung requests (fault injection) must not hold a shutdown forever.
        timeout_graceful_shutdown=2,
    )
    return QuietServer(config)


async def serve_all(
    servers: list[QuietServer],
    on_ready: Callable[[], None] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
) -> int:
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for server in servers:
            server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop)
    tasks = [asyncio.create_task(server.serve()) for server in servers]
    while not all(server.started for server in servers):
        if any(task.done() for task in tasks):
            stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            print("failed to start (port in use?)", file=sys.stderr, flush=True)
            return 1
        await asyncio.sleep(0.01)
    if on_ready is not None:
        on_ready()
    try:
        await asyncio.gather(*tasks)
    finally:
        if on_stop is not None:
            await on_stop()
    return 0


Teardown = Callable[[], Awaitable[None]]


def run_servers(
    build: Callable[[], Awaitable[tuple[list[QuietServer], Teardown | None]]],
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM. `build` runs inside the event loop (the simulated
    engines need one) and returns the servers plus an optional teardown."""

    async def main() -> int:
        servers, teardown = await build()
        return await serve_all(servers, on_ready, teardown)

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())
