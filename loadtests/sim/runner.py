"""Drives a pure `Engine` in real time: one asyncio task runs its steps back to back.

Time: every duration the engine reports is simulated; the runner sleeps simulated × scale.
Steps are scheduled against deadlines (the end of step k is the start of step k+1), so the
Python overhead between steps is absorbed instead of accumulating; only when the process
falls far behind (CPU starved) does it re-anchor. The simulated clock advances exactly by
step durations while busy and follows the wall clock while idle, so the figures reported in
/metrics (simulated seconds) do not include this process's overhead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loadtests.sim.engine import Engine, KVEvent, Seq, Step, TokenOut
from loadtests.sim.metrics import ITL_BUCKETS, LATENCY_BUCKETS, TTFT_BUCKETS, Histogram

MAX_LAG_S = 0.05
"""Real seconds behind schedule after which the runner stops trying to catch up."""
RECENT_ITL = 20_000
"""Inter-token latencies kept raw for exact percentiles (/sim/state); the histogram keeps all."""


@dataclass(eq=False)
class Handle:
    """A request's view of its progress, updated by the runner after every step."""

    seq: Seq
    produced: int = 0
    finished: bool = False
    aborted: bool = False
    _event: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait(self) -> None:
        """Until new tokens arrived (or the request ended)."""
        await self._event.wait()
        self._event.clear()

    def _notify(self) -> None:
        self._event.set()


class Runner:
    def __init__(
        self,
        engine: Engine,
        time_scale: float = 1.0,
        speed: float = 1.0,
        on_events: Callable[[list[KVEvent], float], None] | None = None,
        on_pool_store: Callable[[Seq, int, int], None] | None = None,
        on_pull_start: Callable[[Seq], None] | None = None,
        on_hold: Callable[[Seq], None] | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time scale must be positive")
        self.engine = engine
        self.time_scale = time_scale
        self.slow_factor = 1.0
        self.speed = speed
        """The GPU's relative speed: every step's simulated duration is divided by it."""
        self.on_events = on_events
        self.on_pool_store = on_pool_store
        self.on_pull_start = on_pull_start
        """Called when the engine admits a `pull` request: the caller transfers its KV and
        answers with `pull_done`."""
        self.on_hold = on_hold
        """Called when a `hold` request finishes and its blocks start waiting for a pull."""
        self.handles: dict[str, Handle] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue_time = Histogram(LATENCY_BUCKETS)
        self.prefill_time = Histogram(LATENCY_BUCKETS)
        """vLLM's `request_prefill_time_seconds`: from first scheduled to first token."""
        self.itl = Histogram(ITL_BUCKETS)
        """vLLM's `inter_token_latency_seconds`: between consecutive tokens of a request."""
        self.itl_recent: deque[float] = deque(maxlen=RECENT_ITL)
        self.tpot = Histogram(ITL_BUCKETS)
        """vLLM's `request_time_per_output_token_seconds`: a request's decode time per token."""
        self.decode_time = Histogram(LATENCY_BUCKETS)
        """vLLM's `request_decode_time_seconds`: from first token to last."""
        self.abort_delays: deque[float] = deque(maxlen=32)
        self.client_aborts = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._anchor_real = self._loop.time()
        self._anchor_sim = 0.0
        self._step_end_sim: float | None = None
        self._idle = True
        self._wake_sim: float | None = None
        """Simulated arrival of the first request since the engine went idle."""

    # -- clock ---------------------------------------------------------------------------

    def sim_now(self) -> float:
        """Simulated seconds since start; never beyond the end of the step in flight."""
        t = self._anchor_sim + (self._loop.time() - self._anchor_real) / self.time_scale
        if self._step_end_sim is not None:
            t = min(t, self._step_end_sim)
        return max(t, self._anchor_sim)

    # -- requests -----------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def submit(self, seq: Seq) -> Handle:
        seq.arrival = self.sim_now()
        if self._idle and self._wake_sim is None:
            self._wake_sim = seq.arrival
        handle = Handle(seq)
        self.engine.add(seq)
        self.handles[seq.id] = handle
        self._wake.set()
        return handle

    def abort(self, handle: Handle, client_gone_at: float | None = None) -> bool:
        """Stop a request (client gone, or its handler failed). Idempotent."""
        self.handles.pop(handle.seq.id, None)
        if handle.finished or handle.aborted:
            return False
        handle.aborted = True
        aborted = self.engine.abort(handle.seq.id)
        if client_gone_at is not None:
            self.client_aborts += 1
            self.abort_delays.append(self._loop.time() - client_gone_at)
        handle._notify()
        self._wake.set()  # freed blocks may let a stuck waiting request in
        return aborted

    def wake(self) -> None:
        """Blocks were freed outside a step (a hold released): a waiting request may fit."""
        self._wake.set()

    def pull_done(self, seq_id: str, ok: bool) -> None:
        """A pull the engine asked for (`on_pull_start`) ended; its request becomes schedulable."""
        if self.engine.pull_done(seq_id, ok) is None:
            return
        if self._idle and self._wake_sim is None:
            # Like an arrival: the busy period starts when the KV landed.
            self._wake_sim = self.sim_now()
        self._wake.set()

    # -- the step loop ------------------------------------------------------------------

    async def _run(self) -> None:
        loop = self._loop
        while True:
            if not self.engine.has_work():
                await self._wait_for_work()
                continue
            now = loop.time()
            if self._idle:
                # A busy period starts at the arrival that ended the idle time: the real
                # latency of waking this task up is not simulated time.
                start = self._wake_sim if self._wake_sim is not None else self.sim_now()
                self._anchor_sim, self._anchor_real = max(start, self._anchor_sim), now
                self._idle, self._wake_sim = False, None
            elif now - self._anchor_real > MAX_LAG_S:
                # Far behind schedule (CPU starved): give up catching up, without counting
                # the lag as simulated time.
                self._anchor_real = now
            step = self.engine.schedule()
            self._start_pulls()
            if step is None:
                # Nothing fits until something finishes or is aborted.
                await self._wait_for_work()
                continue
            # The step's own record carries the duration simulated, so that the engine's
            # timestamps and busy time (its /metrics) see the slowdown too.
            duration = step.duration = step.duration * self.slow_factor / self.speed
            self._step_end_sim = self._anchor_sim + duration
            deadline = self._anchor_real + duration * self.time_scale
            try:
                await asyncio.sleep(max(deadline - loop.time(), 0.0))
            except asyncio.CancelledError:
                self._step_end_sim = None
                raise
            self._anchor_sim, self._anchor_real = self._step_end_sim, deadline
            self._step_end_sim = None
            outs = self.engine.complete(step, self._anchor_sim)
            self._dispatch(outs)
            self._after_step(step)
            if self.engine.new_holds:
                for seq in self.engine.drain_new_holds():
                    if self.on_hold is not None:
                        self.on_hold(seq)

    def _start_pulls(self) -> None:
        if self.engine.pull_starts:
            for seq in self.engine.drain_pull_starts():
                if self.on_pull_start is None:
                    # Nobody to pull from: recompute. Soon, not now: the loop is about to
                    # wait for work, which would miss a wake-up set before it.
                    self._loop.call_soon(self.pull_done, seq.id, False)
                else:
                    self.on_pull_start(seq)

    async def _wait_for_work(self) -> None:
        self._idle = True
        self._wake_sim = None
        self._wake.clear()
        await self._wake.wait()

    def _dispatch(self, outs: list[TokenOut]) -> None:
        for out in outs:
            handle = self.handles.get(out.seq.id)
            if handle is None:
                continue
            handle.produced = out.index + 1
            seq = out.seq
            now = self._anchor_sim
            if out.index == 0 and seq.first_token_at is not None:
                self.ttft.observe(seq.first_token_at - seq.arrival)
                if seq.scheduled_at is not None:
                    self.queue_time.observe(seq.scheduled_at - seq.arrival)
                    self.prefill_time.observe(seq.first_token_at - seq.scheduled_at)
            elif seq.last_token_at is not None:
                gap = now - seq.last_token_at
                self.itl.observe(gap)
                self.itl_recent.append(gap)
            seq.last_token_at = now
            if out.finished:
                handle.finished = True
                self.handles.pop(seq.id, None)
                self.e2e.observe(now - seq.arrival)
                if out.index > 0 and seq.first_token_at is not None:
                    decode = now - seq.first_token_at
                    self.decode_time.observe(decode)
                    self.tpot.observe(decode / out.index)
            handle._notify()

    def _after_step(self, step: Step) -> None:
        if self.on_pool_store is not None:
            for seq, first, end in self.engine.pool_stores(step):
                self.on_pool_store(seq, first, end)
        self.flush_events()

    def flush_events(self) -> None:
        """Publish the engine's pending KV events (after a step, or an out-of-band change)."""
        if self.on_events is not None:
            events = self.engine.drain_events()
            if events:
                self.on_events(events, self._anchor_sim)
