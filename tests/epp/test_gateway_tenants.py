"""Tenants through a real Envoy and `kvroute epp`: a tenant over its limit gets the proxy's
429 (status, `Retry-After`, body) as Envoy's immediate answer, and its requests carry the
tenant's cache salt to the worker; an unknown key is the proxy's 401."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from loadtests.benchmark.envoy import EnvoyPicker
from loadtests.support.routerproc import RouterProcess
from tests.epp.support import require_envoy
from tests.support.upstream import RecordingUpstream

pytestmark = [pytest.mark.slow]

TENANTS = """\
tenants:
  slow: {keys: [sk-slow], limits: {requests_per_s: 0.05}}
  free: {keys: [sk-free]}
"""
MODEL = "rec-model"


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(TENANTS)
    return path


@pytest.fixture(scope="module")
def upstream() -> Iterator[RecordingUpstream]:
    with RecordingUpstream() as u:
        yield u


def chat(url: str, key: str, content: str) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30, trust_env=False,
                      headers={"authorization": f"Bearer {key}"})  # fmt: skip


def test_a_tenant_over_its_limit_gets_the_proxys_429_through_envoy(
    upstream: RecordingUpstream, tenants_file: Path, tmp_path: Path
) -> None:
    require_envoy()
    args = ["--tenants", str(tenants_file), "--tenant-salt-secret-file", str(_secret(tmp_path))]
    with EnvoyPicker({"u0": upstream.url}, "cache_aware", args, log_path=str(tmp_path / "gw.log")) as gw, \
            RouterProcess({"u0": upstream.url}, "cache_aware", args) as proxy:  # fmt: skip
        first = chat(gw.url, "sk-slow", "one")
        assert first.status_code == 200 and first.headers["x-kvroute-worker"] == "u0"
        over = chat(gw.url, "sk-slow", "two")
        assert chat(proxy.url, "sk-slow", "one").status_code == 200
        direct = chat(proxy.url, "sk-slow", "two")
        assert over.status_code == direct.status_code == 429
        assert over.json() == direct.json()
        assert over.json()["error"]["type"] == "rate_limit_error"
        assert over.headers.get("retry-after") == direct.headers.get("retry-after") is not None
        assert chat(gw.url, "sk-free", "free to go").status_code == 200
        unknown = chat(gw.url, "sk-nobody", "who?")
        assert unknown.status_code == 401 and unknown.json() == chat(proxy.url, "sk-nobody", "who?").json()
        # The tenant's requests reached the worker with its cache salt, without its key.
        seen = [r for r in upstream.received if b"free to go" in r.body]
        assert len(seen) == 1
        assert orjson.loads(seen[0].body)["cache_salt"]
        assert "authorization" not in seen[0].headers


def _secret(tmp_path: Path) -> Path:
    path = tmp_path / "salt-secret"
    path.write_text("a-salt-secret-for-the-test-0123456789abcdef")
    return path
