"""`kvroute serve --tenants FILE` end to end: tenant keys are client keys, a bad file stops
startup with its line, and a reload (admin call or SIGHUP) swaps tenants without dropping
what is in flight and keeps the old tenants when the new file is bad."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from loadtests.support.routerproc import RouterProcess
from router.serve import check_tenants, load_config
from tests.support.upstream import RecordingUpstream

CHAT = {"model": "rec-model", "messages": [{"role": "user", "content": "hi"}]}
ADMIN = "admin-token-tenants-5555"
FIRST = "tenants:\n  alice: {keys: [sk-alice]}\n  bob: {keys: [sk-bob]}\n"
SECOND = "tenants:\n  alice: {keys: [sk-alice]}\n  carol: {keys: [sk-carol]}\n"
THIRD = "tenants:\n  dave: {keys: [sk-dave]}\n"


def chat(r: RouterProcess, key: str) -> int:
    return httpx.post(r.url + "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"}).status_code


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("tenants")
    (d / "tenants.yaml").write_text(FIRST)
    (d / "admin").write_text(ADMIN + "\n")
    with RecordingUpstream() as up, RouterProcess(
        {"a": up.url}, extra_args=["--tenants", str(d / "tenants.yaml"), "--admin-token-file", str(d / "admin")]
    ) as r:
        yield r, d / "tenants.yaml"


def test_tenant_keys_are_the_client_keys(served) -> None:
    r, _ = served
    assert chat(r, "sk-alice") == 200 and chat(r, "sk-bob") == 200
    assert chat(r, "sk-mallory") == 401
    assert httpx.post(r.url + "/v1/chat/completions", json=CHAT).status_code == 401


def test_reload_by_admin_call_and_a_bad_file_keeps_the_tenants(served) -> None:
    r, path = served
    admin = {"authorization": f"Bearer {ADMIN}"}
    path.write_text(SECOND)
    resp = httpx.post(r.url + "/admin/tenants/reload", headers=admin)
    assert resp.status_code == 200
    assert sorted(t["name"] for t in resp.json()["data"]) == ["alice", "carol"]
    assert "sk-" not in resp.text  # keys are never shown
    assert chat(r, "sk-carol") == 200 and chat(r, "sk-bob") == 401
    path.write_text("tenants:\n  x: {keys: [k]}\n  y: {keys: [k]}\n")
    bad = httpx.post(r.url + "/admin/tenants/reload", headers=admin)
    assert bad.status_code == 422 and "line 2" in bad.json()["error"]["message"]
    assert chat(r, "sk-carol") == 200  # still the last good tenants
    assert httpx.post(r.url + "/admin/tenants/reload").status_code == 401


def test_sighup_reloads(served) -> None:
    r, path = served
    path.write_text(THIRD)
    assert r.proc is not None
    r.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while chat(r, "sk-dave") != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert chat(r, "sk-dave") == 200 and chat(r, "sk-alice") == 401
    assert httpx.get(r.url + "/health").status_code == 200  # still serving


def test_a_bad_file_stops_startup_naming_the_line(tmp_path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("groups: [acme]\ntenants:\n  a:\n    keys: [k1]\n    cache_scope: acne\n")
    with pytest.raises(SystemExit) as err:
        check_tenants(load_config(["--worker", "a=http://127.0.0.1:9", "--tenants", str(path)]))
    assert f"{path}:5" in str(err.value) and "unknown sharing group 'acne'" in str(err.value)
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--worker", "a=http://127.0.0.1:9", "--tenants", str(path)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0 and f"{path}:5" in proc.stderr and "Traceback" not in proc.stderr


def test_the_file_comes_from_the_environment_and_yaml(tmp_path) -> None:
    path = tmp_path / "t.yaml"
    assert load_config([], {"KVROUTE_TENANTS": str(path)}).tenants.file == str(path)
    assert load_config([], {"KVROUTE_TENANTS_FILE": str(path)}).tenants.file == str(path)
    cfg = tmp_path / "kvroute.yaml"
    cfg.write_text(f"tenants_file: {path}\n")
    assert load_config(["--config", str(cfg)], {}).tenants.file == str(path)
    cfg.write_text(f"tenants: {{file: {path}}}\n")
    assert load_config(["--config", str(cfg)], {}).tenants.file == str(path)
