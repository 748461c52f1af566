"""The container image, built for real and checked from inside (`buildah run`).

Run by .ci/image-check.sh, which builds the image first and passes it as KVROUTE_IMAGE; on its
own (`python -m pytest .ci/test_image.py`, as root with buildah) it builds one with
`scripts/build-image --base local`. Outside tests/ on purpose: it needs root and buildah, so
the main pytest run does not collect it.

`buildah run --isolation chroot` shares the host's network and PID namespace: the simulated
worker on the host is reachable on loopback, and the router's process can be signalled directly,
as the kubelet's runtime signals a container's entrypoint process. (Signalling `buildah run`
itself would not do: it kills its child instead of passing the signal on.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtests.sim.cluster import SimWorkerProcess
from loadtests.sim.worker import DEFAULT_MODEL
from loadtests.support.routerproc import free_port

ROOT = Path(__file__).resolve().parents[1]
VERSION = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)[1]  # type: ignore[index]
SITE_PACKAGES = "/opt/venv/lib/python3.11/site-packages"
# Measured 248 MB on the local Debian base (docs/deploy.md; 184 MB without the epp and tracing
# extras); a jump past this means something that does not belong in the image got in.
MAX_IMAGE_BYTES = 320_000_000
# Shorter than the chart's terminationGracePeriodSeconds (60), long enough for the stream below.
GRACE_S = 15.0


def buildah(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"buildah {' '.join(args)}: {proc.stderr[-2000:]}"
    return proc.stdout


def run_in_image(container: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["buildah", "run", "--isolation", "chroot", container, "--", *argv],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def image() -> str:
    if ref := os.environ.get("KVROUTE_IMAGE"):
        return ref
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-image"), "--base", "local"],
        capture_output=True, text=True, timeout=1800,
        env={**os.environ, "KVROUTE_IMAGE_ENGINE": "buildah"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def config(image: str) -> dict[str, Any]:
    return json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]["config"]


@pytest.fixture(scope="module")
def container(image: str) -> Iterator[str]:
    name = f"kvroute-image-check-{os.getpid()}"
    buildah("from", "--pull=never", "--name", name, image)
    try:
        yield name
    finally:
        buildah("rm", name)


@pytest.fixture(scope="module")
def rootfs(container: str) -> Iterator[Path]:
    path = Path(buildah("mount", container).strip())
    try:
        yield path
    finally:
        buildah("umount", container)


@pytest.fixture(scope="module")
def sim_worker() -> Iterator[SimWorkerProcess]:
    # time_scale 5: a 150-token answer streams for about 3 s, long enough to SIGTERM mid-stream.
    with SimWorkerProcess(time_scale=5.0) as worker:
        yield worker


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += children
            todo += children
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def is_router(argv: list[str]) -> bool:
    """`/opt/venv/bin/python /opt/venv/bin/kvroute serve ...`, not its parent
    `buildah-chroot-exec /opt/venv/bin/kvroute serve ...` (which SIGKILLs it on SIGTERM)."""
    return (
        len(argv) > 2
        and not argv[0].startswith("buildah")
        and argv[1].endswith("/kvroute")
        and argv[2] == "serve"
    )


class InImageRouter:
    """The image's ENTRYPOINT plus `args`, under `buildah run`; `.url`, `.pid`, `.wait()`."""

    def __init__(self, container: str, entrypoint: list[str], args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # --host: the image listens on 0.0.0.0 (KVROUTE_HOST); this check stays on loopback.
        # --log-level warning: its output goes to a pipe read only on failure.
        argv = [*entrypoint, *args, "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        self.proc = subprocess.Popen(
            ["buildah", "run", "--isolation", "chroot", container, "--", *argv],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self.pid = 0

    def start(self, timeout: float = 60) -> InImageRouter:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if not self.pid:
                self.pid = next((p for p in descendants(self.proc.pid) if is_router(cmdline(p))), 0)
            try:
                if httpx.get(self.url + "/health", timeout=1, trust_env=False).status_code == 200:
                    assert self.pid, "router answers but its process was not found"
                    return self
            except httpx.TransportError:
                time.sleep(0.2)
        raise AssertionError(f"router did not come up: rc={self.proc.poll()}\n{self.output()}")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        self.stop()
        out, _ = self.proc.communicate(timeout=10)
        return out[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=GRACE_S + 10)
                return
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def __enter__(self) -> InImageRouter:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def chat(stream: bool, max_tokens: int) -> dict[str, Any]:
    return {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "Tell me about KV caches."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def read_stream(url: str, out: dict[str, Any], max_tokens: int) -> None:
    """POST a streamed chat; record status, the worker header and each SSE payload with its time."""
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=chat(True, max_tokens), timeout=60, trust_env=False
    ) as resp:
        out["status"] = resp.status_code
        out["worker"] = resp.headers.get("x-kvroute-worker")
        out["events"] = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                out["events"].append((time.monotonic(), line[len("data: ") :]))


def assert_complete_stream(out: dict[str, Any], max_tokens: int) -> None:
    assert out.get("status") == 200, out
    payloads = [p for _, p in out["events"]]
    assert payloads[-1] == "[DONE]", payloads[-3:]
    assert not any('"error"' in p for p in payloads), [p for p in payloads if '"error"' in p]
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) >= max_tokens, f"{len(chunks)} chunks for {max_tokens} tokens"


# -- the image's user and file permissions ----------------------------------------------------


def test_runs_as_its_non_root_user(config: dict[str, Any], container: str) -> None:
    assert config["User"] == "10001:10001"
    ids = run_in_image(container, "sh", "-c", "id -u; id -g")
    assert ids.returncode == 0, ids.stderr
    assert ids.stdout.split() == ["10001", "10001"]
    values = yaml.safe_load((ROOT / "helm" / "kvroute" / "values.yaml").read_text())
    pod = values["router"]["podSecurityContext"]
    assert (pod["runAsUser"], pod["runAsGroup"], pod["runAsNonRoot"]) == (10001, 10001, True)


def test_its_user_cannot_change_the_installed_code(container: str, rootfs: Path) -> None:
    writable = []
    for dirpath, dirnames, filenames in os.walk(rootfs / "opt" / "venv"):
        for name in [*dirnames, *filenames]:
            st = (Path(dirpath) / name).lstat()
            if st.st_uid != 0 or (st.st_mode & 0o022 and not Path(dirpath, name).is_symlink()):
                writable.append(str(Path(dirpath, name).relative_to(rootfs)))
    assert not writable, f"not root-owned or group/other-writable: {writable[:10]}"
    probe = run_in_image(
        container, "sh", "-c",
        f"test ! -w {SITE_PACKAGES} && test ! -w /opt/venv/bin && test ! -w / && test -w /tmp",
    )  # fmt: skip
    assert probe.returncode == 0, "the kvroute user can write where it should not (or not /tmp)"


# -- the entrypoint ---------------------------------------------------------------------------


def test_entrypoint_execs_kvroute_serve_from_the_virtualenv(
    config: dict[str, Any], container: str, rootfs: Path
) -> None:
    assert config["Entrypoint"] == ["kvroute", "serve"], "exec form: signals reach kvroute"
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert env["KVROUTE_HOST"] == "0.0.0.0"
    assert "include-system-site-packages = false" in (rootfs / "opt/venv/pyvenv.cfg").read_text()
    probe = run_in_image(
        container, "sh", "-c",
        "command -v kvroute; kvroute --version; cd /tmp && python -c 'import router; print(router.__file__)'",
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == [
        "/opt/venv/bin/kvroute",
        VERSION,
        f"{SITE_PACKAGES}/router/__init__.py",
    ]


def test_serve_does_not_need_psutil(container: str) -> None:
    """psutil is a load-test dependency (the bench extra), not in the image."""
    code = (
        "import sys; sys.modules['psutil'] = None\n"  # any `import psutil` now fails
        "from router.serve import load_config, make_app\n"
        "make_app(load_config(['--worker', 'w0=http://127.0.0.1:9']))\n"
        "print('ok')"
    )
    probe = run_in_image(container, "python", "-c", code)
    assert probe.returncode == 0 and probe.stdout.strip() == "ok", probe.stderr[-2000:]


def test_runs_the_endpoint_picker_and_exports_traces(container: str) -> None:
    """The chart's EPP mode and its OTLP values run this image: both extras are in it, and
    the OTLP exporters import (xds-protos' old opentelemetry-proto copy would break them)."""
    code = (
        "from router.cli import main\n"
        "import router.epp.server, router.epp.messages\n"
        "from router.tracing import require_tracing_extra; require_tracing_extra()\n"
        "print('ok')"
    )
    probe = run_in_image(container, "python", "-c", code)
    assert probe.returncode == 0 and probe.stdout.strip() == "ok", probe.stderr[-2000:]


# -- serving ----------------------------------------------------------------------------------


def test_not_ready_without_a_reachable_worker(config: dict[str, Any], container: str) -> None:
    # Port 9 (discard) has no server: alive, but not ready.
    with InImageRouter(container, config["Entrypoint"], ["--worker", "x=http://127.0.0.1:9"]) as r:
        assert httpx.get(r.url + "/ready", timeout=5, trust_env=False).status_code == 503
        metrics = httpx.get(r.url + "/metrics", timeout=5, trust_env=False)
        assert metrics.status_code == 200 and 'kvroute_worker_healthy{worker="x"} 0' in metrics.text


def test_serves_health_ready_and_proxies_a_stream(
    config: dict[str, Any], container: str, sim_worker: SimWorkerProcess
) -> None:
    args = ["--worker", f"w0={sim_worker.url}"]
    with InImageRouter(container, config["Entrypoint"], args) as r:
        deadline = time.monotonic() + 30
        while httpx.get(r.url + "/ready", timeout=5, trust_env=False).status_code != 200:
            assert time.monotonic() < deadline, "router never turned ready"
            time.sleep(0.2)
        out: dict[str, Any] = {}
        read_stream(r.url, out, max_tokens=20)
        assert_complete_stream(out, max_tokens=20)
        assert out["worker"] == "w0"


def test_sigterm_lets_the_stream_finish_then_exits_zero(
    config: dict[str, Any], container: str, sim_worker: SimWorkerProcess
) -> None:
    max_tokens = 150
    args = ["--worker", f"w0={sim_worker.url}", "--shutdown-grace-s", str(GRACE_S)]
    with InImageRouter(container, config["Entrypoint"], args) as r:
        out: dict[str, Any] = {}
        reader = threading.Thread(target=read_stream, args=(r.url, out, max_tokens))
        reader.start()
        deadline = time.monotonic() + 30
        while len(out.get("events", [])) < 5:
            assert time.monotonic() < deadline and reader.is_alive(), f"no stream: {out}"
            time.sleep(0.02)
        signalled = time.monotonic()
        events_at_signal = len(out["events"])
        os.kill(r.pid, signal.SIGTERM)
        # It stops accepting at once...
        while True:
            try:
                socket.create_connection(("127.0.0.1", r.port), timeout=1).close()
            except OSError:
                break
            assert time.monotonic() - signalled < 3, "still accepting connections after SIGTERM"
            time.sleep(0.05)
        # ...lets the stream in flight finish, then exits 0 within the grace period.
        reader.join(timeout=GRACE_S + 10)
        status = r.wait(timeout=GRACE_S + 10)
        exited = time.monotonic()
    assert_complete_stream(out, max_tokens)
    after = len(out["events"]) - events_at_signal
    assert after > max_tokens // 2, f"only {after} events after SIGTERM: the stream had nearly ended"
    assert status == 0, f"kvroute serve exited {status} after SIGTERM"
    assert exited - signalled < GRACE_S, f"took {exited - signalled:.1f}s of a {GRACE_S}s grace"


# -- what the image holds ---------------------------------------------------------------------


def test_holds_no_compiler_pip_cache_or_source_tree(rootfs: Path) -> None:
    paths = [Path(d).relative_to(rootfs) / n for d, ds, fs in os.walk(rootfs) for n in [*ds, *fs]]
    bin_dirs = {Path(d) for d in ("usr/bin", "usr/sbin", "usr/local/bin", "opt/venv/bin")}
    programs = {p.name for p in paths if p.parent in bin_dirs}
    compilers = {"gcc", "cc", "c++", "g++", "clang", "tcc", "ld", "as", "make"}
    assert not compilers & programs, f"compiler tools: {compilers & programs}"
    assert not (rootfs / "usr/lib/gcc").exists(), "gcc's libexec (cc1) is there"
    assert not [p for p in paths if ".cache" in p.parts], "a cache directory (pip's?)"
    assert not (rootfs / SITE_PACKAGES.lstrip("/") / "pip").exists(), "pip is a build-time tool"
    assert not (rootfs / "src").exists() and not (rootfs / "dist").exists(), "builder leftovers"
    sources = {"pyproject.toml", "Dockerfile", ".dockerignore", "test_image_install.py", "helm"}
    assert not sources & {p.name for p in paths}, "files of the source tree"
    ours = [str(p) for p in paths if p.parent.name == "router" and p.suffix == ".py"]
    assert ours and all(p.startswith(SITE_PACKAGES.lstrip("/") + "/") for p in ours), ours[:5]
    # The wheel holds the four packages and nothing else of the checkout (tests, docs, helm).
    dist_info = rootfs / SITE_PACKAGES.lstrip("/") / f"kvroute-{VERSION}.dist-info"
    packages = set((dist_info / "top_level.txt").read_text().split())
    assert packages == {"cache_client", "loadtests", "normalizer", "router"}


def test_size(image: str) -> None:
    manifest = json.loads(buildah("inspect", "--type", "image", "--format", "{{.Manifest}}", image))
    size = sum(layer["size"] for layer in manifest["layers"])
    print(f"image {image}: {size / 1e6:.0f} MB uncompressed")
    assert size < MAX_IMAGE_BYTES, f"{size / 1e6:.0f} MB"
