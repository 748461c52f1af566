"""Hostile input: garbage through the parser and validator raises nothing but RouterError,
whatever passes validation goes through the normalizer and the prefix-key builder without
raising, and over HTTP every bad input in the table gets a 4xx with an OpenAI-style body."""

from __future__ import annotations

import json

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from normalizer.canonical import NormalizeOptions, canonicalize_body
from router.chain import EstimateChainBuilder
from router.errors import RouterError
from router.proxy.exchange import canonical
from router.requests import parse_body, validate
from tests.support.upstream import RecordingUpstream

pytestmark = pytest.mark.router_process(extra_args=["--max-body-bytes", "100000"])

FIELDS = ["model", "messages", "prompt", "role", "content", "tool_calls", "function", "arguments", "name",
          "tool_call_id", "type", "text", "tools", "functions", "stream", "user", "input", "instructions",
          "system", "max_tokens", "tool_use", "tool_result", "input_schema", "function_call", "function_call_output",
          "call_id", "output", "user_id", "metadata", "assistant", "image_url", "url", "input_image", "input_audio",
          "video_url", "image", "source", "data", "data:image/png;base64,iVBORw0K", "data:image/jpeg;base64,/9j/4AA"]
scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=6) | st.sampled_from(FIELDS)
)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=3), children, max_size=5),
    max_leaves=25,
)
messages = st.lists(
    st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name", "tool_call_id"]), values, max_size=5)
    | values,
    max_size=4,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just("m") | values,
        "messages": messages | values,
        "prompt": values | st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=4),
        "tools": st.lists(values, max_size=3) | values,
        "functions": values,
        "stream": st.booleans() | values,
        "user": st.text(max_size=5) | values,
        "input": st.text(max_size=5) | st.lists(values, max_size=4) | values,
        "instructions": st.text(max_size=5) | values,
        "system": st.text(max_size=5) | st.lists(values, max_size=3) | values,
        "max_tokens": st.integers(0, 10) | values,
    },
)
KINDS = st.sampled_from(["chat", "completion", "responses", "messages", None])


def route_pipeline(raw: bytes, kind) -> None:
    """What the proxy does with a body before forwarding it (minus I/O)."""
    body = parse_body(raw)
    validate(body, kind)
    if kind is not None:
        body = canonical(body, kind, NormalizeOptions())
        EstimateChainBuilder().build(body, kind)
    orjson.dumps(body)


@given(raw=st.binary(max_size=300), kind=KINDS)
@settings(max_examples=300, deadline=None)
def test_random_bytes_raise_only_router_errors(raw: bytes, kind) -> None:
    try:
        route_pipeline(raw, kind)
    except RouterError as exc:
        assert 400 <= exc.status < 500 and exc.message


@given(body=bodies, kind=KINDS)
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
def test_random_bodies_raise_only_router_errors(body, kind) -> None:
    try:
        route_pipeline(orjson.dumps(body), kind)
    except RouterError as exc:
        assert exc.status == 400 and exc.code in ("missing_required_parameter", "invalid_type", "invalid_body")


@given(body=bodies)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_what_validates_is_canonicalized_idempotently(body) -> None:
    try:
        validate(body, "chat")
    except RouterError:
        return
    once = canonicalize_body(body)
    assert canonicalize_body(once) == once
    assert EstimateChainBuilder().build(once, "chat").keys == EstimateChainBuilder().build(canonicalize_body(once), "chat").keys


def nested(depth: int) -> bytes:
    return b'{"model": "rec-model", "messages": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]}"


HOSTILE = [
    ("nested 300 deep", "/v1/chat/completions", nested(300), 400, "invalid_body"),
    ("nested 2000 deep", "/v1/chat/completions", nested(2000), 400, "invalid_json"),
    ("tool_calls not an array", "/v1/chat/completions",
     b'{"model": "rec-model", "messages": [{"role": "assistant", "tool_calls": 5}]}', 400, "invalid_type"),
    ("tool_call function a string", "/v1/chat/completions",
     b'{"model": "rec-model", "messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]}', 400, "invalid_type"),
    ("tool_call function null", "/v1/chat/completions",
     b'{"model": "rec-model", "messages": [{"role": "assistant", "tool_calls": [{"function": null}]}]}', 400, "invalid_type"),
    ("role not a string", "/v1/chat/completions", b'{"model": "rec-model", "messages": [{"role": ["user"]}]}', 400, "invalid_type"),
    ("completions with broken messages", "/v1/completions",
     b'{"model": "rec-model", "prompt": "x", "messages": [{"role": {}}]}', 400, "invalid_type"),
    ("NaN literal", "/v1/chat/completions", b'{"model": "rec-model", "temperature": NaN, "messages": []}', 400, "invalid_json"),
    ("lone surrogate", "/v1/chat/completions", b'{"model": "rec-model", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "invalid_json"),
    ("trailing garbage", "/v1/chat/completions", b'{"model": "rec-model", "messages": [{"role": "user"}]} xx', 400, "invalid_json"),
    ("stream null-ish string", "/v1/chat/completions", b'{"model": "rec-model", "stream": "false", "messages": [{"role": "user"}]}', 400, "invalid_type"),
    ("user not a string", "/v1/chat/completions", b'{"model": "rec-model", "user": 7, "messages": [{"role": "user"}]}', 400, "invalid_type"),
    ("empty prompt list", "/v1/completions", b'{"model": "rec-model", "prompt": []}', 400, "invalid_type"),
    ("embeddings without model", "/v1/embeddings", b'{"input": "x"}', 400, "missing_required_parameter"),
    ("model empty", "/v1/embeddings", b'{"model": "", "input": "x"}', 400, "invalid_type"),
]


@pytest.fixture(scope="module")
def router_workers(upstream: RecordingUpstream) -> dict[str, str]:
    return {"a": upstream.url}


@pytest.mark.parametrize(("case", "path", "raw", "status", "code"), HOSTILE, ids=[c[0] for c in HOSTILE])
def test_hostile_body_gets_a_4xx_openai_error(router, case, path, raw, status, code) -> None:
    r = httpx.post(router.url + path, content=raw, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]
    assert "Traceback" not in r.text


def test_declared_oversized_body_is_refused_before_it_is_read(router) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 10000000000\r\n\r\n{")
        # The head and the body may arrive in separate segments: read until the body the
        # head announces is complete (or the router closes the connection).
        answer = b""
        while True:
            data = s.recv(65536)
            answer += data
            head, sep, body = answer.partition(b"\r\n\r\n")
            length = next(
                (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                 if line.lower().startswith(b"content-length:")),
                None,
            )
            if not data or (sep and length is not None and len(body) >= length):
                break
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_refused(router) -> None:
    def chunks():
        for _ in range(30):
            yield b"x" * 10_000

    r = httpx.post(router.url + "/v1/chat/completions", content=chunks(), timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


BAD_MEDIA = [
    "data:image/png;base64,iVBORw0KGgoAAAANSUhE",  # truncated inside its header
    "data:image/png;base64,%%%% not base64 %%%%",  # malformed
    "data:image/png,raw",  # not base64
    "data:application/x-unknown;base64,AAAAAAAA",  # an unknown media type
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgABEXAAARFwCAIAAAA=",  # a header claiming 70,000 × 70,000
]


@pytest.mark.parametrize("url", BAD_MEDIA)
def test_bad_media_is_forwarded_for_the_engine_to_judge(router, upstream: RecordingUpstream, url: str) -> None:
    """What a vision model's server would refuse is its to refuse: the router routes it (one
    element at the default count) and forwards it, never a 500."""
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]
    for path, body in (
        ("/v1/chat/completions", {"model": "rec-model", "messages": [{"role": "user", "content": parts}]}),
        ("/v1/messages", {"model": "rec-model", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.partition(",")[2]}},
        ]}]}),
    ):
        r = httpx.post(router.url + path, content=orjson.dumps(body), headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 200, (path, r.text)


def test_unknown_paths_and_methods_get_openai_errors(router) -> None:
    for method, path, status in [("GET", "/v1/chat/completions", 405), ("PUT", "/v1/completions", 405),
                                 ("GET", "/v1/nope", 404), ("POST", "/admin/../v1/models", 405), ("GET", "/%00", 404)]:
        r = httpx.request(method, router.url + path, timeout=10)
        assert r.status_code == status, (method, path, r.status_code)
        assert r.json()["error"]["message"]


# Bodies that pass the Responses and Messages checks, with hostile content inside: what
# validates must go through the normalizer and the chain builder without raising.
agent_items = st.dictionaries(st.sampled_from(["type", "role", "content", "arguments", "call_id", "output", "name",
                                               "input", "tool_use_id", "text", "summary"]), values, max_size=5)
responses_bodies = st.fixed_dictionaries(
    {"model": st.just("m"), "input": st.text(max_size=5) | st.lists(agent_items, max_size=4)},
    optional={"instructions": st.text(max_size=5), "tools": st.lists(st.dictionaries(st.sampled_from(FIELDS), values, max_size=4), max_size=2)},
)
messages_bodies = st.fixed_dictionaries(
    {
        "model": st.just("m"), "max_tokens": st.integers(1, 10),
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"])}, optional={
            "content": st.text(max_size=5) | st.lists(agent_items, max_size=3) | values}), min_size=1, max_size=4),
    },
    optional={"system": st.text(max_size=5) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": values}), max_size=2),
              "tools": st.lists(st.dictionaries(st.sampled_from(FIELDS), values, max_size=4), max_size=2)},
)


@given(body=responses_bodies)
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
def test_valid_responses_bodies_route_without_raising(body) -> None:
    try:
        route_pipeline(orjson.dumps(body), "responses")
    except RouterError as exc:
        assert exc.status == 400


@given(body=messages_bodies)
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
def test_valid_messages_bodies_route_without_raising(body) -> None:
    try:
        route_pipeline(orjson.dumps(body), "messages")
    except RouterError as exc:
        assert exc.status == 400
