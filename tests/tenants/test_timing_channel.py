"""The side-channel timing trial (loadtests/measure/tenant_timing.py): its statistics, and a short
trial through two replicas sharing Redis in front of simulated workers. The timing verdict
itself (probe against cold TTFT) is the loadtest's, measured on an idle machine: here only
what does not depend on the machine's speed is asserted."""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import httpx
import pytest

from loadtests.measure.tenant_timing import (
    TENANTS,
    Backend,
    Sent,
    auc,
    report,
    router_args,
    routers,
    run_rounds,
    summed_hits,
)
from loadtests.sim.cluster import SimCluster


def test_auc_is_one_when_every_x_is_faster_and_a_half_for_the_same_samples() -> None:
    fast, slow = [0.01 * i for i in range(1, 21)], [1 + 0.01 * i for i in range(1, 21)]
    assert auc(fast, slow)[0] == 1.0 and auc(fast, slow)[1] < 1e-6
    assert auc(slow, fast)[0] == 0.0
    same_auc, same_p = auc(slow, list(slow))
    assert same_auc == 0.5 and same_p == pytest.approx(1.0)


def test_auc_counts_ties_as_halves_and_is_undefined_without_samples() -> None:
    assert auc([1.0, 2.0], [1.0, 3.0])[0] == pytest.approx(0.625)  # (1/2 + 1 + 0 + 1) / 4
    assert all(math.isnan(v) for v in auc([], [1.0]))


def sent(kind: str, ttft: float, cached: int = 0, prompt: int = 4000) -> Sent:
    return Sent(kind, 0, 0, ttft, prompt, cached, float(cached))


def test_report_fails_a_probe_that_reused_tokens_or_a_resend_that_missed() -> None:
    good = [sent("probe", 0.12), sent("cold", 0.12), sent("resend", 0.03, 3900), sent("group", 0.03, 3900)]
    assert report(good * 3)["checks"]["probe_reuses_nothing"]
    assert report(good * 3)["checks"]["hits_distinguishable_from_cold"]
    leaky = [*good, sent("probe", 0.03, 3900)]
    assert not report(leaky)["checks"]["probe_reuses_nothing"]
    missed = [*good, sent("resend", 0.12, 0)]
    assert not report(missed)["checks"]["resend_hits"]



@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.sim_cluster(workers=2, time_scale=0.05)
def test_a_short_trial_through_two_replicas_isolates_and_shares_as_configured(
    cluster: SimCluster, tmp_path: Path, redis_prefix: str
) -> None:
    (tmp_path / "tenants.yaml").write_text(TENANTS)
    (tmp_path / "salt").write_text(uuid.uuid4().hex * 2 + "\n")
    args = router_args(tmp_path / "tenants.yaml", tmp_path / "salt", 2, redis_prefix)
    urls = list(cluster.worker_urls.values())

    def reset() -> None:
        for u in urls:
            httpx.post(u + "/reset_prefix_cache", timeout=30).raise_for_status()

    with routers(cluster.worker_urls, args, 2, tmp_path) as rs:
        backend = Backend(rs, cluster.model, lambda: summed_hits(urls), reset, settle_s=0.05)
        sends = run_rounds(backend, rounds=2, words=2700, seed=3)
    assert {s.replica for s in sends} == {0, 1}
    assert all(s.prompt_tokens > 3500 and not math.isnan(s.ttft_s) for s in sends)
    checks = report(sends)["checks"]
    assert checks["probe_reuses_nothing"] and checks["resend_hits"] and checks["group_hits"]
