"""The cost model behind cache-aware routing: predicted time to first token.

Defaults are derived from `shared/calibration/h200_kv_costs.json` (one H200, bf16,
Llama-3-8B-shaped layers, 32 layers):

* prefill cost per token grows with context (attention is quadratic). The calibration gives
  the whole prompt's prefill time T(N) for N = 1k..32k tokens (32 layers): 92 ms at 4k,
  474 ms at 16k, 1210 ms at 32k. T(N) = base·N + ctx·N²/2 with base = 20.3 µs and
  ctx = 1.01 ns fits 4k..32k within 1.5% (below 4k fixed overheads dominate: 28 ms at 1k,
  which a router can ignore). The marginal cost of token x is base + ctx·x, so prefilling
  tokens start..end with start already cached costs base·(end-start) + ctx·(end²-start²)/2.
* a pool hit is charged the host→device copy instead: 128 KiB of K and V per token
  (32 layers · 8 KV heads · 128 dims · 2 · bf16) over 55 GB/s pinned ≈ 2.4 µs/token.
* the slower tiers (`cache_client/tiers.py`) are charged their read into host memory, then
  that copy: from a node's NVMe disk at 7 GB/s, 18.7 + 2.4 ≈ 21.1 µs/token (about a
  zero-context token's prefill: a disk copy pays only for long contexts on this model, and
  far more on larger ones); from the remote tier at 100 Gb/s, 10.5 + 2.4 ≈ 12.9 µs/token.
  A worker loads each run from the first tier holding it in LMCache's order (pool, disk,
  remote). A tier a worker cannot reach (another node's pool or disk) is not offered to
  it: its tokens are a recompute there.

Queued prefill is tracked separately (`WorkerLoad.queued_prefill_s`); the in-flight penalty
only covers the batch steps that running decodes lengthen.

Another model is described with the same five numbers (`--cost-*` flags). Those are priors:
unless `--cost-learning off`, each worker's coefficients are learned online from its answers
(`router/calibration.py`), except the ones set explicitly by flag, which stand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol


class Queue(Protocol):
    """What the TTFT prediction reads of a worker's load (`router.routing.WorkerLoad`)."""

    @property
    def inflight(self) -> int: ...
    @property
    def queued_prefill_s(self) -> float: ...
    @property
    def lag_s(self) -> float: ...


DEFAULTS = {"prefill_base_us": 20.3, "prefill_ctx_ns": 1.01, "pool_load_us": 2.4, "inflight_penalty_ms": 0.3, "step_ms": 15.0}
"""The `--cost-*` defaults (the H200 Llama-3-8B calibration above)."""
KV_BYTES_PER_TOKEN = 131_072
"""K and V of one token of Llama-3-8B in bf16: 32 layers · 8 KV heads · 128 dims · 2 · 2 bytes."""
DISK_GBYTES_S = 7.0
"""Read bandwidth of a node's disk tier: one PCIe 4.0 x4 NVMe drive's rated sequential read
(Samsung PM1733 / PM9A3 data sheets: 6.8–7.0 GB/s), the kind of drive in an 8×H100 node."""
REMOTE_GBPS = 100.0
"""Bandwidth to the remote tier: one 100 Gb/s Ethernet or RoCE NIC (ConnectX-6 Dx), the
front-end network of a rented GPU node (its GPU fabric is not where LMCache's remote
backends live)."""
_SETTING_OF = {
    "prefill_base_s": "prefill_base_us", "prefill_ctx_s": "prefill_ctx_ns", "pool_load_s_per_token": "pool_load_us",
    "inflight_penalty_s": "inflight_penalty_ms", "step_s": "step_ms", "disk_load_s_per_token": "disk_load_us",
    "remote_load_s_per_token": "remote_load_us",
}  # fmt: skip
"""CostModel field -> the setting that gives it."""


@dataclass(frozen=True)
class CostSettings:
    """The `cost` section of the router's config (`--cost-*`): `CostModel`'s numbers in the
    units they are measured in. None: not set, so the default (`DEFAULTS`) is the prior
    and learning may move it; a value set explicitly is held fixed."""

    prefill_base_us: float | None = None
    prefill_ctx_ns: float | None = None
    pool_load_us: float | None = None
    inflight_penalty_ms: float | None = None
    step_ms: float | None = None
    disk_load_us: float | None = None
    """Seconds (µs) to load a token's KV from the node's disk tier; None: a token's KV bytes
    at the disk's read bandwidth, then its copy to the GPU as from the pool."""
    remote_load_us: float | None = None
    """µs to load a token's KV from the remote tier; None: its KV bytes at the network's
    bandwidth, then its copy to the GPU as from the pool."""
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    disk_gbytes_s: float | None = None
    """The disk tier's read bandwidth, GB/s (default `DISK_GBYTES_S`)."""
    remote_gbps: float | None = None
    """The network's bandwidth to the remote tier, Gb/s (default `REMOTE_GBPS`)."""
    learning: str = "on"
    """on: learn each worker's coefficients online (router/calibration.py); off: fixed costs."""

    def __post_init__(self) -> None:
        if self.learning not in ("on", "off"):
            raise ValueError(f"cost learning must be on or off, not {self.learning!r}")
        for name in ("disk_gbytes_s", "remote_gbps"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, not {value}")
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token must be positive, not {self.kv_bytes_per_token}")

    def value(self, name: str) -> float:
        v = getattr(self, name)
        if v is not None:
            return v
        if name == "disk_load_us":  # read from disk into host memory, then the pool's copy
            return self.kv_bytes_per_token / ((self.disk_gbytes_s or DISK_GBYTES_S) * 1e3) + self.value("pool_load_us")
        if name == "remote_load_us":  # over the network into host memory, then the pool's copy
            return self.kv_bytes_per_token * 8 / ((self.remote_gbps or REMOTE_GBPS) * 1e3) + self.value("pool_load_us")
        return DEFAULTS[name]

    def model(self) -> CostModel:
        return CostModel(
            prefill_base_s=self.value("prefill_base_us") * 1e-6,
            prefill_ctx_s=self.value("prefill_ctx_ns") * 1e-9,
            pool_load_s_per_token=self.value("pool_load_us") * 1e-6,
            inflight_penalty_s=self.value("inflight_penalty_ms") * 1e-3,
            step_s=self.value("step_ms") * 1e-3,
            disk_load_s_per_token=self.value("disk_load_us") * 1e-6,
            remote_load_s_per_token=self.value("remote_load_us") * 1e-6,
        )

    def fixed(self) -> frozenset[str]:
        """CostModel fields set explicitly (a tier's bandwidth given sets its load cost):
        learning leaves them alone."""
        given = {f for f, setting in _SETTING_OF.items() if getattr(self, setting) is not None}
        if self.disk_gbytes_s is not None:
            given.add("disk_load_s_per_token")
        if self.remote_gbps is not None:
            given.add("remote_load_s_per_token")
        return frozenset(given)


class Held(NamedTuple):
    """How many leading tokens of a prompt each tier a candidate can reach holds."""

    gpu: int = 0
    """On its own GPU."""
    pool: int = 0
    """In its node's CPU pool."""
    disk: int = 0
    """On its node's disk tier."""
    remote: int = 0
    """In the remote tier."""


class Reuse(NamedTuple):
    """How a candidate gets the cached part of a prompt: tokens it already has on its GPU,
    then tokens copied from each tier (in the prompt's order: each copied run continues
    where the previous one ends)."""

    gpu: int = 0
    pool: int = 0
    disk: int = 0
    remote: int = 0

    @property
    def tokens(self) -> int:
        """Prompt tokens not recomputed."""
        return self.gpu + self.pool + self.disk + self.remote

    @property
    def copied(self) -> int:
        return self.pool + self.disk + self.remote

    @property
    def tier(self) -> str:
        """The farthest tier it loads from: `remote`, `disk`, `pool`, `gpu`, or `none`."""
        if self.remote:
            return "remote"
        if self.disk:
            return "disk"
        if self.pool:
            return "pool"
        return "gpu" if self.gpu else "none"


NO_REUSE = Reuse()


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_base_s: float = 20.3e-6
    """Seconds per prompt token at zero context."""
    prefill_ctx_s: float = 1.01e-9
    """Extra seconds per prompt token for each token of context before it."""
    pool_load_s_per_token: float = 2.4e-6
    """Seconds to load one token's KV from the shared CPU pool."""
    inflight_penalty_s: float = 0.3e-3
    """TTFT added by each request already running on a worker. A running sequence adds its
    KV reads to every batch step: 4k tokens × 128 KiB over the H200's 4.8 TB/s HBM ≈ 0.11 ms
    a step, and a new request's first token waits one to a few steps."""

    step_s: float = 15e-3
    """One engine step under load (a batch-64 decode step at 4k context on the same
    bandwidth model: ≈14 ms). Predicted TTFT differences smaller than a step are below the
    scheduler's resolution — a request waits for the step in progress wherever it lands —
    so cache-aware routing only moves a conversation off the worker holding most of its
    prefix for a predicted gain of more than one step."""

    disk_load_s_per_token: float = 21.1e-6
    """Seconds to load one token's KV from the node's disk tier (`CostSettings.value`)."""
    remote_load_s_per_token: float = 12.9e-6
    """Seconds to load one token's KV from the remote tier (`CostSettings.value`)."""

    overhead_s: float = 0.0
    """Fixed seconds per request before its first token beyond its prefill (tokenization,
    scheduling, the step in progress): 0 by default, learned per worker (a slower worker's
    is longer)."""

    def prefill_s(self, start: int, end: int) -> float:
        """Seconds to prefill prompt tokens start..end given start tokens already cached."""
        if end <= start:
            return 0.0
        return self.prefill_base_s * (end - start) + self.prefill_ctx_s * (end * end - start * start) / 2

    def pool_load_s(self, tokens: int) -> float:
        return self.pool_load_s_per_token * max(tokens, 0)

    def reuse(self, held: Held, total_tokens: int) -> tuple[Reuse, float]:
        """How a worker holding `held` of a prompt gets its KV, and the seconds that takes
        (copies plus the prefill of the rest): what its GPU has is kept, and the engine's
        connector loads every further token some tier it reaches holds, each run from the
        first tier that holds it in the order LMCache asks them (its node's pool, its
        node's disk, the remote tier) — not the cheapest, and never stopping early to
        recompute instead: the prediction is of what the engine will do."""
        gpu = min(held.gpu, total_tokens)
        end = min(max(held), total_tokens)
        if end <= gpu:
            return Reuse(gpu), self.prefill_s(gpu, total_tokens)
        pool = max(min(held.pool, end) - gpu, 0)
        disk = max(min(held.disk, end) - gpu - pool, 0)
        remote = end - gpu - pool - disk
        seconds = (
            self.pool_load_s_per_token * pool + self.disk_load_s_per_token * disk
            + self.remote_load_s_per_token * remote + self.prefill_s(end, total_tokens)
        )  # fmt: skip
        return Reuse(gpu, pool, disk, remote), seconds

    def predicted_ttft_s(self, load: Queue, held: Held, total_tokens: int) -> tuple[float, float, Reuse]:
        """(prefill seconds, time to first token, the reuse they assume) of a prompt of
        total_tokens on a worker at `load` holding `held` of it. The prefill is `reuse`'s
        plus the worker's fixed overhead; the TTFT adds the prefill already
        queued on the worker, the batch steps its running requests lengthen, and how far
        behind these predictions the worker's queue is running (`lag_s`)."""
        plan, seconds = self.reuse(held, total_tokens)
        prefill = self.overhead_s + seconds
        return prefill, load.queued_prefill_s + load.inflight * self.inflight_penalty_s + load.lag_s + prefill, plan
