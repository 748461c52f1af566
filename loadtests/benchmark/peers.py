"""Other routers run in front of the same simulated workers: the bench's peers.

* `sglang-router` (PyPI; its binary is `smg`, SGLang's model gateway), policy `cache_aware`:
  an approximate radix tree of the request text per worker, balanced when in-flight
  counts drift apart. At start it probes each worker's `GET /health`, `GET /server_info`
  and `GET /model_info`, and tries to download a tokenizer for the model name from the
  Hugging Face hub: `HF_ENDPOINT` points at a closed loopback port so that fails at once
  (it only needs the tokenizer for its gRPC mode). It rewrites requests: `max_tokens`
  becomes `max_completion_tokens`, `user` is dropped.
* `vllm-router` (PyPI; vLLM's router, a fork of sglang's), policies `cache_aware` (the same
  text tree; it asks a worker to render the prompt first, `POST /v1/chat/completions/render`)
  and `consistent_hash` (hash of `x-session-id`, then other session headers, then `user`).
  At start it probes `GET /health` only. Its policy `pd` (`vllm-router/pd`, never implied
  by `vllm-router` alone) runs it in its prefill/decode mode on a fleet with roles
  (`--vllm-pd-disaggregation --kv-connector nixl`, `--prefill URL` and `--decode URL` per
  worker, its default `cache_aware` policy on both sides). It speaks vLLM's NixlConnector
  protocol, the one the simulator serves: P gets the body with `max_tokens: 1`,
  `min_tokens: 1`, `stream: false` and `kv_transfer_params: {do_remote_decode: true, ...}`
  under an `X-Request-Id` naming both workers; D gets the client's body with P's returned
  `kv_transfer_params`. It splits every request (no local prefill on D).

Neither canonicalizes a request: tool schemas, argument strings and system prompts reach
the worker in the client's bytes (both re-serialise the JSON, preserving key order).

Each is installed on first use into its own virtual environment under
`~/.cache/kvroute/peers/NAME` (reused afterwards; `KVROUTE_PEERS_DIR` moves it), pinned to
the version this harness was checked against.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtests.benchmark.workload import MODEL
from loadtests.support.processes import run, spawn, stop_group
from loadtests.support.routerproc import free_port


@dataclass(frozen=True)
class PeerSpec:
    name: str
    package: str
    version: str
    binary: str
    subcommand: tuple[str, ...]
    policies: tuple[str, ...]
    """Policies the bench runs; the first is the one `NAME` alone means."""
    log_level: str
    pd: bool = False
    """Whether it has a prefill/decode mode the bench runs as policy `pd`."""


PEERS: dict[str, PeerSpec] = {
    "sglang-router": PeerSpec("sglang-router", "sglang-router", "0.3.2", "smg", ("launch",), ("cache_aware",), "warn"),
    "vllm-router": PeerSpec(
        "vllm-router", "vllm-router", "0.1.17", "vllm-router", (), ("cache_aware", "consistent_hash"), "warning", pd=True
    ),
}
PD_POLICY = "pd"
PD_ROUTING_POLICY = "cache_aware"
"""The policy a peer in prefill/decode mode picks P and D with (vllm-router's default)."""

# Variables that would send a peer's traffic (or its tokenizer download) anywhere else.
_SCRUB_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "HF_TOKEN")


def peers_dir() -> Path:
    return Path(os.environ.get("KVROUTE_PEERS_DIR", "~/.cache/kvroute/peers")).expanduser()


def parse_peer(item: str) -> list[tuple[str, str]]:
    """'vllm-router' → every policy the bench runs for it; 'vllm-router/consistent_hash' → one."""
    name, _, policy = item.partition("/")
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    spec = PEERS[name]
    if not policy:
        return [(name, p) for p in spec.policies]
    known = (*spec.policies, PD_POLICY) if spec.pd else spec.policies
    if policy not in known:
        raise ValueError(f"{name}: the bench runs policies {', '.join(known)}, not {policy!r}")
    return [(name, policy)]


def result_key(name: str, policy: str) -> str:
    """`vllm-router` for its default policy, `vllm-router/consistent_hash` for the others."""
    return name if policy == PEERS[name].policies[0] else f"{name}/{policy}"


def ensure_installed(name: str, log: list[str] | None = None) -> Path:
    """The peer's executable, installing it into its own venv the first time."""
    spec = PEERS[name]
    venv = peers_dir() / name
    exe = venv / "bin" / spec.binary
    marker = venv / f".installed-{spec.package}-{spec.version}"
    if exe.exists() and marker.exists():
        return exe
    venv.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         f"{spec.package}=={spec.version}"],
    ]  # fmt: skip
    for cmd in steps:
        done = run(cmd, 900, capture_output=True, text=True)
        if log is not None:
            log.append(f"$ {' '.join(cmd)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        if done.returncode != 0:
            raise RuntimeError(f"installing {spec.package}=={spec.version} failed:\n{done.stderr[-2000:]}")
    if not exe.exists():
        raise RuntimeError(f"{spec.package} installed no {spec.binary} executable in {venv}")
    marker.write_text(spec.version)
    return exe


def peer_command(
    name: str,
    policy: str,
    exe: Path,
    worker_urls: list[str],
    port: int,
    metrics_port: int,
    roles: list[str] | None = None,
) -> list[str]:
    """The peer's command line; for policy `pd`, `roles` gives each worker's role (in
    `worker_urls` order)."""
    spec = PEERS[name]
    workers = ["--worker-urls", *worker_urls, "--policy", policy]
    if policy == PD_POLICY:
        workers = pd_worker_args(worker_urls, roles)
    return [
        str(exe), *spec.subcommand,
        "--host", "127.0.0.1", "--port", str(port),
        *workers,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--log-level", spec.log_level,
    ]  # fmt: skip


def pd_worker_args(worker_urls: list[str], roles: list[str] | None) -> list[str]:
    """vllm-router's prefill/decode flags: `--prefill URL` and `--decode URL` per worker.
    A worker of role `both` has no place there (it would be two workers to the router)."""
    if roles is None or len(roles) != len(worker_urls):
        raise ValueError("a peer in prefill/decode mode needs one role per worker")
    if "both" in roles or "prefill" not in roles or "decode" not in roles:
        raise ValueError(f"a peer in prefill/decode mode needs prefill and decode workers only, not {roles}")
    args = ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", PD_ROUTING_POLICY]
    for url, role in zip(worker_urls, roles, strict=True):
        args += ["--prefill", url] if role == "prefill" else ["--decode", url]
    return args


def peer_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB_ENV}
    # Any tokenizer download is refused on a loopback port nobody listens on, at once.
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    env["HF_HUB_OFFLINE"] = "1"
    env["NO_PROXY"] = "127.0.0.1,localhost"
    return env


class PeerRouter:
    """`with PeerRouter("sglang-router", "cache_aware", worker_urls) as r: r.url ...`"""

    def __init__(
        self,
        name: str,
        policy: str,
        worker_urls: list[str],
        log_path: str | None = None,
        model: str = MODEL,
        ready_timeout_s: float = 90.0,
        roles: list[str] | None = None,
    ) -> None:
        self.name = name
        self.policy = policy
        self.worker_urls = worker_urls
        self.roles = roles
        """Each worker's role, for policy `pd`."""
        self.log_path = log_path
        self.model = model
        self.ready_timeout_s = ready_timeout_s
        self.port = free_port()
        self.metrics_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> PeerRouter:
        exe = ensure_installed(self.name)
        cmd = peer_command(self.name, self.policy, exe, self.worker_urls, self.port, self.metrics_port, self.roles)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = spawn(cmd, env=peer_env(), stdout=out, stderr=out)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        """Until a one-token completion goes through (the router has registered workers)."""
        assert self.proc is not None
        body = {"model": self.model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        deadline = time.monotonic() + self.ready_timeout_s
        last = ""
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} (log: {self.log_path})")
                try:
                    r = client.post(self.url + "/v1/chat/completions", json=body)
                    if r.status_code == 200:
                        return
                    last = f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as exc:
                    last = type(exc).__name__
                time.sleep(0.25)
        raise RuntimeError(f"{self.name} was not ready after {self.ready_timeout_s:.0f} s ({last})")

    def metrics(self) -> str:
        try:
            return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5, trust_env=False).text
        except httpx.HTTPError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        stop_group(proc)

    def __enter__(self) -> PeerRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
