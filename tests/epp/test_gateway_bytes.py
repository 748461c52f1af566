"""Through a real Envoy and `kvroute epp`, byte for byte, against recording upstreams: streams
and whole answers arrive as the worker sent them; tool definitions in two key orders reach
the worker as identical bytes; the worker gets no client credential; the subset hint is
obeyed; refusals are the proxy's (same status, same body) when Envoy answers them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from loadtests.benchmark.envoy import EnvoyPicker
from loadtests.support.routerproc import RouterProcess
from router.epp.envoy_config import SUBSET_TEST_HEADER
from tests.epp.support import require_envoy
from tests.support.upstream import RecordingUpstream

pytestmark = [pytest.mark.slow]

MODEL = "rec-model"
LIMITS = ["--max-body-bytes", "4096"]


@pytest.fixture(scope="module")
def upstreams() -> Iterator[list[RecordingUpstream]]:
    with RecordingUpstream() as a, RecordingUpstream() as b:
        yield [a, b]


@pytest.fixture(scope="module")
def workers(upstreams: list[RecordingUpstream]) -> dict[str, str]:
    return {f"u{i}": u.url for i, u in enumerate(upstreams)}


@pytest.fixture(scope="module")
def gateway(workers: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvoyPicker]:
    require_envoy()
    log = tmp_path_factory.mktemp("gw") / "gateway.log"
    with EnvoyPicker(workers, "cache_aware", LIMITS, log_path=str(log), subset_header=True) as gw:
        yield gw


@pytest.fixture(scope="module")
def proxy(workers: dict[str, str]) -> Iterator[RouterProcess]:
    with RouterProcess(workers, "cache_aware", LIMITS) as r:
        yield r


def chat(content: str = "hello", stream: bool = False, **extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream, **extra}


def raw_post(url: str, body: dict[str, object] | bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    headers = {"content-type": "application/json", **(headers or {})}
    with httpx.Client(timeout=30, trust_env=False) as client, client.stream("POST", url + "/v1/chat/completions", content=content, headers=headers) as r:
        r.read()
        return r


def test_streams_and_whole_answers_arrive_byte_identical(gateway: EnvoyPicker, upstreams: list[RecordingUpstream]) -> None:
    for stream in (True, False):
        body = chat("byte for byte", stream=stream)
        via = raw_post(gateway.url, body)
        direct = raw_post(upstreams[0].url, body)
        assert via.status_code == direct.status_code == 200
        assert via.content == direct.content
        assert via.headers["x-kvroute-worker"] in ("u0", "u1")
        assert via.headers["x-kvroute-route-reason"]


def test_tools_in_two_key_orders_reach_the_worker_as_identical_bytes(gateway: EnvoyPicker, upstreams: list[RecordingUpstream]) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "description": "find a thing",
                                             "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}}}}  # fmt: skip
    reordered = {"function": {"parameters": {"properties": {"n": {"type": "integer"}, "q": {"type": "string"}}, "type": "object"},
                              "description": "find a thing", "name": "lookup"}, "type": "function"}  # fmt: skip
    a = b'{"model": "rec-model", "tools": [%s], "messages": [{"role": "user", "content": "tools"}]}' % orjson.dumps(tool)
    b = b'{"model": "rec-model", "tools": [%s], "messages": [{"role": "user", "content": "tools"}]}' % orjson.dumps(reordered)
    for raw in (a, b):
        assert raw_post(gateway.url, raw).status_code == 200
    received = [r.body for u in upstreams for r in u.received if b'"lookup"' in r.body]
    assert len(received) == 2
    assert received[0] == received[1]
    assert a != b


def test_the_worker_gets_the_canonical_body_without_client_credentials(gateway: EnvoyPicker, upstreams: list[RecordingUpstream]) -> None:
    marker = "credentials are the gateway's"
    r = raw_post(gateway.url, chat(marker), headers={"authorization": "Bearer sk-client", "x-api-key": "sk-client"})
    assert r.status_code == 200
    (seen,) = [x for u in upstreams for x in u.received if marker.encode() in x.body]
    assert "authorization" not in seen.headers and "x-api-key" not in seen.headers
    endpoints = seen.headers["x-gateway-destination-endpoint"].split(",")
    assert sorted(endpoints) == sorted(u.url.removeprefix("http://") for u in upstreams)  # the choice, then the fallback
    assert seen.body == orjson.dumps(orjson.loads(seen.body))  # serialized once, compactly


def test_the_subset_hint_is_obeyed(gateway: EnvoyPicker, upstreams: list[RecordingUpstream], proxy: RouterProcess) -> None:
    only = upstreams[1].url.removeprefix("http://")
    for i in range(6):
        r = raw_post(gateway.url, chat(f"subset {i}"), headers={SUBSET_TEST_HEADER: only})
        assert r.status_code == 200
        assert r.headers["x-kvroute-worker"] == "u1"
    r = raw_post(gateway.url, chat("nowhere"), headers={SUBSET_TEST_HEADER: "10.255.0.1:9"})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_healthy_worker"


@pytest.mark.parametrize(
    "raw",
    [b"{not json", orjson.dumps({"messages": [{"role": "user", "content": "x"}]}), orjson.dumps({"model": MODEL, "messages": "hi"}),
     orjson.dumps(chat("x" * 5000))],
    ids=["bad-json", "no-model", "bad-field", "too-large"],
)
def test_refusals_are_the_proxys(gateway: EnvoyPicker, proxy: RouterProcess, raw: bytes) -> None:
    via, direct = raw_post(gateway.url, raw), raw_post(proxy.url, raw)
    assert via.status_code == direct.status_code
    assert via.status_code in (400, 413)
    assert via.json() == direct.json()


def test_the_pickers_http_side_serves_no_requests(gateway: EnvoyPicker) -> None:
    r = httpx.post(gateway.admin_url + "/v1/chat/completions", json=chat(), trust_env=False)
    assert r.status_code == 404
    assert "through the gateway" in r.json()["error"]["message"]
    assert httpx.get(gateway.admin_url + "/ready", trust_env=False).status_code == 200
    models = httpx.get(gateway.url + "/v1/models", trust_env=False, timeout=10)  # through Envoy: to an endpoint
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


def test_logs_say_nothing_alarming(gateway: EnvoyPicker) -> None:
    assert gateway.picker.log_path is not None
    text = Path(gateway.picker.log_path).read_text()
    assert "internal error" not in text
    assert "Traceback" not in text


def test_the_picker_serves_the_gateway_over_tls(workers: dict[str, str], tmp_path: Path) -> None:
    require_envoy()
    with EnvoyPicker(workers, "cache_aware", log_path=str(tmp_path / "tls.log"), epp_tls=True) as gw:
        r = raw_post(gw.url, chat("over TLS", stream=True))
        assert r.status_code == 200 and r.headers["x-kvroute-worker"] in workers
