"""The container image's build, replayed without a Docker engine.

The Dockerfile's builder stage is parsed and its COPY/RUN steps are run here, in a temporary
directory standing in for the image's filesystem (/src, /opt/venv, /dist and /tmp are mapped
into it), with a fresh virtualenv (no system site-packages; dependencies come from PyPI).
Then `kvroute serve` is started from that virtualenv, as the final stage's ENTRYPOINT would,
and must answer /health. The final stage itself is checked for what it promises: slim base,
non-root user, only the virtualenv copied in, exec-form ENTRYPOINT.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]


def parse_dockerfile(text: str) -> list[Stage]:
    """Instructions per stage, continuation lines joined, ARG defaults substituted in FROM."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    logical: list[str] = []
    buf = ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    for entry in logical:
        op, _, rest = entry.strip().partition(" ")
        op = op.upper()
        rest = rest.strip()
        if op == "ARG" and not stages:
            key, _, default = rest.partition("=")
            args[key] = default
        elif op == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base, name))
        else:
            stages[-1].instructions.append((op, rest))
    return stages


STAGES = parse_dockerfile(DOCKERFILE.read_text())
BUILDER = next(s for s in STAGES if s.name == "builder")
FINAL = STAGES[-1]


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    for pat in patterns:
        pat = pat.rstrip("/")
        if pat.startswith("**/"):
            if any(fnmatch.fnmatch(part, pat[3:]) for part in rel.split("/")):
                return True
        elif fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel.split("/")[0], pat):
            return True
    return False


def copy_context(dest: Path) -> list[str]:
    """The build context as Docker sends it: the repository minus .dockerignore matches."""
    patterns = dockerignore_patterns()
    copied = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = Path(dirpath).relative_to(ROOT).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if not ignored(rel_dir + d, patterns)]
        for name in filenames:
            rel = rel_dir + name
            if ignored(rel, patterns):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(dirpath) / name, target)
            copied.append(rel)
    return copied


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the Dockerfile's promises (no build needed) --------------------------------------------


def test_final_stage_is_slim_nonroot_and_execs_kvroute_serve() -> None:
    assert BUILDER.base == FINAL.base == "python:3.11-slim"
    assert FINAL.all("ENTRYPOINT") == ['["kvroute", "serve"]'], "exec form: signals reach kvroute"
    (user,) = FINAL.all("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root UID (runAsNonRoot can verify it)"
    copies = FINAL.all("COPY")
    assert copies == ["--from=builder /opt/venv /opt/venv"], (
        "only the virtualenv leaves the builder"
    )
    final_runs = " ".join(FINAL.all("RUN"))
    for tool in ("gcc", "build-essential", "pip install", "apt-get install", "python -m build"):
        assert tool not in final_runs, f"{tool} in the final stage"
    assert any("PATH=/opt/venv/bin" in env for env in FINAL.all("ENV"))


def test_chart_runs_the_image_as_its_user() -> None:
    (user,) = FINAL.all("USER")
    values = (ROOT / "helm" / "kvroute" / "values.yaml").read_text()
    assert f"runAsUser: {user.split(':')[0]}" in values


def test_dockerignore_keeps_what_the_wheel_needs() -> None:
    patterns = dockerignore_patterns()
    for needed in (
        "pyproject.toml",
        "router/serve.py",
        "normalizer/prefix.py",
        "cache_client/base.py",
    ):
        assert not ignored(needed, patterns), needed
    for junk in (
        ".git/config",
        "tests/test_helm.py",
        "router/__pycache__/x.pyc",
        ".venv-x/bin/python",
    ):
        assert ignored(junk, patterns), junk


# -- the build, replayed ----------------------------------------------------------------------


@pytest.mark.slow
def test_wheel_installs_into_fresh_venv_and_serves(tmp_path: Path) -> None:
    fs = tmp_path / "image"
    paths = {
        "/src": fs / "src",
        "/opt/venv": fs / "opt" / "venv",
        "/dist": fs / "dist",
        "/tmp": fs / "tmp",
    }
    for p in paths.values():
        p.mkdir(parents=True, exist_ok=True)
    paths["/opt/venv"].rmdir()  # `python -m venv /opt/venv` creates it

    # One pass over all image paths: a replacement must not be rewritten again (the
    # temporary directory itself lives under /tmp).
    image_paths = "|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w/])({image_paths})(?=/|\s|$|')")

    def host_path(text: str) -> str:
        return pattern.sub(lambda m: str(paths[m.group(1)]), text)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    workdir = paths["/src"]
    shim = tmp_path / "bin"
    shim.mkdir()
    # The base image's `python` is CPython 3.11; here that is the interpreter running pytest.
    (shim / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (shim / "python").chmod(0o755)
    env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
    log = []
    for op, arg in BUILDER.instructions:
        if op == "ENV":
            for item in shlex.split(arg):
                key, _, value = item.partition("=")
                env[key] = value
        elif op == "WORKDIR":
            workdir = Path(host_path(arg))
        elif op == "COPY":
            *sources, dest = arg.split()
            target = workdir if dest in (".", "./") else Path(host_path(dest))
            if sources == ["."]:
                copied = copy_context(target)
                assert "router/serve.py" in copied and not any(
                    c.startswith("tests/") for c in copied
                )
            else:
                for src in sources:
                    shutil.copy2(ROOT / src, target / Path(src).name)
        elif op == "RUN":
            command = host_path(arg)
            proc = subprocess.run(
                ["sh", "-c", command],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            log.append(f"$ {command}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
            assert proc.returncode == 0, "\n".join(log)
        else:
            raise AssertionError(f"test does not know how to replay {op} {arg}")

    venv = paths["/opt/venv"]
    assert not (venv / "pyvenv.cfg").read_text().count("include-system-site-packages = true")
    wheels = list(paths["/dist"].glob("kvroute-*.whl"))
    assert len(wheels) == 1, wheels

    # What the final stage runs: ENTRYPOINT ["kvroute", "serve"] from the venv on PATH.
    # (cwd outside the source tree so the installed package, not the checkout, is imported.)
    final_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "KVROUTE_"))
    }
    for arg in FINAL.all("ENV"):
        for item in shlex.split(arg):
            key, _, value = item.partition("=")
            final_env[key] = value.replace("/opt/venv", str(venv)).replace(
                "$PATH", os.environ["PATH"]
            )
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import router, sys; print(router.__file__)"],
        cwd=tmp_path, env=final_env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().startswith(str(venv)), probe.stdout

    port = free_port()
    # --host overrides the image's KVROUTE_HOST=0.0.0.0: this test listens on loopback only.
    # Worker port 9 (discard) has no server: the router must still start and report itself
    # alive but not ready.
    proc = subprocess.Popen(
        [str(venv / "bin" / "kvroute"), "serve", "--worker", "x=http://127.0.0.1:9",
         "--host", "127.0.0.1", "--port", str(port)],
        cwd=tmp_path, env=final_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        health = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert health is not None, f"router did not come up: {proc.poll()=}\n{_output(proc)}"
        assert health.status_code == 200
        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2, trust_env=False)
        assert ready.status_code == 503, "no worker is reachable, so the router is not ready"
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2, trust_env=False)
        assert metrics.status_code == 200 and "kvroute_worker_healthy" in metrics.text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _output(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=10)
    return out[-4000:]
