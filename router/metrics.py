"""A small Prometheus registry: counters, gauges and histograms with labels.

Written here rather than taken from prometheus_client because the hot path increments
several series per request and per stream: a dict update without locks (one event loop)
is all that needs. Exposition follows the Prometheus text format 0.0.4.
"""

from __future__ import annotations

import bisect
import re
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.tenants.model import Tenant

LabelValues = tuple[str, ...]

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ERROR_BUCKETS = (-3.0, -2.0, -1.0, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0)
"""log2 of observed / predicted: 1/8x .. 8x."""
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: LabelValues, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_: str, labels: Iterable[str] = ()) -> None:
        self.name = name
        self.help = help_
        self.labelnames = tuple(labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_: str, labels: Iterable[str] = ()) -> None:
        super().__init__(name, help_, labels)
        self.values: dict[LabelValues, float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = self.header()
        lines += [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}" for k, v in self.values.items()]
        return lines


class Gauge(Counter):
    kind = "gauge"

    def set(self, *labels: str, value: float) -> None:
        self.values[labels] = value

    def remove(self, *labels: str) -> None:
        self.values.pop(labels, None)


class CallbackGauge(_Metric):
    """A gauge read at scrape time from a callback returning {label values: value}."""

    kind = "gauge"

    def __init__(
        self, name: str, help_: str, labels: Iterable[str], read: Callable[[], dict[LabelValues, float]]
    ) -> None:
        super().__init__(name, help_, labels)
        self.read = read

    def render(self) -> list[str]:
        lines = self.header()
        lines += [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}" for k, v in self.read().items()]
        return lines


class CallbackCounter(CallbackGauge):
    """A counter read at scrape time (the callback returns running totals)."""

    kind = "counter"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self, name: str, help_: str, labels: Iterable[str] = (), buckets: Iterable[float] = DEFAULT_BUCKETS
    ) -> None:
        super().__init__(name, help_, labels)
        self.buckets = tuple(sorted(buckets))
        # per label set: [count per bucket (non-cumulative, +Inf last), sum]
        self.series: dict[LabelValues, tuple[list[int], list[float]]] = {}
        self.exemplars: dict[LabelValues, dict[int, str]] | None = None
        """Per label set, bucket index -> its exemplar's suffix (None: none recorded)."""

    def observe(self, value: float, *labels: str) -> None:
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = ([0] * (len(self.buckets) + 1), [0.0])
        s[0][bisect.bisect_left(self.buckets, value)] += 1
        s[1][0] += value

    def count(self, *labels: str) -> int:
        s = self.series.get(labels)
        return sum(s[0]) if s else 0

    def exemplar(self, value: float, trace_id: str, *labels: str) -> None:
        """The latest traced observation of `value`'s bucket (an observation counted by
        `observe`): its trace id, shown in the OpenMetrics exposition."""
        if self.exemplars is None:
            self.exemplars = {}
        bucket = bisect.bisect_left(self.buckets, value)
        self.exemplars.setdefault(labels, {})[bucket] = f' # {{trace_id="{trace_id}"}} {_num(value)} {time.time():.3f}'

    def render(self, openmetrics: bool = False) -> list[str]:
        lines = self.header()
        for key, (counts, total) in self.series.items():
            cum = 0
            marks = self.exemplars.get(key, {}) if openmetrics and self.exemplars else {}
            for i, (bound, c) in enumerate(zip((*self.buckets, float("inf")), counts, strict=True)):
                cum += c
                le = 'le="+Inf"' if bound == float("inf") else f'le="{_num(bound)}"'
                lines.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {cum}{marks.get(i, '')}")
            lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_num(total[0])}")
            lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {cum}")
        return lines


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def register(self, metric):
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help_: str, labels: Iterable[str] = ()) -> Counter:
        return self.register(Counter(name, help_, labels))

    def gauge(self, name: str, help_: str, labels: Iterable[str] = ()) -> Gauge:
        return self.register(Gauge(name, help_, labels))

    def histogram(
        self, name: str, help_: str, labels: Iterable[str] = (), buckets: Iterable[float] = DEFAULT_BUCKETS
    ) -> Histogram:
        return self.register(Histogram(name, help_, labels, buckets))

    def callback_gauge(
        self, name: str, help_: str, labels: Iterable[str], read: Callable[[], dict[LabelValues, float]]
    ) -> CallbackGauge:
        return self.register(CallbackGauge(name, help_, labels, read))

    def callback_counter(
        self, name: str, help_: str, labels: Iterable[str], read: Callable[[], dict[LabelValues, float]]
    ) -> CallbackCounter:
        return self.register(CallbackCounter(name, help_, labels, read))

    def render(self, openmetrics: bool = False) -> str:
        """The text format 0.0.4; `openmetrics`: OpenMetrics 1.0 (with exemplars), for a
        scraper that asks for it (`OPENMETRICS_TYPE` in its Accept header)."""
        lines: list[str] = []
        if openmetrics:
            for metric in self._metrics.values():
                lines += _openmetrics(metric)
            return "\n".join(lines) + "\n# EOF\n"
        for metric in self._metrics.values():
            lines += metric.render()  # type: ignore[attr-defined]
        return "\n".join(lines) + "\n"


OPENMETRICS_TYPE = "application/openmetrics-text"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def _openmetrics(metric: _Metric) -> list[str]:
    """One family in OpenMetrics: a counter's family is named without `_total`, its samples
    with it; histograms carry their exemplars."""
    lines = metric.render(openmetrics=True) if isinstance(metric, Histogram) else metric.render()  # type: ignore[attr-defined]
    family = metric.name.removesuffix("_total") if metric.kind == "counter" else metric.name
    out = [f"# HELP {family} {_escape(metric.help)}", f"# TYPE {family} {metric.kind}"]
    if metric.kind == "counter" and not metric.name.endswith("_total"):
        return out + [metric.name + "_total" + line[len(metric.name):] for line in lines[2:]]
    return out + lines[2:]


class RouterMetrics:
    """The router's own series. One instance per app (tests run several apps per process).

    Also the index's `cache_client.base.IndexObserver`: `kvroute_index_backend_up`."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.counter(
            "kvroute_requests_total", "Proxied requests by worker, route reason and HTTP status.",
            ("worker", "reason", "status"),
        )
        self.ttft = r.histogram(
            "kvroute_ttft_seconds", "Time from request arrival to the first byte from the worker, as seen by the router."
        )
        self.prompt_tokens = r.counter("kvroute_prompt_tokens_total", "Estimated prompt tokens of routed requests.")
        self.predicted_cached = r.counter(
            "kvroute_predicted_cached_tokens_total",
            "Prompt tokens the router predicted the chosen worker would reuse (its GPU's or copied from a tier).",
        )
        self.predicted_copied = r.counter(
            "kvroute_predicted_copied_tokens_total",
            "Of the predicted cached tokens, those predicted copied from a tier (its node's pool or disk, the "
            "remote tier) rather than found on the worker's GPU.",
            ("tier",),
        )
        self.retries = r.counter(
            "kvroute_retries_total", "Requests retried on another worker after a failure before the first byte."
        )
        self.stream_errors = r.counter(
            "kvroute_stream_errors_total", "Streams ended with an error event after their first byte."
        )
        self.client_disconnects = r.counter(
            "kvroute_client_disconnects_total", "Requests whose client went away before the answer was complete."
        )
        self.rejected = r.counter(
            "kvroute_rejected_total", "Requests answered by the router itself with an error, by code.", ("code",)
        )
        self.route_seconds = r.histogram(
            "kvroute_route_seconds", "Time to canonicalize, hash, look up and decide.", buckets=FAST_BUCKETS
        )
        self.index_lookup_seconds = r.histogram(
            "kvroute_index_lookup_seconds", "Index lookup latency.", buckets=FAST_BUCKETS
        )
        self.index_backend_up = r.gauge(
            "kvroute_index_backend_up", "1 if the configured index backend answers, 0 while on the local fallback."
        )
        self.worker_inflight = r.gauge("kvroute_worker_inflight", "Requests in flight per worker.", ("worker",))
        self.worker_healthy = r.gauge("kvroute_worker_healthy", "1 if the worker passes health checks.", ("worker",))
        self.tenants: TenantMetrics | None = None
        """Per-tenant series, present once tenants are configured (`enable_tenants`)."""
        self.ttft_prediction_error = r.histogram(
            "kvroute_ttft_prediction_error_log2",
            "log2(observed / predicted) time from dispatch to first byte, per worker: 0 exact, 1 twice as long "
            "as predicted, -1 half (streams the cost model priced).",
            ("worker",), buckets=ERROR_BUCKETS,
        )  # fmt: skip

    def enable_cost_learning(
        self, read: Callable[[], dict[LabelValues, float]], observations: Callable[[], dict[LabelValues, float]]
    ) -> None:
        """Expose the learned coefficients (worker, coefficient) and the observations fitted."""
        r = self.registry
        r.callback_gauge(
            "kvroute_cost_coefficient",
            "Each worker's cost model as learned online (seconds; per token for prefill_base_s and "
            "pool_load_s_per_token, per token of context per token for prefill_ctx_s); the prior until it has "
            "enough observations.",
            ("worker", "coefficient"), read,
        )  # fmt: skip
        r.callback_counter(
            "kvroute_cost_observations_total", "Answers the worker's cost model was fitted on.", ("worker",), observations
        )

    def enable_index_stats(self, read: Callable[[], dict[LabelValues, float]]) -> None:
        """Expose a shared index's lookups by how they were answered, and the answers that
        ended before their write reached it (each a turn another replica may route blind)."""
        self.registry.callback_counter(
            "kvroute_index_events_total",
            "Shared index: lookups answered by Redis (remote_lookup) or, over the budget or with Redis "
            "down, by this replica's own view (fallback_lookup); answers that ended before their "
            "write reached Redis (unsettled_write).",
            ("event",), read,
        )  # fmt: skip

    def enable_tenants(self, max_labels: int = 100) -> TenantMetrics:
        if self.tenants is None:
            self.tenants = TenantMetrics(self.registry, max_labels)
        return self.tenants

    def tenant_rejected(self, tenant: Tenant | None, reason: str) -> None:
        """For the tenant limits: a request refused (no-op without tenants)."""
        if self.tenants is not None:
            self.tenants.rejected(tenant, reason)

    def tenant_queue_wait(self, tenant: Tenant | None, seconds: float) -> None:
        """For the fair-share queue: how long a request waited (no-op without tenants)."""
        if self.tenants is not None:
            self.tenants.waited(tenant, seconds)

    def index_backend_state(self, up: bool) -> None:
        self.index_backend_up.set(value=1.0 if up else 0.0)


NO_TENANT = "none"
"""The tenant label of requests without a tenant."""
OTHER_TENANTS = "other"
"""The tenant label of tenants beyond `TenantMetrics.max_labels`."""

_USAGE_OUT = re.compile(rb'"(?:completion_tokens|output_tokens)"\s*:\s*(\d+)')
"""Generated tokens in a worker's usage (chat/completions, Responses, Messages). Unescaped
quotes can only be a JSON key: generated text inside a JSON string has them escaped."""


class TenantMetrics:
    """Per-tenant series, labelled by tenant *name*: never a key or prompt text.

    The label set is bounded: the first `max_labels` tenants seen get their own label, later
    ones share `other`, requests without a tenant are `none`. The limits and the fair-share
    queue report through `rejected` and `queue_wait`."""

    def __init__(self, r: Registry, max_labels: int = 100) -> None:
        self.max_labels = max_labels
        self._labels: dict[str, str] = {}
        self.requests = r.counter(
            "kvroute_tenant_requests_total", "Proxied requests per tenant, by HTTP status.", ("tenant", "status")
        )
        self.prompt_tokens = r.counter(
            "kvroute_tenant_prompt_tokens_total", "Estimated prompt tokens of routed requests, per tenant.", ("tenant",)
        )
        self.generated_tokens = r.counter(
            "kvroute_tenant_generated_tokens_total",
            "Generated tokens per tenant, as the workers' usage reports them (whole answers, and "
            "streams that carry usage).", ("tenant",),
        )
        self.ttft = r.histogram(
            "kvroute_tenant_ttft_seconds", "Time from arrival to the first streamed byte, per tenant.", ("tenant",)
        )
        self.rejections = r.counter(
            "kvroute_tenant_rejected_total", "Requests refused by the tenant limits, by reason.", ("tenant", "reason")
        )
        self.queue_wait = r.histogram(
            "kvroute_tenant_queue_wait_seconds", "Time a request waited in the fair-share queue, per tenant.",
            ("tenant",),
        )

    def label(self, tenant: Tenant | None) -> str:
        if tenant is None:
            return NO_TENANT
        label = self._labels.get(tenant.name)
        if label is None:
            label = tenant.name if len(self._labels) < self.max_labels else OTHER_TENANTS
            if label != OTHER_TENANTS:
                self._labels[tenant.name] = label
        return label

    def request(self, tenant: Tenant | None, status: int) -> None:
        self.requests.inc(self.label(tenant), str(status))

    def prompt(self, tenant: Tenant | None, tokens: int) -> None:
        self.prompt_tokens.inc(self.label(tenant), amount=tokens)

    def first_byte(self, tenant: Tenant | None, seconds: float) -> None:
        self.ttft.observe(seconds, self.label(tenant))

    def generated_in(self, tenant: Tenant | None, data: bytes, streamed_tokens: int = 0) -> int:
        """Count the generated tokens a whole answer, or a stream's last chunks, report
        (and return them: the tenant's token limit is charged them too). A chat or
        completions stream carries usage only if its client asked for it
        (`stream_options.include_usage`); without it, `streamed_tokens`, the relay's count
        of the stream's token events, stands in, so that leaving usage out does not slip
        past a tenant's token limit."""
        found = _USAGE_OUT.findall(data)
        tokens = int(found[-1]) if found else max(streamed_tokens, 0)
        if tokens:
            self.generated_tokens.inc(self.label(tenant), amount=tokens)
        return tokens

    def rejected(self, tenant: Tenant | None, reason: str) -> None:
        """A request the tenant limits refused (`reason`: e.g. requests_per_s, concurrent)."""
        self.rejections.inc(self.label(tenant), reason)

    def waited(self, tenant: Tenant | None, seconds: float) -> None:
        """Time a request spent in the fair-share queue before it got its turn."""
        self.queue_wait.observe(seconds, self.label(tenant))
