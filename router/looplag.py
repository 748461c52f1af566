"""Event-loop lag: how late a timer fires, sampled a few times a second.

Everything the router does runs on one event loop per process; when something blocks it
(a CPU-heavy request, a synchronous call, GC of a large heap), every stream stalls at once.
A sleep that wakes up late measures exactly that. `kvroute_event_loop_lag_seconds` is the
worst lag of the last `window_s`, so a scrape every 15 s still sees a short stall.
"""

from __future__ import annotations

import asyncio
from collections import deque

from router.aio import cancel_and_wait
from router.metrics import CallbackGauge, Registry


class LoopLagMonitor:
    def __init__(self, interval_s: float = 0.1, window_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max(int(window_s / interval_s), 1))
        self.max_lag_s = 0.0
        """Worst lag since start."""
        self._task: asyncio.Task | None = None

    def recent_max(self) -> float:
        return max((lag for _, lag in self._samples), default=0.0)

    def register(self, registry: Registry) -> None:
        registry.register(
            CallbackGauge(
                "kvroute_event_loop_lag_seconds",
                "Worst event-loop lag (a timer firing late) over the last 10 seconds.",
                (),
                lambda: {(): self.recent_max()},
            )
        )

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            lag = max(now - before - self.interval_s, 0.0)
            self._samples.append((now, lag))
            self.max_lag_s = max(self.max_lag_s, lag)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvroute-loop-lag")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
