"""The simulated engine's cost model, derived from the shared H200 calibration.

Source: `loadtests/sim/data/h200_kv_costs.json` (one H200, bf16, random weights; see
`/work/shared/calibration/README.md`). It holds, for Llama-3-8B- and Qwen2.5-72B-shaped
layers, the prefill time T(L) of a whole model over a prompt of L = 1k, 4k, 16k, 32k tokens,
pinned host↔device copy bandwidth, and KV bytes per token. The derivation (numbers for both
profiles are tabulated in `docs/simulator.md`):

Prefill (compute bound). The marginal cost of prefilling token x (x tokens already in
context) is c(x); a chunk of tokens start..end costs ∫ c. The measured T(L) give the mean
marginal cost on each measured interval, m_k = (T(L_k+1) − T(L_k)) / (L_k+1 − L_k), which
we place at the interval midpoints (2.5k, 10k, 24.5k tokens) and interpolate linearly;
below the first midpoint c is flat (the linear layers dominate), beyond the last it keeps
the last slope (attention is quadratic, so its marginal cost grows linearly). For the 8B
shape that gives 20.8 µs/token at ≤2.5k, 31.1 at 10k, 45.0 at 24.5k. The 1k point is not
used for the slope: a lone 1k prompt timed layer by layer in eager PyTorch (28 ms) pays
small-matrix inefficiency and launch overhead that a batched, CUDA-graphed engine step
does not; our step pays a fixed overhead instead (below).

Decode (memory bound). One step reads every weight once plus the KV of every decoding
sequence's context: t_mem = (weight bytes + Σ context · KV bytes/token) ÷ HBM bandwidth.
H200 HBM3e is 4.8 TB/s nominal (NVIDIA datasheet); decode kernels sustain about 80% of
peak, so we assume 3.84 TB/s effective. Decoding tokens also cost compute, c(0) each.
A step that mixes prefill chunks and decodes takes overhead + max(compute, memory).

Per-step overhead: 1 ms (scheduling, input preparation, sampling). Not calibrated; it
puts Llama-3-8B batch-1 decode at ~5.2 ms/token, in line with public H200 numbers.

Pool load (PCIe bound). Loading a token's KV from the LMCache CPU pool copies its KV bytes
host→device at the pinned bandwidth measured for large copies (55.0 GB/s). LMCache loads
before the forward pass, so the load time adds to the step that admits the request.

Slower tiers (not measured; the same derivation as the router's defaults in `router/cost.py`,
so that the simulator charges what the router predicts). LMCache reads a chunk from a node's
disk or from the remote tier into host memory, then copies it to the GPU like a pool chunk:
  disk   = KV bytes/token ÷ disk read bandwidth + the pool's pinned copy. Default 7.0 GB/s:
           one PCIe 4.0 x4 NVMe drive's rated sequential read (Samsung PM1733 / PM9A3 data
           sheets: 6.8–7.0 GB/s), the kind of drive in an 8-GPU node (`--disk-gbytes-s`).
  remote = KV bytes/token × 8 ÷ network bandwidth + the pool's pinned copy. Default
           100 Gb/s: one 100 Gb/s Ethernet or RoCE NIC, the front-end network of a rented GPU
           node, where LMCache's remote backends live (`--remote-gbps`).
For Llama-3-8B that is 18.7 + 2.4 ≈ 21.1 µs/token from disk and 10.5 + 2.4 ≈ 12.9 µs/token
from the remote tier. Like the pool load, both use KV bytes per GPU: under TP each rank
reads its own shard (an assumption: the ranks of a node share its drive and NIC).

KV pulled from a prefill worker (vLLM's NixlConnector, not measured): GPU to GPU over RDMA,
no host copy: KV bytes/token × 8 ÷ link bandwidth. Default 400 Gb/s: the ConnectX-7 NIC
each GPU of an HGX/DGX H100 or H200 node has on its compute fabric (NVIDIA's DGX H200
datasheet: 8 × 400 Gb/s, one per GPU), which UCX uses for GPU-direct reads between nodes
(`--kv-link-gbps`). For Llama-3-8B that is 2.6 µs/token (86 ms for 32k tokens). Under TP
each rank pulls its own shard over its own NIC (KV bytes per GPU). The pull runs beside the
decode worker's steps (vLLM loads asynchronously), so it delays only its own request.

Tensor parallelism (the 72B profile runs TP8 on one 8×H200 node). Not measured: each GPU
computes 1/8 of every layer (compute ÷ 8), at an assumed 80% TP efficiency (two NVLink
all-reduces per layer on the critical path); each GPU reads 1/8 of the weights and holds
1/8 of the KV heads (8 KV heads → one per GPU), so memory time and KV capacity scale by
1/8; every step pays 2 all-reduces × layers × 8 µs of latency; the 8 GPUs load from the
pool over their own PCIe links in parallel (KV bytes per GPU ÷ pinned bandwidth).

KV capacity per worker (per GPU, in tokens): (0.85 × HBM − weights per GPU − 2 GiB
reserved for activations and CUDA graphs) ÷ KV bytes/token per GPU. HBM is 143,771 MiB,
what `nvidia-smi` reports for a 141 GB H200. Override with `--kv-capacity-tokens`.
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CALIBRATION_PATH = Path(__file__).resolve().parent / "data" / "h200_kv_costs.json"

HBM_BYTES = 143_771 * 2**20
"""Usable HBM of one H200 (nvidia-smi's figure for the 141 GB part)."""
HBM_PEAK_BPS = 4.8e12
HBM_EFFICIENCY = 0.80
GPU_MEMORY_UTILIZATION = 0.85
ACTIVATION_RESERVE_BYTES = 2 * 2**30
STEP_OVERHEAD_S = 1.0e-3
TP_EFFICIENCY = 0.80
ALLREDUCE_LATENCY_S = 8e-6
BYTES_PER_PARAM = 2  # bf16

POOL, DISK, REMOTE = "pool", "disk", "remote"
LMCACHE_ORDER = (POOL, DISK, REMOTE)
"""The order LMCache's storage manager asks its backends for a chunk (local CPU, local disk,
remote): a chunk several hold is loaded from the first, whatever their bandwidths."""
"""The tiers a worker loads KV from besides its GPU: its node's CPU pool, its node's disk
tier, the cluster-wide remote tier."""
DISK_GBYTES_S = 7.0
"""Disk tier read bandwidth, GB/s: a PCIe 4.0 x4 NVMe drive's rated sequential read (see above)."""
REMOTE_GBPS = 100.0
"""Bandwidth to the remote tier, Gb/s: one 100 Gb/s NIC (see above)."""
NIXL = "nixl"
"""KV pulled from a prefill worker's GPU (vLLM's NixlConnector): a tier of the decode side's
reuse counters, never a place the pool looks up."""
KV_LINK_GBPS = 400.0
"""Bandwidth of a prefill→decode KV pull, Gb/s: one GPU's 400 Gb/s ConnectX-7 (see above)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    calibration_name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, bf16, whole model."""
        return self.layers * self.kv_heads * self.head_dim * 2 * BYTES_PER_PARAM


SHAPES: dict[str, ModelShape] = {
    # Parameter counts from the models' cards (Llama-3-8B 8.03 B, Qwen2.5-72B 72.7 B).
    "llama3-8b": ModelShape("llama3-8b", 8.03e9, 32, 8, 128),
    "qwen2.5-72b": ModelShape("qwen2.5-72b", 72.7e9, 80, 8, 128),
}


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    shape: str
    tp: int
    max_model_len: int


PROFILES: dict[str, Profile] = {
    "h200-llama3-8b": Profile("h200-llama3-8b", "llama3-8b", 1, 131_072),
    "h200-qwen2.5-72b-tp8": Profile("h200-qwen2.5-72b-tp8", "qwen2.5-72b", 8, 131_072),
}
DEFAULT_PROFILE = "h200-llama3-8b"


def load_calibration(path: Path = CALIBRATION_PATH) -> dict[str, Any]:
    return json.loads(path.read_text())


def _measured_prefill(calibration: dict[str, Any], shape: str) -> list[tuple[int, float]]:
    """[(prompt tokens, seconds for the whole model on one GPU)], sorted by length."""
    points = []
    for key, value in calibration["prefill"].items():
        name, _, tokens = key.rpartition("/")
        if name == shape:
            points.append((int(tokens), value["model_ms_1gpu"] / 1000.0))
    points.sort()
    if len(points) < 3:
        raise ValueError(f"calibration has fewer than 3 prefill points for {shape!r}")
    return points


def _pinned_h2d_bps(calibration: dict[str, Any]) -> float:
    """Pinned host→device bandwidth of the largest measured copy (KV loads are large)."""
    best_size, best_bw = -1, 0.0
    for key, value in calibration["copy"].items():
        kind, _, size = key.partition("/")
        mib = int(size.removesuffix("MiB"))
        if kind == "pinned" and mib > best_size:
            best_size, best_bw = mib, value["h2d_GBps"] * 1e9
    if best_size < 0:
        raise ValueError("calibration has no pinned copy measurement")
    return best_bw


@dataclass(frozen=True)
class CostModel:
    """Step durations in simulated seconds for one worker (one GPU, or one TP group)."""

    profile: Profile
    knots: tuple[tuple[float, float], ...]
    """(context tokens, marginal prefill seconds per token) after the TP split."""
    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    hbm_bps: float
    pool_bps: float
    step_overhead_s: float
    default_capacity_tokens: int
    disk_bps: float = DISK_GBYTES_S * 1e9
    """Disk tier read bandwidth, bytes/s."""
    remote_bps: float = REMOTE_GBPS * 1e9 / 8
    """Bandwidth to the remote tier, bytes/s."""
    link_bps: float = KV_LINK_GBPS * 1e9 / 8
    """Bandwidth of a KV pull from a prefill worker, bytes/s."""
    _xs: tuple[float, ...] = field(init=False, repr=False)
    _prefix: tuple[float, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        xs = tuple(x for x, _ in self.knots)
        # Cumulative ∫c from the first knot to each knot, for O(log n) chunk costs.
        prefix = [0.0]
        for (x0, c0), (x1, c1) in itertools.pairwise(self.knots):
            prefix.append(prefix[-1] + (x1 - x0) * (c0 + c1) / 2)
        object.__setattr__(self, "_xs", xs)
        object.__setattr__(self, "_prefix", tuple(prefix))

    @property
    def kv_bytes_per_token(self) -> float:
        """Whole-model KV bytes per token (all TP ranks)."""
        return self.kv_bytes_per_token_per_gpu * self.profile.tp

    def marginal_prefill_s(self, x: float) -> float:
        """Seconds to prefill one token with `x` tokens of context before it."""
        (x0, c0), (xn, cn) = self.knots[0], self.knots[-1]
        if x <= x0:
            return c0
        if x >= xn:
            xp, cp = self.knots[-2]
            return cn + (x - xn) * (cn - cp) / (xn - xp)
        i = bisect.bisect_right(self._xs, x) - 1
        (xa, ca), (xb, cb) = self.knots[i], self.knots[i + 1]
        return ca + (x - xa) * (cb - ca) / (xb - xa)

    def _integral_to(self, x: float) -> float:
        """∫ c from 0 to x."""
        x0, c0 = self.knots[0]
        if x <= x0:
            return c0 * x
        base = c0 * x0
        if x >= self._xs[-1]:
            xn = self._xs[-1]
            return base + self._prefix[-1] + (x - xn) * (self.marginal_prefill_s(xn) + self.marginal_prefill_s(x)) / 2
        i = bisect.bisect_right(self._xs, x) - 1
        xa = self._xs[i]
        return base + self._prefix[i] + (x - xa) * (self.knots[i][1] + self.marginal_prefill_s(x)) / 2

    def prefill_s(self, start: int, end: int) -> float:
        """Compute seconds to prefill prompt tokens start..end (start already in context)."""
        if end <= start:
            return 0.0
        return self._integral_to(end) - self._integral_to(start)

    def decode_memory_s(self, context_tokens: int) -> float:
        """Seconds to stream the weights and `context_tokens` tokens of KV from HBM once."""
        return (self.weight_bytes_per_gpu + context_tokens * self.kv_bytes_per_token_per_gpu) / self.hbm_bps

    def pool_load_s(self, tokens: int) -> float:
        """Seconds to copy `tokens` tokens of KV from the CPU pool into HBM."""
        return max(tokens, 0) * self.kv_bytes_per_token_per_gpu / self.pool_bps

    def disk_load_s(self, tokens: int) -> float:
        """Seconds to read `tokens` tokens of KV from the node's disk tier into HBM."""
        return max(tokens, 0) * self.kv_bytes_per_token_per_gpu / self.disk_bps + self.pool_load_s(tokens)

    def remote_load_s(self, tokens: int) -> float:
        """Seconds to fetch `tokens` tokens of KV from the remote tier into HBM."""
        return max(tokens, 0) * self.kv_bytes_per_token_per_gpu / self.remote_bps + self.pool_load_s(tokens)

    def nixl_pull_s(self, tokens: int) -> float:
        """Seconds to pull `tokens` tokens of KV from a prefill worker's GPU (GPU to GPU)."""
        return max(tokens, 0) * self.kv_bytes_per_token_per_gpu / self.link_bps

    def load_s(self, tier: str, tokens: int) -> float:
        """Seconds to load `tokens` tokens of KV from `tier` (POOL, DISK or REMOTE)."""
        if tier == POOL:
            return self.pool_load_s(tokens)
        if tier == DISK:
            return self.disk_load_s(tokens)
        if tier == REMOTE:
            return self.remote_load_s(tokens)
        raise ValueError(f"unknown tier {tier!r}")

    def step_s(
        self,
        prefill_chunks: list[tuple[int, int]],
        decode_contexts: list[int],
        pool_tokens: int = 0,
        disk_tokens: int = 0,
        remote_tokens: int = 0,
    ) -> float:
        """Duration of one engine step.

        `prefill_chunks`: (start, end) token ranges prefilled this step; `decode_contexts`:
        the context length of every sequence decoding one token; `pool_tokens`,
        `disk_tokens`, `remote_tokens`: tokens loaded from each tier before the forward pass.
        """
        loaded = pool_tokens > 0 or disk_tokens > 0 or remote_tokens > 0
        if not prefill_chunks and not decode_contexts and not loaded:
            return 0.0
        compute = sum(self.prefill_s(s, e) for s, e in prefill_chunks)
        compute += len(decode_contexts) * self.knots[0][1]
        memory = self.decode_memory_s(sum(decode_contexts))
        duration = self.step_overhead_s + max(compute, memory) + self.pool_load_s(pool_tokens)
        # Added only when present, so that a pool-only step's duration is bit for bit what it was.
        if disk_tokens > 0:
            duration += self.disk_load_s(disk_tokens)
        if remote_tokens > 0:
            duration += self.remote_load_s(remote_tokens)
        return duration


def build_cost_model(
    profile_name: str = DEFAULT_PROFILE,
    calibration: dict[str, Any] | None = None,
    disk_gbytes_s: float = DISK_GBYTES_S,
    remote_gbps: float = REMOTE_GBPS,
    kv_link_gbps: float = KV_LINK_GBPS,
) -> CostModel:
    if not disk_gbytes_s > 0 or not remote_gbps > 0 or not kv_link_gbps > 0:
        raise ValueError("tier bandwidths must be positive")
    try:
        profile = PROFILES[profile_name]
    except KeyError:
        raise ValueError(f"unknown profile {profile_name!r}; known: {', '.join(PROFILES)}") from None
    cal = calibration if calibration is not None else load_calibration()
    shape = SHAPES[profile.shape]
    points = _measured_prefill(cal, shape.calibration_name)
    tp_speedup = profile.tp * TP_EFFICIENCY if profile.tp > 1 else 1.0
    knots = tuple(
        ((l0 + l1) / 2, (t1 - t0) / (l1 - l0) / tp_speedup)
        for (l0, t0), (l1, t1) in itertools.pairwise(points)
    )
    # Interval means must not fall with context; if measurement noise made one do so,
    # clamp it so that the per-token cost never shrinks as the context grows.
    fixed: list[tuple[float, float]] = []
    for x, c in knots:
        fixed.append((x, max(c, fixed[-1][1]) if fixed else c))
    weight_bytes = shape.params * BYTES_PER_PARAM / profile.tp
    kv_per_gpu = shape.kv_bytes_per_token / profile.tp
    overhead = STEP_OVERHEAD_S
    if profile.tp > 1:
        overhead += 2 * shape.layers * ALLREDUCE_LATENCY_S
    free = GPU_MEMORY_UTILIZATION * HBM_BYTES - weight_bytes - ACTIVATION_RESERVE_BYTES
    capacity = int(free // kv_per_gpu)
    return CostModel(
        profile=profile,
        knots=tuple(fixed),
        weight_bytes_per_gpu=weight_bytes,
        kv_bytes_per_token_per_gpu=kv_per_gpu,
        hbm_bps=HBM_PEAK_BPS * HBM_EFFICIENCY,
        pool_bps=_pinned_h2d_bps(cal),
        step_overhead_s=overhead,
        default_capacity_tokens=capacity,
        disk_bps=disk_gbytes_s * 1e9,
        remote_bps=remote_gbps * 1e9 / 8,
        link_bps=kv_link_gbps * 1e9 / 8,
    )


def summary(model: CostModel, lengths: tuple[int, ...] = (1024, 4096, 16384, 32768)) -> dict[str, Any]:
    """The derived figures, for docs and `--print-costs`."""
    return {
        "profile": model.profile.name,
        "marginal_prefill_us_per_token": {n: round(model.marginal_prefill_s(n) * 1e6, 2) for n in lengths},
        "mean_prefill_us_per_token": {n: round(model.prefill_s(0, n) / n * 1e6, 2) for n in lengths},
        "prefill_whole_prompt_ms": {n: round(model.prefill_s(0, n) * 1e3, 1) for n in lengths},
        "decode_step_ms_batch1_ctx1k": round(model.step_s([], [1024]) * 1e3, 3),
        "decode_step_ms_batch64_ctx4k": round(model.step_s([], [4096] * 64) * 1e3, 3),
        "pool_load_us_per_token": round(model.pool_load_s(1) * 1e6, 3),
        "disk_load_us_per_token": round(model.disk_load_s(1) * 1e6, 3),
        "remote_load_us_per_token": round(model.remote_load_s(1) * 1e6, 3),
        "nixl_pull_us_per_token": round(model.nixl_pull_s(1) * 1e6, 3),
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "default_capacity_tokens": model.default_capacity_tokens,
    }
