"""A deliberately fast OpenAI-compatible upstream for router overhead benchmarks.

It answers at once: `/v1/chat/completions` and `/v1/completions` without streaming return a
fixed-size completion; with `"stream": true` they return `max_tokens` SSE chunks (default 40),
each in its own HTTP chunked-encoding frame and its own socket write, as vLLM flushes one
token event at a time. For model `fast-model` the chunks go out as fast as the reader takes
them (one chunk per active stream per turn of the event loop, so concurrent streams
interleave); for model `paced-model` one chunk per stream every `--paced-ms` (25 ms: 40
tokens/s), all streams in the same tick, like a vLLM engine step emitting one token for
every running sequence. `/health`, `/v1/models` and what sglang-router and vllm-router ask
a worker (`/server_info`, `/model_info`, vLLM's render and tokenize endpoints) are answered.

It is a raw asyncio protocol on uvloop with httptools parsing, pre-built responses and one
pump per pace writing all streams' chunks (no task per stream), so a request costs it a few
microseconds: what a benchmark then measures is the router in front of it. One process
listens on several ports (one per simulated worker); several processes can share them
(SO_REUSEPORT) if one core is not enough.

    python -m loadtests.benchmark.fast_upstream --port 9001 --port 9002 [--model fast-model] [--paced-ms 25]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import signal
import socket
import sys

import httptools
import orjson

DEFAULT_MODEL = "fast-model"
PACED_MODEL = "paced-model"
DEFAULT_PACED_MS = 25.0
DEFAULT_CHUNKS = 40
MAX_CHUNKS = 100_000
# Past this many bytes buffered in the kernel+transport, a stream waits for the reader:
# the upstream must not turn a slow router into unbounded memory here.
WRITE_HIGH_WATER = 256 * 1024


def raise_fd_limit() -> int:
    """Raise the soft open-files limit to the hard one (1,024 connections need 2,048+ fds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
    return soft


class Responses:
    """Every byte string the upstream sends, built once."""

    def __init__(self, model: str) -> None:
        self.model = model
        completion = orjson.dumps(
            {
                "id": "chatcmpl-fast", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * 20},
                             "finish_reason": "stop", "logprobs": None}],
                "usage": {"prompt_tokens": 64, "completion_tokens": 20, "total_tokens": 84},
            }
        )
        self.completion = _whole(200, b"application/json", completion)
        models = orjson.dumps(
            {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "fast",
                                         "root": m, "max_model_len": 131072} for m in (model, PACED_MODEL)]}
        )
        self.models = _whole(200, b"application/json", models)
        # sglang-router asks a worker for its model/server info at registration.
        self.model_info = _whole(200, b"application/json", orjson.dumps(
            {"model_path": model, "tokenizer_path": model, "is_generation": True, "served_model_name": model}
        ))
        self.server_info = _whole(200, b"application/json", orjson.dumps(
            {"model_path": model, "served_model_name": model, "dp_size": 1, "tp_size": 1,
             "max_total_num_tokens": 1_000_000, "version": "fast"}
        ))
        self.ok_empty = _whole(200, b"text/plain", b"")
        self.metrics = _whole(200, b"text/plain; version=0.0.4",
                              b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
        self.not_found = _whole(404, b"application/json", b'{"error":{"message":"not found","type":"invalid_request_error","code":"not_found"}}')
        self.bad_request = _whole(400, b"application/json", b'{"error":{"message":"bad json","type":"invalid_request_error","code":"invalid_json"}}')
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        self._frames: list[bytes] = []
        self._token_ids: dict[tuple[int, bool], bytes] = {}
        self.unknown: set[tuple[bytes, bytes]] = set()
        self.stream_tail = _frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"

    def token_ids(self, n: int, tokenize: bool) -> bytes:
        answer = self._token_ids.get((n, tokenize))
        if answer is None:
            ids = list(range(1000, 1000 + n))
            body = {"count": n, "max_model_len": 131072, "tokens": ids} if tokenize else {"token_ids": ids, "features": None}
            answer = self._token_ids[(n, tokenize)] = _whole(200, b"application/json", orjson.dumps(body))
        return answer

    def frame(self, i: int) -> bytes:
        """The i-th token event as one chunked-encoding frame (about 230 bytes, like vLLM's)."""
        while len(self._frames) <= i:
            n = len(self._frames)
            event = {
                "id": "chatcmpl-fast", "object": "chat.completion.chunk", "created": 0, "model": self.model,
                "choices": [{"index": 0, "delta": {"content": f" tok{n}"}, "logprobs": None, "finish_reason": None}],
            }
            self._frames.append(_frame(b"data: " + orjson.dumps(event) + b"\n\n"))
        return self._frames[i]


def _whole(status: int, content_type: bytes, body: bytes) -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}[status]
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (status, reason, content_type, len(body))
        + body
    )


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class UpstreamProtocol(asyncio.Protocol):
    __slots__ = ("_body", "_keep_alive", "_parser", "_pumps", "_responses", "_transport", "_url", "paused")

    def __init__(self, responses: Responses, pumps: dict[bool, Pump]) -> None:
        self._responses = responses
        self._pumps = pumps
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []
        self.paused = False
        self._keep_alive = True

    # -- transport callbacks -------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._transport.write(self._responses.bad_request)  # type: ignore[union-attr]
            self._transport.close()  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        return None  # the pump drops streams whose transport is closing

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    # -- parser callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()
        method = self._parser.get_method()
        path = self._url.split(b"?", 1)[0]
        r = self._responses
        t = self._transport
        assert t is not None
        if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions", b"/generate"):
            try:
                body = orjson.loads(b"".join(self._body))
            except orjson.JSONDecodeError:
                self._send(r.bad_request)
                return
            if isinstance(body, dict) and body.get("stream") is True:
                chunks = body.get("max_tokens") or body.get("max_completion_tokens") or DEFAULT_CHUNKS
                chunks = min(max(int(chunks), 0), MAX_CHUNKS)
                t.write(r.stream_head)
                self._pumps[body.get("model") == PACED_MODEL].add(_Stream(self, t, chunks))
                return
            self._send(r.completion)
            return
        if method == b"GET" or method == b"HEAD":
            answer = {
                b"/v1/models": r.models,
                b"/models": r.models,
                b"/get_model_info": r.model_info,
                b"/model_info": r.model_info,
                b"/get_server_info": r.server_info,
                b"/server_info": r.server_info,
                b"/metrics": r.metrics,
            }.get(path)
            if answer is None and path in (b"/health", b"/health_generate", b"/ping", b"/liveness", b"/readiness", b"/version"):
                answer = r.ok_empty
            if answer is not None:
                self._send(answer)
                return
        if method == b"POST" and path in (b"/tokenize", b"/v1/chat/completions/render", b"/v1/completions/render"):
            # vllm-router's cache_aware asks the worker for the prompt's token ids (vLLM's
            # render and tokenize endpoints): answer like vLLM, one token per 4 bytes.
            self._send(r.token_ids(len(b"".join(self._body)) // 4, path == b"/tokenize"))
            return
        key = (method, path)
        if key not in r.unknown:  # once per path: printing per request would cost more than answering
            r.unknown.add(key)
            print(f"fast_upstream: unknown {method.decode()} {path.decode(errors='replace')}", file=sys.stderr, flush=True)
        self._send(r.not_found)

    def _send(self, data: bytes) -> None:
        t = self._transport
        assert t is not None
        t.write(data)
        if not self._keep_alive:
            t.close()

    def stream_done(self) -> None:
        if not self._keep_alive:
            self._transport.close()  # type: ignore[union-attr]


class _Stream:
    __slots__ = ("chunks", "next", "proto", "transport")

    def __init__(self, proto: UpstreamProtocol, transport: asyncio.Transport, chunks: int) -> None:
        self.proto = proto
        self.transport = transport
        self.chunks = chunks
        self.next = 0


class Pump:
    """Writes the next chunk of every active stream once per tick: each turn of the event
    loop (unpaced) or every `interval_s` (paced). A stream whose reader is behind (transport
    paused) skips ticks; one whose connection closed is dropped."""

    def __init__(self, responses: Responses, interval_s: float | None) -> None:
        self.responses = responses
        self.interval_s = interval_s
        self.active: list[_Stream] = []
        self.scheduled = False

    def add(self, stream: _Stream) -> None:
        self.active.append(stream)
        if not self.scheduled:
            self.scheduled = True
            loop = asyncio.get_running_loop()
            if self.interval_s is None:
                loop.call_soon(self.tick)
            else:
                loop.call_later(self.interval_s, self.tick)

    def tick(self) -> None:
        r = self.responses
        still: list[_Stream] = []
        for st in self.active:
            t = st.transport
            if t.is_closing():
                continue
            if st.proto.paused:
                still.append(st)
                continue
            if st.next < st.chunks:
                t.write(r.frame(st.next))
                st.next += 1
                still.append(st)
            else:
                t.write(r.stream_tail)
                st.proto.stream_done()
        self.active = still
        self.scheduled = bool(still)
        if still:
            loop = asyncio.get_running_loop()
            if self.interval_s is None:
                loop.call_soon(self.tick)
            else:
                loop.call_later(self.interval_s, self.tick)


async def serve(ports: list[int], host: str, model: str, paced_ms: float = DEFAULT_PACED_MS) -> None:
    loop = asyncio.get_running_loop()
    responses = Responses(model)
    pumps = {False: Pump(responses, None), True: Pump(responses, paced_ms / 1000)}
    for i in range(200):  # warm the frame cache so no stream pays for building it
        responses.frame(i)
    servers = []
    for port in ports:
        server = await loop.create_server(
            lambda: UpstreamProtocol(responses, pumps), host, port, reuse_port=True, backlog=4096
        )
        servers.append(server)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("fast_upstream: listening on " + ",".join(map(str, ports)), flush=True)
    await stop.wait()
    for server in servers:
        server.close()


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.benchmark.fast_upstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, action="append", required=True, help="port to listen on (repeatable)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--paced-ms", type=float, default=DEFAULT_PACED_MS,
                        help=f"chunk interval of model {PACED_MODEL!r}")
    args = parser.parse_args(argv)
    raise_fd_limit()
    import uvloop

    uvloop.run(serve(args.port, args.host, args.model, args.paced_ms))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
