"""Peer routers: names, command lines, environment, install reuse, and one real peer in
front of the simulator."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import pytest

from loadtests.benchmark import peers
from loadtests.benchmark.peers import (
    PEERS,
    PeerRouter,
    ensure_installed,
    parse_peer,
    peer_command,
    peer_env,
    result_key,
)


def test_peer_names_and_policies() -> None:
    assert parse_peer("sglang-router") == [("sglang-router", "cache_aware")]
    assert parse_peer("vllm-router") == [("vllm-router", "cache_aware"), ("vllm-router", "consistent_hash")]
    assert parse_peer("vllm-router/consistent_hash") == [("vllm-router", "consistent_hash")]
    with pytest.raises(ValueError):
        parse_peer("nginx")
    with pytest.raises(ValueError):
        parse_peer("sglang-router/power_of_two")
    assert result_key("vllm-router", "cache_aware") == "vllm-router"
    assert result_key("vllm-router", "consistent_hash") == "vllm-router/consistent_hash"


def test_commands_bind_loopback_and_name_every_worker() -> None:
    cmd = peer_command("sglang-router", "cache_aware", Path("/x/smg"), ["http://127.0.0.1:1", "http://127.0.0.1:2"], 9000, 9001)
    assert cmd[:2] == ["/x/smg", "launch"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"
    i = cmd.index("--worker-urls")
    assert cmd[i + 1 : i + 3] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert cmd[cmd.index("--policy") + 1] == "cache_aware"
    vcmd = peer_command("vllm-router", "consistent_hash", Path("/x/vllm-router"), ["http://127.0.0.1:1"], 9000, 9001)
    assert vcmd[1] == "--host"


def test_environment_keeps_tokenizer_downloads_and_proxies_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("HF_TOKEN", "secret")
    env = peer_env()
    assert "HTTPS_PROXY" not in env and "HF_TOKEN" not in env
    assert env["HF_ENDPOINT"].startswith("http://127.0.0.1:")
    assert env["HF_HUB_OFFLINE"] == "1"


def test_an_installed_peer_is_reused_without_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVROUTE_PEERS_DIR", str(tmp_path))
    spec = PEERS["sglang-router"]
    exe = tmp_path / "sglang-router" / "bin" / spec.binary
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "sglang-router" / f".installed-{spec.package}-{spec.version}").write_text(spec.version)

    def no_subprocess(*a, **k):
        raise AssertionError("an installed peer must not be reinstalled")

    monkeypatch.setattr(peers.subprocess, "run", no_subprocess)
    assert ensure_installed("sglang-router") == exe


@pytest.mark.slow
def test_sglang_router_in_front_of_the_simulator(tmp_path: Path) -> None:
    """Installs sglang-router on first use (PyPI), then streams one request through it."""
    from loadtests.sim.cluster import SimCluster

    with SimCluster(workers=2, time_scale=0.05) as cluster:
        log = tmp_path / "smg.log"
        with PeerRouter("sglang-router", "cache_aware", list(cluster.worker_urls.values()), log_path=str(log)) as r:
            body = {
                "model": "sim-llama3-8b",
                "messages": [{"role": "user", "content": "hello " * 200}],
                "max_tokens": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with httpx.stream("POST", r.url + "/v1/chat/completions", json=body, timeout=30, trust_env=False) as resp:
                assert resp.status_code == 200
                text = "".join(resp.iter_text())
            assert '"completion_tokens":5' in text.replace(" ", "")
            assert text.rstrip().endswith("data: [DONE]")
            assert r.proc is not None and r.proc.poll() is None
            pid = r.pid
        stat_file = Path(f"/proc/{pid}/stat")
        assert not stat_file.exists() or stat_file.read_text().split()[2] == "Z"
