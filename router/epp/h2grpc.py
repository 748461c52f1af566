"""A small gRPC server over HTTP/2 on the router's event loop, for the picker's two services:
Envoy's ext_proc stream and the gRPC health protocol.

Why not grpcio's server: an ext_proc exchange is about a dozen small messages per request,
each on the critical path (Envoy waits for the answer to the request's body, its response
headers and every response chunk). grpcio's asyncio server hands each message between its
own polling thread and the event loop: on the 2-core benchmark machine a picker that only
echoed cost ~1.1 ms of CPU and added ~1.5 ms at concurrency 1 (its sync server did no
better; nor did the h2 library, ~0.9 ms of CPU: it is built for generality). This server
does only what these services need, in one place, and answers from the loop that read the
message: a few microseconds a frame.

What it implements of HTTP/2 (RFC 9113) and gRPC's HTTP/2 protocol:
* the connection preface, SETTINGS (acknowledged; the peer's initial window and maximum
  frame size honoured), PING, GOAWAY, WINDOW_UPDATE, RST_STREAM; PRIORITY ignored;
* HEADERS and CONTINUATION, decoded with the `hpack` package (the peer's dynamic table);
  the server's own headers are encoded as literals without indexing (no table to keep);
* DATA, padded or not, split into gRPC's length-prefixed messages (uncompressed only);
* flow control both ways: the server opens its receive windows to the maximum and tops the
  connection's up as data is consumed; it sends within the peer's windows and queues the
  rest until a WINDOW_UPDATE;
* a response is HEADERS (`:status: 200`, `content-type: application/grpc`), messages, then
  trailers (`grpc-status`); unknown methods get UNIMPLEMENTED.

Plaintext (h2c, prior knowledge, as Envoy dials gRPC clusters) or TLS with ALPN `h2`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from hpack.exceptions import HPACKError
from hpack.huffman_table import decode_huffman
from hpack.table import HeaderTable

log = logging.getLogger("kvroute.epp")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x4, 0x5
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, CANCEL, COMPRESSION_ERROR = 0x0, 0x1, 0x3, 0x8, 0x9
GRPC_OK, GRPC_UNKNOWN, GRPC_UNIMPLEMENTED, GRPC_UNAVAILABLE = 0, 2, 12, 14

_HEADER = struct.Struct(">I")  # the 4-byte length in a frame's first 3 (with the type) and a gRPC prefix
_FRAME = struct.Struct(">BHBBI")  # length (1 + 2 bytes), type, flags, stream id


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman coding."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([value])
    out = bytearray([limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# `:status: 200` is entry 8 of HPACK's static table; `content-type` is entry 31.
RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + _hpack_int(16, 7) + b"application/grpc"
_TRAILERS = {code: _literal(b"grpc-status", str(code).encode()) for code in (GRPC_OK, GRPC_UNKNOWN, GRPC_UNIMPLEMENTED, GRPC_UNAVAILABLE)}


def trailers(code: int, message: str = "") -> bytes:
    block = _TRAILERS.get(code) or _literal(b"grpc-status", str(code).encode())
    if message:
        block += _literal(b"grpc-message", message.encode("ascii", "replace"))
    return block


class HpackDecoder:
    """HPACK decoding (RFC 7541) of the headers a client sends: its dynamic table kept in
    step, Huffman-coded strings decoded once and remembered (a client sends the same few
    values on every stream: the `hpack` package's decoder, pure Python, spent ~70 µs a
    stream decoding them again)."""

    STATIC = HeaderTable.STATIC_TABLE

    def __init__(self, max_size: int = 4096) -> None:
        self.entries: list[tuple[bytes, bytes]] = []
        """The dynamic table, newest first."""
        self.size = 0
        self.max_size = max_size
        self.limit = max_size
        """The most the client may set the table to (our SETTINGS_HEADER_TABLE_SIZE: the default)."""
        self.huffman: dict[bytes, bytes] = {}

    def _int(self, block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
        mask = (1 << prefix_bits) - 1
        value = block[i] & mask
        i += 1
        if value < mask:
            return value, i
        shift = 0
        while True:
            byte = block[i]
            i += 1
            value += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value, i
            if shift > 28:
                raise HPACKError("integer too large")

    def _string(self, block: bytes, i: int) -> tuple[bytes, int]:
        huffman = block[i] & 0x80
        length, i = self._int(block, i, 7)
        raw = block[i : i + length]
        if len(raw) != length:
            raise HPACKError("truncated string")
        if not huffman:
            return raw, i + length
        value = self.huffman.get(raw)
        if value is None:
            value = decode_huffman(raw)
            if len(self.huffman) >= 4096:
                self.huffman.clear()
            self.huffman[raw] = value
        return value, i + length

    def _get(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= len(self.STATIC):
            return self.STATIC[index - 1]
        dynamic = index - len(self.STATIC) - 1
        if 0 <= dynamic < len(self.entries):
            return self.entries[dynamic]
        raise HPACKError(f"invalid table index {index}")

    def _add(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + 32
        self.entries.insert(0, (name, value))
        self.size += size
        self._evict()

    def _evict(self) -> None:
        while self.size > self.max_size and self.entries:
            name, value = self.entries.pop()
            self.size -= len(name) + len(value) + 32

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        i, n = 0, len(block)
        try:
            while i < n:
                byte = block[i]
                if byte & 0x80:  # indexed field
                    index, i = self._int(block, i, 7)
                    out.append(self._get(index))
                    continue
                if byte & 0xE0 == 0x20:  # dynamic table size update
                    size, i = self._int(block, i, 5)
                    if size > self.limit:
                        raise HPACKError("table size over the limit")
                    self.max_size = size
                    self._evict()
                    continue
                indexing = byte & 0x40
                index, i = self._int(block, i, 6 if indexing else 4)
                if index:
                    name = self._get(index)[0]
                else:
                    name, i = self._string(block, i)
                value, i = self._string(block, i)
                if indexing:
                    self._add(name, value)
                out.append((name, value))
        except IndexError:
            raise HPACKError("truncated header block") from None
        return out


class Call:
    """One gRPC call (one HTTP/2 stream): its request messages as they arrive (`read`: None
    once the client has sent its last) and the server's answers (`send`, then `finish`)."""

    __slots__ = ("buffer", "closed", "conn", "ended", "messages", "method", "pending", "started", "stream_id", "task", "waiter", "window")

    def __init__(self, conn: Connection, stream_id: int, method: str) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.method = method
        self.buffer = bytearray()
        self.messages: list[bytes | None] = []
        self.waiter: asyncio.Future | None = None
        self.started = False
        self.ended = False
        """The client's side is closed (END_STREAM) or the stream was reset."""
        self.closed = False
        """The server's side is closed (trailers sent, or reset)."""
        self.window = conn.peer_initial_window
        self.pending: list[tuple[bool, bytes]] = []
        """Output waiting for the peer's flow-control window, in order: (is trailers, bytes)."""
        self.task: asyncio.Task | None = None

    # -- the client's messages ------------------------------------------------------------
    def _deliver(self, item: bytes | None) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            self.waiter = None
            waiter.set_result(item)
        else:
            self.messages.append(item)

    def _data(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        while len(buffer) >= 5:
            size = _HEADER.unpack_from(buffer, 1)[0]
            if len(buffer) < 5 + size:
                return
            if buffer[0]:
                self.conn.reset(self.stream_id, PROTOCOL_ERROR)  # compressed messages: never negotiated
                return
            self._deliver(bytes(buffer[5 : 5 + size]))
            del buffer[: 5 + size]

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self._deliver(None)

    async def read(self) -> bytes | None:
        """The next request message; None once the client has finished (or gone)."""
        if self.conn.out:
            # What the handler answered leaves now, before it turns to the next message: with
            # messages queued it would not yield to the loop (and its flush) until they ran
            # out, holding a stream's first chunk behind the ones after it.
            self.conn.flush()
        if self.messages:
            return self.messages.pop(0)
        if self.ended:
            return None
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        return await waiter

    # -- the server's answers -------------------------------------------------------------
    def send(self, payload: bytes) -> None:
        """One response message (serialized)."""
        if self.closed:
            return
        conn = self.conn
        if not self.started:
            self.started = True
            conn.write_headers(self.stream_id, RESPONSE_HEADERS, end_stream=False)
        conn.send_data(self, _HEADER.pack(len(payload)).rjust(5, b"\x00") + payload)

    def finish(self, code: int = GRPC_OK, message: str = "") -> None:
        """Trailers: the call's status (HEADERS first if nothing was sent)."""
        if self.closed:
            return
        self.closed = True
        conn = self.conn
        block = trailers(code, message)
        if not self.started:
            self.started = True
            block = RESPONSE_HEADERS + block  # trailers-only
        conn.finish_stream(self, block)


Handler = Callable[[Call], Awaitable[None]]


class Connection(asyncio.Protocol):
    """One client's HTTP/2 connection."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface = False
        self.decoder = HpackDecoder()
        self.calls: dict[int, Call] = {}
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = 16_384
        self.send_window = DEFAULT_WINDOW
        self.recv_consumed = 0
        self.headers_block: tuple[int, int, bytearray] | None = None
        """A HEADERS block awaiting its CONTINUATIONs: (stream id, flags, fragment)."""
        self.last_stream = 0
        self.out: list[bytes] = []
        self.flush_scheduled = False
        self.closing = False

    # -- output -----------------------------------------------------------------------
    def _write(self, data: bytes) -> None:
        self.out.append(data)
        if not self.flush_scheduled:
            # Frames written while handling one read (or one loop turn) leave in one write.
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.out and self.transport is not None and not self.transport.is_closing():
            out, self.out = self.out, []
            self.transport.write(b"".join(out))

    def write_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        self._write(_frame(HEADERS, flags, stream_id, block))

    def send_data(self, call: Call, data: bytes) -> None:
        if call.pending:
            call.pending.append((False, data))
            return
        rest = self._within_windows(call, data)
        if rest:
            call.pending.append((False, rest))

    def _within_windows(self, call: Call, data: bytes) -> bytes:
        """DATA frames for `data` as far as the windows allow; what is left over."""
        view = memoryview(data)
        while view:
            room = min(self.send_window, call.window, self.peer_max_frame)
            if room <= 0:
                return bytes(view)
            piece = bytes(view[:room])
            self._write(_frame(DATA, 0, call.stream_id, piece))
            self.send_window -= len(piece)
            call.window -= len(piece)
            view = view[len(piece) :]
        return b""

    def finish_stream(self, call: Call, block: bytes) -> None:
        if call.pending:
            call.pending.append((True, block))  # after the data it follows
            return
        self.write_headers(call.stream_id, block, end_stream=True)
        self._closed(call)

    def _drain(self, call: Call) -> None:
        """Send what waited for a window, in order, until it runs out again."""
        pending = call.pending
        while pending:
            is_trailers, item = pending[0]
            if is_trailers:
                pending.pop(0)
                self.write_headers(call.stream_id, item, end_stream=True)
                self._closed(call)
                return
            rest = self._within_windows(call, item)
            if rest:
                pending[0] = (False, rest)
                return
            pending.pop(0)

    def _closed(self, call: Call) -> None:
        if call.ended:
            self.calls.pop(call.stream_id, None)

    def reset(self, stream_id: int, code: int) -> None:
        self._write(_frame(RST_STREAM, 0, stream_id, _HEADER.pack(code)))
        call = self.calls.pop(stream_id, None)
        if call is not None:
            call.closed = True
            call._end()

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        settings = struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW)
        self._write(_frame(SETTINGS, 0, 0, settings))
        self._write(_frame(WINDOW_UPDATE, 0, 0, _HEADER.pack(MAX_WINDOW - DEFAULT_WINDOW)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            call.closed = True
            call._end()
            if call.task is not None and not call.task.done():
                call.task.cancel()  # the client is gone: its calls end with it
        self.calls.clear()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        if not self.preface:
            if len(buffer) < len(PREFACE):
                return
            if bytes(buffer[: len(PREFACE)]) != PREFACE:
                self._goaway(PROTOCOL_ERROR)
                return
            del buffer[: len(PREFACE)]
            self.preface = True
        offset = 0
        size = len(buffer)
        try:
            while size - offset >= 9:
                hi, lo, kind, flags, stream_id = _FRAME.unpack_from(buffer, offset)
                length = (hi << 16) | lo
                if size - offset < 9 + length:
                    break
                payload = bytes(buffer[offset + 9 : offset + 9 + length])
                offset += 9 + length
                self._frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
                if self.closing:
                    return
        finally:
            del buffer[:offset]

    # -- frames ---------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.headers_block is not None and kind != CONTINUATION:
            self._goaway(PROTOCOL_ERROR)
            return
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers_frame(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
                self._write(_frame(SETTINGS, ACK, 0))
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, _HEADER.unpack(payload)[0] & 0x7FFFFFFF)
        elif kind == PING:
            if not flags & ACK:
                self._write(_frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            call = self.calls.pop(stream_id, None)
            if call is not None:
                call.closed = True
                call._end()
                if call.task is not None and not call.task.done():
                    call.task.cancel()
        elif kind == GOAWAY:
            self.closing = True
            if self.transport is not None:
                self.transport.close()
        # PRIORITY, PUSH_PROMISE (never sent by clients) and unknown types: ignored.

    def _headers_frame(self, flags: int, stream_id: int, payload: bytes) -> None:
        """A header block's first frame (without its padding and priority): decoded now if
        it is the whole block, else kept until its CONTINUATION frames end it."""
        if flags & PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._headers(stream_id, flags, payload)
        else:
            self.headers_block = (stream_id, flags, bytearray(payload))

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        """More of the header block being received (on its stream only)."""
        if self.headers_block is None or self.headers_block[0] != stream_id:
            self._goaway(PROTOCOL_ERROR)
            return
        self.headers_block[2].extend(payload)
        if flags & END_HEADERS:
            sid, first_flags, block = self.headers_block
            self.headers_block = None
            self._headers(sid, first_flags, bytes(block))

    def _window_update(self, stream_id: int, increment: int) -> None:
        """The client can take `increment` more bytes: on the connection (stream 0) or one
        call. Calls with data waiting for the window send it now."""
        if stream_id == 0:
            self.send_window += increment
            for call in list(self.calls.values()):
                if call.pending:
                    self._drain(call)
        else:
            call = self.calls.get(stream_id)
            if call is not None:
                call.window += increment
                if call.pending:
                    self._drain(call)

    def _settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - len(payload) % 6, 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for call in self.calls.values():
                    call.window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                self.peer_max_frame = value

    def _headers(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            headers = self.decoder.decode(block)
        except HPACKError:
            self._goaway(COMPRESSION_ERROR)
            return
        call = self.calls.get(stream_id)
        if call is not None:  # the client's trailers
            if flags & END_STREAM:
                call._end()
                if call.closed:
                    self.calls.pop(stream_id, None)
            return
        if stream_id <= self.last_stream or stream_id % 2 == 0:
            return  # a stream this connection already saw, or a server-initiated id
        self.last_stream = stream_id
        path = next((v for k, v in headers if k == b":path"), b"").decode("latin-1")
        call = Call(self, stream_id, path)
        self.calls[stream_id] = call
        if flags & END_STREAM:
            call._end()
        handler = self.server.handlers.get(path)
        if handler is None:
            call.finish(GRPC_UNIMPLEMENTED, f"unknown method {path}")
            return
        call.task = asyncio.ensure_future(self.server.run(handler, call))

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        consumed = len(payload)
        if flags & PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        self.recv_consumed += consumed
        if self.recv_consumed > MAX_WINDOW // 2:
            self._write(_frame(WINDOW_UPDATE, 0, 0, _HEADER.pack(self.recv_consumed)))
            self.recv_consumed = 0
        call = self.calls.get(stream_id)
        if call is None or call.ended:
            return
        if payload:
            call._data(payload)
        if flags & END_STREAM:
            call._end()
            if call.closed:
                self.calls.pop(stream_id, None)

    def _goaway(self, code: int) -> None:
        self._write(_frame(GOAWAY, 0, 0, _HEADER.pack(self.last_stream) + _HEADER.pack(code)))
        self.flush()
        self.closing = True
        if self.transport is not None:
            self.transport.close()


class GrpcServer:
    """`handlers`: full method name (`/package.Service/Method`) -> coroutine taking the `Call`."""

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.connections: set[Connection] = set()
        self.server: asyncio.base_events.Server | None = None
        self.calls: set[asyncio.Task] = set()

    async def run(self, handler: Handler, call: Call) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.calls.add(task)
        try:
            await handler(call)
            call.finish(GRPC_OK)
        except asyncio.CancelledError:
            call.finish(GRPC_UNAVAILABLE, "cancelled")
            raise
        except Exception as exc:  # a bug in a handler: the call fails, the server goes on
            log.error("gRPC handler %s failed: %s", call.method, type(exc).__name__)
            call.finish(GRPC_UNKNOWN, "internal error")
        finally:
            self.calls.discard(task)

    async def start(self, host: str, port: int, ssl: Any = None) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: Connection(self), host, port, ssl=ssl, reuse_address=True)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; let the calls in flight end within `grace_s`, then cancel them."""
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn._write(_frame(GOAWAY, 0, 0, _HEADER.pack(conn.last_stream) + _HEADER.pack(NO_ERROR)))
            conn.flush()
        if self.calls:
            _, pending = await asyncio.wait(set(self.calls), timeout=grace_s)
            for task in pending:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*pending, return_exceptions=True)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await self.server.wait_closed()
