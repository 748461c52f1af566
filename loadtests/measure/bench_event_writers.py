"""Redis work of precise mode's KV-event writes with several router replicas (JSON on stdout).

    python -m loadtests.measure.bench_event_writers [--redis URL] [--replicas 4] [--batches 2000]

Each replica receives every worker's KV events. The replicas here ingest the same batches
(16 stored blocks each, and every fourth batch 4 of them evicted) into `RedisIndex`es that
share one prefix, once with every replica writing the events to Redis (as before the
writer election) and once with the elected writer alone (`RedisLoadBoard.writes_events`,
`KvEventIngestor.follow`), alternating, `--rounds` times each. Reported per run: the
index scripts Redis ran (`EVALSHA` calls), the time it spent in them (`INFO
commandstats`) and its CPU time. Needs a Redis nobody else is loading: the figures are
the server's totals over each run. Keys go under a fresh prefix and are removed after.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from typing import Any

import orjson
import redis

from cache_client.kv_events import KvEvent, KvEventIngestor, KvEventSource
from cache_client.redis_conn import RedisBackend, parse_redis_url
from cache_client.redis_index import RedisIndex
from router.load.redis import RedisLoadBoard
from router.services import event_writer_election


def _server_totals(client: redis.Redis) -> tuple[int, int, float]:
    scripts = client.info("commandstats").get("cmdstat_evalsha", {})
    cpu = client.info("cpu")
    return int(scripts.get("calls", 0)), int(scripts.get("usec", 0)), cpu["used_cpu_sys"] + cpu["used_cpu_user"]


async def one_run(url: str, replicas: int, batches: int, elect: bool, client: redis.Redis) -> dict[str, Any]:
    prefix = f"bench-writers-{uuid.uuid4().hex[:8]}"
    made: list[tuple[RedisIndex, RedisLoadBoard, KvEventIngestor]] = []
    for i in range(replicas):
        index = RedisIndex(RedisBackend(parse_redis_url(url), budget_s=1.0), prefix=prefix)
        await index.connect()
        board = RedisLoadBoard(index.backend, prefix=prefix, replica_id=f"r{i}")
        ingestor = KvEventIngestor(index)
        follow = event_writer_election(index, board) if elect else None
        if follow is not None:
            ingestor.follow(*follow)
        made.append((index, board, ingestor))
    for _, board, _ in made * 2:  # twice: every replica sees every other's registry entry
        await board.sync()
    before = _server_totals(client)
    source = KvEventSource("w1", "tcp://127.0.0.1:1")
    for n in range(batches):
        keys = tuple(range(n * 16 + 1, n * 16 + 17))
        for _, _, ingestor in made:
            await ingestor.apply(source, [KvEvent("stored", keys, block_size=16)])
            if n % 4 == 3:
                await ingestor.apply(source, [KvEvent("removed", keys[-4:])])
    for index, _, _ in made:
        await index.flush()
    after = _server_totals(client)
    writers = sum(1 for _, board, _ in made if board.writes_events) if elect else replicas
    for index, board, _ in made:
        await board._leave()
        await index.close()
    for key in client.scan_iter(match="{" + prefix + "}*"):
        client.delete(key)
    return {
        "writers": writers,
        "index_script_calls": after[0] - before[0],
        "redis_script_ms": round((after[1] - before[1]) / 1e3, 1),
        "redis_cpu_s": round(after[2] - before[2], 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    client = redis.Redis.from_url(args.redis)
    runs = []
    for _ in range(args.rounds):
        for elect in (False, True):
            runs.append({"elected_writer": elect, **asyncio.run(one_run(args.redis, args.replicas, args.batches, elect, client))})
    out = {"replicas": args.replicas, "batches": args.batches, "blocks_per_batch": 16, "runs": runs}
    sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
