"""API keys on /v1/*, the admin token, and credentials toward workers: the client's never
reach a worker, each worker gets its own (YAML `api_key_env`)."""

from __future__ import annotations

import httpx
import pytest

from loadtests.support.routerproc import RouterProcess
from router.auth import KeyCheck, presented_key, resolve_admin_token, resolve_api_keys
from router.serve import check_secrets, load_config
from tests.support.upstream import RecordingUpstream

CHAT = {"model": "rec-model", "messages": [{"role": "user", "content": "hi"}]}
FLAG_KEY = "sk-flag-key-1111"
FILE_KEY = "sk-file-key-2222"
ADMIN = "admin-token-3333-abcdef"
WORKER_KEY = "worker-secret-4444"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    d = tmp_path_factory.mktemp("secrets")
    (d / "keys").write_text(f"# client keys\n{FILE_KEY}\n\n")
    (d / "admin").write_text(ADMIN + "\n")
    with RecordingUpstream() as up:
        (d / "kvroute.yaml").write_text(
            f"workers:\n  - name: a\n    url: {up.url}\n    api_key_env: WORKER_A_KEY\n"
        )
        args = ["--config", str(d / "kvroute.yaml"), "--api-keys", FLAG_KEY, "--api-keys-file", str(d / "keys"),
                "--admin-token-file", str(d / "admin")]
        with RouterProcess({}, extra_args=args, env={"WORKER_A_KEY": WORKER_KEY}) as r:
            yield r, up


def assert_401(resp: httpx.Response, code: str = "invalid_api_key") -> None:
    assert resp.status_code == 401
    assert resp.headers["www-authenticate"] == "Bearer"
    error = resp.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == code


def test_v1_needs_a_valid_key(secured) -> None:
    r, _ = secured
    assert_401(httpx.post(r.url + "/v1/chat/completions", json=CHAT))
    assert_401(httpx.post(r.url + "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sk-wrong"}))
    assert_401(httpx.post(r.url + "/v1/chat/completions", json=CHAT, headers={"authorization": FLAG_KEY}))  # no scheme
    assert_401(httpx.get(r.url + "/v1/models"))
    assert_401(httpx.post(r.url + "/v1/embeddings", json={"model": "rec-model", "input": "x"},
                          headers={"authorization": "Bearer " + FLAG_KEY + "x"}))
    ok = httpx.post(r.url + "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer " + FLAG_KEY})
    assert ok.status_code == 200
    ok = httpx.post(r.url + "/v1/chat/completions", json=CHAT, headers={"authorization": "bearer " + FILE_KEY})
    assert ok.status_code == 200
    ok = httpx.get(r.url + "/v1/models", headers={"x-api-key": FILE_KEY})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "rec-model"


def test_operational_endpoints_stay_open(secured) -> None:
    r, _ = secured
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert httpx.get(r.url + path).status_code == 200, path


def test_client_key_stays_here_and_the_worker_gets_its_own(secured) -> None:
    r, up = secured
    resp = httpx.post(r.url + "/v1/chat/completions", json=CHAT,
                      headers={"authorization": "Bearer " + FLAG_KEY, "x-request-id": "auth-1", "cookie": "c=1"})
    assert resp.status_code == 200
    sent = next(x for x in reversed(up.received) if x.headers.get("x-request-id") == "auth-1")
    assert sent.headers["authorization"] == "Bearer " + WORKER_KEY
    assert "cookie" not in sent.headers and FLAG_KEY not in str(sent.headers)


def test_admin_token(secured) -> None:
    r, _ = secured
    resp = httpx.get(r.url + "/admin/workers")
    assert_401(resp, "invalid_admin_token")
    assert_401(httpx.get(r.url + "/admin/workers", headers={"authorization": "Bearer " + FLAG_KEY}), "invalid_admin_token")
    resp = httpx.get(r.url + "/admin/workers", headers={"authorization": "Bearer " + ADMIN})
    assert resp.status_code == 200 and [w["name"] for w in resp.json()["data"]] == ["a"]
    # the admin token is not a client key
    assert_401(httpx.get(r.url + "/v1/models", headers={"authorization": "Bearer " + ADMIN}))


def test_admin_disabled_without_a_token() -> None:
    with RecordingUpstream() as up, RouterProcess({"a": up.url}) as r:
        for method, path in [("GET", "/admin/workers"), ("POST", "/admin/workers/a/drain"), ("POST", "/debug/route")]:
            resp = httpx.request(method, r.url + path, headers={"authorization": "Bearer anything"})
            assert resp.status_code == 403 and resp.json()["error"]["code"] == "admin_disabled"
        # and no client keys configured: /v1 is open
        assert httpx.post(r.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_key_check_and_parsing() -> None:
    check = KeyCheck(["k1", "k2"])
    assert check.accepts(b"k1") and check.accepts(b"k2")
    assert not check.accepts(b"k3") and not check.accepts(b"") and not check.accepts(None) and not check.accepts(b"k1 ")
    assert presented_key([(b"authorization", b"Bearer  k1 ")]) == b"k1"
    assert presented_key([(b"authorization", b"Basic azE6")]) is None
    assert presented_key([(b"x-api-key", b"k2")]) == b"k2"
    assert presented_key([(b"cookie", b"k1")]) is None
    with pytest.raises(ValueError):
        KeyCheck([])


def test_secret_settings_from_env_and_files(tmp_path, monkeypatch) -> None:
    env = {"KVROUTE_API_KEYS": "e1, e2", "KVROUTE_ADMIN_TOKEN": " adm "}
    config = load_config(["--worker", "a=http://127.0.0.1:9"], env)
    assert config.security.api_keys == ["e1", "e2"]
    assert resolve_admin_token(config.security.admin_token, config.security.admin_token_file) == "adm"
    config = load_config(["--worker", "a=http://127.0.0.1:9", "--api-keys", "f1,f2", "--api-keys", "f3"], {})
    assert resolve_api_keys(config.security.api_keys, None) == ["f1", "f2", "f3"]
    missing = load_config(["--worker", "a=http://127.0.0.1:9", "--api-keys-file", str(tmp_path / "missing")], {})
    with pytest.raises(SystemExit, match="cannot read --api-keys-file"):
        check_secrets(missing)
    two = tmp_path / "two"
    two.write_text("secret-one\nsecret-two\n")
    with pytest.raises(SystemExit) as exc:
        check_secrets(load_config(["--worker", "a=http://127.0.0.1:9", "--admin-token-file", str(two)], {}))
    assert "secret" not in str(exc.value)  # the message names the setting, never its value
    # and `kvroute serve` refuses to start on it
    from router.serve import cli

    monkeypatch.setattr("uvicorn.run", lambda *a, **k: pytest.fail("the router started"))
    with pytest.raises(SystemExit, match="cannot read --api-keys-file"):
        cli(["--worker", "a=http://127.0.0.1:9", "--api-keys-file", str(tmp_path / "missing")])
