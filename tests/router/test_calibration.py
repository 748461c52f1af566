"""The online cost estimator (router/calibration.py) on synthetic observations: pure logic."""

from __future__ import annotations

import random

import pytest

from router.calibration import (
    PRIOR_CHECK_ANSWERS,
    PRIOR_MAX_FACTOR,
    PRIOR_OFF_BY,
    Calibrator,
    Dispatch,
    Estimator,
    Observation,
    Stats,
    marginal_prefill_s,
)
from router.config_loader import load_config
from router.cost import CostSettings

PRIOR = CostSettings().model()  # the 8B defaults: ~3x too cheap for the "true" worker below
TRUE = {"overhead": 0.004, "base": 60e-6, "ctx": 4e-9, "inflight": 0.5e-3}


def seconds(start: int, end: int, inflight: int = 0, slow: float = 1.0) -> float:
    n = end - start
    return slow * (TRUE["overhead"] + TRUE["base"] * n + TRUE["ctx"] * (end * end - start * start) / 2 + TRUE["inflight"] * inflight)


def feed(e: Estimator, rng: random.Random, n: int, slow: float = 1.0, outliers: float = 0.0) -> None:
    for _ in range(n):
        end = rng.choice([rng.randint(20, 400), rng.randint(500, 30_000), rng.randint(500, 30_000)])
        start = rng.choice([0, 0, rng.randint(0, end)])
        k = rng.randint(0, 8)
        y = seconds(start, end, k, slow) * rng.uniform(0.95, 1.05)
        if rng.random() < outliers:
            y *= rng.uniform(2, 5)  # queued behind work the router did not see
        e.add(Observation(start, end, y, 0, k))


def ratio(e: Estimator, context: int, slow: float = 1.0) -> float:
    return marginal_prefill_s(e.model, context) / (slow * (TRUE["base"] + TRUE["ctx"] * context))


def test_converges_from_a_wrong_prior_within_a_few_hundred() -> None:
    e = Estimator(PRIOR)
    feed(e, random.Random(1), 200)
    assert ratio(e, 4096) == pytest.approx(1, abs=0.1)
    assert ratio(e, 16_384) == pytest.approx(1, abs=0.1)
    assert e.model.overhead_s == pytest.approx(TRUE["overhead"], rel=0.5)


def test_robust_to_queued_outliers() -> None:
    e = Estimator(PRIOR)
    feed(e, random.Random(2), 300, outliers=0.1)
    assert ratio(e, 4096) == pytest.approx(1, abs=0.1)
    assert ratio(e, 16_384) == pytest.approx(1, abs=0.15)


def test_follows_a_slowdown() -> None:
    rng = random.Random(3)
    e = Estimator(PRIOR)
    feed(e, rng, 200)
    feed(e, rng, 60, slow=2.0)
    assert e.shifts >= 1
    assert ratio(e, 4096, slow=2.0) == pytest.approx(1, abs=0.15)


def test_a_slowdown_is_priced_as_soon_as_it_is_detected() -> None:
    """A slowed worker gets few requests once priced slower: the rescaled past must carry
    the estimate, not the handful of rows after the change (the shift window's 16)."""
    rng = random.Random(6)
    e = Estimator(PRIOR)
    feed(e, rng, 200)
    before = e.shifts
    feed(e, rng, e.settings.shift_window + 2, slow=2.0)
    assert e.shifts == before + 1 and e.stale == 0  # undated answers are taken in order
    assert ratio(e, 4096, slow=2.0) == pytest.approx(1, abs=0.15)
    assert ratio(e, 16384, slow=2.0) == pytest.approx(1, abs=0.15)


def _settled(rng: random.Random) -> tuple[Estimator, float]:
    """A worker's fit on 200 answers, a tenth of a second apart: the estimator and the clock."""
    e = Estimator(PRIOR)
    clock = 0.0
    for _ in range(200):
        end = rng.randint(500, 20_000)
        start = rng.choice([0, rng.randint(0, end)])
        clock += 0.1
        e.add(Observation(start, end, seconds(start, end, 4) * rng.uniform(0.95, 1.05), 0, 4, clock))
    return e, clock


def _continuation(rng: random.Random, slow: float, at: float, noise: float = 0.05) -> Observation:
    """A short turn on a long conversation: what a worker priced slower is mostly sent."""
    start = rng.randint(5_000, 40_000)
    end = start + rng.randint(150, 900)
    return Observation(start, end, seconds(start, end, 4, slow) * rng.uniform(1 - noise, 1 + noise), 0, 4, at)


def test_answers_measured_before_a_slowdown_do_not_undo_it() -> None:
    """Answers are fitted as they end: a long one whose first byte came before the worker
    slowed ends after the change was detected. Fitted as new, a few such rows at the old
    speed, longer than the continuations the slowed worker is then sent, moved the per-token
    cost into the overhead and held it at 0.7 of the truth (the slowdown run of 5 December,
    seed 1). Dated by their first byte, they are left with the past they belong to."""
    rng = random.Random(7)
    e, clock = _settled(rng)
    changed_at = clock
    before = e.shifts
    for i in range(40):
        clock += 0.5
        e.add(_continuation(rng, 2.0, clock))
        if i in (20, 21, 22):  # long prefills sent just before the change, ending now
            start = rng.randint(5_000, 30_000)
            end = start + rng.randint(1_500, 3_000)
            e.add(Observation(start, end, seconds(start, end, 4), 0, 4, changed_at - rng.uniform(0, 1)))
    assert e.shifts == before + 1 and e.stale == 3
    assert ratio(e, 4096, slow=2.0) == pytest.approx(1, abs=0.15)
    assert ratio(e, 16384, slow=2.0) == pytest.approx(1, abs=0.15)


def _slowdown_detected(seed: int) -> Estimator:
    """A settled worker slows 2x; answers vary by ±20% after the change, as a busy engine's
    do, and every third one to end was measured before it. Fed until the change is detected."""
    rng = random.Random(seed)
    e, clock = _settled(rng)
    before, changed_at, i = e.shifts, clock, 0
    while e.shifts == before:
        i += 1
        if i % 3 == 0:
            e.add(_continuation(rng, 1.0, changed_at - rng.uniform(0, 2), noise=0.2))
        else:
            clock += 0.5
            e.add(_continuation(rng, 2.0, clock, noise=0.2))
    return e


def test_a_slowdown_s_factor_comes_from_the_rows_after_it() -> None:
    """The detector trips once half of its window is off, and answers measured before the
    change, ending late, fall among those after it: the median of the whole window is the
    low end of the new answers, and understated a 2x slowdown as 1.5x (the slowdown run of 5
    December, seed 2; over these ten seeds 0.76-0.95 of the truth, the sixth 0.82). The
    later half by first byte gives the change's own factor (0.83-1.07)."""
    ratios = sorted(ratio(_slowdown_detected(seed), 4096, slow=2.0) for seed in range(10))
    assert ratios[5] == pytest.approx(1, abs=0.1)
    assert all(r == pytest.approx(1, abs=0.2) for r in ratios)


def test_prior_stands_until_enough_observations() -> None:
    e = Estimator(PRIOR)
    feed(e, random.Random(4), e.settings.min_observations - 1)
    assert e.model is PRIOR


def test_explicit_coefficient_is_held_fixed() -> None:
    e = Estimator(PRIOR, fixed={"prefill_ctx_s"})
    feed(e, random.Random(5), 200)
    assert e.model.prefill_ctx_s == PRIOR.prefill_ctx_s
    assert e.model.prefill_base_s > 2 * PRIOR.prefill_base_s  # the rest still learned


def test_replicas_statistics_add_up() -> None:
    rng = random.Random(6)
    a, b = Estimator(PRIOR), Estimator(PRIOR)
    feed(a, rng, 100)
    b.others = [Stats.from_export(a.stats.export())]  # b has seen nothing itself
    assert b.learned
    b.refit()
    assert marginal_prefill_s(b.model, 4096) == pytest.approx(marginal_prefill_s(a.model, 4096), rel=0.02)


def dispatch(queued_s: float = 0.0, waiting: int = 0) -> Dispatch:
    return Dispatch("w0", 8000, 0, 0, queued_s, 0, waiting, 0.5, 0.5)


def test_calibrator_skips_requests_that_found_a_queue() -> None:
    cal = Calibrator(PRIOR)
    assert cal.observe(dispatch(queued_s=2.0), 3.0, 0) is None
    assert cal.observe(dispatch(waiting=3), 3.0, 0) is None
    obs = cal.observe(dispatch(queued_s=0.1), 0.6, 4000)
    assert obs is not None and obs.seconds == pytest.approx(0.5) and obs.start == 4000
    assert cal.skipped_queued == 2 and "w0" not in cal.costs  # not yet enough to stand


def _answered(cal: Calibrator, rng: random.Random, slow: float, queued: bool, unseen: float = 1.0) -> None:
    """One answer from a worker `slow` times the prior's speed: queued behind a prefill the
    router priced with the same prior, or alone; `unseen`: also waiting for work the model
    does not see (a busy engine's decodes), as a factor."""
    total = rng.randint(2_000, 20_000)
    own = PRIOR.prefill_s(0, total)
    queue = rng.uniform(2, 6) * own if queued else 0.0
    d = Dispatch("w0", total, 0, 0, queue, 0, 0, own, own + queue)
    cal.observe(d, slow * (own + queue) * rng.uniform(0.9, 1.2) * unseen, 0)


def test_queued_answers_rescale_a_prior_that_is_far_off_before_any_fit() -> None:
    """A router started into a busy fleet: every answer finds a queue, so nothing is fitted,
    but the answers show the prior 3x too cheap, and it is rescaled after a few."""
    cal, rng = Calibrator(PRIOR), random.Random(5)
    # Every other answer also waited for work the model does not see: that only adds time,
    # so it must not pass for a slower worker (the median would read those).
    for i in range(PRIOR_CHECK_ANSWERS - 1):
        _answered(cal, rng, 3.0, queued=True, unseen=2.5 if i % 2 else 1.0)
    assert "w0" not in cal.costs  # the prior still stands
    _answered(cal, rng, 3.0, queued=True, unseen=2.5)
    factor = cal.prior_factors["w0"]
    assert 3.0 * 0.9 <= factor <= 3.0 * 1.2
    assert marginal_prefill_s(cal.costs["w0"], 4096) == pytest.approx(factor * marginal_prefill_s(PRIOR, 4096))
    # Checked once: later queued answers leave it, and its own fit takes over from there.
    for _ in range(3 * PRIOR_CHECK_ANSWERS):
        _answered(cal, rng, 10.0, queued=True)
    assert cal.prior_factors["w0"] == factor
    for _ in range(200):
        _answered(cal, rng, 3.0, queued=False)
    assert marginal_prefill_s(cal.costs["w0"], 4096) == pytest.approx(3.0 * 1.05 * marginal_prefill_s(PRIOR, 4096), rel=0.1)


def test_a_prior_about_right_stands_and_early_fits_survive_a_rescale() -> None:
    rng = random.Random(6)
    right = Calibrator(PRIOR)
    for _ in range(PRIOR_CHECK_ANSWERS):
        _answered(right, rng, 1.2, queued=True)  # the unmodelled waits of a busy engine
    assert right.prior_factors["w0"] == 1.0 and "w0" not in right.costs
    off = Calibrator(PRIOR)
    for _ in range(5):
        _answered(off, rng, 2.5, queued=False)  # fitted, but not yet enough to stand
    for _ in range(PRIOR_CHECK_ANSWERS):
        _answered(off, rng, 2.5, queued=True)
    assert off.prior_factors["w0"] > PRIOR_OFF_BY
    assert off.estimators["w0"].observations == 5  # kept by the rescaled estimator
    # Bounded: a worker 20x slower than the prior is first priced at the bound.
    far = Calibrator(PRIOR)
    for _ in range(PRIOR_CHECK_ANSWERS):
        _answered(far, rng, 20.0, queued=True)
    assert far.prior_factors["w0"] == PRIOR_MAX_FACTOR


def test_queued_answers_never_scale_a_prior_down() -> None:
    """Queued answers faster than predicted: the predicted queue counts prefills in progress
    whole, so a worker the prior prices right shows ratios well under 1. Its prior stands
    (scaled down, it drew every long prompt and, all of them queued, fit nothing)."""
    rng = random.Random(7)
    cal = Calibrator(PRIOR)
    for _ in range(PRIOR_CHECK_ANSWERS):
        _answered(cal, rng, 0.3, queued=True)
    assert cal.prior_factors["w0"] == 1.0 and "w0" not in cal.costs
    assert cal.estimators["w0"].prior == PRIOR


def test_config_flags_are_priors_and_explicit_ones_win() -> None:
    default = load_config([])
    assert default.cost.learning == "on" and default.cost.fixed() == frozenset()
    assert default.cost.model() == PRIOR
    set_ = load_config(["--cost-prefill-base-us", "50", "--cost-learning", "off"], {"KVROUTE_COST_STEP_MS": "9"})
    assert set_.cost.learning == "off"
    assert set_.cost.fixed() == {"prefill_base_s", "step_s"}
    assert set_.cost.model().prefill_base_s == pytest.approx(50e-6)
    with pytest.raises(SystemExit):
        load_config([], {"KVROUTE_COST_LEARNING": "maybe"})


def test_bounded_loads_give_a_faster_worker_its_share() -> None:
    """The recent-traffic cap scales with learned speed: a worker twice as fast may carry
    twice the slow one's recent requests without counting as over it."""
    from dataclasses import replace

    from router.policies.bounded import speed_shares, within_bounds
    from router.routing import WorkerLoad

    slow = replace(PRIOR, prefill_base_s=2 * PRIOR.prefill_base_s, prefill_ctx_s=2 * PRIOR.prefill_ctx_s)
    loads = [
        WorkerLoad("fast", recent=30.0, cost=PRIOR), WorkerLoad("slow1", recent=10.0, cost=slow),
        WorkerLoad("slow2", recent=10.0, cost=slow),
    ]  # fmt: skip
    assert speed_shares(loads) == pytest.approx({"fast": 1.5, "slow1": 0.75, "slow2": 0.75})
    assert {w.name for w in within_bounds(loads)} == {"fast", "slow1", "slow2"}
    blind = [replace(w, cost=None) for w in loads]  # without learned costs: the old cap
    assert {w.name for w in within_bounds(blind)} == {"slow1", "slow2"}


def test_cached_tokens_are_read_from_each_api_s_usage() -> None:
    from router.proxy.handler import _cached_tokens

    chat = b'data: {"choices":[],"usage":{"prompt_tokens":1000,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":600}}}\n\n'
    responses = (
        b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":{"input_tokens":1000,'
        b'"input_tokens_details":{"cached_tokens":600},"output_tokens":5}}}\n\n'
    )
    # Anthropic's input_tokens leaves out the tokens read from (and written to) the cache.
    messages = (
        b'event: message_delta\ndata: {"type":"message_delta","usage":{"input_tokens":300,'
        b'"cache_creation_input_tokens":100,"cache_read_input_tokens":600,"output_tokens":5}}\n\n'
    )
    # In the router's units: its estimate of the prompt (here 2,000) scales the engine's count.
    for tail in (chat, responses, messages):
        assert _cached_tokens(tail, 2000) == 1200, tail
    assert _cached_tokens(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', 2000) is None
