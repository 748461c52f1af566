"""`kvroute bench` support for learned costs: cost-model variants, heterogeneous fleets, the
learned coefficients over a run, and the ideal TTFT floor of a scenario.

* Cost variants: a kvroute policy with `@learned` (no cost flags: the 8B defaults are priors
  and each worker's costs are learned), `@exact` (the simulator's own prefill line and pool
  cost, in the router's wall-clock seconds, learning off) or `@static` (the defaults, learning
  off), e.g. `--policies cache_aware@learned,cache_aware@exact,cache_aware@static`.
* `--speeds F0,F1,...` gives each simulated worker its speed; `--speed-change w3=0.5@120`
  sets one at a simulated second of the run (the simulator's `POST /sim/speed`).
* `CostSampler` reads the router's `kvroute_cost_coefficient` every few simulated seconds;
  `learning_summary` compares the learned per-token prefill cost at 4k and 16k context with
  the simulator's (both in simulated seconds: the router's are wall seconds ÷ time scale).
* `ideal_floor`: each measured request's prefill of only its new tokens (the conversation's
  previous prompt, or the group's shared prefix, held) on an idle worker at the profile's
  speed; `kvroute bench` reports every router's mean TTFT over the mean floor.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from loadtests.benchmark.harness import RequestRecord, parse_prometheus, percentile
from loadtests.benchmark.traces import ENGINE_TOKEN_BUDGET, ideal_ttft_s
from loadtests.benchmark.workload import Workload, session_tokens
from loadtests.sim.costs import CostModel

COST_VARIANTS = ("learned", "exact", "static")
CONTEXTS = (4096, 16384)


def split_variant(name: str) -> tuple[str, str | None]:
    """`cache_aware@learned` -> ("cache_aware", "learned")."""
    policy, sep, variant = name.partition("@")
    if not sep:
        return name, None
    if variant not in COST_VARIANTS:
        raise ValueError(f"unknown cost variant {variant!r}; known: {', '.join(COST_VARIANTS)}")
    return policy, variant


def exact_line(cost: CostModel, time_scale: float) -> list[str]:
    """The simulator's prefill as the router's two-coefficient line (through the marginal
    cost at 0 and 32k context) and its pool cost, in wall seconds (× the time scale)."""
    c0, c32 = cost.marginal_prefill_s(0), cost.marginal_prefill_s(32_768)
    return [
        "--cost-prefill-base-us", f"{c0 * 1e6 * time_scale:.4f}",
        "--cost-prefill-ctx-ns", f"{(c32 - c0) / 32_768 * 1e9 * time_scale:.5f}",
        "--cost-pool-load-us", f"{cost.pool_load_s(1) * 1e6 * time_scale:.5f}",
    ]  # fmt: skip


def cost_args(variant: str, cost: CostModel, time_scale: float) -> list[str]:
    if variant == "learned":
        return ["--cost-learning", "on"]
    if variant == "static":
        return ["--cost-learning", "off"]
    return [*exact_line(cost, time_scale), "--cost-learning", "off"]


@dataclass(frozen=True)
class SpeedChange:
    worker: str
    speed: float
    at_s: float
    """Simulated seconds after the run starts."""


def parse_speed_changes(text: str | None) -> list[SpeedChange]:
    """`w3=0.5@120,w1=2@300`."""
    out = []
    for item in (p.strip() for p in (text or "").split(",") if p.strip()):
        worker, _, rest = item.partition("=")
        speed, _, at = rest.partition("@")
        if not worker or not speed or not at or float(speed) <= 0 or float(at) < 0:
            raise ValueError(f"expected WORKER=SPEED@SIM_SECONDS, got {item!r}")
        out.append(SpeedChange(worker, float(speed), float(at)))
    return out


def parse_speeds(text: str | None, workers: int) -> list[float] | None:
    if not text:
        return None
    speeds = [float(x) for x in text.split(",")]
    if len(speeds) != workers or not all(f > 0 for f in speeds):
        raise ValueError(f"--speeds needs {workers} positive numbers")
    return speeds


async def apply_speed_changes(changes: Sequence[SpeedChange], urls: dict[str, str], time_scale: float) -> None:
    """POST each change to its worker at its simulated second (a task cancelled at the end)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        for change in sorted(changes, key=lambda c: c.at_s):
            await asyncio.sleep(max(start + change.at_s * time_scale - loop.time(), 0.0))
            await client.post(urls[change.worker] + "/sim/speed", json={"speed": change.speed})


class CostSampler:
    """The router's learned coefficients per worker, and the requests it has routed, every
    `interval_s` simulated seconds (a few dozen requests at a seed load: convergence is then
    stated to within that many)."""

    def __init__(self, client: httpx.AsyncClient, router_url: str, time_scale: float, interval_s: float = 2.0) -> None:
        self.client = client
        self.url = router_url + "/metrics"
        self.time_scale = time_scale
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    async def _one(self, t_sim: float) -> None:
        try:
            parsed = parse_prometheus((await self.client.get(self.url, timeout=5)).text)
        except httpx.HTTPError:
            return
        workers: dict[str, dict[str, float]] = {}
        for labels, value in parsed.get("kvroute_cost_coefficient", []):
            workers.setdefault(labels.get("worker", "?"), {})[labels.get("coefficient", "?")] = value
        for labels, value in parsed.get("kvroute_cost_observations_total", []):
            workers.setdefault(labels.get("worker", "?"), {})["observations"] = value
        # log2(observed / predicted) dispatch-to-first-token, summed so far: the model's bias.
        for suffix in ("sum", "count"):
            for labels, value in parsed.get(f"kvroute_ttft_prediction_error_log2_{suffix}", []):
                if labels.get("worker") in workers:
                    workers[labels["worker"]][f"prediction_error_log2_{suffix}"] = value
        routed = sum(value for _, value in parsed.get("kvroute_requests_total", []))
        if workers:
            self.samples.append({"t_sim_s": round(t_sim, 2), "routed": routed, "workers": workers})

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            await self._one((loop.time() - start) / self.time_scale)
            await asyncio.sleep(self.interval_s * self.time_scale)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._one(-1.0)  # the final reading (time unknown: marked -1)


def _learned_marginal(coeffs: dict[str, float], context: int, time_scale: float) -> float | None:
    base, ctx = coeffs.get("prefill_base_s"), coeffs.get("prefill_ctx_s")
    if base is None or ctx is None:
        return None
    return (base + ctx * context) / time_scale


def learning_summary(
    samples: list[dict[str, Any]], cost: CostModel, time_scale: float, speeds: Sequence[float] | None,
    changes: Sequence[SpeedChange] = (), tolerance: float = 0.15, measured_from_s: float = 0.0,
) -> dict[str, Any]:
    """Learned ÷ simulated marginal prefill cost per worker at 4k and 16k context: at the
    end of the run, and the first sample (simulated second, requests the router had routed,
    the worker's observations) from which it stays within `tolerance` (after the last speed
    change of that worker, if any); and the mean log2(observed ÷ predicted TTFT) of the
    requests answered from `measured_from_s` on (the warm-up's, priced by the prior, left out)."""
    out: dict[str, Any] = {}
    if not samples:
        return out
    names = sorted(samples[-1]["workers"])
    for name in names:
        speed = _speed_of(name, speeds)
        changed = [c for c in changes if c.worker == name]
        since = max((c.at_s for c in changed), default=0.0)
        final_speed = max(changed, key=lambda c: c.at_s).speed if changed else speed
        ratios_end = {}
        converged: dict[str, Any] = {}
        for ctx in CONTEXTS:
            truth = cost.marginal_prefill_s(ctx) / final_speed
            series = [
                (s["t_sim_s"], s.get("routed"), s["workers"].get(name, {}).get("observations", 0.0),
                 _learned_marginal(s["workers"].get(name, {}), ctx, time_scale))
                for s in samples
            ]  # fmt: skip
            last = series[-1][3]
            ratios_end[str(ctx)] = last / truth if last is not None else None
            first_ok = None
            for t, routed, obs, v in series:
                inside = v is not None and abs(v / truth - 1) <= tolerance
                if (t >= since or t < 0) and inside:
                    first_ok = first_ok or {"t_sim_s": t, "routed": routed, "observations": obs}
                elif t >= since:
                    first_ok = None
            converged[str(ctx)] = first_ok
        out[name] = {
            "speed": final_speed,
            "learned_over_sim_marginal": ratios_end,
            "within_tolerance_from": converged,
            "observations": samples[-1]["workers"][name].get("observations"),
            "prediction_error_log2_mean": _mean_error_since(samples, name, measured_from_s),
            "coefficients": samples[-1]["workers"][name],
        }
    return out


def _mean_error_since(samples: list[dict[str, Any]], name: str, since_s: float) -> float | None:
    start = next((s for s in samples if s["t_sim_s"] >= since_s), samples[0])["workers"].get(name, {})
    end = samples[-1]["workers"].get(name, {})
    n = end.get("prediction_error_log2_count", 0.0) - start.get("prediction_error_log2_count", 0.0)
    total = end.get("prediction_error_log2_sum", 0.0) - start.get("prediction_error_log2_sum", 0.0)
    return total / n if n > 0 else None


def _speed_of(name: str, speeds: Sequence[float] | None) -> float:
    if not speeds or not name.startswith("w") or not name[1:].isdigit():
        return 1.0
    i = int(name[1:])
    return speeds[i] if i < len(speeds) else 1.0


def ideal_floor(workload: Workload, records: Sequence[RequestRecord], cost: CostModel) -> dict[str, Any]:
    """Ideal TTFT of the measured requests, mean and p99: each reuses its conversation's
    previous prompt (its first turn, the group's shared prefix), perfectly, on an idle worker
    at `cost`'s speed. Each request's TTFT is at least its floor, so the floors' p99 is a
    lower bound on the run's p99 too: the tail no router can remove (the longest new
    prompts' own prefill)."""
    sessions = {s.index: s for s in workload.sessions}
    tokens: dict[int, Any] = {}
    floors = []
    for r in records:
        if not r.measured or r.session not in sessions:
            continue
        if r.session not in tokens:
            s = sessions[r.session]
            tokens[r.session] = session_tokens(s, workload.groups.get(s.group) if s.group is not None else None)
        toks = tokens[r.session]
        if r.turn >= len(toks.prompts):
            continue
        prompt = toks.prompts[r.turn]
        held = toks.prompts[r.turn - 1] if r.turn > 0 else toks.shared
        floors.append(ideal_ttft_s(min(held, prompt), prompt, cost, ENGINE_TOKEN_BUDGET))
    return {"requests": len(floors), "mean_s": sum(floors) / len(floors) if floors else None, "p99_s": percentile(floors, 99)}


UNCALIBRATED = ("exact", "static")
"""The cost variants with learning off that a learned router is compared against."""


def comparison(routers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every router's mean TTFT over the ideal floor, and each learning variant's TTFT
    against `@exact` and `@static` of the same policy, with the least p99 ratio any router
    could show against them (`..._p99_floor_bound`: its floors' p99 over theirs, since no
    request is faster than its own floor)."""
    out: dict[str, Any] = {}
    for key, r in routers.items():
        for stat in ("ttft_mean_over_ideal_floor", "ttft_p99_over_ideal_floor"):
            if r.get(stat) is not None:
                out[f"{key}_{stat}"] = r[stat]
    for key, r in routers.items():
        policy, variant = split_variant(key.split("+")[0].split("-nopool")[0])
        if variant is None or variant in UNCALIBRATED:
            continue
        for ref_variant in UNCALIBRATED:
            ref = routers.get(f"{policy}@{ref_variant}")
            if ref is None:
                continue
            for stat in ("ttft_mean_s", "ttft_p99_s"):
                if r.get(stat) and ref.get(stat):
                    out[f"{key}_over_{ref_variant}_{stat.removeprefix('ttft_').removesuffix('_s')}"] = r[stat] / ref[stat]
            if r.get("ideal_floor_p99_s") and ref.get("ttft_p99_s"):
                out[f"{key}_over_{ref_variant}_p99_floor_bound"] = r["ideal_floor_p99_s"] / ref["ttft_p99_s"]
    return out


def markdown_lines(routers: dict[str, dict[str, Any]], compared: dict[str, Any]) -> list[str]:
    """results.md's lines on the ideal floor and learned costs; `compared`: the run's
    comparison (`comparison`'s keys among them), as computed once for results.json."""
    lines = ["", "## Against the ideal floor, and learned costs", ""]
    for key, r in routers.items():
        over = r.get("ttft_mean_over_ideal_floor")
        floor = r.get("ideal_floor_mean_s")
        text = f"- {key}: TTFT mean ÷ ideal floor {over:.2f} (floor {floor:.3f} s)" if over and floor else f"- {key}:"
        p99_over, p99_floor = r.get("ttft_p99_over_ideal_floor"), r.get("ideal_floor_p99_s")
        if p99_over and p99_floor:
            text += f", p99 ÷ the floors' p99 {p99_over:.2f} ({p99_floor:.3f} s)"
        learned = r.get("cost_learning") or {}
        parts = []
        for worker, w in sorted(learned.items()):
            ratios = w["learned_over_sim_marginal"]
            shown = "/".join(f"{v:.2f}" if v is not None else "–" for v in ratios.values())
            error = w.get("prediction_error_log2_mean")
            bias = f", TTFT observed ÷ predicted {2**error:.2f} (geometric mean)" if error is not None else ""
            parts.append(f"{worker} ×{w['speed']:g}: {shown} ({w['observations']:.0f} obs{bias})")
        if parts:
            text += "; learned ÷ simulated prefill cost per token at 4k/16k: " + ", ".join(parts)
        lines.append(text)
    for key in routers:
        for ref in UNCALIBRATED:
            mean, p99, bound = (compared.get(f"{key}_over_{ref}_{stat}") for stat in ("mean", "p99", "p99_floor_bound"))
            if mean is not None and p99 is not None and bound is not None:
                lines.append(
                    f"- {key} ÷ @{ref}: TTFT mean {mean:.2f}, p99 {p99:.2f} "
                    f"(no router's p99 below {bound:.2f}: its floors' p99 over @{ref}'s)"
                )
    return lines
