"""vLLM's prefix-cache block hashes, reproduced exactly. Pure functions.

vLLM (v1 engine, `vllm/v1/core/kv_cache_utils.py`) identifies every *full* block of
`block_size` prompt tokens by a chained hash:

    hash_i = H((hash_{i-1} or NONE_HASH, tuple(block_i_token_ids), extra_keys_i))
    NONE_HASH = H(seed)          seed = $PYTHONHASHSEED if set, else "vllm-none-hash"

where H is the `--prefix-caching-hash-algo`:

* `sha256` (default): SHA-256 of `pickle.dumps(obj, protocol=HIGHEST_PROTOCOL)`;
* `sha256_cbor`: SHA-256 of `cbor2.dumps(obj, canonical=True)` (language-independent).

`extra_keys` is None for plain text requests; a request's `cache_salt` adds
`(("cache_salt", salt),)` to its first block (LoRA and multimodal inputs add keys this
module does not model). KV events carry hashes in vLLM's "external" form: with
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` (the default) the low 64 bits of the digest read as
a big-endian unsigned integer, else the raw digest bytes. The router keys its index by that
64-bit integer, so keys computed here and keys received in events compare directly.

The non-cryptographic `xxhash` algorithms are deliberately unsupported: vLLM seeds them
with per-process random bytes unless PYTHONHASHSEED is set, so no router could reproduce
them by default.

Checked against hashes captured from a real vLLM worker: tests/fixtures/vllm_block_hashes.json.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

HashAlgo = Literal["sha256", "sha256_cbor"]
HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
"""vLLM's fixed seed for cryptographic algorithms when PYTHONHASHSEED is unset."""

PICKLE_PROTOCOL = 5
"""`pickle.HIGHEST_PROTOCOL` on every CPython vLLM supports (3.10-3.14)."""

_MASK64 = (1 << 64) - 1


# -- canonical CBOR (RFC 8949 §4.2.1 / cbor2 canonical=True) for the value shapes vLLM hashes --
def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([(major << 5) | value])
    if value < 1 << 8:
        return bytes([(major << 5) | 24, value])
    if value < 1 << 16:
        return bytes([(major << 5) | 25]) + struct.pack(">H", value)
    if value < 1 << 32:
        return bytes([(major << 5) | 26]) + struct.pack(">I", value)
    return bytes([(major << 5) | 27]) + struct.pack(">Q", value)


def _cbor_int(value: int) -> bytes:
    major, n = (0, value) if value >= 0 else (1, -1 - value)
    if n <= _MASK64:
        return _cbor_head(major, n)
    # Bignums (tag 2 / 3): arbitrary-precision integers, as cbor2 encodes them.
    payload = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return _cbor_head(6, 2 + major) + _cbor_head(2, len(payload)) + payload


def cbor_canonical(value: Any) -> bytes:
    """Canonical CBOR of None, bools, ints, bytes, str, lists/tuples and str/int-keyed dicts.

    The same bytes `cbor2.dumps(value, canonical=True)` produces for these types, so the
    router needs no cbor2 dependency. Floats and other types raise TypeError: vLLM never
    puts them in a text request's block hash.
    """
    if value is None:
        return b"\xf6"
    if value is True:
        return b"\xf5"
    if value is False:
        return b"\xf4"
    if isinstance(value, int):
        return _cbor_int(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        return _cbor_head(2, len(data)) + data
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(value, (list, tuple)):
        return _cbor_head(4, len(value)) + b"".join(cbor_canonical(v) for v in value)
    if isinstance(value, dict):
        # Canonical order: by the encoded key, shorter first, then bytewise.
        items = sorted(((cbor_canonical(k), cbor_canonical(v)) for k, v in value.items()),
                       key=lambda kv: (len(kv[0]), kv[0]))
        return _cbor_head(5, len(items)) + b"".join(k + v for k, v in items)
    raise TypeError(f"cannot CBOR-encode {type(value).__name__} the way vLLM hashes blocks")


# -- the hash functions ---------------------------------------------------------------------
def sha256_pickle(value: Any) -> bytes:
    """vLLM's `sha256`: SHA-256 over the pickle of the value."""
    return hashlib.sha256(pickle.dumps(value, protocol=PICKLE_PROTOCOL)).digest()


def sha256_cbor(value: Any) -> bytes:
    """vLLM's `sha256_cbor`: SHA-256 over the canonical CBOR of the value."""
    return hashlib.sha256(cbor_canonical(value)).digest()


def hash_function(algo: str):
    if algo == "sha256":
        return sha256_pickle
    if algo == "sha256_cbor":
        return sha256_cbor
    raise ValueError(
        f"unsupported prefix-caching hash algorithm {algo!r}: use one of {', '.join(HASH_ALGOS)} "
        "(xxhash variants are randomly seeded per vLLM process)"
    )


def none_hash(algo: str = "sha256", seed: str = DEFAULT_NONE_HASH_SEED) -> bytes:
    """The parent hash of every prefix's first block (`NONE_HASH`)."""
    return hash_function(algo)(seed)


def hash_block_tokens(
    algo: str,
    parent: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
    *,
    seed: str = DEFAULT_NONE_HASH_SEED,
) -> bytes:
    """One block's hash, chained to `parent` (None: the first block of a prefix)."""
    if not parent:
        parent = none_hash(algo, seed)
    return hash_function(algo)((parent, tuple(token_ids), extra_keys))


def external_hash(digest: bytes) -> int:
    """A digest as KV events carry it: the low 64 bits, big-endian, unsigned."""
    return int.from_bytes(digest, "big") & _MASK64


@dataclass(frozen=True)
class BlockHasher:
    """vLLM's request block hasher for one (block size, algorithm, seed)."""

    block_size: int = 16
    algo: str = "sha256"
    seed: str = DEFAULT_NONE_HASH_SEED
    _fn: Any = field(init=False, repr=False, compare=False)
    _none: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        fn = hash_function(self.algo)
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_none", fn(self.seed))

    @property
    def none_hash(self) -> bytes:
        return self._none

    def digests(
        self,
        token_ids: Sequence[int],
        *,
        max_blocks: int | None = None,
        cache_salt: str | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """Digests of the full blocks of `token_ids` (at most `max_blocks`).

        `parent` continues a chain (the digest before `token_ids[0]`); `cache_salt` is only
        mixed into the first block of a prefix, as vLLM does.
        """
        bs = self.block_size
        n = len(token_ids) // bs
        if max_blocks is not None:
            n = min(n, max(max_blocks, 0))
        fn = self._fn
        prev = parent or self._none
        out: list[bytes] = []
        for i in range(n):
            extra = (("cache_salt", cache_salt),) if (cache_salt and i == 0 and parent is None) else None
            prev = fn((prev, tuple(token_ids[i * bs : (i + 1) * bs]), extra))
            out.append(prev)
        return out

    def keys(self, token_ids: Sequence[int], **kwargs: Any) -> list[int]:
        """The blocks' hashes in KV-event (64-bit integer) form."""
        return [external_hash(d) for d in self.digests(token_ids, **kwargs)]

    def cacheable_blocks(self, num_prompt_tokens: int) -> int:
        """Blocks of a prompt the engine can serve from cache.

        vLLM always computes at least the last prompt token (its logits start decoding), so
        a prompt of exactly k·block_size tokens can hit at most k-1 blocks.
        """
        return max(num_prompt_tokens - 1, 0) // self.block_size


# -- reading a worker's configuration ---------------------------------------------------------
def parse_cache_config_info(metrics_text: str) -> dict[str, str]:
    """Labels of `vllm:cache_config_info` from a worker's Prometheus /metrics text."""
    for line in metrics_text.splitlines():
        if not line.startswith("vllm:cache_config_info{"):
            continue
        body = line[len("vllm:cache_config_info{") : line.rindex("}")]
        labels: dict[str, str] = {}
        i = 0
        while i < len(body):
            eq = body.index("=", i)
            name = body[i:eq].strip().lstrip(",").strip()
            # Label values are double-quoted with backslash escapes.
            j = eq + 2
            value = []
            while body[j] != '"':
                if body[j] == "\\":
                    j += 1
                    value.append({"n": "\n"}.get(body[j], body[j]))
                else:
                    value.append(body[j])
                j += 1
            labels[name] = "".join(value)
            i = j + 1
        return labels
    return {}


@dataclass(frozen=True)
class WorkerHashConfig:
    block_size: int
    algo: str
    prefix_caching: bool
    capacity_tokens: int | None
    """KV-cache size in tokens (num_gpu_blocks · block_size), when the worker reports it."""


def hash_config_from_metrics(metrics_text: str) -> WorkerHashConfig | None:
    """Block size, hash algorithm and capacity from `vllm:cache_config_info`, if present."""
    labels = parse_cache_config_info(metrics_text)
    if not labels or "block_size" not in labels:
        return None
    block_size = int(labels["block_size"])
    hbs = labels.get("hash_block_size", "None")
    if hbs not in ("", "None"):
        block_size = int(hbs)
    capacity = None
    blocks = labels.get("num_gpu_blocks", "None")
    if blocks not in ("", "None") and labels.get("block_size", "None") not in ("", "None"):
        capacity = int(blocks) * int(labels["block_size"])
    return WorkerHashConfig(
        block_size=block_size,
        algo=labels.get("prefix_caching_hash_algo", "sha256"),
        prefix_caching=labels.get("enable_prefix_caching", "True") == "True",
        capacity_tokens=capacity,
    )
