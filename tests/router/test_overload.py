"""Overload and shutdown: per-worker in-flight limits, the bounded wait queue, 429 with
Retry-After beyond them, and SIGTERM letting in-flight streams finish."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import httpx

from loadtests.support.routerproc import RouterProcess
from tests.support.upstream import RecordingUpstream, UpstreamBehaviour

CHAT = {"model": "rec-model", "messages": [{"role": "user", "content": "hi"}]}


async def burst(url: str, n: int, timeout: float = 20.0) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=n)) as client:
        return await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=CHAT) for _ in range(n)))


def assert_overloaded(resp: httpx.Response) -> None:
    assert resp.status_code == 429
    assert int(resp.headers["retry-after"]) >= 1
    error = resp.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"


def test_limit_queue_and_429_beyond_them() -> None:
    with RecordingUpstream(behaviour=UpstreamBehaviour(first_byte_delay_s=1.0)) as up:
        args = ["--max-inflight-per-worker", "2", "--queue-size", "2", "--queue-timeout-s", "5"]
        with RouterProcess({"only": up.url}, extra_args=args) as r:
            seen_early: list[int] = []
            threading.Timer(0.6, lambda: seen_early.append(len(up.received))).start()
            responses = asyncio.run(burst(r.url, 8))
            statuses = sorted(resp.status_code for resp in responses)
            assert statuses == [200] * 4 + [429] * 4  # 2 in flight + 2 queued; 4 turned away
            for resp in responses:
                if resp.status_code == 429:
                    assert_overloaded(resp)
            assert seen_early == [2]  # never more than the limit at the worker
            assert len(up.received) == 4
            assert 'kvroute_rejected_total{code="overloaded"} 4' in r.metrics()
            assert "kvroute_queue_depth 0" in r.metrics()


def test_queued_requests_time_out_with_429() -> None:
    with RecordingUpstream(behaviour=UpstreamBehaviour(first_byte_delay_s=1.5)) as up:
        args = ["--max-inflight-per-worker", "1", "--queue-size", "10", "--queue-timeout-s", "0.3"]
        with RouterProcess({"only": up.url}, extra_args=args) as r:
            t0 = time.monotonic()
            responses = asyncio.run(burst(r.url, 3))
            assert sorted(resp.status_code for resp in responses) == [200, 429, 429]
            for resp in responses:
                if resp.status_code == 429:
                    assert_overloaded(resp)
                    assert "no slot freed in time" in resp.json()["error"]["message"]
            assert time.monotonic() - t0 < 5


def test_a_client_leaving_the_queue_frees_its_place() -> None:
    with RecordingUpstream(behaviour=UpstreamBehaviour(first_byte_delay_s=1.2)) as up:
        args = ["--max-inflight-per-worker", "1", "--queue-size", "1", "--queue-timeout-s", "10"]
        with RouterProcess({"only": up.url}, extra_args=args) as r:

            async def main() -> tuple[int, int]:
                async with httpx.AsyncClient(timeout=20) as client:
                    first = asyncio.create_task(client.post(r.url + "/v1/chat/completions", json=CHAT))
                    await asyncio.sleep(0.2)
                    with contextlib.suppress(httpx.ReadTimeout):  # queued, then gives up
                        await client.post(r.url + "/v1/chat/completions", json=CHAT, timeout=0.3)
                    await asyncio.sleep(0.1)
                    # The queue (size 1) has room again: this one waits instead of a 429.
                    third = await client.post(r.url + "/v1/chat/completions", json=CHAT)
                    return (await first).status_code, third.status_code

            assert asyncio.run(main()) == (200, 200)
            assert len(up.received) == 2  # the one that left never reached the worker
            assert "kvroute_queue_depth 0" in r.metrics()


def _read_stream(url: str, out: dict) -> None:
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as resp:
            out["status"] = resp.status_code
            out["events"] = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as exc:
        out["error"] = type(exc).__name__


def test_sigterm_lets_in_flight_streams_finish_and_refuses_new_connections() -> None:
    with RecordingUpstream(behaviour=UpstreamBehaviour(chunks=10, chunk_delay_s=0.2)) as up:
        r = RouterProcess({"only": up.url}, extra_args=["--shutdown-grace-s", "10"])
        with r:
            out: dict = {}
            reader = threading.Thread(target=_read_stream, args=(r.url, out))
            reader.start()
            time.sleep(0.5)  # the stream is under way
            assert r.proc is not None
            os.killpg(r.proc.pid, signal.SIGTERM)
            time.sleep(0.3)
            try:
                httpx.get(r.url + "/health", timeout=1)
                refused = False
            except httpx.HTTPError:
                refused = True
            reader.join(timeout=10)
            assert r.proc.wait(timeout=10) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
        assert refused
        assert out.get("status") == 200, out
        events = out["events"]
        assert len(events) == 11 and events[-1] == "[DONE]"
        assert not any('"error"' in e for e in events)


def test_streams_outliving_the_grace_period_end_with_an_error_event() -> None:
    with RecordingUpstream(behaviour=UpstreamBehaviour(chunks=50, chunk_delay_s=0.1)) as up:
        with RouterProcess({"only": up.url}, extra_args=["--shutdown-grace-s", "0.5"]) as r:
            out: dict = {}
            reader = threading.Thread(target=_read_stream, args=(r.url, out))
            reader.start()
            time.sleep(0.5)
            assert r.proc is not None
            os.killpg(r.proc.pid, signal.SIGTERM)
            reader.join(timeout=10)
        assert out.get("status") == 200, out
        events = out["events"]
        assert events[-1] == "[DONE]"
        assert "shutting down" in json.loads(events[-2])["error"]["message"]
