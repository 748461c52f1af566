"""Start `kvroute serve` as a subprocess on a free loopback port (tests, demo, benchmarks)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

import httpx

from loadtests.support.processes import spawn, stop_group


def port_free(port: int) -> bool:
    """Whether a loopback port can be bound now (for picking fixed ranges of ports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterProcess:
    """`with RouterProcess({"w0": url}, policy="cache_aware") as r: r.url ...`"""

    def __init__(
        self,
        workers: Mapping[str, str],
        policy: str = "cache_aware",
        extra_args: Sequence[str] = (),
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 20.0,
        wait_ready: bool = True,
        log_path: str | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
            "--policy", policy, "--log-level", "warning",
            *(a for name, u in workers.items() for a in ("--worker", f"{name}={u}")),
            *extra_args,
        ]
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.wait_ready = wait_ready
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> RouterProcess:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = spawn(self.args, env=self.env, stdout=out, stderr=out)
        deadline = time.monotonic() + self.ready_timeout_s
        path = "/ready" if self.wait_ready else "/health"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvroute serve exited with {self.proc.returncode}: {' '.join(self.args)}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"kvroute serve did not become ready on port {self.port}")

    def stop(self) -> None:
        stop_group(self.proc)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
