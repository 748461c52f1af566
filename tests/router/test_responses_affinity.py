"""Stateful Responses affinity (router/proxy/stateful.py), in process against workers that
store responses the way vLLM does: each worker holds the responses it produced, and answers
404 to a `previous_response_id` (or a GET/DELETE by id) it does not hold.

Covers: learning the owner from a whole body and from a stream (its id split across
chunks); pinning chained requests and the by-id endpoints to the owner; no retry on
another worker; `store: false`; unknown id -> 404 `response_not_found`; owner drained or
failing -> 503 `response_owner_unavailable`; the GPU-hit prediction in /debug/route; two
router apps sharing one Redis agree on the owner. And the stream id scanner itself.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from cache_client.response_owners import OwnerRecord
from router.config import RouterConfig
from router.config_loader import flat_config
from router.proxy.stateful import SCAN_LIMIT, ResponseIdScanner
from router.proxy.upstream import Headers, UpstreamConnectError
from router.workers import WorkerSpec
from tests.support.asgi import MODEL, AsgiCall, post, running_app
from tests.support.system_redis import SYSTEM_REDIS, delete_prefix

RESPONSES = "/v1/responses"
ADMIN = "admin-affinity-token-1234"
JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream")]


class StoredResponse:
    def __init__(self, status: int, body: bytes, headers: Headers, pieces: list[bytes] | None = None) -> None:
        self.status = status
        self.headers = headers
        self._pieces = pieces if pieces is not None else [body]

    async def read(self) -> bytes:
        return b"".join(self._pieces)

    async def chunks(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            yield piece

    async def aclose(self) -> None:
        return None


class StoringWorkers:
    """The forwarding client in front of workers that each keep their own response store."""

    def __init__(self, usage_tokens: int = 120) -> None:
        self.stores: dict[str, set[str]] = {}
        self.calls: list[tuple[str, str, str, dict[str, Any] | None]] = []
        """(worker, method, path, JSON body) of every request that reached a worker."""
        self.unreachable: set[str] = set()
        self.usage_tokens = usage_tokens
        self._ids = itertools.count(1)

    async def post(self, base_url: str, path: str, headers: Headers, body: bytes) -> StoredResponse:
        return await self.request("POST", base_url, path, headers, body)

    async def request(self, method: str, base_url: str, path: str, headers: Headers, body: bytes = b"") -> StoredResponse:
        worker = base_url.removeprefix("http://").split(".", 1)[0]
        parsed = orjson.loads(body) if body else None
        self.calls.append((worker, method, path, parsed))
        if worker in self.unreachable:
            raise UpstreamConnectError("ConnectError: refused")
        store = self.stores.setdefault(worker, set())
        if path == RESPONSES:
            return self._create(worker, store, parsed or {})
        response_id = path.split("/")[3].split("?")[0]
        if response_id not in store:
            return _error(404, f"Response with id '{response_id}' not found.")
        if method == "DELETE":
            store.discard(response_id)
        return StoredResponse(200, orjson.dumps({"id": response_id, "object": "response"}), JSON)

    async def aclose(self) -> None:
        return None

    def _create(self, worker: str, store: set[str], body: dict[str, Any]) -> StoredResponse:
        prev = body.get("previous_response_id")
        if prev is not None and prev not in store:
            return _error(404, f"Response with id '{prev}' not found.")  # what vLLM answers elsewhere
        response_id = f"resp_{worker}_{next(self._ids)}"
        if body.get("store", True):
            store.add(response_id)
        usage = {"input_tokens": self.usage_tokens - 20, "output_tokens": 20, "total_tokens": self.usage_tokens}
        answer = {"id": response_id, "object": "response", "status": "completed", "output": [], "usage": usage}
        if not body.get("stream"):
            return StoredResponse(200, orjson.dumps(answer), JSON)
        created = orjson.dumps({"type": "response.created", "sequence_number": 0, "response": {**answer, "usage": None}})
        stream = b"event: response.created\ndata: " + created + b"\n\n"
        # The id split across two chunks, the way a TCP read can cut it.
        cut = stream.index(response_id.encode()) + 5
        completed = orjson.dumps({"type": "response.completed", "response": answer})
        done = b"event: response.completed\ndata: " + completed + b"\n\n"
        return StoredResponse(200, b"", SSE, [stream[:cut], stream[cut:], done])


def _error(status: int, message: str) -> StoredResponse:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}})
    return StoredResponse(status, body, JSON)


def config(workers: int = 4, **overrides: object) -> RouterConfig:
    specs = [WorkerSpec(f"w{i}", f"http://w{i}.test:8000") for i in range(1, workers + 1)]
    return flat_config(workers=specs, health_interval_s=3600.0, outlier_interval_s=0.0, admin_token=ADMIN, **overrides)


def turn(text: str, previous: str | None = None, **extra: object) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "input": [{"role": "user", "content": text}], **extra}
    if previous is not None:
        body["previous_response_id"] = previous
    return body


async def call(app: Any, method: str, path: str) -> Any:
    return await AsgiCall(app, path, b"", method=method).start().finish()


async def test_chained_requests_go_to_the_worker_that_stores_the_previous_response() -> None:
    workers = StoringWorkers()
    async with running_app(config(), workers) as app:
        for chain in range(4):
            first = await post(app, RESPONSES, turn(f"chain {chain} turn 0, with its own words"))
            assert first.status == 200
            owner, previous = first.headers["x-kvroute-worker"], first.json()["id"]
            for t in range(1, 4):
                nxt = await post(app, RESPONSES, turn(f"chain {chain} turn {t}", previous))
                assert nxt.status == 200, nxt.body
                assert nxt.headers["x-kvroute-worker"] == owner
                assert nxt.headers["x-kvroute-route-reason"] == "gpu_hit"
                previous = nxt.json()["id"]
        # Every chained request reached its owner only, once: never a wrong worker's 404.
        assert len(workers.calls) == 16


async def test_owner_learned_from_a_stream_whose_id_is_split_across_chunks() -> None:
    workers = StoringWorkers()
    async with running_app(config(), workers) as app:
        first = await post(app, RESPONSES, turn("stream me", stream=True))
        assert first.status == 200 and b"response.created" in first.body
        owner = first.headers["x-kvroute-worker"]
        response_id = next(iter(workers.stores[owner]))
        # The tokens `response.completed` reported at the stream's end.
        assert await app.proxy.affinity.owners.owner(response_id) == OwnerRecord(owner, 120)
        for _ in range(3):
            nxt = await post(app, RESPONSES, turn("and again", response_id))
            assert nxt.status == 200 and nxt.headers["x-kvroute-worker"] == owner


async def test_unknown_previous_response_is_a_404_in_openai_shape_without_forwarding() -> None:
    workers = StoringWorkers()
    async with running_app(config(), workers) as app:
        response = await post(app, RESPONSES, turn("hello", "resp_never_seen"))
        assert response.status == 404
        error = response.json()["error"]
        assert error["code"] == "response_not_found" and error["type"] == "invalid_request_error"
        assert "resp_never_seen" in error["message"] and "full" in error["message"]
        assert workers.calls == []


async def test_store_false_is_not_learned() -> None:
    workers = StoringWorkers()
    async with running_app(config(), workers) as app:
        first = await post(app, RESPONSES, turn("not stored", store=False))
        assert first.status == 200
        nxt = await post(app, RESPONSES, turn("next", first.json()["id"]))
        assert nxt.status == 404 and nxt.json()["error"]["code"] == "response_not_found"


async def test_owner_failing_before_first_byte_is_not_retried_elsewhere() -> None:
    workers = StoringWorkers()
    async with running_app(config(), workers) as app:
        first = await post(app, RESPONSES, turn("hello"))
        owner = first.headers["x-kvroute-worker"]
        workers.unreachable.add(owner)
        before = len(workers.calls)
        nxt = await post(app, RESPONSES, turn("next", first.json()["id"]))
        assert nxt.status == 503
        assert nxt.json()["error"]["code"] == "response_owner_unavailable"
        assert [c[0] for c in workers.calls[before:]] == [owner]  # one try, on the owner only


async def test_owner_drained_gets_the_documented_error_and_a_resent_input_is_served() -> None:
    workers = StoringWorkers()
    async with running_app(config(), workers) as app:
        first = await post(app, RESPONSES, turn("hello"))
        owner = first.headers["x-kvroute-worker"]
        assert app.fleet is not None
        app.fleet.drain(owner, True)
        before = len(workers.calls)
        nxt = await post(app, RESPONSES, turn("next", first.json()["id"]))
        assert nxt.status == 503
        error = nxt.json()["error"]
        assert error["code"] == "response_owner_unavailable" and "without `previous_response_id`" in error["message"]
        assert nxt.headers.get("x-kvroute-worker") is None and len(workers.calls) == before
        resent = await post(app, RESPONSES, turn("hello and next, the whole conversation"))
        assert resent.status == 200 and resent.headers["x-kvroute-worker"] != owner


async def test_get_cancel_delete_by_id_go_to_the_owner() -> None:
    workers = StoringWorkers()
    async with running_app(config(), workers) as app:
        first = await post(app, RESPONSES, turn("hello"))
        owner, response_id = first.headers["x-kvroute-worker"], first.json()["id"]
        path = f"{RESPONSES}/{response_id}"
        got = await call(app, "GET", path)
        assert got.status == 200 and got.json()["id"] == response_id and got.headers["x-kvroute-worker"] == owner
        assert (await call(app, "POST", path + "/cancel")).status == 200
        assert (await call(app, "GET", path + "/input_items")).status == 200
        assert [(c[0], c[1]) for c in workers.calls[1:]] == [(owner, "GET"), (owner, "POST"), (owner, "GET")]
        assert (await call(app, "PUT", path)).status == 405
        assert (await call(app, "DELETE", path)).status == 200
        gone = await call(app, "GET", path)
        assert gone.status == 404 and gone.json()["error"]["code"] == "response_not_found"
        assert (await call(app, "GET", f"{RESPONSES}/resp_unknown")).json()["error"]["code"] == "response_not_found"


async def test_debug_route_predicts_a_gpu_hit_on_the_owner_for_the_stored_tokens() -> None:
    workers = StoringWorkers(usage_tokens=345)
    async with running_app(config(), workers) as app:
        first = await post(app, RESPONSES, turn("hello"))
        owner = first.headers["x-kvroute-worker"]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router.test") as client:
            resp = await client.post(
                "/debug/route", params={"path": RESPONSES}, json=turn("next", first.json()["id"]),
                headers={"authorization": f"Bearer {ADMIN}"},
            )
        assert resp.status_code == 200, resp.text
        chosen = resp.json()["chosen"]
        assert chosen["worker"] == owner and chosen["reason"] == "gpu_hit" and chosen["cached_tokens"] == 345
        assert resp.json()["ranking"] == [owner]


@pytest.mark.redis
async def test_two_routers_sharing_redis_agree_on_the_owner() -> None:
    prefix = f"test-affinity-{secrets.token_hex(4)}"
    workers = StoringWorkers()
    try:
        async with running_app(config(redis=SYSTEM_REDIS, redis_prefix=prefix), workers) as a, \
                running_app(config(redis=SYSTEM_REDIS, redis_prefix=prefix), workers) as b:
            assert await a.index.connect() and await b.index.connect()  # type: ignore[attr-defined]
            previous = None
            owner = None
            for t, app in enumerate([a, b, a, b, b]):
                response = await post(app, RESPONSES, turn(f"turn {t}", previous))
                assert response.status == 200, response.body
                owner = owner or response.headers["x-kvroute-worker"]
                assert response.headers["x-kvroute-worker"] == owner
                previous = response.json()["id"]
            got = await call(b, "GET", f"{RESPONSES}/{previous}")
            assert got.status == 200 and got.headers["x-kvroute-worker"] == owner
    finally:
        delete_prefix(SYSTEM_REDIS, "{" + prefix + "}")


# -- the stream id scanner --------------------------------------------------------------------
CREATED = b'event: response.created\ndata: {"type":"response.created","sequence_number":0,"response":{"id":"resp_abc123","object":"response"}}\n\n'


@pytest.mark.parametrize("cut", [1, 30, CREATED.index(b"resp_abc") + 4, CREATED.index(b"resp_abc123") + 11])
def test_scanner_finds_an_id_split_across_chunks(cut: int) -> None:
    scanner = ResponseIdScanner()
    assert scanner.feed(CREATED[:cut]) is None and not scanner.done
    assert scanner.feed(CREATED[cut:]) == "resp_abc123" and scanner.done


def test_scanner_gives_up_without_an_id_and_on_a_huge_first_chunk() -> None:
    scanner = ResponseIdScanner()
    assert scanner.feed(b'data: {"type":"response.in_progress"}\n\n') is None and not scanner.done
    huge = ResponseIdScanner()
    assert huge.feed(b"event: response.created\ndata: " + b"x" * (2 * SCAN_LIMIT) + CREATED) is None
    assert huge.done and huge.buffer == b""
    assert huge.feed(CREATED) is None  # past the limit: never looked at again
