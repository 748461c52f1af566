"""PNG plots of a bench run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from loadtests.benchmark.harness import percentile

T = TypeVar("T")


def plot_or_log(prog: str, draw: Callable[[], T]) -> T | None:
    """Draw plots once the results are on disk: a failure (matplotlib missing or broken, a
    figure that cannot be drawn) is logged and costs nothing else."""
    try:
        return draw()
    except Exception as exc:
        print(f"{prog}: no plots ({type(exc).__name__}: {exc}); the results are written", file=sys.stderr)
        return None


def _pyplot():  # imported lazily: matplotlib is the `bench` extra, and slow to import
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(plt: Any, fig: Any, ax: Any, path: Path, title: str, **legend: Any) -> Path:
    """Title, grid and legend, then the PNG written and the figure freed (every plot ends so)."""
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(**{"fontsize": 8, **legend})
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_cdf(ttfts: Mapping[str, Sequence[float]], path: Path, title: str) -> Path:
    """Empirical CDF of TTFT per router, log-scaled time axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, values in ttfts.items():
        xs = sorted(v for v in values if v > 0)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{name} (n={len(xs)})")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (simulated s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.axhline(0.99, color="grey", lw=0.6, ls=":")
    return _finish(plt, fig, ax, path, title)


def ttft_by_turn(
    by_turn: Mapping[str, Mapping[int, Sequence[float]]], path: Path, title: str, max_turn: int = 24
) -> Path:
    """Mean (solid) and p99 (dashed) TTFT against the request's index in its session."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, turns in by_turn.items():
        idx = sorted(t for t in turns if t <= max_turn and turns[t])
        if not idx:
            continue
        means = [sum(turns[t]) / len(turns[t]) for t in idx]
        p99s = [percentile(turns[t], 99) for t in idx]
        (line,) = ax.plot(idx, means, marker="o", ms=3, label=f"{name} mean")
        ax.plot(idx, p99s, ls="--", color=line.get_color(), lw=0.8, label=f"{name} p99")
    ax.set_yscale("log")
    ax.set_xlabel("request index within the session (0 = first)")
    ax.set_ylabel("time to first token (simulated s, log scale)")
    return _finish(plt, fig, ax, path, title, fontsize=7, ncol=2)


def capacity_curve(trials: Mapping[str, Sequence[Mapping[str, object]]], slo_s: float, path: Path, title: str) -> Path:
    """p99 TTFT against offered load, one line per router, from its capacity probes.

    A probe repeated at a larger time scale (its first run was flagged) is drawn once, by its
    last run; flagged probes that stand are drawn hollow."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, runs in trials.items():
        last: dict[float, Mapping[str, object]] = {}
        for t in runs:
            if t.get("ttft_p99_s") is not None:
                last[float(t["rate_per_s"])] = t  # type: ignore[arg-type]
        if not last:
            continue
        rates = sorted(last)
        (line,) = ax.plot(rates, [last[r]["ttft_p99_s"] for r in rates], marker="o", ms=4, label=name)
        flagged = [r for r in rates if last[r].get("bottleneck")]
        if flagged:
            ax.plot(flagged, [last[r]["ttft_p99_s"] for r in flagged], "o", ms=8, mfc="none", color=line.get_color())
    ax.axhline(slo_s, color="grey", lw=0.8, ls="--", label=f"SLO p99 {slo_s:g} s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (sessions started per simulated s, log scale)")
    ax.set_ylabel("TTFT p99 (simulated s, log scale)")
    return _finish(plt, fig, ax, path, title)
