"""Online calibration: each worker's cost model learned from what its answers show.

The router prices a request in seconds (`router/cost.py`); the coefficients behind those
seconds depend on the GPU, the model and the engine, and differ between the workers of one
fleet. Every streamed answer is a measurement: the time from dispatch to its first byte is
the worker's fixed per-request overhead + the prefill of the tokens it did not hold + the
copy of those it loaded from the pool + the steps its running requests lengthen, plus the
queue it found. So per worker, a linear model

    seconds = overhead + base·n + ctx·(end² − start²)/2 + pool·p + inflight·k + disk·d + remote·r

(n = end − start new tokens, p, d, r tokens copied from its node's pool, its node's disk and
the remote tier, k requests running at dispatch) is fitted by weighted least squares over
sufficient statistics (XᵀWX, XᵀWy, 7×7: O(1) memory, O(49) per observation, no window to
keep; a tier no answer copied from keeps its prior) with

* relative errors: rows are weighted by 1/ŷ², so a 1k prompt counts as much as a 30k one;
* exponential forgetting (half-life in observations): a worker that slows down (thermal
  throttling, a noisy neighbour) is followed once the new observations outweigh the old;
* Huber weights on the relative residual against the current fit, its scale a running mean
  of |residual|: a request that queued behind work the router did not see (another
  router's, an engine hiccup) weighs little, while a lasting change raises the scale and
  is let in;
* answers dated by their first byte: they are fitted as they end, and one whose first byte
  came before a detected change of regime is left out (it describes the past, which the
  change already rescaled);
* queueing kept out at the observation site (`Calibrator.observe`): only requests that
  found at most a small predicted queue are fitted, with that queue subtracted; the
  queued ones still check the prior's scale while a worker has no fit of its own, and
  raise a prior they find too cheap (`Calibrator._check_prior`: a router started into a
  busy fleet would otherwise fit nothing and price it by priors off by 2x and more until
  the backlog drains);
* the prior (the `--cost-*` defaults) as a ridge term whose strength is a small fraction of
  each coefficient's own information in the observations: the prior stands until
  `min_observations`, then keeps the fit defined where the observations cannot tell two
  coefficients apart, and yields wherever they can, however far off it was;
  coefficients set explicitly by flag are held fixed (their term moves to the left side);
* non-negative coefficients: a coefficient the data pushes below zero is dropped from the
  free set and the rest refitted.

The fit runs every few observations; the routing decision reads the resulting frozen
`CostModel` per worker from the load view (`WorkerLoad.cost`) and stays a pure function.
With Redis, replicas publish their statistics with the load board's sync and each adds the
others' to its own (a sum of sufficient statistics is the fit over the union).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from router.cost import CostModel

COEFFS = (
    "overhead_s", "prefill_base_s", "prefill_ctx_s", "pool_load_s_per_token", "inflight_penalty_s",
    "disk_load_s_per_token", "remote_load_s_per_token",
)  # fmt: skip
"""The fitted coefficients, in feature order (CostModel field names)."""
_N = len(COEFFS)
OVERHEAD_SCALE_S = 5e-3
"""The unit of the overhead coefficient in the fit (its prior is 0, so it needs one)."""
_MIN_SCALES = (OVERHEAD_SCALE_S, 1e-7, 1e-13, 1e-8, 1e-5, 1e-8, 1e-8)
"""Units for coefficients whose prior is 0 or tiny (the fit is conditioned in these)."""


@dataclass(frozen=True, slots=True)
class Observation:
    """One answered request on one worker, in the router's token units."""

    start: int
    """Prompt tokens the worker reused (its GPU or the pool)."""
    end: int
    """Prompt tokens in all."""
    seconds: float
    """Dispatch to first byte, less the queue predicted at dispatch."""
    pool_tokens: int = 0
    """Of the reused tokens, those copied from its node's CPU pool."""
    inflight: int = 0
    """Requests running on the worker when this one was sent."""
    at: float | None = None
    """When its first byte came (any monotonic clock, one per estimator): what a change of
    regime is dated by. Observations are fitted as their answers end, and a long answer
    ends long after its first byte. None: undated, taken as in order."""
    disk_tokens: int = 0
    """Of the reused tokens, those copied from its node's disk tier."""
    remote_tokens: int = 0
    """Of the reused tokens, those copied from the remote tier."""

    def features(self) -> tuple[float, ...]:
        n = max(self.end - self.start, 0)
        return (
            1.0, float(n), (self.end * self.end - self.start * self.start) / 2.0, float(self.pool_tokens),
            float(self.inflight), float(self.disk_tokens), float(self.remote_tokens),
        )  # fmt: skip


@dataclass(frozen=True)
class EstimatorSettings:
    half_life: float = 48.0
    """Observations after which an observation weighs half (forgetting)."""
    ridge: float = 0.01
    """Pull towards the prior, as a fraction of each coefficient's information in the
    observations: little, only enough to keep the fit defined while the observations do not
    yet tell the coefficients apart (and the prior alone before any)."""
    huber_k: float = 2.0
    """Residuals beyond k × the running mean |residual| are down-weighted."""
    min_observations: int = 12
    """Below this many, the prior stands."""
    refit_every: int = 4
    shift_window: int = 16
    """A change of regime: the median relative residual of this many consecutive
    observations beyond `shift_threshold` (all off in one direction, not a few outliers)."""
    shift_threshold: float = 0.25
    shift_keep: float = 0.05
    """On a change of regime while the fit is still settling (fewer than `settled`
    observations: its residuals may be its own error), the weight the old observations keep."""
    settled: int = 64
    shift_rescaled_keep: float = 0.3
    """On a change of regime of a settled fit, the weight the old observations keep once
    rescaled by the change's factor (`Stats.rescale`): they then describe the new regime to
    first order, so the estimate moves at once instead of waiting for new rows, which a
    slowed worker gets few of once the router prices it slower."""
    shift_max_factor: float = 5.0
    """Bound on the factor a change of regime rescales by (either way)."""


class Stats:
    """Weighted sufficient statistics of one worker's fit (scaled features)."""

    __slots__ = ("a", "b", "weight")

    def __init__(self) -> None:
        self.a = [[0.0] * _N for _ in range(_N)]
        self.b = [0.0] * _N
        self.weight = 0.0

    def add(self, x: Sequence[float], y: float, w: float, decay: float) -> None:
        a, b = self.a, self.b
        for i in range(_N):
            row, wx = a[i], w * x[i]
            for j in range(_N):
                row[j] = row[j] * decay + wx * x[j]
            b[i] = b[i] * decay + wx * y
        self.weight = self.weight * decay + w

    def discount(self, factor: float) -> None:
        for row in self.a:
            for j in range(_N):
                row[j] *= factor
        self.b = [v * factor for v in self.b]
        self.weight *= factor

    def rescale(self, factor: float) -> None:
        """As if every observation had taken `factor` times as long. The weights are relative
        (1 / seconds²), so A scales by 1/factor² and b by 1/factor: the solution, by factor."""
        inv = 1.0 / factor
        for row in self.a:
            for j in range(_N):
                row[j] *= inv * inv
        self.b = [v * inv for v in self.b]

    def export(self) -> list[float]:
        """Upper triangle of A, then b, then the weight (what replicas share)."""
        return [self.a[i][j] for i in range(_N) for j in range(i, _N)] + self.b + [self.weight]

    @classmethod
    def from_export(cls, flat: Sequence[float]) -> Stats:
        s = cls()
        k = 0
        for i in range(_N):
            for j in range(i, _N):
                s.a[i][j] = s.a[j][i] = float(flat[k])
                k += 1
        s.b = [float(v) for v in flat[k : k + _N]]
        s.weight = float(flat[k + _N])
        return s

    def plus(self, others: Iterable[Stats]) -> Stats:
        total = Stats()
        for s in (self, *others):
            for i in range(_N):
                for j in range(_N):
                    total.a[i][j] += s.a[i][j]
                total.b[i] += s.b[i]
            total.weight += s.weight
        return total


def _median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            if f:
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


class Estimator:
    """One worker's online fit. Pure: no clock, no I/O."""

    def __init__(self, prior: CostModel, fixed: Iterable[str] = (), settings: EstimatorSettings | None = None) -> None:
        self.settings = settings or EstimatorSettings()
        self.prior = prior
        values = [getattr(prior, c) for c in COEFFS]
        self._scale = [max(v, lo) for v, lo in zip(values, _MIN_SCALES, strict=True)]
        self._phi0 = [v / s for v, s in zip(values, self._scale, strict=True)]
        self._fixed = [c in set(fixed) for c in COEFFS]
        self._decay = 0.5 ** (1.0 / self.settings.half_life)
        self.stats = Stats()
        self.observations = 0
        self.residual_scale = 1.0
        """Running mean |relative residual| (the Huber scale); starts wide open."""
        self._phi = list(self._phi0)
        self._recent: deque[tuple[float, float]] = deque(maxlen=self.settings.shift_window)
        """The latest residuals, each with its observation's first byte."""
        self.shifts = 0
        """Changes of regime detected (the worker slowed down or sped up)."""
        self._latest_at = 0.0
        """The latest first byte fitted."""
        self._regime_from = 0.0
        """The latest first byte fitted when the last change of regime was detected."""
        self.stale = 0
        """Observations dropped as older than the last change of regime."""
        self.others: list[Stats] = []
        """Other replicas' statistics for this worker, as last synced (added at each fit)."""
        self.model = prior
        """The current estimate (the prior until `min_observations`)."""

    def predict(self, obs: Observation) -> float:
        return sum(p * s * x for p, s, x in zip(self._phi, self._scale, obs.features(), strict=True))

    def add(self, obs: Observation) -> None:
        at = self._latest_at if obs.at is None else obs.at
        if at < self._regime_from:
            # Measured in the regime just left, though its answer ended after the change was
            # detected (a long decode): the past it belongs to is already rescaled, and fitted
            # now it would pull the new regime's fit back by the whole change.
            self.stale += 1
            return
        self._latest_at = max(self._latest_at, at)
        x = obs.features()
        xs = [v * s for v, s in zip(x, self._scale, strict=True)]
        # Fixed coefficients (explicit flags) move to the left side.
        y = obs.seconds - sum(self._phi0[i] * xs[i] for i in range(_N) if self._fixed[i])
        predicted = max(self.predict(obs), 1e-4)
        r = (obs.seconds - predicted) / predicted
        k = self.settings.huber_k * self.residual_scale
        huber = 1.0 if abs(r) <= k else k / abs(r)
        self.residual_scale = max(0.97 * self.residual_scale + 0.03 * min(abs(r), 10.0), 0.02)
        self._detect_shift(at, r)
        # Relative errors: weighted by the observation itself, not by the prediction, which
        # changes as the fit moves (early rows would then weigh more than later ones).
        seen = max(obs.seconds, 1e-4)
        self.stats.add(xs, y, huber / (seen * seen), self._decay)
        self.observations += 1
        s = self.settings
        if self.learned and self.observations % s.refit_every == 0:
            self.refit()

    def _detect_shift(self, at: float, r: float) -> None:
        """Huber weights resist a lasting change as much as outliers: when the recent
        residuals are all off in one direction, rescale the past by the change's factor (a
        throttled GPU or a noisy neighbour slows every coefficient alike) and discount it,
        so what differs from a uniform change is learnt from the new rows."""
        recent = self._recent
        recent.append((at, r))
        if len(recent) < recent.maxlen or self.observations < self.settings.min_observations:  # type: ignore[operator]
            return
        if abs(_median(r for _, r in recent)) > self.settings.shift_threshold:
            s = self.settings
            if self.observations >= s.settled:
                # The change's factor from the later half by first byte: a change is detected
                # once half the window is off, and the rows before it, some ending late among
                # the ones after it, would pull the whole window's median back towards 1.
                later = sorted(recent, key=lambda row: row[0])[len(recent) // 2 :]
                factor = 1.0 + _median(r for _, r in later)
                self.stats.rescale(min(max(factor, 1.0 / s.shift_max_factor), s.shift_max_factor))
                self.stats.discount(s.shift_rescaled_keep)
            else:
                self.stats.discount(s.shift_keep)
            self.residual_scale = 1.0
            recent.clear()
            self.shifts += 1
            self._regime_from = self._latest_at
            if self.learned:
                self.refit()  # the rescaled past prices the next request, not the old fit

    def rescale_prior(self, factor: float) -> None:
        """Scale the prior's free coefficients by `factor` (a prior found off by that much
        before the fit stands). The features stay in the original prior's units, so the
        observations already fitted keep their meaning and stay."""
        self._phi0 = [p if fixed else p * factor for p, fixed in zip(self._phi0, self._fixed, strict=True)]
        self.prior = replace(self.prior, **{c: p * s for c, p, s in zip(COEFFS, self._phi0, self._scale, strict=True)})
        if self.learned:
            self.refit()
        else:
            self._phi = list(self._phi0)
            self.model = self.prior

    @property
    def learned(self) -> bool:
        """Enough observations (here or at other replicas) for the fit to stand."""
        return self.observations >= self.settings.min_observations or any(s.weight > 0 for s in self.others)

    def refit(self) -> CostModel:
        """Solve with this worker's statistics (plus other replicas')."""
        stats = self.stats.plus(self.others) if self.others else self.stats
        free = [i for i in range(_N) if not self._fixed[i]]
        phi = list(self._phi0)
        # The pull towards the prior is a fraction of each coefficient's own information
        # (the diagonal of XᵀWX), not a fixed amount in prior units: a worker 200x slower
        # per token than the prior (a small model on a CPU core) must be reachable too.
        ridge = [self.settings.ridge * stats.a[i][i] + 1e-9 for i in range(_N)]
        while free:
            a = [[stats.a[i][j] + (ridge[i] if i == j else 0.0) for j in free] for i in free]
            b = [stats.b[i] + ridge[i] * self._phi0[i] for i in free]
            solved = _solve(a, b)
            if solved is None:
                return self.model
            negative = [i for i, v in zip(free, solved, strict=True) if v < 0]
            if not negative:
                for i, v in zip(free, solved, strict=True):
                    phi[i] = v
                break
            # Drop the most negative coefficient (held at zero) and refit the rest.
            worst = min(negative, key=lambda i: solved[free.index(i)])
            free.remove(worst)
            phi[worst] = 0.0
        self._phi = phi
        self.model = replace(self.prior, **{c: p * s for c, p, s in zip(COEFFS, phi, self._scale, strict=True)})
        return self.model


def marginal_prefill_s(model: CostModel, context: int) -> float:
    """Seconds to prefill one token after `context` tokens (the slope the flags describe)."""
    return model.prefill_base_s + model.prefill_ctx_s * context


def coefficients(model: CostModel) -> Mapping[str, float]:
    return {c: getattr(model, c) for c in COEFFS} | {"step_s": model.step_s}


def relative_error(predicted: float, observed: float) -> float:
    """log2(observed / predicted): 0 exact, +1 took twice as long, −1 half."""
    if predicted <= 0 or observed <= 0:
        return math.nan
    return math.log2(observed / predicted)


@dataclass(frozen=True)
class Dispatch:
    """What the router knew when it sent a request: the I/O edge fills it from the
    decision, and `Calibrator.observe` turns it into an observation once the answer is in."""

    worker: str
    total_tokens: int
    predicted_cached: int
    """Prompt tokens the decision predicted reused (GPU or pool)."""
    gpu_tokens: int
    """Of those, on the worker's GPU (the rest copied from the tiers it reaches)."""
    queued_s: float
    """Prefill the load view showed queued on the worker."""
    inflight: int
    engine_waiting: int
    predicted_prefill_s: float
    predicted_ttft_s: float | None
    """The policy's predicted TTFT on this worker (None: the policy does not price)."""
    disk_tokens: int = 0
    """Of the predicted copies, those from its node's disk tier (the rest of the copies from
    its node's pool, but `remote_tokens`)."""
    remote_tokens: int = 0
    """Of the predicted copies, those from the remote tier."""

    def copies(self, reused: int) -> tuple[int, int, int]:
        """(pool, disk, remote) tokens of `reused` (as the engine reported them) that were
        copied: what it reused beyond the GPU's, split between the tiers as predicted (all
        from the pool where no copy was predicted: its node's pool is where LMCache finds
        most)."""
        copied = max(reused - self.gpu_tokens, 0)
        predicted = self.predicted_cached - self.gpu_tokens
        if copied == 0 or predicted <= 0:
            return copied, 0, 0
        disk = round(copied * self.disk_tokens / predicted)
        remote = min(round(copied * self.remote_tokens / predicted), copied - disk)
        return copied - disk - remote, disk, remote


PRIOR_CHECK_ANSWERS = 6
"""Queued answers that check a worker's prior before it has a fit of its own (few: in the
burst that needs them, answers come back seconds apart)."""
PRIOR_OFF_BY = 1.5
"""A prior those answers find too cheap by more than this factor is rescaled: the rule is for
priors off by a different GPU or model (2x and more), not for a few tens of percent. Never
down (`Calibrator._check_prior`)."""
PRIOR_MAX_FACTOR = 10.0
"""Bound on that rescaling: a check of a few answers is no fit; a worker further off than
this (a small model on a CPU core against H200 priors) is reached by its fit."""


class Calibrator:
    """Every worker's estimator, and the costs the load view hands the policy."""

    def __init__(
        self, prior: CostModel, fixed: Iterable[str] = (), settings: EstimatorSettings | None = None,
        queue_fraction: float = 0.5,
    ) -> None:
        self.prior = prior
        self.fixed = frozenset(fixed)
        self.settings = settings or EstimatorSettings()
        self.queue_fraction = queue_fraction
        """A request is fitted only if the queue predicted ahead of it was at most this
        fraction of its own predicted prefill (or of one step): its TTFT is then mostly its
        own, and the small rest is subtracted."""
        self.estimators: dict[str, Estimator] = {}
        self.costs: dict[str, CostModel] = {}
        """Learned models by worker (read by the load board's snapshot)."""
        self.skipped_queued = 0
        self.prior_factors: dict[str, float] = {}
        """Workers whose prior the queued answers checked, and the factor it was scaled by
        (1.0: it stood)."""
        self._prior_ratios: dict[str, list[float]] = {}

    def estimator(self, worker: str) -> Estimator:
        e = self.estimators.get(worker)
        if e is None:
            e = self.estimators[worker] = Estimator(self.prior, self.fixed, self.settings)
        return e

    def observe(
        self, d: Dispatch, first_byte_s: float, cached_tokens: int | None, sent_at: float | None = None,
    ) -> Observation | None:
        """Learn from one answered request (`cached_tokens`: as the engine reported them,
        in the router's token units; None: not reported; `sent_at`: when it was dispatched,
        on the clock the other observations' are; None: undated). Returns what was fitted,
        if any."""
        if d.engine_waiting > 0 or d.queued_s > self.queue_fraction * max(d.predicted_prefill_s, self.prior.step_s):
            self.skipped_queued += 1
            self._check_prior(d, first_byte_s)
            return None
        start = d.predicted_cached if cached_tokens is None else min(max(cached_tokens, 0), d.total_tokens)
        seconds = first_byte_s - d.queued_s
        if seconds <= 0 or d.total_tokens <= 0:
            return None
        pool, disk, remote = d.copies(start)
        obs = Observation(
            start, d.total_tokens, seconds, pool, d.inflight, None if sent_at is None else sent_at + first_byte_s,
            disk, remote,
        )
        e = self.estimator(d.worker)
        e.add(obs)
        if e.learned:
            self.costs[d.worker] = e.model
        return obs

    def _check_prior(self, d: Dispatch, first_byte_s: float) -> None:
        """A worker whose answers all find a queue (a router started into a busy fleet) fits
        nothing, so its prior prices it however far off that prior is, and the backlog a
        mispriced burst leaves is the tail (72B workers priced by the 8B defaults
        at three times a random balancer's load). A queued answer still measures the prior's
        scale: the queue ahead of it was priced by the same prior, so on a worker k times
        slower than the prior says it takes about k times its predicted queue + prefill, or
        longer: a queued answer also waits for work the model does not see (the decodes
        sharing its steps, an engine out of KV admitting it late), which only adds time. So
        the lower quartile of the first few ratios, not their median, rescales the worker's
        prior, once, before its own fit stands; learning goes on from there.

        Only upwards. The ratios bound the worker's slowness from below, not from above: the
        queue they divide by is over-predicted by design (`queued_s` counts a prefill in
        progress whole until its first byte), so a worker the prior prices right shows ratios
        well under 1, and scaling its prior down by them made it look two to three times
        faster than it was (on the Mooncake synthetic trace two workers' priors were
        scaled by 0.33-0.46; each then drew every long prompt and, its answers all queued, fit
        nothing to correct it for 20-30 s). A worker faster than its prior queues less and
        is found by its own fit."""
        worker = d.worker
        if worker in self.prior_factors or self.estimator(worker).learned:
            return
        predicted = d.predicted_prefill_s + d.queued_s
        if predicted <= 0 or first_byte_s <= 0:
            return
        ratios = self._prior_ratios.setdefault(worker, [])
        ratios.append(first_byte_s / predicted)
        if len(ratios) < PRIOR_CHECK_ANSWERS:
            return
        del self._prior_ratios[worker]
        factor = sorted(ratios)[len(ratios) // 4]
        if factor <= PRIOR_OFF_BY:
            self.prior_factors[worker] = 1.0
            return
        factor = min(factor, PRIOR_MAX_FACTOR)
        self.prior_factors[worker] = factor
        e = self.estimators[worker]
        e.rescale_prior(factor)
        self.costs[worker] = e.model

    def export(self) -> dict[str, list[float]]:
        """This replica's statistics per worker (shared through the load board)."""
        return {w: e.stats.export() for w, e in self.estimators.items() if e.observations}

    def absorb(self, remote: Mapping[str, Sequence[Sequence[float]]]) -> None:
        """Other replicas' statistics per worker (each a list of exports): refit with them."""
        for worker in set(self.estimators) | set(remote):
            e = self.estimator(worker)
            e.others = [Stats.from_export(flat) for flat in remote.get(worker, ())]
            if e.learned:
                e.refit()
                self.costs[worker] = e.model

    def forget(self, worker: str) -> None:
        self.estimators.pop(worker, None)
        self.costs.pop(worker, None)
        self.prior_factors.pop(worker, None)
        self._prior_ratios.pop(worker, None)


def cost_readers(calibrator: Calibrator) -> tuple[Callable[[], dict[tuple[str, ...], float]], Callable[[], dict[tuple[str, ...], float]]]:
    """Scrape-time readers for /metrics: (worker, coefficient) -> value, and worker ->
    observations fitted."""

    def coefficients_now() -> dict[tuple[str, ...], float]:
        return {
            (w, c): v for w, e in calibrator.estimators.items() for c, v in coefficients(e.model).items()
        }

    def observations_now() -> dict[tuple[str, ...], float]:
        return {(w,): float(e.observations) for w, e in calibrator.estimators.items()}

    return coefficients_now, observations_now
