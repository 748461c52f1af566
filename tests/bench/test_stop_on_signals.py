"""SIGTERM (or SIGINT) to a command that starts processes stops every one of them, its
children's own children included, and the command exits with 128 + the signal.

Each child runs in a process group of its own (loadtests/support/processes.py), so nothing but the
command itself can stop them: `bench-proxy` stopped by `timeout` used to leave its fast
upstream and its routers running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

COMMAND = textwrap.dedent(
    """
    import sys, time
    from loadtests.support.processes import spawn, stop_children_on_signals

    # A child that forks a grandchild into its own group, like vLLM's engine core.
    family = "import subprocess, time; subprocess.Popen(['sleep', '120']); time.sleep(120)"
    with stop_children_on_signals():
        for _ in range(2):
            spawn([sys.executable, "-c", family])
        print("started", flush=True)
        time.sleep(120)
    """
)


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _descendants_once(
    proc: subprocess.Popen, ready: Callable[[list[psutil.Process]], bool], timeout_s: float
) -> list[psutil.Process]:
    """The command's whole process tree, once `ready(tree)` holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the command exited early with {proc.returncode}"
        with_children = psutil.Process(proc.pid).children(recursive=True)
        if ready(with_children):
            return with_children
        time.sleep(0.2)
    raise AssertionError("the command's children did not start in time")


def _stop_and_check(proc: subprocess.Popen, tree: list[psutil.Process], sig: int) -> None:
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=60)
    finally:
        for p in _alive(tree):  # never leak them into the rest of the test run
            p.kill()
    assert code == 128 + sig
    time.sleep(0.2)
    survivors = _alive(tree)
    assert not survivors, [(p.pid, p.cmdline()) for p in survivors]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_every_child_group_and_exits_non_zero(sig: int) -> None:
    proc = subprocess.Popen([sys.executable, "-c", COMMAND], stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    tree = _descendants_once(proc, lambda t: sum(p.name() == "sleep" for p in t) == 2, 30)
    assert len(tree) == 4  # two children, each with its grandchild
    _stop_and_check(proc, tree, sig)


@pytest.mark.slow
def test_sigterm_stops_bench_proxy_with_its_upstream_router_and_load_generator(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "router.cli", "bench-proxy", "--out", str(tmp_path / "out"),
        "--routers", "direct,kvroute-round_robin", "--levels", "1", "--duration", "60", "--warmup", "0.2",
        "--repeats", "1", "--modes", "nonstream", "--workers", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, cwd=ROOT)

    def running(tree: list[psutil.Process]) -> bool:
        lines = [" ".join(p.cmdline()) for p in tree if p.is_running()]
        return all(any(part in line for line in lines) for part in ("fast_upstream", "serve", "loadtests.benchmark.loadgen"))

    tree = _descendants_once(proc, running, 120)
    _stop_and_check(proc, tree, signal.SIGTERM)
