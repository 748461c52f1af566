"""The index keys on the cache scope: a request's `cache_salt` seeds its estimate chain (no
key shared between salts, every key shared within one), precise chains hash it as vLLM does
(checked against vLLM's own hash function where its venv exists), and the simulated engine
shares no block between salts."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from loadtests.sim.engine import BlockHasher as SimHasher
from loadtests.sim.engine import block_hashes_of
from loadtests.sim.pool import chunk_keys
from normalizer.vllm_hash import BlockHasher
from router.chain import EstimateChainBuilder
from router.tenants.model import Tenant
from router.tenants.salt import CacheSalter

SALTER = CacheSalter(b"chain-scope-test-secret")
A = SALTER.salt_for(Tenant("alice"))
B = SALTER.salt_for(Tenant("bob"))
DOC = "The quarterly figures, line by line. " * 400  # ~3,700 tokens: many blocks

BODIES = {
    "chat": {"model": "m", "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": "sum up"}]},
    "completion": {"model": "m", "prompt": DOC},
    "responses": {"model": "m", "input": [{"role": "user", "content": DOC}]},
    "messages": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": DOC}]},
}


@pytest.mark.parametrize("kind", list(BODIES))
def test_different_salts_share_no_key_and_equal_salts_share_all(kind: str) -> None:
    build = EstimateChainBuilder().build
    body = BODIES[kind]
    plain = build(body, kind)  # type: ignore[arg-type]
    a1 = build({**body, "cache_salt": A}, kind)  # type: ignore[arg-type]
    a2 = build({**body, "cache_salt": A}, kind)  # type: ignore[arg-type]
    b = build({**body, "cache_salt": B}, kind)  # type: ignore[arg-type]
    assert len(a1) == len(plain) > 10
    assert a1.keys == a2.keys
    assert not set(a1.keys) & set(b.keys)
    assert not set(a1.keys) & set(plain.keys)
    assert a1.cum_tokens == plain.cum_tokens  # the salt is no prompt: token counts unchanged


def test_a_group_shares_its_chain() -> None:
    carol, dave = Tenant("carol", cache_scope="team"), Tenant("dave", cache_scope="team")
    build = EstimateChainBuilder().build
    body = BODIES["chat"]
    assert build({**body, "cache_salt": SALTER.salt_for(carol)}, "chat").keys == \
        build({**body, "cache_salt": SALTER.salt_for(dave)}, "chat").keys


def test_precise_keys_differ_for_every_block_between_salts() -> None:
    hasher = BlockHasher(16)
    tokens = list(range(160))
    a, b, plain = hasher.keys(tokens, cache_salt=A), hasher.keys(tokens, cache_salt=B), hasher.keys(tokens)
    assert len(a) == 10 and a == hasher.keys(tokens, cache_salt=A)
    assert not set(a) & set(b) and not set(a) & set(plain)  # the first block's salt chains on


def test_the_simulated_engine_shares_no_block_between_salts() -> None:
    data = DOC.encode()
    a, b, plain = block_hashes_of(data, b"m", A), block_hashes_of(data, b"m", B), block_hashes_of(data, b"m")
    assert len(a) > 100 and a == block_hashes_of(data, b"m", A)
    assert not set(a) & set(b) and not set(a) & set(plain)
    sim = SimHasher(b"m")  # the memoising hasher agrees, salted or not, in any order
    assert sim.hashes(data, B) == b and sim.hashes(data) == plain and sim.hashes(data, A) == a
    keys_a, keys_b = chunk_keys(data, "m", A), chunk_keys(data, "m", B)
    assert keys_a and not set(keys_a) & set(keys_b) and keys_a == chunk_keys(data, "m", A)


VENV = Path(os.environ.get("KVROUTE_VLLM_VENV", Path.home() / ".cache" / "kvroute" / "vllm-venv"))

_VLLM_SNIPPET = r"""
import json, sys
from types import SimpleNamespace
from vllm.v1.core import kv_cache_utils as k
try:
    from vllm.utils.hashing import get_hash_fn_by_name
except ImportError:
    from vllm.utils import get_hash_fn_by_name
args = json.loads(sys.argv[1])
fn = get_hash_fn_by_name(args["algo"])
k.init_none_hash(fn)
req = SimpleNamespace(mm_features=[], lora_request=None, cache_salt=args["salt"], prompt_embeds=None,
                      _prompt_embeds_per_block_hashes={})
bs, tokens, parent, out = args["block_size"], args["tokens"], None, []
for start in range(0, len(tokens) // bs * bs, bs):
    extra, _ = k.generate_block_hash_extra_keys(req, start, start + bs, 0)
    parent = k.hash_block_tokens(fn, parent, tokens[start:start + bs], extra)
    out.append(bytes(parent).hex())
print(json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason=f"no vLLM venv at {VENV} (setup_env.sh)")
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_salted_block_hashes_match_vllms_own(algo: str) -> None:
    tokens = list(range(1000, 1100))
    args = {"algo": algo, "salt": A, "block_size": 16, "tokens": tokens}
    # PYTHONHASHSEED fixes vLLM's NONE_HASH (some releases draw it at random without it).
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    out = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", _VLLM_SNIPPET, json.dumps(args)],
        capture_output=True, text=True, timeout=300, check=True, env=env,
    )
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    mine = [d.hex() for d in BlockHasher(16, algo, seed="0").digests(tokens, cache_salt=A)]
    assert mine == theirs


async def test_precise_self_check_knows_the_tenants_salts() -> None:
    """With tenants every prefix is salted: the KV-event self-check verifies it with the
    router's salts instead of flagging a misconfiguration; unknown salts are no mismatch
    once a salted prefix verified, and a misconfigured hasher is still caught."""
    from cache_client.kv_events import KvEvent, KvEventIngestor, KvEventSource
    from cache_client.memory import MemoryIndex

    tokens = list(range(64))
    hasher = BlockHasher(16)
    src = KvEventSource("w1", "tcp://127.0.0.1:1")

    def stored(salt: str | None) -> KvEvent:
        return KvEvent("stored", tuple(hasher.keys(tokens, cache_salt=salt)), token_ids=tuple(tokens), block_size=16)

    ing = KvEventIngestor(MemoryIndex(), hasher=hasher)
    ing.salts = lambda: [A]
    await ing.apply(src, [stored(A), stored(B), stored(None)])
    assert ing.stats.of(src.key).hash_checks == 3
    assert ing.stats.of(src.key).hash_mismatches == 0  # A verified; B: a salt not known yet

    wrong = KvEventIngestor(MemoryIndex(), hasher=BlockHasher(16, "sha256_cbor"))
    wrong.salts = lambda: [A]
    wrong.verify_hashes = 2
    await wrong.apply(src, [stored(A) for _ in range(2)])
    assert wrong.stats.of(src.key).hash_mismatches == 1  # nothing ever verifies: flagged
