"""A small recording OpenAI-compatible upstream on a real loopback port, for tests that
need to see the exact bytes and headers a worker receives, or to misbehave on purpose."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadtests.support.routerproc import free_port


@dataclass
class Recorded:
    path: str
    body: bytes
    headers: dict[str, str]


@dataclass
class UpstreamBehaviour:
    status: int = 200
    chunks: int = 3
    chunk_delay_s: float = 0.0
    first_byte_delay_s: float = 0.0
    break_after_chunks: int | None = None
    """Drop the connection after this many chunks (a worker dying mid-stream)."""


@dataclass
class RecordingUpstream:
    model: str = "rec-model"
    behaviour: UpstreamBehaviour = field(default_factory=UpstreamBehaviour)
    received: list[Recorded] = field(default_factory=list)
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _app(self) -> Starlette:
        async def record(request: Request) -> bytes:
            body = await request.body()
            self.received.append(Recorded(request.url.path, body, dict(request.headers)))
            return body

        async def completions(request: Request) -> Response:
            body = orjson.loads(await record(request))
            b = self.behaviour
            if b.first_byte_delay_s:
                await asyncio.sleep(b.first_byte_delay_s)
            if b.status != 200:
                return JSONResponse({"error": {"message": "injected", "type": "server_error", "code": b.status}}, b.status)
            if not body.get("stream"):
                return JSONResponse(
                    {"id": "x", "object": "chat.completion", "created": 0, "model": self.model,
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
                )

            async def events():
                for i in range(b.chunks):
                    if b.break_after_chunks is not None and i >= b.break_after_chunks:
                        raise RuntimeError("injected mid-stream failure")
                    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": self.model,
                             "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                    if b.chunk_delay_s:
                        await asyncio.sleep(b.chunk_delay_s)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        async def embeddings(request: Request) -> Response:
            await record(request)
            return JSONResponse({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}], "model": self.model})

        async def messages(request: Request) -> Response:
            # Anthropic Messages, non-streaming: enough for an SDK client to parse the reply.
            await record(request)
            return JSONResponse(
                {"id": "msg_rec", "type": "message", "role": "assistant", "model": self.model,
                 "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn", "stop_sequence": None,
                 "usage": {"input_tokens": 1, "output_tokens": 1}}
            )

        async def models(_request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "test"}]})

        async def health(_request: Request) -> Response:
            return Response(status_code=200)

        async def not_found(_request: Request, _exc: Exception) -> Response:
            # An OpenAI-style error, the shape vLLM answers its own errors in.
            error = {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404}
            return JSONResponse({"error": error}, status_code=404)

        return Starlette(exception_handlers={404: not_found}, routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", health),
        ])

    def __enter__(self) -> RecordingUpstream:
        config = uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="error", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("recording upstream did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
