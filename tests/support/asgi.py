"""In-process proxy tests without sockets: a scripted fake of the upstream client, the real
app wired to it, and an ASGI driver that can stream and disconnect.

`FakeUpstream` implements the forwarding client's interface (router/proxy/upstream.py:
`post(base_url, path, headers, body)` -> a response with `status`, `headers`, `read()`,
`chunks()`, `aclose()`) and plays one scripted `Answer` per post, in order. `running_app`
builds `router.app.build_app(config)` with it (health checks answered by an httpx
MockTransport, so every configured worker is up) and runs the lifespan. `AsgiCall` drives
one request through `app(scope, receive, send)`: the test sees each message sent as it is
sent and can make the client disconnect at any point.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from router.app import KvrouteApp, build_app
from router.config import RouterConfig
from router.proxy.upstream import Headers, UpstreamError

MODEL = "fake-model"


@dataclass
class Answer:
    """What the fake worker does with one request."""

    status: int = 200
    chunks: Sequence[bytes] = (b'{"ok": true}',)
    """The body, in the pieces `chunks()` yields (`read()` joins them)."""
    headers: Headers = field(default_factory=lambda: [(b"content-type", b"application/json")])
    post_error: UpstreamError | None = None
    """Raised by `post()` itself (e.g. UpstreamConnectError: the worker is unreachable)."""
    error_after_chunks: UpstreamError | None = None
    """Raised once every chunk has been yielded (the connection broke mid-stream)."""
    hold_after_chunks: bool = False
    """After the chunks, wait until closed (a worker still generating)."""


class FakeResponse:
    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.status = answer.status
        self.headers = list(answer.headers)
        self.closed = False
        self._closed = asyncio.Event()

    async def read(self) -> bytes:
        return b"".join(self.answer.chunks)

    async def chunks(self) -> AsyncIterator[bytes]:
        for chunk in self.answer.chunks:
            yield chunk
        if self.answer.error_after_chunks is not None:
            raise self.answer.error_after_chunks
        if self.answer.hold_after_chunks:
            await self._closed.wait()

    async def aclose(self) -> None:
        self.closed = True
        self._closed.set()


@dataclass
class Post:
    base_url: str
    path: str
    headers: Headers
    body: bytes
    method: str = "POST"


class FakeUpstream:
    """The forwarding client, scripted: the n-th post gets `answers[n]` (the last one repeats)."""

    def __init__(self, answers: Sequence[Answer]) -> None:
        self.answers = list(answers)
        self.posts: list[Post] = []
        self.responses: list[FakeResponse] = []
        self.closed = False

    async def post(self, base_url: str, path: str, headers: Headers, body: bytes) -> FakeResponse:
        return await self.request("POST", base_url, path, headers, body)

    async def request(self, method: str, base_url: str, path: str, headers: Headers, body: bytes = b"") -> FakeResponse:
        self.posts.append(Post(base_url, path, headers, body, method))
        answer = self.answers[min(len(self.posts), len(self.answers)) - 1]
        if answer.post_error is not None:
            raise answer.post_error
        response = FakeResponse(answer)
        self.responses.append(response)
        return response

    async def aclose(self) -> None:
        self.closed = True


def healthy_workers(model: str = MODEL) -> httpx.AsyncClient:
    """A health-check client to which every worker is up and serves `model`."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": model, "object": "model"}]})
        return httpx.Response(200, json={"status": "ok"})

    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


@contextlib.asynccontextmanager
async def running_app(config: RouterConfig, upstream: FakeUpstream) -> AsyncIterator[KvrouteApp]:
    """The real app, forwarding through `upstream`, inside its lifespan."""
    app = build_app(config, upstream=upstream, health_client=healthy_workers())
    async with app.lifespan(app.api):
        yield app


def chat_body(stream: bool = False, content: str = "hi") -> dict[str, Any]:
    return {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": content}]}


@dataclass
class AsgiResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


class AsgiCall:
    """One POST through an ASGI app, as a server would make it, with the client's side in
    the test's hands: `next_message()` waits for what the app sends, `disconnect()` makes
    the client go away."""

    def __init__(
        self, app: Any, path: str, body: dict[str, Any] | bytes, headers: Sequence[tuple[bytes, bytes]] = (),
        method: str = "POST",
    ) -> None:
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        self.app = app
        self.scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
            "headers": [
                (b"host", b"router.test"), (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode()), *headers,
            ],
        }  # fmt: skip
        self._incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._incoming.put_nowait({"type": "http.request", "body": raw, "more_body": False})
        self._outgoing: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[dict[str, Any]] = []
        self.task: asyncio.Task | None = None

    async def _receive(self) -> dict[str, Any]:
        return await self._incoming.get()

    async def _send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        self._outgoing.put_nowait(message)

    def start(self) -> AsgiCall:
        self.task = asyncio.create_task(self.app(self.scope, self._receive, self._send))
        return self

    async def next_message(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return await asyncio.wait_for(self._outgoing.get(), timeout_s)

    def disconnect(self) -> None:
        self._incoming.put_nowait({"type": "http.disconnect"})

    async def finish(self, timeout_s: float = 5.0) -> AsgiResponse:
        """Wait for the app to return; the response as the client received it."""
        assert self.task is not None, "start() first"
        await asyncio.wait_for(self.task, timeout_s)
        start = next(m for m in self.sent if m["type"] == "http.response.start")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]}
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        return AsgiResponse(start["status"], headers, body)


async def post(app: Any, path: str, body: dict[str, Any] | bytes, timeout_s: float = 5.0) -> AsgiResponse:
    """One whole request: send it, wait for the whole answer."""
    return await AsgiCall(app, path, body).start().finish(timeout_s)
