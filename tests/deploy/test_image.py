"""The Dockerfile's promises, read from the file (no build needed).

The final stage is checked for what it promises: slim base, non-root user, only the
virtualenv copied in, exec-form ENTRYPOINT; .dockerignore for what the wheel needs. The image
itself is built and run by .ci/image-check.sh (.ci/test_image.py): its user and file
permissions, entrypoint, serving, SIGTERM handling, contents and size. That replaced the
replay of the builder stage's steps outside a container that used to live here.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path

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
