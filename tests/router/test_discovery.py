"""Worker discovery: the fleet follows DNS / EndpointSlice answers without a restart."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from cache_client.memory import MemoryIndex
from cache_client.tiers import DEFAULT_NODE
from normalizer.prefix import PrefixKey
from router.discovery import (
    DiscoveryTarget,
    DnsDiscovery,
    EndpointSliceDiscovery,
    endpoint_slice_addresses,
    endpoint_slice_endpoints,
    in_cluster_client,
    kv_events_endpoint,
    make_discovery,
    parse_discovery_target,
    spec_for,
    start_discovery,
    system_resolver,
)
from router.workers import Fleet, WorkerSpec
from tests.support.wait import wait_for_async

HOST = "vllm-headless.llm.svc.cluster.local"
MODEL = "qwen"


class StubResolver:
    """Answers for HOST that the test changes between rounds; can be told to fail."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.error: Exception | None = None
        self.calls = 0

    async def __call__(self, host: str) -> list[str]:
        assert host == HOST
        self.calls += 1
        if self.error is not None:
            raise self.error
        return list(self.answers)


def fake_vllm(request: httpx.Request) -> httpx.Response:
    """Every discovered worker answers health checks like a vLLM server with one model."""
    if request.url.path == "/health":
        return httpx.Response(200)
    if request.url.path == "/v1/models":
        return httpx.Response(
            200, json={"object": "list", "data": [{"id": MODEL, "object": "model"}]}
        )
    return httpx.Response(404)


@pytest.fixture
async def setup() -> Any:
    index = MemoryIndex()
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake_vllm))
    fleet = Fleet([], client, health_interval_s=3600, on_down=index.drop_location)
    yield fleet, index
    await client.aclose()


def keys(*values: int) -> list[PrefixKey]:
    return [PrefixKey(v) for v in values]


# -- targets -------------------------------------------------------------------------------


def test_parse_targets() -> None:
    assert parse_discovery_target(f"dns://{HOST}:8000") == DiscoveryTarget("dns", HOST, 8000)
    assert parse_discovery_target("dns://[::1]:8000") == DiscoveryTarget("dns", "::1", 8000)
    assert parse_discovery_target("k8s://llm/vllm:8000") == DiscoveryTarget(
        "k8s", "vllm", 8000, "llm"
    )
    assert parse_discovery_target("k8s://llm/vllm:http") == DiscoveryTarget(
        "k8s", "vllm", "http", "llm"
    )


@pytest.mark.parametrize(
    "bad",
    [
        "dns://host",
        "dns://:8000",
        "dns://h:99999",
        "dns://h:80/path",
        "http://h:80",
        "k8s://llm/vllm",
        "k8s:///vllm:80",
        "h:80",
    ],
)
def test_parse_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_discovery_target(bad)


def test_worker_names_and_endpoints() -> None:
    assert spec_for("127.0.0.5", 8000) == WorkerSpec("127.0.0.5:8000", "http://127.0.0.5:8000")
    assert spec_for("::1", 8000) == WorkerSpec("[::1]:8000", "http://[::1]:8000")
    assert spec_for("127.0.0.5", 8000, node="gpu-1").node == "gpu-1"
    assert kv_events_endpoint(spec_for("127.0.0.5", 8000)) == "tcp://127.0.0.5:5557"
    assert kv_events_endpoint(spec_for("::1", 8000), 6000) == "tcp://[::1]:6000"


def test_dns_discovery_needs_dns_target(setup: Any) -> None:
    fleet, _ = setup
    with pytest.raises(ValueError):
        DnsDiscovery(fleet, "k8s://llm/vllm:8000")


# -- DNS -----------------------------------------------------------------------------------


async def test_workers_join_and_leave_without_restart(setup: Any) -> None:
    fleet, index = setup
    resolver = StubResolver("127.0.0.2", "127.0.0.3")
    disc = DnsDiscovery(fleet, f"dns://{HOST}:8000", interval_s=0.02, resolver=resolver)
    await disc.start()
    try:
        # start() resolved once before returning and health-checked the newcomers.
        assert sorted(fleet.names()) == ["127.0.0.2:8000", "127.0.0.3:8000"]
        assert sorted(w.name for w in fleet.candidates(MODEL)) == [
            "127.0.0.2:8000",
            "127.0.0.3:8000",
        ]
        assert fleet.get("127.0.0.2:8000").url == "http://127.0.0.2:8000"
        assert fleet.get("127.0.0.2:8000").node == DEFAULT_NODE, "DNS does not say where pods run"

        await index.record("127.0.0.2:8000", keys(1, 2), [100, 100])
        await index.record("127.0.0.3:8000", keys(1, 2), [100, 100])
        assert (await index.lookup(keys(1, 2))).depth("127.0.0.2:8000") == 2

        # .2 is gone (pod deleted), .4 joined (scale-up): the running poller picks both up.
        resolver.answers = ["127.0.0.3", "127.0.0.4"]
        await wait_for_async(
            lambda: fleet.get("127.0.0.4:8000") is not None and fleet.get("127.0.0.2:8000") is None
        )
        await wait_for_async(lambda: len(fleet.candidates(MODEL)) == 2)
        assert sorted(w.name for w in fleet.candidates(MODEL)) == [
            "127.0.0.3:8000",
            "127.0.0.4:8000",
        ]
        assert disc.members == ["127.0.0.3:8000", "127.0.0.4:8000"]

        view = await index.lookup(keys(1, 2))
        assert view.depth("127.0.0.2:8000") == 0, "a leaving worker's index entries must be dropped"
        assert view.depth("127.0.0.3:8000") == 2, "workers that stay keep their entries"
    finally:
        await disc.stop()
    calls = resolver.calls
    await asyncio.sleep(0.1)
    assert resolver.calls == calls, "stop() must end polling"


async def test_resolver_failure_keeps_membership(setup: Any) -> None:
    fleet, index = setup
    resolver = StubResolver("127.0.0.2")
    disc = DnsDiscovery(fleet, f"dns://{HOST}:8000", resolver=resolver)
    await disc.start()
    try:
        await index.record("127.0.0.2:8000", keys(7), [50])
        resolver.error = OSError("temporary failure in name resolution")
        with pytest.raises(OSError):
            await disc.refresh()
        await disc._refresh_logged()  # what the background loop does: log, keep going
        assert disc.last_error is not None and "temporary failure" in disc.last_error
        assert fleet.names() == ["127.0.0.2:8000"]
        assert (await index.lookup(keys(7))).depth("127.0.0.2:8000") == 1

        resolver.error = None
        resolver.answers = []  # an authoritative empty answer (Service scaled to zero)
        added, removed = await disc.refresh()
        assert (added, removed) == ([], ["127.0.0.2:8000"])
        assert fleet.names() == [] and not fleet.any_serving()
        assert (await index.lookup(keys(7))).depth("127.0.0.2:8000") == 0
        assert disc.last_error is None
    finally:
        await disc.stop()


async def test_start_survives_a_failing_first_lookup(setup: Any) -> None:
    fleet, _ = setup
    resolver = StubResolver("127.0.0.2")
    resolver.error = OSError("dns down")
    disc = DnsDiscovery(fleet, f"dns://{HOST}:8000", interval_s=0.02, resolver=resolver)
    await disc.start()
    try:
        assert fleet.names() == []
        resolver.error = None
        await wait_for_async(lambda: fleet.names() == ["127.0.0.2:8000"])
    finally:
        await disc.stop()


async def test_static_worker_with_same_address_is_left_alone(setup: Any) -> None:
    fleet, _ = setup
    fleet.add(WorkerSpec("127.0.0.2:8000", "http://127.0.0.2:8000", api_key="static"))
    resolver = StubResolver("127.0.0.2", "127.0.0.3")
    disc = DnsDiscovery(fleet, f"dns://{HOST}:8000", resolver=resolver)
    await disc.refresh()
    assert disc.members == ["127.0.0.3:8000"]
    resolver.answers = []
    await disc.refresh()
    assert fleet.names() == ["127.0.0.2:8000"], "discovery must not remove a worker it did not add"
    assert fleet.get("127.0.0.2:8000").api_key == "static"


async def test_hooks_and_address_normalisation(setup: Any) -> None:
    fleet, _ = setup
    joined: list[str] = []
    left: list[str] = []

    async def on_added(spec: WorkerSpec) -> None:
        joined.append(kv_events_endpoint(spec))

    async def on_removed(name: str) -> None:
        assert fleet.get(name) is None, "hook runs after the fleet changed"
        left.append(name)

    resolver = StubResolver("127.0.0.2", "0:0:0:0:0:0:0:1", "127.0.0.2")
    disc = DnsDiscovery(
        fleet,
        f"dns://{HOST}:8000",
        resolver=resolver,
        on_added=on_added,
        on_removed=on_removed,
        check_new=False,
    )
    added, _ = await disc.refresh()
    assert added == ["127.0.0.2:8000", "[::1]:8000"]
    assert sorted(joined) == ["tcp://127.0.0.2:5557", "tcp://[::1]:5557"]
    assert fleet.candidates(MODEL) == [], "not health-checked yet (check_new=False)"
    resolver.answers = ["::1"]
    await disc.refresh()
    assert left == ["127.0.0.2:8000"] and fleet.names() == ["[::1]:8000"]

    resolver.answers = ["not-an-ip"]
    with pytest.raises(ValueError):
        await disc.refresh()
    assert fleet.names() == ["[::1]:8000"]


async def test_system_resolver_uses_loop_getaddrinfo() -> None:
    # localhost comes from /etc/hosts: no packet leaves the machine.
    assert "127.0.0.1" in await system_resolver("localhost") or "::1" in await system_resolver(
        "localhost"
    )


async def test_system_resolver_does_not_block_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import time

    def slow_getaddrinfo(host: str, *args: Any, **kwargs: Any) -> list[Any]:
        time.sleep(0.3)  # a slow DNS server, in the executor thread
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.9", 0))]

    monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        assert await system_resolver("slow.example") == ["127.0.0.9"]
    finally:
        task.cancel()
    assert ticks >= 10, "the event loop kept running while DNS was slow"


# -- EndpointSlices ------------------------------------------------------------------------


def slice_doc(
    ready: dict[str, bool],
    port: int = 8000,
    name: str = "http",
    nodes: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An EndpointSlice as the API server lists it; `nodes` gives endpoints their nodeName."""
    endpoints: list[dict[str, Any]] = []
    for ip, ok in ready.items():
        endpoint: dict[str, Any] = {"addresses": [ip], "conditions": {"ready": ok}}
        if nodes and ip in nodes:
            endpoint["nodeName"] = nodes[ip]
        endpoints.append(endpoint)
    return {
        "addressType": "IPv4",
        "ports": [
            {"name": name, "port": port, "protocol": "TCP"},
            {"name": "kv-events", "port": 5557},
        ],
        "endpoints": endpoints,
    }


def test_endpoint_slice_addresses() -> None:
    slices = [
        slice_doc({"127.0.0.2": True, "127.0.0.3": False}),
        {"ports": [{"port": 9999}], "endpoints": [{"addresses": ["127.0.0.9"]}]},
    ]
    assert endpoint_slice_addresses(slices, 8000) == (["127.0.0.2"], 8000)
    assert endpoint_slice_addresses(slices, "http") == (["127.0.0.2"], 8000)
    assert endpoint_slice_addresses(slices, 9999) == (["127.0.0.9"], 9999)  # no condition = ready
    assert endpoint_slice_addresses(slices, "grpc") == ([], None)


def test_endpoint_slice_endpoints_carry_node_names() -> None:
    slices = [
        slice_doc(
            {"127.0.0.2": True, "127.0.0.3": True, "127.0.0.4": False, "127.0.0.5": True},
            nodes={"127.0.0.2": "gpu-a", "127.0.0.3": "gpu-b", "127.0.0.4": "gpu-a"},
        ),
        # The controller moving .5 between slices: the copy naming its node wins.
        slice_doc({"127.0.0.5": True}, nodes={"127.0.0.5": "gpu-b"}),
    ]
    endpoints, port = endpoint_slice_endpoints(slices, "http")
    assert port == 8000
    assert endpoints == {"127.0.0.2": "gpu-a", "127.0.0.3": "gpu-b", "127.0.0.5": "gpu-b"}
    assert endpoint_slice_endpoints([slice_doc({"127.0.0.2": True})], 8000) == (
        {"127.0.0.2": None},
        8000,
    ), "no nodeName: no node"


class FakeApiServer:
    """A tiny HTTPS Kubernetes API server on loopback serving EndpointSlice lists."""

    def __init__(self, tmp: Path) -> None:
        self.cert = tmp / "ca.crt"
        key = tmp / "tls.key"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-keyout",
                str(key),
                "-out",
                str(self.cert),
            ],
            check=True,
            capture_output=True,
        )
        self.token = "token-1"
        self.slices: list[dict[str, Any]] = []
        self.pods: dict[str, dict[str, str]] = {}
        """Pod name -> its labels, served at /api/v1/namespaces/llm/pods/NAME."""
        self.requests: list[tuple[str, dict[str, list[str]], str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlsplit(self.path)
                auth = self.headers.get("authorization", "")
                server.requests.append((url.path, parse_qs(url.query), auth))
                if auth != f"Bearer {server.token}":
                    self._send(401, {"kind": "Status", "code": 401})
                elif url.path.startswith("/api/v1/namespaces/llm/pods/") and url.path.rsplit("/", 1)[1] in server.pods:
                    labels = server.pods[url.path.rsplit("/", 1)[1]]
                    self._send(200, {"kind": "Pod", "metadata": {"labels": labels}})
                elif url.path != "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices":
                    self._send(404, {"kind": "Status", "code": 404})
                else:
                    self._send(200, {"kind": "EndpointSliceList", "items": server.slices})

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, key)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[FakeApiServer]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the fake API server's certificate")
    server = FakeApiServer(tmp_path)
    yield server
    server.close()


async def test_endpoint_slice_discovery_against_fake_api_server(
    setup: Any, api_server: FakeApiServer, tmp_path: Path
) -> None:
    fleet, index = setup
    token_file = tmp_path / "token"
    token_file.write_text("token-1\n")
    client = in_cluster_client(
        api_server=api_server.url, token_path=token_file, ca_path=api_server.cert
    )
    api_server.slices = [slice_doc({"127.0.0.2": True, "127.0.0.3": False})]
    disc = EndpointSliceDiscovery(fleet, "k8s://llm/vllm:http", interval_s=0.02, client=client)
    await disc.start()
    try:
        assert fleet.names() == ["127.0.0.2:8000"], "only ready endpoints become workers"
        path, query, auth = api_server.requests[0]
        assert path == "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
        assert query == {"labelSelector": ["kubernetes.io/service-name=vllm"]}
        assert auth == "Bearer token-1"
        await index.record("127.0.0.2:8000", keys(5), [10])

        # The token rotates and .3 becomes ready while .2 terminates: no restart needed.
        api_server.token = "token-2"
        token_file.write_text("token-2")
        api_server.slices = [slice_doc({"127.0.0.2": False, "127.0.0.3": True})]
        await wait_for_async(lambda: fleet.names() == ["127.0.0.3:8000"])
        # The newcomer joins at once and takes traffic once its health probe answers.
        await wait_for_async(lambda: [w.name for w in fleet.candidates(MODEL)] == ["127.0.0.3:8000"])
        assert (await index.lookup(keys(5))).depth("127.0.0.2:8000") == 0

        # The API server refusing us (e.g. RBAC) keeps the fleet as it is.
        api_server.token = "revoked"
        await wait_for_async(lambda: disc.last_error is not None and "401" in disc.last_error)
        assert fleet.names() == ["127.0.0.3:8000"]
    finally:
        await disc.stop()
        await client.aclose()


async def test_endpoint_slice_tls_is_verified(
    setup: Any, api_server: FakeApiServer, tmp_path: Path
) -> None:
    fleet, _ = setup
    token_file = tmp_path / "token"
    token_file.write_text("token-1")
    other_ca = tmp_path / "other"
    other_ca.mkdir()
    stranger = FakeApiServer(other_ca)  # a different self-signed CA
    stranger.close()
    client = in_cluster_client(
        api_server=api_server.url, token_path=token_file, ca_path=stranger.cert
    )
    disc = EndpointSliceDiscovery(fleet, "k8s://llm/vllm:8000", client=client)
    try:
        with pytest.raises(httpx.ConnectError):
            await disc.refresh()
        assert api_server.requests == [], "no request (and no token) may reach an unverified server"
    finally:
        await client.aclose()


def test_make_discovery_picks_the_source(setup: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet, _ = setup
    assert isinstance(make_discovery(fleet, f"dns://{HOST}:8000"), DnsDiscovery)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(RuntimeError, match="not running in a Kubernetes pod"):
        make_discovery(fleet, "k8s://llm/vllm:8000")


async def test_start_discovery_is_what_the_app_calls(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet, _ = setup

    async def fake_resolver(host: str) -> list[str]:
        assert host == "vllm.test"
        return ["127.0.0.7"]

    monkeypatch.setattr("router.discovery.system_resolver", fake_resolver)
    disc = await start_discovery(fleet, "dns://vllm.test:8001", interval_s=60)
    try:
        assert isinstance(disc, DnsDiscovery)
        assert fleet.names() == ["127.0.0.7:8001"]
        assert [w.name for w in fleet.candidates(MODEL)] == ["127.0.0.7:8001"]
    finally:
        await disc.stop()


async def test_endpoint_slice_discovery_places_workers_on_their_nodes(
    api_server: FakeApiServer, tmp_path: Path
) -> None:
    index = MemoryIndex()
    health = httpx.AsyncClient(transport=httpx.MockTransport(fake_vllm))
    # .4 has no nodeName in its slice: the fleet's --node map places it, as for a DNS worker.
    fleet = Fleet(
        [], health, health_interval_s=3600, on_down=index.drop_location,
        nodes={"127.0.0.4:8000": "from-flag"},
    )  # fmt: skip
    token_file = tmp_path / "token"
    token_file.write_text("token-1")
    client = in_cluster_client(
        api_server=api_server.url, token_path=token_file, ca_path=api_server.cert
    )
    events: list[str] = []

    async def on_added(spec: WorkerSpec) -> None:
        events.append(f"+{spec.name}@{spec.node}")

    async def on_removed(name: str) -> None:
        events.append(f"-{name}")

    api_server.slices = [
        slice_doc(
            {"127.0.0.2": True, "127.0.0.3": True, "127.0.0.4": True, "127.0.0.5": True},
            nodes={"127.0.0.2": "gpu-a", "127.0.0.3": "gpu-a", "127.0.0.5": "gpu-b"},
        )
    ]
    disc = EndpointSliceDiscovery(
        fleet, "k8s://llm/vllm:http", interval_s=3600, client=client,
        on_added=on_added, on_removed=on_removed,
    )  # fmt: skip
    try:
        await disc.start()
        nodes = {w.name: w.node for w in fleet}
        assert nodes == {
            "127.0.0.2:8000": "gpu-a",
            "127.0.0.3:8000": "gpu-a",
            "127.0.0.4:8000": "from-flag",
            "127.0.0.5:8000": "gpu-b",
        }
        await index.record("127.0.0.2:8000", keys(1), [10])
        await index.record("127.0.0.3:8000", keys(1), [10])

        # .2's address now belongs to a pod on gpu-b (rescheduled, address reused); .4's
        # slice learns its node too. Both leave and join again; .3 and .5 are untouched.
        events.clear()
        moved = {"127.0.0.2": "gpu-b", "127.0.0.3": "gpu-a", "127.0.0.4": "gpu-c", "127.0.0.5": "gpu-b"}
        api_server.slices = [slice_doc(dict.fromkeys(moved, True), nodes=moved)]
        added, removed = await disc.refresh()
        assert added == removed == ["127.0.0.2:8000", "127.0.0.4:8000"]
        assert events == [
            "-127.0.0.2:8000",
            "-127.0.0.4:8000",
            "+127.0.0.2:8000@gpu-b",
            "+127.0.0.4:8000@gpu-c",
        ], "the old worker is gone before the new one is announced"
        assert fleet.get("127.0.0.2:8000").node == "gpu-b"
        assert fleet.get("127.0.0.4:8000").node == "gpu-c"
        assert fleet.get("127.0.0.2:8000").healthy, "the newcomer is health-checked at once"
        view = await index.lookup(keys(1))
        assert view.depth("127.0.0.2:8000") == 0, "a moved worker's index entries are dropped"
        assert view.depth("127.0.0.3:8000") == 1
        assert disc.members == [f"127.0.0.{i}:8000" for i in (2, 3, 4, 5)]

        # Nothing changed: nothing leaves or joins.
        events.clear()
        assert await disc.refresh() == ([], [])
        assert events == []
    finally:
        await disc.stop()
        await client.aclose()
        await health.aclose()


async def test_endpoint_slice_discovery_reads_roles_from_pod_labels(
    setup: Any, api_server: FakeApiServer, tmp_path: Path
) -> None:
    """`kvroute.io/role`, or llm-d's `llm-d.ai/role`, on the pod behind an endpoint gives its
    worker's role; a pod without one (or unreadable) is `both` unless `--role` says."""
    fleet, _ = setup
    token_file = tmp_path / "token"
    token_file.write_text("token-1")
    client = in_cluster_client(api_server=api_server.url, token_path=token_file, ca_path=api_server.cert)
    doc = slice_doc({"127.0.0.2": True, "127.0.0.3": True, "127.0.0.4": True, "127.0.0.5": True})
    for endpoint, pod in zip(doc["endpoints"], ("p-0", "d-0", "plain", "gone"), strict=True):
        endpoint["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "llm"}
    api_server.slices = [doc]
    api_server.pods = {"p-0": {"kvroute.io/role": "prefill"}, "d-0": {"llm-d.ai/role": "decode"}, "plain": {"app": "x"}}
    disc = EndpointSliceDiscovery(fleet, "k8s://llm/vllm:http", interval_s=3600, client=client)
    try:
        await disc.start()
        roles = {w.name: w.role for w in fleet}
        assert roles == {"127.0.0.2:8000": "prefill", "127.0.0.3:8000": "decode", "127.0.0.4:8000": "both", "127.0.0.5:8000": "both"}
        assert fleet.disaggregated()
        pod_reads = sum(1 for path, _, _ in api_server.requests if "/pods/" in path)
        await disc.refresh()
        # Pods read are not read again; the unreadable one is retried.
        assert sum(1 for path, _, _ in api_server.requests if "/pods/" in path) == pod_reads + 1
    finally:
        await disc.stop()
        await client.aclose()
