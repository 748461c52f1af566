"""The agent APIs in process (tests/support/asgi.py): `/v1/responses` and `/v1/messages`
forwarded as canonical bytes, turn N+1 routed to turn N's worker, the pass-throughs, every
error the router answers in the endpoint's own shape, and broken streams ended per API."""

from __future__ import annotations

import orjson
import pytest

from router.config_loader import flat_config
from router.proxy.upstream import UpstreamError
from router.workers import WorkerSpec
from tests.support.asgi import MODEL, Answer, AsgiCall, FakeUpstream, post, running_app

SSE = [(b"content-type", b"text/event-stream")]
TOOL = {"name": "get_weather", "description": "Weather of a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL_REORDERED = {"input_schema": {"required": ["city"], "properties": {"city": {"type": "string"}}, "type": "object"},
                  "description": "Weather of a city.", "name": "get_weather"}


def config(workers: int = 3, **overrides: object):
    specs = [WorkerSpec(f"w{i}", f"http://w{i}.test:8000") for i in range(1, workers + 1)]
    return flat_config(workers=specs, health_interval_s=3600.0, outlier_interval_s=0.0, **overrides)


def messages_body(tool: dict, **extra: object) -> dict:
    return {"model": MODEL, "max_tokens": 64, "system": "You are terse.", "tools": [tool],
            "messages": [{"role": "user", "content": "Weather in Paris?"}], **extra}


async def test_anthropic_tools_in_any_key_order_reach_the_worker_as_identical_bytes() -> None:
    upstream = FakeUpstream([Answer()])
    async with running_app(config(workers=1), upstream) as app:
        for tool in (TOOL, TOOL_REORDERED):
            response = await post(app, "/v1/messages", messages_body(tool))
            assert response.status == 200
    first, second = upstream.posts
    assert first.path == second.path == "/v1/messages"
    assert first.body == second.body
    assert orjson.loads(first.body)["tools"][0]["input_schema"]["required"] == ["city"]


def responses_turn(arguments: str, key_order_flipped: bool = False) -> dict:
    tool = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    if key_order_flipped:
        tool = dict(reversed(tool.items()))
    return {"model": MODEL, "instructions": "You are terse.", "tools": [tool], "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]}


async def test_responses_tools_and_function_call_arguments_are_forwarded_canonical() -> None:
    upstream = FakeUpstream([Answer()])
    async with running_app(config(workers=1), upstream) as app:
        await post(app, "/v1/responses", responses_turn('{"city": "Paris", "unit": "c"}'))
        await post(app, "/v1/responses", responses_turn('{ "unit":"c","city":"Paris" }', key_order_flipped=True))
    first, second = upstream.posts
    assert first.path == "/v1/responses" and first.body == second.body
    assert orjson.loads(first.body)["input"][1]["arguments"] == '{"city":"Paris","unit":"c"}'


async def test_responses_turns_resent_whole_route_to_turn_ones_worker_as_gpu_hits() -> None:
    # The Agents SDK's loop (to_input_list()): each request resends every prior item plus
    # the model's last output (an assistant message, or a function_call) and what follows
    # it (the user's next message, or the function_call_output).
    turn1 = responses_turn('{"city":"Paris"}')
    turn2 = {**turn1, "input": [
        *turn1["input"],
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny in Paris."}]},
        {"role": "user", "content": "And in Rome?"},
    ]}
    turn3 = {**turn2, "input": [
        *turn2["input"],
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c2", "output": "rainy"},
    ]}
    upstream = FakeUpstream([Answer()])
    async with running_app(config(workers=4), upstream) as app:
        answers = [await post(app, "/v1/responses", turn) for turn in (turn1, turn2, turn3)]
    assert all(a.status == 200 for a in answers)
    assert {a.headers["x-kvroute-worker"] for a in answers} == {answers[0].headers["x-kvroute-worker"]}
    assert [a.headers["x-kvroute-route-reason"] for a in answers[1:]] == ["gpu_hit", "gpu_hit"]


async def test_anthropic_turn_two_routes_to_turn_ones_worker_as_a_gpu_hit() -> None:
    turn1 = messages_body(TOOL)
    turn2 = {**turn1, "messages": [
        *turn1["messages"],
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny " * 40}]},
    ]}
    upstream = FakeUpstream([Answer()])
    async with running_app(config(workers=4), upstream) as app:
        first = await post(app, "/v1/messages", turn1)
        second = await post(app, "/v1/messages", turn2)
    assert second.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    assert second.headers["x-kvroute-route-reason"] == "gpu_hit"


@pytest.mark.parametrize("path", ["/v1/messages/count_tokens", "/tokenize", "/detokenize", "/v1/rerank", "/rerank",
                                  "/v2/rerank", "/v1/score", "/score"])
async def test_pass_through_endpoints_are_forwarded_as_sent(path: str) -> None:
    upstream = FakeUpstream([Answer()])
    raw = b'{"model": "fake-model",  "query": "q", "documents": ["b", "a"], "z": {"b": 1, "a": 2}}'
    async with running_app(config(workers=2), upstream) as app:
        response = await post(app, path, raw)
    assert response.status == 200 and response.json() == {"ok": True}
    assert upstream.posts[0].path == path and orjson.loads(upstream.posts[0].body) == orjson.loads(raw)
    assert response.headers["x-kvroute-route-reason"] == "least_loaded"


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/rerank", "/v1/score"])
async def test_pass_throughs_where_vllm_makes_the_model_optional_need_none(path: str) -> None:
    upstream = FakeUpstream([Answer()])
    async with running_app(config(workers=2), upstream) as app:
        response = await post(app, path, {"prompt": "x", "tokens": [1, 2]})
    assert response.status == 200 and upstream.posts[0].path == path


BAD = [
    ("/v1/messages", {"model": MODEL, "max_tokens": 5}, "messages"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": []}, "messages"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ("/v1/messages", {"model": MODEL, "max_tokens": "5", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5, "system": 3, "messages": [{"role": "user", "content": "x"}]}, "system"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5, "system": [{"type": "image"}], "messages": [{"role": "user"}]}, "system"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5, "tools": {}, "messages": [{"role": "user", "content": "x"}]}, "tools"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ("/v1/messages/count_tokens", {"messages": []}, "model"),
    ("/v1/responses", {"model": MODEL}, "input"),
    ("/v1/responses", {"model": MODEL, "input": 5}, "input"),
    ("/v1/responses", {"model": MODEL, "input": ["x"]}, "input"),
    ("/v1/responses", {"model": MODEL, "input": "x", "instructions": ["x"]}, "instructions"),
    ("/v1/responses", {"model": MODEL, "input": "x", "tools": "t"}, "tools"),
    ("/v1/responses", {"model": MODEL, "input": "x", "stream": "yes"}, "stream"),
    ("/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": 7}, "previous_response_id"),
    ("/v1/responses", {"model": MODEL, "input": [{"role": []}]}, "role"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": {}}]}]}, "type"),
    ("/tokenize", {"model": 7, "prompt": "x"}, "model"),
    ("/v1/embeddings", {"input": "x"}, "model"),
]


@pytest.mark.parametrize(("path", "body", "field"), BAD, ids=[f"{p}:{f}" for p, _, f in BAD])
async def test_bad_input_gets_a_400_in_the_endpoints_shape(path: str, body: dict, field: str) -> None:
    upstream = FakeUpstream([Answer()])
    async with running_app(config(workers=1), upstream) as app:
        response = await post(app, path, body)
    assert response.status == 400 and not upstream.posts
    error = response.json()
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert field in error["error"]["message"]
    else:
        assert error["error"]["type"] == "invalid_request_error" and field in error["error"]["message"]


async def test_anthropic_errors_have_anthropic_types() -> None:
    upstream = FakeUpstream([Answer(status=503, chunks=(b"busy",))])
    async with running_app(config(workers=1, max_attempts=1), upstream) as app:
        unknown = await post(app, "/v1/messages", {**messages_body(TOOL), "model": "nope"})
        failed = await post(app, "/v1/messages", messages_body(TOOL))
        garbage = await post(app, "/v1/messages/count_tokens", b"{not json")
    assert unknown.status == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert failed.status == 502 and failed.json() == {"type": "error", "error": {"type": "api_error", "message": failed.json()["error"]["message"]}}
    assert garbage.status == 400 and garbage.json()["error"]["type"] == "invalid_request_error"


async def test_anthropic_client_key_as_x_api_key_and_401_in_anthropic_shape() -> None:
    upstream = FakeUpstream([Answer()])
    async with running_app(config(workers=1, api_keys=["client-key-0123456789"]), upstream) as app:
        missing = await AsgiCall(app, "/v1/messages", messages_body(TOOL)).start().finish()
        wrong = await AsgiCall(app, "/v1/messages", messages_body(TOOL), [(b"x-api-key", b"nope")]).start().finish()
        ok = await AsgiCall(app, "/v1/messages", messages_body(TOOL), [(b"x-api-key", b"client-key-0123456789")]).start().finish()
        tokenize = await AsgiCall(app, "/tokenize", {"model": MODEL, "prompt": "x"}).start().finish()
        responses = await AsgiCall(app, "/v1/responses", {"model": MODEL, "input": "x"}).start().finish()
    for refused in (missing, wrong):
        assert refused.status == 401
        assert refused.json() == {"type": "error", "error": {"type": "authentication_error", "message": refused.json()["error"]["message"]}}
    assert tokenize.status == 401 and tokenize.json()["error"]["code"] == "invalid_api_key"
    assert responses.status == 401 and responses.json()["error"]["type"] == "authentication_error"
    assert ok.status == 200 and len(upstream.posts) == 1
    assert all(k != b"x-api-key" for k, _ in upstream.posts[0].headers)  # the client's key is not forwarded


@pytest.mark.parametrize(
    ("path", "body", "tail"),
    [
        ("/v1/responses", {"model": MODEL, "input": "x", "stream": True},
         b'event: error\ndata: {"type":"error","code":"stream_interrupted","message":'),
        ("/v1/messages", {**messages_body(TOOL), "stream": True},
         b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":'),
    ],
    ids=["responses", "messages"],
)
async def test_stream_broken_after_first_byte_ends_in_the_apis_own_error_event(path: str, body: dict, tail: bytes) -> None:
    events = [b"event: response.created\ndata: {}\n\n"]
    upstream = FakeUpstream([Answer(chunks=events, headers=SSE, error_after_chunks=UpstreamError("reset"))])
    async with running_app(config(workers=1), upstream) as app:
        response = await post(app, path, body)
    assert response.status == 200 and response.body.startswith(events[0])
    rest = response.body[len(events[0]):]
    assert rest.startswith(tail) and rest.endswith(b"\n\n") and b"[DONE]" not in rest


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ([(b"x-session-id", b"h1"), (b"x-session-affinity", b"h2")], {"prompt_cache_key": "p", "user": "u"}, "h1"),
        ([(b"x-session-affinity", b"h2")], {"prompt_cache_key": "p", "metadata": {"user_id": "m"}}, "h2"),
        ([], {"prompt_cache_key": "p", "metadata": {"user_id": "m"}, "user": "u"}, "p"),
        ([], {"metadata": {"user_id": "m"}, "user": "u"}, "m"),
        ([], {"prompt_cache_key": 5, "metadata": "x", "user": "u"}, "u"),
        ([], {}, None),
    ],
)
def test_session_key_takes_the_first_hint_in_order(headers: list, body: dict, expected: str | None) -> None:
    from router.proxy.exchange import Exchange, session_key

    ex = Exchange({"path": "/v1/messages", "headers": headers}, None, 0.0)
    assert session_key(ex, body) == expected


async def test_wrong_method_on_messages_is_a_405_in_anthropic_shape() -> None:
    async with running_app(config(workers=1), FakeUpstream([Answer()])) as app:
        call = AsgiCall(app, "/v1/messages", b"")
        call.scope["method"] = "GET"
        response = await call.start().finish()
    assert response.status == 405 and response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["type"] == "error"
