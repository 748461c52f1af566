"""Child processes of the load-test commands, and stopping every one of them.

Each child a command starts (simulator, routers, peer routers, load generators, vLLM
workers, the LMCache server) runs in a session of its own, hence a process group of its
own: signalling the group reaches whatever the child forked too (vLLM's engine core,
`kvroute serve --processes N`'s workers), and a Ctrl-C typed in the terminal reaches the
command alone, which then stops its children in order.

The other side of that: when the command itself is killed, its children get no signal
(`timeout` signals only the command's group), and a Python process that dies of SIGTERM's
default action runs no `finally`. So `bench-proxy` stopped by `timeout` used to leave its
fast upstream, two kvroute routers, `sglang-router` and `vllm-router` running.

`stop_children_on_signals()` turns SIGTERM and SIGINT into an orderly stop: every group
started through `spawn()` is sent SIGTERM at once (a thread may be blocked waiting on one),
`SystemExit(128 + signal)` unwinds the command (its own `finally` blocks stop what they
own and write what they have), and on the way out every group still registered is
waited for, then killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Registry:
    def __init__(self) -> None:
        # Re-entrant: the signal handler runs in the main thread, maybe while it holds this.
        self.lock = threading.RLock()
        self.live: dict[int, subprocess.Popen[Any]] = {}
        self.stopping = False
        self.signum: int | None = None
        """The signal being handled, once one arrived."""
        self.deferred = False
        """A signal arrived while the main thread was inside `spawn`: raised once it returns."""
        self.main_spawning = 0
        self.depth = 0


_REGISTRY = _Registry()


class Stopping(RuntimeError):
    """Raised by `spawn` in a thread other than the main one once the command is stopping."""


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    # pgid == pid: every child is started in a new session. A group whose leader has exited
    # may still hold its orphans, hence no poll() check here.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def spawn(args: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen` in a new session (its own process group), registered so that
    `stop_all()` and the signal handler of `stop_children_on_signals()` reach it."""
    reg = _REGISTRY
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        # A signal handled between the fork and the registration must not unwind past the
        # new child: the handler defers its exception while this is non-zero.
        reg.main_spawning += 1
    try:
        proc: subprocess.Popen[Any] = subprocess.Popen(args, start_new_session=True, **popen_kwargs)
        with reg.lock:
            for pid in [pid for pid, p in reg.live.items() if p.returncode is not None]:
                del reg.live[pid]
            reg.live[proc.pid] = proc
    finally:
        if in_main:
            reg.main_spawning -= 1
    if reg.stopping:  # a signal came while it started, or the command is on its way out
        stop_groups([proc])
        if in_main and reg.deferred:
            reg.deferred = False
            raise SystemExit(128 + (reg.signum or signal.SIGTERM))
        raise Stopping(f"not starting {args[0]}: the command is stopping")
    return proc


def run(
    args: Sequence[str], timeout_s: float, *, capture_output: bool = False, text: bool = False, **popen_kwargs: Any
) -> subprocess.CompletedProcess[Any]:
    """`subprocess.run` through `spawn`: a long install or a benchmark client stops with the
    rest of the command's children. Raises `subprocess.TimeoutExpired` after `timeout_s`."""
    if capture_output:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = spawn(args, text=text, **popen_kwargs)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        stop_group(proc)
    return subprocess.CompletedProcess(list(args), proc.returncode, out, err)


def stop_groups(procs: Iterable[subprocess.Popen[Any]], timeout_s: float = 10.0) -> None:
    """SIGTERM every group at once, wait for the leaders up to `timeout_s` in all, then
    SIGKILL whatever is left of each group (a leader's orphans, or a leader that hung)."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(deadline - time.monotonic(), 0.0))
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
    with _REGISTRY.lock:
        for proc in procs:
            if _REGISTRY.live.get(proc.pid) is proc:
                del _REGISTRY.live[proc.pid]


def stop_group(proc: subprocess.Popen[Any] | None, timeout_s: float = 10.0) -> None:
    """Stop one child's whole group: SIGTERM, wait up to `timeout_s`, SIGKILL."""
    if proc is not None:
        stop_groups([proc], timeout_s)


def kill_group(proc: subprocess.Popen[Any] | None) -> None:
    """SIGKILL one child's whole group now (fault injection), and reap it."""
    if proc is not None:
        _signal_group(proc, signal.SIGKILL)
        stop_groups([proc])


def live() -> list[subprocess.Popen[Any]]:
    """Children started through `spawn` and not stopped since (some may have exited)."""
    with _REGISTRY.lock:
        return list(_REGISTRY.live.values())


def stop_all(timeout_s: float = 10.0) -> None:
    stop_groups(live(), timeout_s)


def _on_signal(signum: int, frame: object) -> None:
    reg = _REGISTRY
    with reg.lock:
        already = reg.stopping
        reg.stopping = True
        reg.signum = reg.signum or signum
        procs = list(reg.live.values())
    # A signal while stopping already (an impatient second Ctrl-C, or `timeout` firing
    # during the final stop) kills at once and does not interrupt the stop under way.
    for proc in procs:
        _signal_group(proc, signal.SIGKILL if already else signal.SIGTERM)
    if already:
        return
    if reg.main_spawning:
        reg.deferred = True
        return
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def stop_children_on_signals() -> Iterator[None]:
    """Around a command's body: SIGTERM / SIGINT stop every child `spawn` started, then
    exit with 128 + the signal's number; on any exit, children still running are stopped.

    Nests (only the outermost use installs the handlers and stops the children)."""
    reg = _REGISTRY
    reg.depth += 1
    if reg.depth > 1:
        try:
            yield
        finally:
            reg.depth -= 1
        return
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _on_signal) for sig in STOP_SIGNALS}
    signum: int | None = None
    try:
        yield
    finally:
        try:
            with reg.lock:
                reg.stopping = True
            stop_all()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            signum = reg.signum
            reg.stopping, reg.signum, reg.deferred, reg.depth = False, None, False, 0
    if signum is not None:
        # The body swallowed the SystemExit (a broad except somewhere): still not a success.
        raise SystemExit(128 + signum)
