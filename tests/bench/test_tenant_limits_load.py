"""The tenant benchmark's load generator (loadtests/measure/tenant_limits.py), against a recording
upstream: what it sends, not how fast."""

from __future__ import annotations

import asyncio
import itertools

import orjson

from loadtests.measure import tenant_limits
from loadtests.measure.tenant_limits import Flow, arrival_times, open_loop, prompt_of
from tests.support.upstream import RecordingUpstream


def _prompts(upstream: RecordingUpstream) -> list[str]:
    return [orjson.loads(r.body)["messages"][0]["content"] for r in upstream.received]


def test_each_call_sends_prompts_new_to_the_workers() -> None:
    """Two phases with the same seed send the same arrivals, but never the same prompt: a
    phase that resent an earlier phase's prompts measured cache hits (the limits)."""
    with RecordingUpstream() as upstream:
        tenant_limits.MODEL[0] = upstream.model
        first, second = (Flow("steady", "sk-steady", 40.0, prompt_of(50, "steady"), 2) for _ in range(2))
        asyncio.run(open_loop([upstream.url], [first], 0.5, seed=3))
        sent_first = _prompts(upstream)
        asyncio.run(open_loop([upstream.url], [second], 0.5, seed=3))
        sent_second = _prompts(upstream)[len(sent_first):]
    assert len(sent_first) == len(sent_second) > 5  # the same arrivals
    assert all(s.status == 200 for s in first.samples + second.samples)
    assert not set(sent_first) & set(sent_second)  # none repeated
    assert len(set(sent_first)) == len(sent_first)


def test_a_flow_starts_at_its_start_time() -> None:
    with RecordingUpstream() as upstream:
        tenant_limits.MODEL[0] = upstream.model
        late = Flow("x", "sk-x", 40.0, prompt_of(50, "x"), 2, start_s=0.4)
        asyncio.run(open_loop([upstream.url], [late], 0.8, seed=1))
    assert late.samples and min(s.sent_at for s in late.samples) >= 0.4


def test_a_steady_flow_arrives_evenly_and_a_poisson_flow_does_not() -> None:
    """`--y-arrivals steady`: one request every 1/rate s; the same seed gives the same times."""
    steady = Flow("y", "sk-y", 2.0, "", 1, start_s=1.0, steady=True)
    times = list(arrival_times(steady, 61.0, seed=5))
    assert times == list(arrival_times(steady, 61.0, seed=5))
    assert 1.0 <= times[0] < 1.5 and len(times) == 120
    assert all(abs(b - a - 0.5) < 1e-9 for a, b in itertools.pairwise(times))
    clumpy = list(arrival_times(Flow("y", "sk-y", 2.0, "", 1, start_s=1.0), 61.0, seed=5))
    assert min(b - a for a, b in itertools.pairwise(clumpy)) < 0.1  # Poisson clumps
