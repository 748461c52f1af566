"""The endpoint picker in process: ext_proc messages in (as Envoy sends them), the picker's
answers out, the router's real services behind it (workers up by a mocked health check).

Covers the protocol's request side (destination header and `envoy.lb` metadata alike, the
canonical body and its length, credentials, the subset hint, the body modes, trailers),
refusals as immediate responses with the proxy's statuses and bodies, the response side
(served endpoint, a fallback that served, annotations, chunks echoed unchanged), Responses
affinity (a chained request's list is its owner alone), and pass-through requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from router.config_loader import flat_config
from router.epp import messages as m
from router.epp.picker import Picker
from router.epp.protocol import (
    DESTINATION_ENDPOINT,
    LB_NAMESPACE,
    SERVED_ENDPOINT,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from tests.support.asgi import MODEL, FakeUpstream, post, running_app

W0, W1, W2 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
WORKERS = [f"w0=http://{W0}", f"w1=http://{W1}", f"w2=http://{W2}"]
CHAT = "/v1/chat/completions"
SSE_CHUNKS = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n', b"data: [DONE]\n\n"]


class FakeGateway:
    """Envoy's side of one ext_proc stream: the test queues its messages, reads the answers."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self.outbox: asyncio.Queue[pb.ProcessingResponse] = asyncio.Queue()

    async def read(self) -> pb.ProcessingRequest | None:
        return await self.inbox.get()

    async def send(self, *responses: pb.ProcessingResponse | bytes) -> None:
        for response in responses:
            # Serialized answers (the body chunks) are read back as Envoy reads them.
            self.outbox.put_nowait(pb.ProcessingResponse.FromString(response) if isinstance(response, bytes) else response)

    def put(self, *messages: pb.ProcessingRequest | None) -> None:
        for message in messages:
            self.inbox.put_nowait(message)

    async def answer(self, timeout_s: float = 5.0) -> pb.ProcessingResponse:
        return await asyncio.wait_for(self.outbox.get(), timeout_s)


def _struct(fields: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(fields)
    return s


def headers_message(
    path: str = CHAT, method: str = "POST", headers: dict[str, str] | None = None, eos: bool = False,
    subset: Any = None, request_mode: int = m.BODY_FULL_DUPLEX, response_mode: int = m.BODY_FULL_DUPLEX,
) -> pb.ProcessingRequest:  # fmt: skip
    pairs = {":path": path, ":method": method, ":authority": "gw.test", "content-type": "application/json", **(headers or {})}
    http = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
        end_of_stream=eos,
    )
    message = pb.ProcessingRequest(
        request_headers=http,
        protocol_config=pb.ProtocolConfiguration(request_body_mode=request_mode, response_body_mode=response_mode),
    )
    if subset is not None:
        message.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(_struct({SUBSET_KEY: subset}))
    return message


def body_message(body: bytes, eos: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=eos))


def response_headers_message(status: int = 200, served: str | None = W0, sse: bool = True, eos: bool = False) -> pb.ProcessingRequest:
    pairs = {":status": str(status), "content-type": "text/event-stream" if sse else "application/json"}
    http = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
        end_of_stream=eos,
    )
    message = pb.ProcessingRequest(response_headers=http)
    if served is not None:
        message.metadata_context.filter_metadata[LB_NAMESPACE].CopyFrom(_struct({SERVED_ENDPOINT: served}))
    return message


def response_body_message(body: bytes, eos: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=eos))


def set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}


def chat(stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"content": "hello", "role": "user"}], "model": MODEL, "stream": stream, **extra}


@pytest.fixture
async def picker() -> AsyncIterator[Picker]:
    async with running_app(flat_config(workers=WORKERS, policy="cache_aware"), FakeUpstream([])) as app:
        yield Picker(app.services.proxy, app.services.api_keys, app.services.tenants)


async def start(picker: Picker, *messages: pb.ProcessingRequest | None) -> tuple[FakeGateway, asyncio.Task]:
    gateway = FakeGateway()
    gateway.put(*messages)
    return gateway, asyncio.create_task(picker.process(gateway))


async def routed(picker: Picker, body: bytes, **headers_kwargs: Any) -> tuple[FakeGateway, asyncio.Task, pb.ProcessingResponse, bytes]:
    """Headers and body in; the header answer and the body Envoy is to send on, out."""
    gateway, task = await start(picker, headers_message(**headers_kwargs), body_message(body))
    answer = await gateway.answer()
    sent = b""
    while True:
        body_answer = await gateway.answer()
        streamed = body_answer.request_body.response.body_mutation.streamed_response
        sent += streamed.body
        if streamed.end_of_stream:
            return gateway, task, answer, sent


async def test_the_request_goes_out_canonical_to_the_choice_then_its_fallbacks(picker: Picker) -> None:
    raw = b'{"stream": true, "model": "%s", "messages": [{"role": "user", "content": "hello"}]}' % MODEL.encode()
    gateway, task, answer, sent = await routed(picker, raw, headers={"authorization": "Bearer sk-client", "x-api-key": "k"})
    headers = set_headers(answer.request_headers.response.header_mutation)
    endpoints = headers[DESTINATION_ENDPOINT].split(",")
    assert sorted(endpoints) == sorted([W0, W1, W2])  # the choice, then the ranking (max_attempts 3)
    assert answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_ENDPOINT].string_value == headers[DESTINATION_ENDPOINT]
    assert sent == orjson.dumps(picker.proxy.canonical(orjson.loads(raw), "chat"))  # parsed once, canonical bytes
    assert sent != raw
    assert headers["content-length"] == str(len(sent))
    assert headers["accept-encoding"] == "identity"
    assert set(answer.request_headers.response.header_mutation.remove_headers) == {"authorization", "x-api-key"}
    chosen = endpoints[0]
    gateway.put(response_headers_message(served=chosen))
    annotated = set_headers((await gateway.answer()).response_headers.response.header_mutation)
    assert annotated["x-kvroute-worker"] == picker.worker_at(chosen).name
    assert annotated["x-kvroute-route-reason"] == "miss"
    for i, chunk in enumerate(SSE_CHUNKS):
        gateway.put(response_body_message(chunk, eos=i == len(SSE_CHUNKS) - 1))
        echoed = (await gateway.answer()).response_body.response.body_mutation.streamed_response
        assert (echoed.body, echoed.end_of_stream) == (chunk, i == len(SSE_CHUNKS) - 1)  # unchanged
    gateway.put(None)
    await asyncio.wait_for(task, 5)
    assert picker.proxy.loads.inflight(picker.worker_at(chosen).name) == 0
    metrics = picker.proxy.metrics.registry.render()
    assert "kvroute_ttft_seconds_count 1" in metrics


async def test_a_fallback_that_served_takes_the_ticket_and_the_chain(picker: Picker) -> None:
    raw = orjson.dumps(chat(messages=[{"role": "user", "content": "a fallback served this " * 40}]))
    gateway, task, answer, _ = await routed(picker, raw)
    first, second = set_headers(answer.request_headers.response.header_mutation)[DESTINATION_ENDPOINT].split(",")[:2]
    gateway.put(response_headers_message(served=second))
    annotated = set_headers((await gateway.answer()).response_headers.response.header_mutation)
    fallback = picker.worker_at(second)
    assert annotated == {"x-kvroute-worker": fallback.name, "x-kvroute-route-reason": "retry"}
    assert picker.proxy.loads.inflight(fallback.name) == 1
    assert picker.proxy.loads.inflight(picker.worker_at(first).name) == 0
    gateway.put(response_body_message(b"data: [DONE]\n\n", eos=True), None)
    await gateway.answer()
    await asyncio.wait_for(task, 5)
    assert "kvroute_retries_total 1" in picker.proxy.metrics.registry.render()
    # The next turn of this conversation finds its prefix on the worker that served it.
    routed_again = await picker.proxy.decide(orjson.loads(raw), "chat", MODEL, None)
    assert routed_again.decision.worker == fallback.name


async def test_the_subset_hint_narrows_the_choice(picker: Picker) -> None:
    for subset in (W1, [W1]):  # a header copied to metadata, or a list
        _, task, answer, _ = await routed(picker, orjson.dumps(chat()), subset=subset)
        assert set_headers(answer.request_headers.response.header_mutation)[DESTINATION_ENDPOINT] == W1
        task.cancel()
    _, task, answer, _ = await routed(picker, orjson.dumps(chat()), subset=f"{W2}, {W0}")
    assert set(set_headers(answer.request_headers.response.header_mutation)[DESTINATION_ENDPOINT].split(",")) == {W0, W2}
    task.cancel()


@pytest.mark.parametrize("subset", ["", "10.9.9.9:8000"])
async def test_a_subset_with_no_endpoint_of_the_pool_is_503(picker: Picker, subset: str) -> None:
    gateway, task = await start(picker, headers_message(subset=subset), body_message(orjson.dumps(chat())))
    answer = (await gateway.answer()).immediate_response
    await asyncio.wait_for(task, 5)
    assert answer.status.code == 503
    assert orjson.loads(answer.body)["error"]["code"] == "no_healthy_worker"


@pytest.mark.parametrize(
    "raw",
    [b"{not json", orjson.dumps({"messages": []}), orjson.dumps({"model": MODEL, "messages": "hi"}), b"[1, 2]"],
)
async def test_refusals_have_the_proxys_status_and_body(picker: Picker, raw: bytes) -> None:
    expected = None
    async with running_app(flat_config(workers=WORKERS), FakeUpstream([])) as app:
        expected = await post(app, CHAT, raw)
    gateway, task = await start(picker, headers_message(), body_message(raw))
    answer = (await gateway.answer()).immediate_response
    await asyncio.wait_for(task, 5)
    assert (answer.status.code, orjson.loads(answer.body)) == (expected.status, expected.json())
    assert expected.status == 400


async def test_a_body_over_the_limit_is_413_before_its_end(picker: Picker) -> None:
    limit = picker.proxy.settings.max_body_bytes
    gateway, task = await start(picker, headers_message(), body_message(b"x" * (limit // 2), eos=False), body_message(b"x" * (limit // 2 + 1), eos=False))
    answer = (await gateway.answer()).immediate_response
    await asyncio.wait_for(task, 5)
    assert answer.status.code == 413
    assert orjson.loads(answer.body)["error"]["code"] == "request_too_large"


async def test_anthropic_refusals_are_in_anthropics_shape(picker: Picker) -> None:
    gateway, task = await start(picker, headers_message(path="/v1/messages"), body_message(b"{bad"))
    answer = (await gateway.answer()).immediate_response
    await asyncio.wait_for(task, 5)
    assert answer.status.code == 400
    assert orjson.loads(answer.body)["type"] == "error"


async def test_buffered_bodies_get_their_destination_with_the_body(picker: Picker) -> None:
    gateway, task = await start(picker, headers_message(request_mode=m.BODY_BUFFERED, response_mode=m.BODY_NONE))
    assert not (await gateway.answer()).request_headers.response.HasField("header_mutation")  # answered at once
    gateway.put(body_message(orjson.dumps(chat(stream=False))))
    answer = await gateway.answer()
    common = answer.request_body.response
    assert DESTINATION_ENDPOINT in set_headers(common.header_mutation)
    assert common.body_mutation.body == orjson.dumps(picker.proxy.canonical(chat(stream=False), "chat"))
    assert LB_NAMESPACE in answer.dynamic_metadata.fields
    gateway.put(response_headers_message(sse=False), None)
    assert "x-kvroute-worker" in set_headers((await gateway.answer()).response_headers.response.header_mutation)
    await asyncio.wait_for(task, 5)


async def test_request_trailers_end_the_body_and_are_answered(picker: Picker) -> None:
    trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
    gateway, task = await start(picker, headers_message(), body_message(orjson.dumps(chat()), eos=False), trailers)
    kinds = [(await gateway.answer()).WhichOneof("response") for _ in range(3)]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    task.cancel()


async def test_a_whole_answer_passes_unchanged_and_ends_the_ticket(picker: Picker) -> None:
    gateway, task, answer, _ = await routed(picker, orjson.dumps(chat(stream=False)))
    chosen = set_headers(answer.request_headers.response.header_mutation)[DESTINATION_ENDPOINT].split(",")[0]
    body = b'{"id":"x","choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}'
    gateway.put(response_headers_message(served=chosen, sse=False), response_body_message(body[:10]), response_body_message(body[10:], eos=True))
    await gateway.answer()
    parts = [(await gateway.answer()).response_body.response.body_mutation.streamed_response for _ in range(2)]
    assert b"".join(p.body for p in parts) == body and parts[-1].end_of_stream
    gateway.put(None)
    await asyncio.wait_for(task, 5)
    assert picker.proxy.loads.inflight(picker.worker_at(chosen).name) == 0


async def test_a_chained_responses_request_goes_to_its_owner_alone(picker: Picker) -> None:
    body = {"model": MODEL, "input": "hello", "stream": False}
    gateway, task, answer, _ = await routed(picker, orjson.dumps(body), path="/v1/responses")
    owner = set_headers(answer.request_headers.response.header_mutation)[DESTINATION_ENDPOINT].split(",")[0]
    answer_body = orjson.dumps({"id": "resp_owned_1", "object": "response", "output": [], "usage": {"total_tokens": 9}})
    gateway.put(response_headers_message(served=owner, sse=False), response_body_message(answer_body, eos=True), None)
    await gateway.answer()
    await gateway.answer()
    await asyncio.wait_for(task, 5)
    chained = {"model": MODEL, "input": "and then?", "previous_response_id": "resp_owned_1"}
    gateway, task, answer, _ = await routed(picker, orjson.dumps(chained), path="/v1/responses")
    assert set_headers(answer.request_headers.response.header_mutation)[DESTINATION_ENDPOINT] == owner
    task.cancel()
    # GET /v1/responses/{id} goes to the owner too; an unknown id is the proxy's 404.
    gateway, task = await start(picker, headers_message(path="/v1/responses/resp_owned_1", method="GET", eos=True))
    assert set_headers((await gateway.answer()).request_headers.response.header_mutation)[DESTINATION_ENDPOINT] == owner
    task.cancel()
    gateway, task = await start(picker, headers_message(path="/v1/responses/resp_unknown", method="GET", eos=True))
    answer404 = (await gateway.answer()).immediate_response
    assert answer404.status.code == 404
    assert orjson.loads(answer404.body)["error"]["code"] == "response_not_found"
    await asyncio.wait_for(task, 5)


async def test_requests_not_routed_by_body_go_to_the_least_loaded(picker: Picker) -> None:
    gateway, task = await start(picker, headers_message(path="/v1/models", method="GET", eos=True))
    answer = await gateway.answer()
    headers = set_headers(answer.request_headers.response.header_mutation)
    assert len(headers[DESTINATION_ENDPOINT].split(",")) == 3
    assert "content-length" not in headers
    gateway.put(response_headers_message(served=W2, sse=False))
    assert set_headers((await gateway.answer()).response_headers.response.header_mutation)["x-kvroute-worker"] == "w2"
    gateway.put(response_body_message(b'{"data": []}', eos=True), None)
    assert (await gateway.answer()).response_body.response.body_mutation.streamed_response.body == b'{"data": []}'
    await asyncio.wait_for(task, 5)


async def test_the_gateway_going_away_mid_body_is_a_disconnect(picker: Picker) -> None:
    gateway, task = await start(picker, headers_message(), body_message(b'{"model"', eos=False), None)
    await asyncio.wait_for(task, 5)
    assert gateway.outbox.empty()
    assert "kvroute_client_disconnects_total 1" in picker.proxy.metrics.registry.render()


async def test_client_keys_are_checked_as_the_proxy_checks_them() -> None:
    config = flat_config(workers=WORKERS, api_keys=["sk-good"])
    async with running_app(config, FakeUpstream([])) as app:
        picker = Picker(app.services.proxy, app.services.api_keys, app.services.tenants)
        gateway, task = await start(picker, headers_message(headers={"authorization": "Bearer sk-bad"}))
        answer = (await gateway.answer()).immediate_response
        await asyncio.wait_for(task, 5)
        assert answer.status.code == 401
        assert orjson.loads(answer.body)["error"]["code"] == "invalid_api_key"
        gateway, task, _, _ = await routed(picker, orjson.dumps(chat()), headers={"authorization": "Bearer sk-good"})
        task.cancel()


def test_endpoint_lists_follow_max_attempts() -> None:
    async def run() -> None:
        async with running_app(flat_config(workers=WORKERS, max_attempts=1), FakeUpstream([])) as app:
            picker = Picker(app.services.proxy)
            _, task, answer, _ = await routed(picker, orjson.dumps(chat()))
            assert "," not in set_headers(answer.request_headers.response.header_mutation)[DESTINATION_ENDPOINT]
            task.cancel()

    asyncio.run(run())


@pytest.mark.parametrize("size", [0, 1, 127, 128, 20_000, 62_000, 200_001])
@pytest.mark.parametrize("end", [True, False])
@pytest.mark.parametrize("request_side", [True, False])
def test_hand_encoded_body_responses_are_what_protobuf_encodes(size: int, end: bool, request_side: bool) -> None:
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    got = [pb.ProcessingResponse.FromString(raw) for raw in m.streamed_bodies(body, request=request_side, end=end)]
    pieces = [body[i : i + m.MAX_CHUNK] for i in range(0, len(body), m.MAX_CHUNK)] or [b""]
    assert len(got) == len(pieces)
    for i, (response, piece) in enumerate(zip(got, pieces, strict=True)):
        streamed = pb.StreamedBodyResponse(body=piece, end_of_stream=end and i == len(pieces) - 1)
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        want = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common)) if request_side else \
            pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))  # fmt: skip
        assert response == want
        assert m.streamed_body(piece, request=request_side, end=end and i == len(pieces) - 1) == want.SerializeToString()


def test_hand_encoded_header_answers_are_what_protobuf_encodes() -> None:
    endpoints = [W0, W1]
    sets = [(b"accept-encoding", b"identity"), (b"authorization", b"Bearer k")]
    got = pb.ProcessingResponse.FromString(
        m.request_headers_response(m.route_headers(endpoints, 42, sets, ["x-api-key", "cookie"]), m.destination_metadata(endpoints))
    )
    options = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v)) for k, v in
               [(DESTINATION_ENDPOINT, f"{W0},{W1}".encode()), ("content-length", b"42"), ("accept-encoding", b"identity"),
                ("authorization", b"Bearer k")]]  # fmt: skip
    metadata = _struct({LB_NAMESPACE: {DESTINATION_ENDPOINT: f"{W0},{W1}"}})
    want = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=options, remove_headers=["x-api-key", "cookie"]))),
        dynamic_metadata=metadata,
    )  # fmt: skip
    assert got == want
    assert m.request_headers_response() == pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse())).SerializeToString()
    answer = pb.ProcessingResponse.FromString(m.response_headers_response([(b"x-kvroute-worker", b"w0")]))
    assert answer == pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="x-kvroute-worker", raw_value=b"w0"))]))))  # fmt: skip
    buffered = pb.ProcessingResponse.FromString(m.buffered_request_body(b"{}", m.route_headers([W0], None, [], []), m.destination_metadata([W0])))
    assert buffered.request_body.response.body_mutation.body == b"{}"
    assert set_headers(buffered.request_body.response.header_mutation) == {DESTINATION_ENDPOINT: W0}
    assert buffered.dynamic_metadata == _struct({LB_NAMESPACE: {DESTINATION_ENDPOINT: W0}})
    assert pb.ProcessingResponse.FromString(m.trailers_response(request=False)).HasField("response_trailers")
    assert pb.ProcessingResponse.FromString(m.unchanged_body(request=True)).HasField("request_body")


async def test_every_endpoint_tried_before_the_one_that_served_is_taken_out(picker: Picker) -> None:
    gateway, task, answer, _ = await routed(picker, orjson.dumps(chat()))
    first, second, third = set_headers(answer.request_headers.response.header_mutation)[DESTINATION_ENDPOINT].split(",")
    gateway.put(response_headers_message(served=third))
    annotated = set_headers((await gateway.answer()).response_headers.response.header_mutation)
    assert annotated == {"x-kvroute-worker": picker.worker_at(third).name, "x-kvroute-route-reason": "retry"}
    gateway.put(response_body_message(b"data: [DONE]\n\n", eos=True), None)
    await gateway.answer()
    await asyncio.wait_for(task, 5)
    assert not picker.worker_at(first).healthy and not picker.worker_at(second).healthy
    assert picker.worker_at(third).healthy
