"""Each term of the cache-aware policy, switched off by name (`ablate`), changes the decision
in a case where that term matters: pure logic, no HTTP (as tests/router/test_policies.py)."""

from __future__ import annotations

import pytest

from cache_client import IndexView
from normalizer import chat_segments, prefix_chain
from normalizer.prefix import PrefixChain, reply_segment
from router.cost import CostModel
from router.policies import RoutingSettings, make_policy
from router.policies.cache_aware import TERMS, CacheAwarePolicy
from router.routing import RouteRequest, WorkerLoad

COST = CostModel()


def chain(*contents: str, reply: bool = False) -> PrefixChain:
    messages = [{"role": "user", "content": c} for c in contents]
    if reply:  # a conversation's second turn: the previous prompt, its answer, a new message
        messages.insert(-1, {"role": "assistant", "content": "done. " * 20})
    body = {"model": "m", "messages": messages}
    return prefix_chain("m", chat_segments(body), reply_at=reply_segment(body))


def loads(*names: str, cost: CostModel | None = None, **state: dict) -> list[WorkerLoad]:
    return [WorkerLoad(n, cost=cost, **state.get(n, {})) for n in names]


def place(request: RouteRequest, view: IndexView, candidates: list[WorkerLoad], *ablate: str) -> str:
    return CacheAwarePolicy(ablate=ablate).choose(request, view, candidates, COST).worker


def test_lag() -> None:
    """A worker running 3 s behind its predictions is passed over; without the lag term the
    model's own queue figures, which favour it, decide."""
    c = chain("x" * 40_000, "y" * 40)
    view = IndexView({"pool": 3})
    state = {"a": {"lag_s": 3.0}, "b": {"inflight": 4, "queued_prefill_s": 0.2}}
    assert place(RouteRequest(c), view, loads("a", "b", **state)) == "b"
    assert place(RouteRequest(c), view, loads("a", "b", **state), "lag") == "a"


def test_delay() -> None:
    """Three requests wait behind this prefill on b, one on a: the 11k-token recompute on b
    costs more than a's 1k new tokens; without the Little's-law charge b's shorter queue
    wins."""
    document = "x" * 40_000
    c = chain(document, "y" * 4_000)
    view = IndexView({"a": len(chain(document))})
    others = {n: {"queued_prefill_s": 0.01, "prefilling": 1} for n in "bcdefgh"}
    state = {"a": {"queued_prefill_s": 0.4, "prefilling": 3}, **others}
    candidates = loads("a", *others, **state)
    assert place(RouteRequest(c), view, candidates) == "a"
    assert place(RouteRequest(c), view, candidates, "delay") == "b"


def test_recompute() -> None:
    """Every other worker queues: recomputing w0's 10k-token document on idle w1 is work
    the busy fleet does twice. Without the recompute charge w1's empty queue wins."""
    names = [f"w{i}" for i in range(8)]
    document = "x" * 40_000
    c = chain(document, "y" * 400)
    state = {"w0": {"queued_prefill_s": 1.2, "prefilling": 1}}
    state.update({n: {"queued_prefill_s": 3.0, "prefilling": 1} for n in names[2:]})
    view = IndexView({"w0": len(chain(document))})
    candidates = loads(*names, **state)
    assert place(RouteRequest(c), view, candidates) == "w0"
    assert place(RouteRequest(c), view, candidates, "recompute") == "w1"


def test_hysteresis() -> None:
    """a holds a short prompt and has 10 ms queued; b would answer ~8 ms sooner by
    recomputing it: less than one engine step, so the conversation stays, unless the step
    is not charged."""
    c = chain("x" * 400, "y" * 40)
    candidates = loads("a", "b", a={"queued_prefill_s": 0.010})
    view = IndexView({"a": 3})
    assert place(RouteRequest(c), view, candidates) == "a"
    assert place(RouteRequest(c), view, candidates, "hysteresis") == "b"


def test_caps() -> None:
    """The worker holding the prefix took most of the recent requests: the recent cap spills
    a new session to another; without the caps it stays on the holder."""
    c = chain("x" * 8000, "y" * 40)
    candidates = loads("a", "b", "c", a={"recent": 10.0}, b={"recent": 1.0}, c={"recent": 1.0})
    view = IndexView({"a": 3})
    assert place(RouteRequest(c), view, candidates) in ("b", "c")
    assert place(RouteRequest(c), view, candidates, "caps") == "a"


@pytest.mark.parametrize("by_reply", [True, False])
def test_quiet_home(by_reply: bool) -> None:
    """One conversation is all the recent traffic of its quiet worker (an agent alone on the
    fleet): its home is exempt from the recent cap and keeps it, whether found by the
    previous turn's reply or by the prompt it extends; without the exemption the cap moves
    it."""
    first = chain("x" * 8000)
    c = chain("x" * 8000, "y" * 40, reply=by_reply)
    request = RouteRequest(c) if by_reply else RouteRequest(c, continues="a")
    view = IndexView({"a": c.reply_depth if by_reply else len(first)})
    candidates = loads("a", "b", "c", a={"recent": 10.0})
    assert place(request, view, candidates) == "a"
    assert place(request, view, candidates, "quiet_home") in ("b", "c")


def test_slower_guard() -> None:
    """A long new prompt on a mixed fleet whose fast workers each finish one short prefill:
    the Little's-law charge doubles its price there, and the idle half-speed workers price
    lower. The guard keeps it on a fast worker; without it, it goes to a slow one."""
    slow = CostModel(prefill_base_s=2 * COST.prefill_base_s, prefill_ctx_s=2 * COST.prefill_ctx_s)
    fast_load = {"prefilling": 1, "queued_prefill_s": 0.02}
    candidates = loads("f0", "f1", cost=COST, f0=fast_load, f1=fast_load) + loads("s0", "s1", cost=slow)
    request = RouteRequest(chain("x" * 32_000))
    assert place(request, IndexView(), candidates) in ("f0", "f1")
    assert place(request, IndexView(), candidates, "slower_guard") in ("s0", "s1")


def test_every_term_has_a_case_above() -> None:
    cases = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert set(TERMS) <= cases


def test_unknown_terms_and_other_policies_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown cache_aware terms lagg"):
        CacheAwarePolicy(ablate=("lagg",))
    with pytest.raises(ValueError, match="applies to cache_aware"):
        RoutingSettings(policy="random", ablate=("lag",))
    # However given (a YAML list, a JSON round trip), the setting is a sorted tuple.
    assert RoutingSettings(ablate=["lag", "caps"]).ablate == ("caps", "lag")  # type: ignore[arg-type]
    assert make_policy("cache_aware", ablate=("caps", "lag")).ablate == {"caps", "lag"}  # type: ignore[attr-defined]
    assert make_policy("cache_aware").ablate == frozenset()  # type: ignore[attr-defined]
