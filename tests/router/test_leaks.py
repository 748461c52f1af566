"""Nothing leaks: across faults (500s, timeouts, refused connections, broken streams), bad
input, failed authentication and admin calls, no response and no line of the router's log
(at debug level) contains a worker address, a credential or a traceback."""

from __future__ import annotations

import json

import httpx

from loadtests.support.routerproc import RouterProcess, free_port
from tests.support.upstream import RecordingUpstream, UpstreamBehaviour

CLIENT_KEY = "sk-client-leakcheck-5555"
ADMIN_TOKEN = "admin-leakcheck-6666"
WORKER_KEY = "worker-leakcheck-7777"
ADDED_KEY = "added-worker-leakcheck-8888"
SECRETS = (CLIENT_KEY, ADMIN_TOKEN, WORKER_KEY, ADDED_KEY)
CHAT = {"model": "rec-model", "messages": [{"role": "user", "content": "hi"}]}


def dump(resp: httpx.Response) -> str:
    return f"{resp.status_code}\n{json.dumps(dict(resp.headers))}\n{resp.text}"


def test_no_address_secret_or_traceback_in_responses_or_logs(tmp_path) -> None:
    log_path = tmp_path / "router.log"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    with (
        RecordingUpstream() as good,
        RecordingUpstream(behaviour=UpstreamBehaviour(status=500)) as bad,
        RecordingUpstream(behaviour=UpstreamBehaviour(chunks=6, break_after_chunks=2)) as flaky,
        RecordingUpstream(behaviour=UpstreamBehaviour(first_byte_delay_s=1.0)) as stuck,
    ):
        extra = RecordingUpstream().__enter__()
        workers = {"good": good.url, "bad": bad.url, "flaky": flaky.url, "stuck": stuck.url, "dead": dead}
        addresses = [*workers.values(), extra.url]
        ports = [u.rsplit(":", 1)[1] for u in addresses]
        args = ["--log-level", "debug", "--first-byte-timeout-s", "0.3", "--breaker-failures", "0",
                "--health-interval-s", "0.5", "--policy", "round_robin"]
        env = {"KVROUTE_API_KEYS": CLIENT_KEY, "KVROUTE_ADMIN_TOKEN": ADMIN_TOKEN, "WORKER_KEY": WORKER_KEY}
        yaml = tmp_path / "kvroute.yaml"
        yaml.write_text("workers:\n" + "".join(
            f"  - name: {n}\n    url: {u}\n    api_key_env: WORKER_KEY\n" for n, u in workers.items()))
        seen: list[str] = []
        with RouterProcess({}, extra_args=["--config", str(yaml), *args], env=env, wait_ready=False,
                           log_path=str(log_path)) as r:
            user = {"authorization": "Bearer " + CLIENT_KEY}
            admin = {"authorization": "Bearer " + ADMIN_TOKEN}
            with httpx.Client(base_url=r.url, timeout=20) as c:
                for _ in range(10):  # round robin over every kind of worker
                    seen.append(dump(c.post("/v1/chat/completions", json=CHAT, headers=user)))
                    with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=user) as resp:
                        resp.read()
                        seen.append(dump(resp))
                seen.append(dump(c.post("/v1/embeddings", json={"model": "rec-model", "input": "x"}, headers=user)))
                for headers in ({}, {"authorization": "Bearer " + CLIENT_KEY[:-1]}, {"authorization": "Bearer " + ADMIN_TOKEN}):
                    seen.append(dump(c.post("/v1/chat/completions", json=CHAT, headers=headers)))
                    seen.append(dump(c.get("/admin/workers", headers=headers)))
                for raw in (b"{", b"[]", b'{"model": 1}', b'{"model": "nope", "messages": [{"role": "user"}]}'):
                    seen.append(dump(c.post("/v1/chat/completions", content=raw, headers=user)))
                seen.append(dump(c.get("/admin/workers", headers=admin)))
                seen.append(dump(c.post("/debug/route", json=CHAT, headers=admin)))
                added = c.post("/admin/workers", headers=admin, json={"name": "extra", "url": extra.url, "api_key": ADDED_KEY})
                assert added.status_code == 201
                seen.append(dump(added))
                seen.append(dump(c.post("/admin/workers", headers=admin, json={"name": "extra", "url": extra.url})))
                seen.append(dump(c.post("/admin/workers/bad/drain", headers=admin)))
                extra.__exit__(None, None, None)  # it goes away while the router still counts on it
                for _ in range(5):
                    seen.append(dump(c.post("/v1/chat/completions", json=CHAT, headers=user)))
                seen.append(dump(c.delete("/admin/workers/extra", headers=admin)))
                for path in ("/metrics", "/health", "/ready", "/openapi.json", "/nope"):
                    seen.append(dump(c.get(path)))
                seen.append(dump(c.get("/v1/models", headers=user)))
                # Everything failing: the 502 says why without saying where.
                c.post("/admin/workers/good/drain", headers=admin)
                c.post("/admin/workers/flaky/drain", headers=admin)
                c.post("/admin/workers/stuck/drain", headers=admin)
                c.post("/admin/workers/bad/undrain", headers=admin)
                failed = c.post("/v1/chat/completions", json=CHAT, headers=user)
                assert failed.status_code == 502
                seen.append(dump(failed))
            metrics = r.metrics()
        assert any('"stream_interrupted"' in s for s in seen)  # the faults really happened
        assert 'kvroute_worker_healthy{worker="dead"} 0' in metrics
        assert good.received and bad.received and flaky.received and stuck.received and extra.received is not None
    log = log_path.read_text()
    assert "kvroute.proxy" in log and "worker bad" in log  # the log did record the faults
    assert "worker extra failed before the first byte (ConnectError" in log
    for where, text in [("log", log), *((f"response {i}", s) for i, s in enumerate(seen))]:
        for address in addresses:
            assert address not in text, (where, address)
        for port in ports:
            assert f":{port}" not in text and f"port {port}" not in text, (where, port)
        for secret in SECRETS:
            assert secret not in text, (where, "a secret")
        assert "Traceback" not in text, where
