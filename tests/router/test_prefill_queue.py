"""The prefill queue (router/proxy/prefill_queue.py): requests held in the router while every
worker has prefill queued, routed as workers free, the one whose prefill ends soonest first."""

from __future__ import annotations

import asyncio
import threading

import httpx
import orjson

from loadtests.support.routerproc import RouterProcess
from router.cost import CostModel
from router.proxy.prefill_queue import PrefillQueue
from router.routing import WorkerLoad
from tests.support.upstream import RecordingUpstream, UpstreamBehaviour

COST = CostModel()
STEP_TOKENS = 4096
STEP_S = COST.prefill_s(0, STEP_TOKENS)
"""A full engine step's prefill: the mark a worker is busy by."""


def busy(*steps: float, cost: CostModel | None = None) -> list[WorkerLoad]:
    """Workers with these many steps of prefill queued (priced by `cost`, if learned)."""
    return [WorkerLoad(f"w{i}", queued_prefill_s=q * STEP_S, cost=cost) for i, q in enumerate(steps)]


class Fleet:
    """Free workers per model, as the proxy's `_free_workers` would count them."""

    def __init__(self, **free: int) -> None:
        self.free = free

    def __call__(self, model: str) -> int:
        return self.free.get(model, 0)


def queue(max_wait_s: float = 5.0, **free: int) -> tuple[PrefillQueue, Fleet]:
    q = PrefillQueue(STEP_TOKENS, COST, max_wait_s=max_wait_s)
    fleet = Fleet(**free)
    q.free_workers = fleet
    return q, fleet


async def test_waits_only_when_every_worker_is_busy_or_others_wait() -> None:
    q, fleet = queue(m=0)
    assert not q.must_wait("m", busy(5.0, 0.9))  # one worker under a full step
    assert q.must_wait("m", busy(5.0, 1.0))  # every worker at or over it
    # A worker's own learned costs price its step: twice as slow, twice the seconds.
    slow = CostModel(prefill_base_s=2 * COST.prefill_base_s, prefill_ctx_s=2 * COST.prefill_ctx_s)
    assert not q.must_wait("m", busy(1.5, 1.5, cost=slow))
    waiting = asyncio.create_task(q.wait("m", 1.0))
    await asyncio.sleep(0.01)
    assert q.must_wait("m", busy(0.0, 0.0))  # no overtaking those already waiting
    assert not q.must_wait("other", busy(0.0))  # another model's queue is its own
    fleet.free["m"] = 1
    q.kick()
    assert await waiting is True


async def test_freed_workers_go_to_the_shortest_prefill_first() -> None:
    q, fleet = queue(m=0)
    order: list[str] = []

    async def request(name: str, prefill_s: float) -> None:
        assert await q.wait("m", prefill_s)
        order.append(name)
        q.end_turn("m")  # took its ticket: the worker is busy again (fleet.free below)

    tasks = [asyncio.create_task(request(n, p)) for n, p in (("long", 3.0), ("short", 0.5), ("mid", 1.0))]
    await asyncio.sleep(0.01)
    assert order == [] and q.held == 3
    for expected in (["short"], ["short", "mid"], ["short", "mid", "long"]):
        fleet.free["m"] = 1
        q.kick()
        fleet.free["m"] = 0  # the woken request's prefill now occupies the worker
        await asyncio.sleep(0.01)
        assert order == expected
    await asyncio.gather(*tasks)


async def test_a_long_prefill_waits_for_later_arrivals_no_longer_than_its_length() -> None:
    """Order by arrival + prefill: a request that came more than the difference in prefill
    earlier goes first (pure shortest-first would let short arrivals pass it forever)."""
    q, fleet = queue(m=0)
    order: list[str] = []

    async def request(name: str, prefill_s: float) -> None:
        await q.wait("m", prefill_s)
        order.append(name)
        q.end_turn("m")

    early_long = asyncio.create_task(request("early_long", 0.3))
    await asyncio.sleep(0.35)  # longer than 0.3 - 0.01: the long one's key is now the smaller
    late_short = asyncio.create_task(request("late_short", 0.01))
    await asyncio.sleep(0.01)
    fleet.free["m"] = 1
    q.kick()
    await asyncio.gather(early_long, late_short)
    assert order == ["early_long", "late_short"]


async def test_one_waiter_woken_per_free_worker_until_it_takes_its_ticket() -> None:
    q, _ = queue(m=1)
    woken: list[str] = []

    async def request(name: str) -> None:
        await q.wait("m", 1.0)
        woken.append(name)

    a = asyncio.create_task(request("a"))
    await asyncio.sleep(0.01)
    b = asyncio.create_task(request("b"))
    await asyncio.sleep(0.01)
    q.kick()  # still one free worker, promised to "a" until it ends its turn
    await asyncio.sleep(0.01)
    assert woken == ["a"]
    q.end_turn("m")  # "a" went elsewhere (the worker is still free): "b" is woken
    await asyncio.sleep(0.01)
    assert woken == ["a", "b"]
    q.end_turn("m")
    await asyncio.gather(a, b)


async def test_nothing_is_refused_a_request_goes_on_after_the_longest_wait() -> None:
    q, _ = queue(max_wait_s=0.05, m=0)
    assert await q.wait("m", 1.0) is False  # no turn held: routed as if the queue were off
    assert not q._waiting.get("m") or all(f.done() for *_, f in q._waiting["m"])


async def test_a_client_leaving_with_a_turn_passes_it_on() -> None:
    q, fleet = queue(m=0)
    first = asyncio.create_task(q.wait("m", 0.1))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(q.wait("m", 0.2))
    await asyncio.sleep(0.01)
    fleet.free["m"] = 1
    q.kick()  # the turn goes to `first` ...
    first.cancel()  # ... whose client leaves before taking a ticket
    await asyncio.sleep(0.01)
    assert second.done() and second.result() is True
    q.end_turn("m")


async def test_workers_of_another_model_freeing_wake_nobody() -> None:
    q, fleet = queue(a=0, b=0)
    waiting = asyncio.create_task(q.wait("a", 0.1))
    await asyncio.sleep(0.01)
    fleet.free["b"] = 1
    q.kick()
    await asyncio.sleep(0.01)
    assert not waiting.done()
    fleet.free["a"] = 1
    q.kick("a")
    assert await waiting is True
    q.end_turn("a")


# -- through a router process and a real HTTP worker ------------------------------------------
def chat(words: int, tag: str) -> dict:
    return {"model": "rec-model", "messages": [{"role": "user", "content": f"{tag} " + "lorem " * words}]}


async def send_staggered(url: str, bodies: list[dict], gap_s: float) -> list[int]:
    async with httpx.AsyncClient(timeout=30) as client:
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(client.post(url + "/v1/chat/completions", json=body)))
            await asyncio.sleep(gap_s)
        return [r.status_code for r in await asyncio.gather(*tasks)]


def arrival_order(up: RecordingUpstream) -> list[str]:
    return [orjson.loads(r.body)["messages"][0]["content"].split()[0] for r in up.received]


def test_a_saturated_worker_takes_the_shortest_waiting_prompt_next() -> None:
    """One worker of a 1,000-token step, its first request (3k tokens) still prefilling (the
    first byte comes after 0.6 s): a 36k-token prompt and then a short one arrive. With the
    queue, the short one goes to the worker first (its prefill, under a step, leaves the
    worker free: the long one follows at once); without it both go at once, in order."""
    bodies = [chat(2_000, "first"), chat(24_000, "long"), chat(50, "short")]
    for args, expected, held in (
        (["--prefill-queue-tokens", "1000"], ["first", "short", "long"], True),
        ([], ["first", "long", "short"], False),
    ):
        with RecordingUpstream(behaviour=UpstreamBehaviour(first_byte_delay_s=0.6)) as up:
            with RouterProcess({"only": up.url}, extra_args=args) as r:
                seen_early: list[int] = []
                threading.Timer(0.45, lambda seen=seen_early, up=up: seen.append(len(up.received))).start()
                assert asyncio.run(send_staggered(r.url, bodies, 0.1)) == [200, 200, 200]
                assert arrival_order(up) == expected
                # Held: only the first request reached the worker before its first byte.
                assert seen_early == ([1] if held else [3])
                metrics = r.metrics()
                assert f"kvroute_prefill_queue_held_total {2 if held else 0}\n" in metrics
                assert "kvroute_prefill_queue_depth 0" in metrics
