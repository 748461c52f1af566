"""Prometheus text exposition of the simulated engine's vLLM metrics.

Hand-rolled rather than prometheus_client: a cluster runs many workers in one process and
each needs its own registry; the format is a few lines of text.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards and scrapers see the same le's.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""vLLM's buckets for inter-token latency and time per output token."""
LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass
class Histogram:
    buckets: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str) -> Iterable[str]:
        cumulative = 0
        for le, count in zip(self.buckets, self.counts, strict=False):
            cumulative += count
            yield f'{name}_bucket{{{labels},le="{le}"}} {cumulative}'
        yield f'{name}_bucket{{{labels},le="+Inf"}} {self.n}'
        yield f"{name}_count{{{labels}}} {self.n}"
        yield f"{name}_sum{{{labels}}} {self.total}"


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Exposition:
    """Accumulates metric families and renders them in Prometheus text format 0.0.4."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, value: float, labels: str) -> None:
        self._lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]

    def family(self, name: str, kind: str, help_: str, samples: Iterable[tuple[str, float]]) -> None:
        """One metric with several samples: (labels, value) each."""
        self._lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        self._lines += [f"{name}{{{labels}}} {value}" for labels, value in samples]

    def histogram(self, name: str, help_: str, hist: Histogram, labels: str) -> None:
        self._lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        self._lines.extend(hist.lines(name, labels))

    def render(self) -> str:
        return "\n".join(self._lines) + "\n"
