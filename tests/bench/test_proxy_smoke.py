"""`kvroute bench-proxy` end to end at toy scale: direct and one kvroute, every mode.

Checks the shape of results.json and that nothing failed; no timing is asserted (timings
belong to the benchmark's own output, on a quiet machine)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.benchmark import bench_proxy

LEVEL_KEYS = ("added_p50_ms", "added_p99_ms", "req_per_s", "chunks_per_s", "cpu_s_per_1k", "errors", "rss_mb")


def test_bench_proxy_writes_results_with_zero_errors(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    rc = bench_proxy.cli([
        "--out", str(out), "--levels", "1,4", "--duration", "0.5", "--warmup", "0.2", "--repeats", "1",
        "--routers", "direct,kvroute-round_robin", "--modes", "nonstream,stream,paced",
        "--paced-min-level", "4", "--paced-ms", "2", "--chunks", "5", "--workers", "2",
    ])  # fmt: skip
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["routers"]) == {"direct", "kvroute-round_robin"}
    for name, levels in results["routers"].items():
        assert set(levels) == {"c1", "c4"}
        for level, figures in levels.items():
            for key in LEVEL_KEYS:
                assert key in figures, (name, level, key)
            assert figures["errors"] == 0, (name, level, figures)
            assert figures["req_per_s"] > 0
            assert figures["chunks_per_s"] > 0
            assert figures["nonstream"]["repeats"] == 1 and figures["stream"]["repeats"] == 1
            assert ("paced" in figures) == (level == "c4")
    kv = results["routers"]["kvroute-round_robin"]["c4"]
    assert kv["cpu_s_per_1k"] > 0 and kv["rss_mb"] > 0 and kv["chunks_per_cpu_s"] > 0
    assert kv["added_p50_ms"] is not None
    assert results["routers"]["direct"]["c1"]["cpu_s_per_1k"] is None  # no router process to measure
    assert (out / "results.md").read_text().count("| kvroute-round_robin |") == 2
    assert (out / "results.png").stat().st_size > 0
