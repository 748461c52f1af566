"""`python -m loadtests.benchmark.ablation_table`: one row per run, the full policy and its ablations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtests.benchmark.ablation_table import main, table


def router(mean: float, p99: float, kind: str = "kvroute", policy: str = "cache_aware", **extra: Any) -> dict[str, Any]:
    flag = extra.pop("flag", False)
    return {"kind": kind, "policy": policy, "ttft_mean_s": mean, "ttft_p99_s": p99,
            "harness": {"bottleneck": {"flag": flag}}, **extra}  # fmt: skip


def write_run(path: Path, routers: dict[str, dict[str, Any]]) -> Path:
    path.mkdir()
    (path / "results.json").write_text(json.dumps({"config": {"nodes": 1}, "routers": routers}))
    return path


def test_rows_are_runs_and_columns_line_up_across_pool_suffixes(tmp_path: Path) -> None:
    pool = write_run(tmp_path / "conv-pool", {
        "cache_aware": router(1.0, 10.0),
        "cache_aware~lag": router(1.5, 10.0, ablate=["lag"]),
        "random": router(4.0, 30.0, policy="random", flag=True),
        "sglang-router": router(2.0, 12.0, kind="peer"),
    })  # fmt: skip
    nopool = write_run(tmp_path / "conv-nopool", {
        "cache_aware-nopool": router(2.0, 20.0),
        "cache_aware~caps-nopool": router(1.0, 30.0, ablate=["caps"]),
        "cache_aware+onepool-nopool": router(2.2, 18.0),
        "sglang-router-nopool": router(3.0, 20.0, kind="peer"),
    })  # fmt: skip
    lines = table([pool, nopool]).splitlines()
    # The terms in the policy's order, then the other routers.
    # The full policy run again (on one node `+onepool` changes no flag) follows the first.
    assert lines[0] == "| workload | full | full again | ~lag | ~caps | random | sglang-router |"
    assert lines[2] == (
        "| conv-pool | 1.000 / 10.00 | – | 1.500 / 10.00 (1.50 / 1.00) | – | 4.000 / 30.00 (4.00 / 3.00) † "
        "| 2.000 / 12.00 (2.00 / 1.20) |"
    )
    assert lines[3] == (
        "| conv-nopool | 2.000 / 20.00 | 2.200 / 18.00 (1.10 / 0.90) | – | 1.000 / 30.00 (0.50 / 1.50) | – "
        "| 3.000 / 20.00 (1.50 / 1.00) |"
    )


def test_a_directory_without_results_is_refused(tmp_path: Path, capsys: Any) -> None:
    assert main([str(tmp_path)]) == 2
    assert "no results.json" in capsys.readouterr().err
