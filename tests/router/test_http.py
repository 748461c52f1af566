"""The router over real loopback HTTP against recording upstreams: bytes forwarded, errors,
retries, models, health and metrics."""

from __future__ import annotations

import json

import httpx
import orjson
import pytest

from loadtests.support.routerproc import RouterProcess
from tests.support.upstream import RecordingUpstream, UpstreamBehaviour

pytestmark = pytest.mark.router_process(policy="cache_aware", extra_args=["--max-body-bytes", "200000"])

TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}, "required": ["q"]},
    },
}


def chat_body(tools_json: str, args: str, system: str) -> bytes:
    return (
        '{"model": "rec-model", "tools": ' + tools_json + ', "messages": ['
        '{"role": "system", "content": ' + json.dumps(system) + "},"
        '{"role": "user", "content": "find cats"},'
        '{"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": ' + json.dumps(args) + "}}]},"
        '{"role": "tool", "tool_call_id": "c1", "content": "cats found"}]}'
    ).encode()


@pytest.fixture(scope="module")
def upstreams():
    with RecordingUpstream() as a, RecordingUpstream() as b:
        yield a, b


@pytest.fixture(scope="module")
def router_workers(upstreams) -> dict[str, str]:
    a, b = upstreams
    return {"a": a.url, "b": b.url}


def test_reordered_tools_and_whitespace_reach_the_worker_as_identical_bytes(router, upstreams) -> None:
    one = chat_body(json.dumps([TOOL]), '{"q": "cats", "n": 3}', "You are an agent.\r\nBe brief.  ")
    reordered_tool = {"function": {"parameters": {"required": ["q"], "properties": {"n": {"type": "integer"}, "q": {"type": "string"}}, "type": "object"}, "description": "Search the web", "name": "search"}, "type": "function"}
    two = chat_body(json.dumps([reordered_tool], indent=3), '{ "n":3,\n "q":"cats" }', "You are an agent.\nBe brief.")
    assert one != two
    seen = []
    for raw in (one, two):
        r = httpx.post(router.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        worker = r.headers["x-kvroute-worker"]
        upstream = dict(zip("ab", upstreams, strict=True))[worker]
        seen.append(upstream.received[-1].body)
    assert seen[0] == seen[1]
    sent = orjson.loads(seen[0])
    assert sent["messages"][2]["tool_calls"][0]["function"]["arguments"] == '{"n":3,"q":"cats"}'
    assert sent["messages"][0]["content"] == "You are an agent.\nBe brief."


def test_client_credentials_and_hop_by_hop_headers_are_not_forwarded(router, upstreams) -> None:
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "rec-model", "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": "Bearer client-secret", "x-request-id": "req-1", "proxy-authorization": "x"},
    )
    assert r.status_code == 200
    got = next(u for u in upstreams if u.received and u.received[-1].headers.get("x-request-id") == "req-1")
    headers = got.received[-1].headers
    assert "authorization" not in headers and "proxy-authorization" not in headers
    assert "127.0.0.1" not in r.headers.get("x-kvroute-worker", "") and r.headers["x-kvroute-worker"] in ("a", "b")


BAD_INPUTS = [
    ("malformed json", b'{"model": "rec-model", "messages": [', 400, "invalid_json"),
    ("empty body", b"", 400, "empty_body"),
    ("not an object", b"[1, 2]", 400, "invalid_body"),
    ("missing model", b'{"messages": [{"role": "user", "content": "x"}]}', 400, "missing_required_parameter"),
    ("model wrong type", b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}', 400, "invalid_type"),
    ("missing messages", b'{"model": "rec-model"}', 400, "missing_required_parameter"),
    ("messages wrong type", b'{"model": "rec-model", "messages": "hi"}', 400, "invalid_type"),
    ("empty messages", b'{"model": "rec-model", "messages": []}', 400, "invalid_type"),
    ("message without role", b'{"model": "rec-model", "messages": [{"content": "x"}]}', 400, "invalid_type"),
    ("stream wrong type", b'{"model": "rec-model", "stream": "yes", "messages": [{"role": "user", "content": "x"}]}', 400, "invalid_type"),
    ("tools wrong type", b'{"model": "rec-model", "tools": {}, "messages": [{"role": "user", "content": "x"}]}', 400, "invalid_type"),
    ("unknown model", b'{"model": "gpt-nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found"),
    ("oversized body", b'{"model": "rec-model", "messages": [{"role": "user", "content": "' + b"x" * 300_000 + b'"}]}', 413, "request_too_large"),
    ("invalid utf-8", b'{"model": "rec-model", "messages": [{"role": "user", "content": "\xff"}]}', 400, "invalid_json"),
]


@pytest.mark.parametrize(("case", "raw", "status", "code"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_openai_error(router, case, raw, status, code) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert "Traceback" not in r.text and "127.0.0.1" not in r.text


def test_completions_bad_prompt_and_wrong_method(router) -> None:
    r = httpx.post(router.url + "/v1/completions", json={"model": "rec-model"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_required_parameter"
    r = httpx.get(router.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(router.url + "/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_embeddings_pass_through(router) -> None:
    r = httpx.post(router.url + "/v1/embeddings", json={"model": "rec-model", "input": "hello"})
    assert r.status_code == 200
    assert r.json()["data"][0]["embedding"] == [0.1, 0.2]
    assert r.headers["x-kvroute-route-reason"] == "least_loaded"


def test_models_health_ready_metrics(router) -> None:
    models = httpx.get(router.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["rec-model"]
    assert httpx.get(router.url + "/health").status_code == 200
    assert httpx.get(router.url + "/ready").status_code == 200
    text = httpx.get(router.url + "/metrics").text
    for series in ("kvroute_requests_total", "kvroute_ttft_seconds", "kvroute_prompt_tokens_total",
                   "kvroute_predicted_cached_tokens_total", 'kvroute_worker_inflight{worker="a"}', 'kvroute_worker_healthy{worker="b"} 1'):
        assert series in text
    assert "127.0.0.1" not in text


def test_connection_failure_before_first_byte_is_retried_elsewhere() -> None:
    with RecordingUpstream() as good:
        dead = "http://127.0.0.1:9"  # discard port: connection refused
        with RouterProcess({"dead": dead, "good": good.url}, policy="round_robin", wait_ready=True) as r:
            for _ in range(6):
                resp = httpx.post(r.url + "/v1/chat/completions", json={"model": "rec-model", "messages": [{"role": "user", "content": "x"}]})
                assert resp.status_code == 200
                assert resp.headers["x-kvroute-worker"] == "good"
            assert 'kvroute_worker_healthy{worker="dead"} 0' in r.metrics()


def test_worker_500_is_retried_and_all_failing_gives_502() -> None:
    with RecordingUpstream(behaviour=UpstreamBehaviour(status=500)) as bad, RecordingUpstream() as good:
        with RouterProcess({"bad": bad.url, "good": good.url}, policy="round_robin") as r:
            for _ in range(4):
                resp = httpx.post(r.url + "/v1/chat/completions", json={"model": "rec-model", "messages": [{"role": "user", "content": "x"}]})
                assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == "good"
            assert len(bad.received) >= 1
    with RecordingUpstream(behaviour=UpstreamBehaviour(status=503)) as bad:
        with RouterProcess({"bad": bad.url}) as r:
            resp = httpx.post(r.url + "/v1/chat/completions", json={"model": "rec-model", "messages": [{"role": "user", "content": "x"}]})
            assert resp.status_code == 502
            assert resp.json()["error"]["code"] == "upstream_unavailable"
            assert bad.url not in resp.text


def test_stream_broken_after_first_byte_ends_with_error_event() -> None:
    with RecordingUpstream(behaviour=UpstreamBehaviour(chunks=5, break_after_chunks=2)) as flaky:
        with RouterProcess({"flaky": flaky.url}) as r:
            with httpx.stream("POST", r.url + "/v1/chat/completions",
                              json={"model": "rec-model", "stream": True, "messages": [{"role": "user", "content": "x"}]}) as resp:
                assert resp.status_code == 200
                events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 3
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])
    assert error["error"]["code"] == "stream_interrupted"


def test_no_worker_for_the_model_at_all_is_503_when_all_down() -> None:
    with RouterProcess({"dead": "http://127.0.0.1:9"}, wait_ready=False) as r:
        resp = httpx.post(r.url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert resp.status_code == 503
        assert resp.headers["retry-after"]
        assert httpx.get(r.url + "/ready").status_code == 503
