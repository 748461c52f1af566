"""One markdown table from `kvroute bench --ablate` runs: what each term of cache_aware is worth.

    python -m loadtests.benchmark.ablation_table DIR [DIR...]

Each DIR holds one run's `results.json`; its row is named after the DIR. The columns: the full
policy (the cache_aware entry with no term switched off, with or without the pool), each
`cache_aware~TERM` entry, then the other routers of the run (random, the peers). Each cell
is the TTFT mean / p99 in simulated seconds and, beside the full policy's, their ratios to
it; † marks an entry the bench flagged as measuring the machine rather than the fleet
(`harness.bottleneck`). Columns ignore the pool suffixes (`-nopool`, `+pool`): the row's
run says which fleet it was.

A run of one node may list `cache_aware+onepool` too: with a single node kvroute gets the
same flags as `cache_aware`, so it is the full policy run again later in the same run (the
column `full again`), whose ratio to the first is the run's own swing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from router.policies.cache_aware import TERMS

FULL = "full"
REPEAT = "full again"
REPEAT_KEY = "cache_aware+onepool"
POOL_SUFFIXES = ("-nopool", "+pool")


def column_of(key: str, router: dict[str, Any], one_node: bool) -> str:
    """The column a router of results.json goes in: `full`, `full again`, `~TERM` or its
    own name (without its pool suffix)."""
    for suffix in POOL_SUFFIXES:
        key = key.removesuffix(suffix)
    ablated = router.get("ablate") or []
    if ablated:
        return "~" + "~".join(ablated)
    if key == "cache_aware":
        return FULL
    return REPEAT if key == REPEAT_KEY and one_node else key


def load_row(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Column -> that router's summary, of one run."""
    results = json.loads((run_dir / "results.json").read_text())
    one_node = results.get("config", {}).get("nodes", 1) == 1
    return {column_of(key, r, one_node): r for key, r in results["routers"].items()}


def _order(columns: set[str]) -> list[str]:
    terms = [f"~{t}" for t in TERMS if f"~{t}" in columns]
    combos = sorted(c for c in columns if c.startswith("~") and c not in terms)
    others = sorted(c for c in columns if c not in (FULL, REPEAT) and not c.startswith("~"))
    return [c for c in (FULL, REPEAT) if c in columns] + terms + combos + others


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value is not None and base else "–"


def cell(router: dict[str, Any] | None, full: dict[str, Any] | None) -> str:
    if router is None:
        return "–"
    mean, p99 = router.get("ttft_mean_s"), router.get("ttft_p99_s")
    if mean is None or p99 is None:
        return "failed"
    text = f"{mean:.3f} / {p99:.2f}"
    if full is not None and router is not full:
        text += f" ({_ratio(mean, full.get('ttft_mean_s'))} / {_ratio(p99, full.get('ttft_p99_s'))})"
    flagged = router.get("harness", {}).get("bottleneck", {}).get("flag")
    return text + (" †" if flagged else "")


def table(run_dirs: list[Path]) -> str:
    rows = {d.name: load_row(d) for d in run_dirs}
    columns = _order({c for row in rows.values() for c in row})
    lines = [
        "| workload | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name, row in rows.items():
        full = row.get(FULL)
        lines.append(f"| {name} | " + " | ".join(cell(row.get(c), full) for c in columns) + " |")
    lines += [
        "",
        "TTFT mean / p99 (simulated s); in brackets each ÷ the full policy's; † the bench's bottleneck flag.",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.benchmark.ablation_table", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="run directories, each with results.json (one row each)")
    args = p.parse_args(argv)
    missing = [str(d) for d in args.dirs if not (d / "results.json").is_file()]
    if missing:
        print(f"no results.json in: {', '.join(missing)}", file=sys.stderr)
        return 2
    print(table(args.dirs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
