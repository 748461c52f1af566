"""Timeouts and retries over real loopback HTTP: connect, first byte, idle gap, total, and
the retry budget. Each case makes a worker misbehave in one way and checks what the client
sees (the request still succeeds elsewhere, or a stream ends with an error event)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx

from loadtests.support.routerproc import RouterProcess
from tests.support.upstream import RecordingUpstream, UpstreamBehaviour

CHAT = {"model": "rec-model", "messages": [{"role": "user", "content": "hello there"}]}


def sse_events(resp: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


def stream(url: str, timeout: float = 10.0) -> tuple[int, list[str], str]:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=timeout) as resp:
        return resp.status_code, sse_events(resp), resp.headers.get("x-kvroute-worker", "")


def test_first_byte_timeout_is_retried_on_the_next_worker() -> None:
    with RecordingUpstream(behaviour=UpstreamBehaviour(first_byte_delay_s=2.5)) as stuck, RecordingUpstream() as good:
        args = ["--first-byte-timeout-s", "0.5", "--breaker-failures", "0", "--outlier-interval-s", "0"]
        with RouterProcess({"stuck": stuck.url, "good": good.url}, policy="round_robin", extra_args=args) as r:
            for _ in range(4):
                t0 = time.monotonic()
                status, events, worker = stream(r.url)
                assert status == 200 and worker == "good"
                assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
                assert time.monotonic() - t0 < 2.0  # one timeout (0.5 s), not the stuck worker's 2.5 s
            assert len(stuck.received) >= 1  # it was tried, timed out, and the request moved on
            assert "kvroute_retries_total 0" not in r.metrics()


def test_idle_gap_ends_the_stream_with_an_error_event() -> None:
    with RecordingUpstream(behaviour=UpstreamBehaviour(chunks=4, chunk_delay_s=30)) as stalls:
        with RouterProcess({"stalls": stalls.url}, extra_args=["--idle-timeout-s", "0.5"]) as r:
            t0 = time.monotonic()
            status, events, _ = stream(r.url)
            elapsed = time.monotonic() - t0
    assert status == 200
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "stream_interrupted" and "timeout" in error["message"]
    assert json.loads(events[0])["object"] == "chat.completion.chunk"  # the first chunk was relayed
    assert elapsed < 10.0


def test_total_timeout_bounds_a_stream_that_keeps_sending() -> None:
    with RecordingUpstream(behaviour=UpstreamBehaviour(chunks=200, chunk_delay_s=0.05)) as chatty:
        with RouterProcess({"chatty": chatty.url}, extra_args=["--total-timeout-s", "1.0"]) as r:
            t0 = time.monotonic()
            status, events, _ = stream(r.url)
            elapsed = time.monotonic() - t0
    assert status == 200
    assert events[-1] == "[DONE]"
    assert "total timeout" in json.loads(events[-2])["error"]["message"]
    assert 5 < len(events) < 150  # cut after about 1 s of a 10 s stream
    assert elapsed < 8.0


class _ModelsHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        body = b'{"object": "list", "data": [{"id": "rec-model", "object": "model"}]}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Backlog0(HTTPServer):
    request_queue_size = 0


def test_connect_timeout_is_retried_and_takes_the_worker_out() -> None:
    """A worker whose accept queue is full: SYNs go unanswered, connects time out."""
    black = _Backlog0(("127.0.0.1", 0), _ModelsHandler)
    thread = threading.Thread(target=black.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{black.server_address[1]}"
    filler: socket.socket | None = None
    try:
        with RecordingUpstream() as good:
            args = ["--connect-timeout-s", "0.3", "--health-interval-s", "60"]
            with RouterProcess({"black": url, "good": good.url}, policy="round_robin", extra_args=args) as r:
                black.shutdown()  # stop accepting; the listening socket stays open
                filler = socket.create_connection(black.server_address, timeout=1)  # fills the queue
                t0 = time.monotonic()
                for _ in range(4):
                    resp = httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=10)
                    assert resp.status_code == 200 and resp.headers["x-kvroute-worker"] == "good"
                assert time.monotonic() - t0 < 5.0
                assert 'kvroute_worker_healthy{worker="black"} 0' in r.metrics()
    finally:
        if filler is not None:
            filler.close()
        black.server_close()


def test_retries_stop_at_max_attempts() -> None:
    with (
        RecordingUpstream(behaviour=UpstreamBehaviour(status=503)) as a,
        RecordingUpstream(behaviour=UpstreamBehaviour(status=503)) as b,
        RecordingUpstream(behaviour=UpstreamBehaviour(status=503)) as c,
    ):
        args = ["--max-attempts", "2", "--breaker-failures", "0"]
        with RouterProcess({"a": a.url, "b": b.url, "c": c.url}, extra_args=args) as r:
            for i in range(3):
                resp = httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=10)
                assert resp.status_code == 502
                assert resp.json()["error"]["code"] == "upstream_unavailable"
                assert len(a.received) + len(b.received) + len(c.received) == 2 * (i + 1)
