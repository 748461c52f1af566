"""What any split decision must give up on a prefill/decode fleet to meet an inter-token target.

`python -m loadtests.benchmark.pd_floor DIR [--itl-ratio 0.5]` reads a `kvroute bench --roles` run
that has a `NAME+agg` entry (the same workers aggregated) and a split entry, and bounds,
from the aggregated run's own requests, what splitting costs in time to first token:

1. The target: `itl_ratio` × the aggregated fleet's inter-token p99.
2. A request prefilled on its decode worker stalls one gap per chunk (the engines' step
   budget) of each decode running there, by the chunk's compute (the simulator's cost
   model) on top of a plain decode step (the aggregated ITL p50). A p99 under the target
   lets at most 1% of all gaps exceed it; the requests whose local prefill would exceed
   it, fewest stalled gaps first, stay local while that allowance lasts; the rest must be
   split: the least split share that can meet the target.
3. Each of those pays at least one decode step (D computes the last prompt token) and the
   transfer of its uncached tokens over the P→D link, with no queue anywhere and P
   holding every prefix the aggregated worker held: the TTFT floor, as a ratio to the
   aggregated mean. P's utilisation from their prefill work, and an M/D/1 wait at that
   utilisation, give the floor with P's queue.

A reference, like the trace replay's ideal floor: no decision is assumed, only the work.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtests.benchmark.traces import ENGINE_TOKEN_BUDGET as CHUNK_TOKENS
from loadtests.sim.costs import KV_LINK_GBPS, build_cost_model
from router.cost import KV_BYTES_PER_TOKEN


def split_floor(
    agg: dict[str, Any], records: Sequence[dict[str, Any]], split: dict[str, Any], *, itl_ratio: float = 0.5,
    profile: str = "h200-llama3-8b", link_gbps: float = KV_LINK_GBPS,
) -> dict[str, Any]:  # fmt: skip
    """The floor (module docstring) from the aggregated entry's summary and measured
    records, and the split entry's summary (its roles and decode workers' running mean)."""
    cost = build_cost_model(profile)
    target = itl_ratio * agg["itl_p99_s"]
    step = agg["itl_p50_s"]
    decoders = [w for w, role in split["roles"].items() if role != "prefill"]
    running = split["queues"]["running_mean_per_worker"]
    per_decoder = sum(running[w] for w in decoders) / len(decoders)
    gaps = sum(max(r["completion_tokens"] - 1, 0) for r in records)
    stalls = []
    for r in records:
        start, end = r["cached_tokens"], r["prompt_tokens"]
        chunks = max(math.ceil((end - start) / CHUNK_TOKENS), 1)
        if step + cost.prefill_s(start, min(end, start + CHUNK_TOKENS)) > target:
            stalls.append((chunks * per_decoder, r))
    stalls.sort(key=lambda s: s[0])
    allowance, kept = 0.01 * gaps, 0
    while kept < len(stalls) and stalls[kept][0] <= allowance:
        allowance -= stalls[kept][0]
        kept += 1
    must_split = [r for _, r in stalls[kept:]]
    per_token = KV_BYTES_PER_TOKEN * 8 / (link_gbps * 1e9)
    added = sum(step + (r["prompt_tokens"] - r["cached_tokens"]) * per_token for r in must_split)
    ttfts = [r["ttft_s"] for r in records]
    mean = sum(ttfts) / len(ttfts)
    work = [cost.prefill_s(r["cached_tokens"], r["prompt_tokens"]) for r in must_split]
    span = max(r["sent_s"] for r in records) - min(r["sent_s"] for r in records)
    prefillers = len(split["roles"]) - len(decoders)
    rho = sum(work) / (prefillers * span) if span > 0 and prefillers else math.inf
    service = sum(work) / len(work) if work else 0.0
    wait = rho / (2 * (1 - rho)) * service if rho < 1 else math.inf
    floor = mean + added / len(records)
    queued = floor + wait * len(must_split) / len(records)
    return {
        "itl_target_s": target, "decode_step_s": step, "running_decodes_per_decode_worker": per_decoder,
        "gaps": gaps, "requests": len(records), "local_prefills_over_target": len(stalls),
        "min_split_share": len(must_split) / len(records), "agg_ttft_mean_s": mean,
        "ttft_floor_mean_s": floor, "ttft_floor_over_agg": floor / mean,
        "prefill_worker_utilisation": rho, "md1_wait_s": wait,
        "ttft_floor_with_queue_mean_s": queued, "ttft_floor_with_queue_over_agg": queued / mean,
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.benchmark.pd_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="a kvroute bench --roles output directory with a NAME+agg entry")
    p.add_argument("--itl-ratio", type=float, default=0.5, help="the ITL p99 target as a ratio to aggregated")
    p.add_argument("--split", default="cache_aware", help="the split entry whose fleet is bounded")
    args = p.parse_args(argv)
    results = json.loads((args.dir / "results.json").read_text())
    routers = results["routers"]
    agg_key = f"{args.split}+agg"
    if agg_key not in routers or args.split not in routers:
        p.error(f"{args.dir} needs entries {args.split} and {agg_key}")
    lines = (args.dir / "requests.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["router"] == agg_key and r["measured"] and r["ttft_s"] is not None]
    profile = results.get("config", {}).get("profile", "h200-llama3-8b")
    link = results.get("config", {}).get("kv_link_gbps") or KV_LINK_GBPS
    floor = split_floor(routers[agg_key], records, routers[args.split], itl_ratio=args.itl_ratio, profile=profile,
                        link_gbps=link)  # fmt: skip
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in floor.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
