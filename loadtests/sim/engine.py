"""A pure model of one vLLM engine: paged prefix cache plus a continuous-batching scheduler.

No I/O and no wall clock: the caller owns simulated time. It calls `schedule()` to form the
next step (which reports its simulated duration), advances its clock by that much, then
calls `complete(step, now)` to apply the step's effects. The HTTP layer (`worker.py`) does
this against real time; tests do it against a plain float.

Prefix cache (vLLM's V1 KV cache manager, reduced to what routing depends on):
* KV lives in blocks of 16 tokens. Full prompt blocks are identified by a hash chain
  (`block_hashes`), committed to the cache as soon as they are computed, and shared by
  every later request whose prompt starts with the same blocks. Generated tokens occupy
  blocks while their request runs but are never cached.
* Blocks whose last user finished stay cached but evictable, in LRU order. A finishing
  request releases its blocks tail first, so a conversation's last blocks are evicted
  before the head it shares with others.
* A request reuses at most prompt_len − 1 tokens (the last one must be computed to sample
  from), like vLLM.

Scheduler (vLLM V1): each step has a token budget (`max_num_batched_tokens`). Running
requests go first, each taking one token (decode) or the rest of its prompt that fits
(chunked prefill); then waiting requests are admitted first-come first-served while budget,
sequence slots and free blocks last. A waiting request that does not fit blocks the ones
behind it (head-of-line blocking). When a running request cannot get a block, the most
recently admitted running request is preempted (blocks freed, recomputed later).

Prefill/decode disaggregation (vLLM's NixlConnector, reduced to its effect on blocks):
* A request marked `hold` (the prefill side, `do_remote_decode`) keeps its blocks when it
  finishes: it moves to `held` until `release_held` (the decode side pulled them, or the
  hold timed out).
* A request marked `pull` (the decode side, `do_remote_prefill`) is admitted without compute:
  its blocks beyond the local prefix hit are allocated, and it waits in `pulling` (vLLM's
  WAITING_FOR_REMOTE_KVS) while the caller transfers them, taking no token budget and no
  sequence slot. `pull_done` then puts it first in the queue with all but its last prompt
  token computed (vLLM recomputes the last one to sample from), or, if the transfer failed,
  with only its local hit (vLLM's recompute policy).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from loadtests.sim.costs import DISK, POOL, REMOTE, CostModel
from normalizer.tokens import CHARS_PER_TOKEN

BLOCK_SIZE = 16
BLOCK_BYTES = BLOCK_SIZE * CHARS_PER_TOKEN
HASH_MASK = (1 << 63) - 1
"""Block hashes are kept below 2**63 so that int64 consumers of KV events can hold them."""


def chain_hashes(data: bytes, unit_bytes: int, seed: bytes) -> list[int]:
    """Hashes of every full `unit_bytes` piece of `data`, each chained to the one before."""
    return _chain_from(hashlib.blake2b(seed, digest_size=8).digest(), data, unit_bytes)[0]


def _chain_from(parent: bytes, data: bytes, unit_bytes: int) -> tuple[list[int], bytes]:
    """The chain over `data`'s full units continued from `parent` (a full 8-byte digest):
    the units' hashes and the digest the chain continues from after them."""
    out = []
    for i in range(len(data) // unit_bytes):
        parent = hashlib.blake2b(data[i * unit_bytes : (i + 1) * unit_bytes], digest_size=8, key=parent).digest()
        out.append(int.from_bytes(parent, "big") & HASH_MASK)
    return out, parent


def salted_seed(seed: bytes, cache_salt: str | None) -> bytes:
    """The chain's seed for a request with vLLM's `cache_salt`: vLLM mixes the salt into a
    prompt's first block, so no block is shared between different salts (every later block
    chains from the first) and the same salt shares as ever."""
    return seed if not cache_salt else seed + b"\x00cache_salt\x00" + cache_salt.encode()


def block_hashes_of(data: bytes, seed: bytes = b"", cache_salt: str | None = None) -> list[int]:
    """The GPU prefix-cache keys of a prompt's full 16-token blocks."""
    return chain_hashes(data, BLOCK_BYTES, salted_seed(seed, cache_salt))


class BlockHasher:
    """`block_hashes_of` for a stream of prompts that extend each other, without rehashing
    what was hashed before.

    A 60k-token prompt is 3,750 blocks, and hashing them one by one held the simulator's
    event loop for ~4 ms per request: each conversation turn rehashed the whole history.
    Here the prompt is cut into pieces of PIECE_BLOCKS blocks; each piece is fingerprinted
    with one blake2b call over its bytes (chained, so a fingerprint names the whole prefix
    up to it), and a piece whose fingerprint was seen reuses the block hashes computed then.
    Only new pieces and the tail are hashed block by block. Results are identical to
    `block_hashes_of`; at most `max_pieces` pieces are remembered (LRU)."""

    PIECE_BLOCKS = 256

    def __init__(self, seed: bytes = b"", max_pieces: int = 8192) -> None:
        self.seed = seed
        self.max_pieces = max_pieces
        self._pieces: OrderedDict[bytes, tuple[array[int], bytes]] = OrderedDict()
        """fingerprint of a prefix ending at a piece boundary -> (the piece's block hashes,
        the full digest of its last block, which the chain continues from)"""

    def hashes(self, data: bytes, cache_salt: str | None = None) -> list[int]:
        piece_bytes = self.PIECE_BLOCKS * BLOCK_BYTES
        # Salted chains start elsewhere, so their piece fingerprints never meet unsalted ones.
        parent = hashlib.blake2b(salted_seed(self.seed, cache_salt), digest_size=8).digest()
        fingerprint = parent
        out: list[int] = []
        pieces = self._pieces
        full = len(data) // piece_bytes
        for p in range(full):
            start = p * piece_bytes
            piece = data[start : start + piece_bytes]
            fingerprint = hashlib.blake2b(piece, digest_size=16, key=fingerprint).digest()
            memo = pieces.get(fingerprint)
            if memo is None:
                computed, parent = _chain_from(parent, piece, BLOCK_BYTES)
                known = array("q", computed)  # 8 bytes a hash, not a list of int objects
                pieces[fingerprint] = (known, parent)
                if len(pieces) > self.max_pieces:
                    pieces.popitem(last=False)
            else:
                pieces.move_to_end(fingerprint)
                known, parent = memo
            out.extend(known)
        out.extend(_chain_from(parent, data[full * piece_bytes :], BLOCK_BYTES)[0])
        return out


def token_ids_of(data: bytes) -> list[int]:
    """Token ids of the prompt: one unsigned little-endian int32 per 4-byte piece.

    Unsigned because consumers of KV events decode token ids as u32 (vllm-router's
    `kv_events/decoder.rs`). The same bytes in two's complement are what
    `normalizer.prefix.completion_segments` packs for a token-id prompt, so sending these
    ids back as a prompt (see `signed_token_ids`) reproduces the same bytes and cache keys.
    """
    # In C, not a Python loop: vllm-router's cache_aware asks for every prompt's ids
    # (`/render`), and 60k ids one by one held the simulator's loop for ~10 ms each time.
    ids = array("I")
    assert ids.itemsize == CHARS_PER_TOKEN
    ids.frombytes(data[: len(data) // CHARS_PER_TOKEN * CHARS_PER_TOKEN])
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def signed_token_ids(ids: list[int]) -> list[int]:
    """Map u32 token ids onto the int32 range `completion_segments` packs (same bytes)."""
    return [t - (1 << 32) if t >= 1 << 31 else t for t in ids]


class State(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    PULLING = "waiting_for_remote_kvs"
    """Blocks allocated, KV being pulled from a prefill worker; not schedulable yet."""
    HELD = "held"
    """Finished on a prefill worker; its blocks wait for a decode worker to pull them."""


@dataclass(eq=False)
class Seq:
    """One request inside the engine."""

    id: str
    prompt_len: int
    max_tokens: int
    block_hashes: list[int]
    arrival: float
    pool_hit_tokens: int = 0
    """Leading prompt tokens the CPU pool held when the request arrived (chunk aligned)."""
    pool_runs: list[tuple[str, int]] = field(default_factory=list)
    """Those tokens as (tier, tokens) runs in prompt order: the tier (POOL, DISK, REMOTE)
    each is loaded from. Empty: all of them from the pool."""
    data: bytes = b""
    """Prompt bytes; only needed to report token ids in KV events."""
    pool_keys: list[int] = field(default_factory=list)
    """Pool keys of the prompt's full chunks (opaque to the engine; for the pool client)."""
    state: State = State.WAITING
    num_computed: int = 0
    generated: int = 0
    table: list[int | None] = field(default_factory=list)
    """Per block: the cache hash it is registered under, or None for a private block."""
    counted: bool = False
    """Whether its prefix-cache query has been counted (once, even if preempted)."""
    first_token_at: float | None = None
    scheduled_at: float | None = None
    gpu_hit_tokens: int = 0
    pool_loaded_tokens: int = 0
    """Prompt tokens loaded instead of computed, from every tier."""
    tier_loaded_tokens: dict[str, int] = field(default_factory=dict)
    """`pool_loaded_tokens` by the tier they came from."""
    pool_stored_chunks: int = 0
    preemptions: int = 0
    hold: bool = False
    """Keep the blocks when finished (a prefill worker's request for a remote decode)."""
    pull: bool = False
    """Pull the prompt's KV beyond the local hit from a prefill worker before computing."""
    pull_tokens: int = 0
    pull_blocks: int = 0
    """What the pull transfers: prompt tokens beyond the local hit, and their blocks."""
    prompt_digest: bytes = b""
    """A digest of the prompt's bytes, on both sides of a pull: they must be the same prompt."""
    nixl_tokens: int = 0
    """Prompt tokens the pull saved from recomputation (0 until it succeeded)."""
    last_token_at: float | None = None
    """Simulated time of the latest generated token (for inter-token latency)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_len + self.generated

    @property
    def decoding(self) -> bool:
        """Caught up with every token but the last sampled one: the next step decodes it."""
        return self.generated > 0 and self.num_computed == self.total_tokens - 1


@dataclass(slots=True)
class Scheduled:
    seq: Seq
    start: int
    tokens: int


@dataclass
class Step:
    items: list[Scheduled]
    duration: float
    prefill_tokens: int
    decode_tokens: int
    pool_tokens: int
    kv_held: bool = False
    """A request waited for KV blocks during this step: the oldest waiting one did not fit
    in the free blocks though the step had token budget and a sequence slot for it, or the
    step preempted a running one (which waits to be readmitted)."""
    disk_tokens: int = 0
    remote_tokens: int = 0
    """Tokens loaded from the disk and remote tiers (`pool_tokens`: from the CPU pool)."""


@dataclass(slots=True)
class TokenOut:
    seq: Seq
    index: int
    """0-based index of the generated token."""
    finished: bool


@dataclass(frozen=True, slots=True)
class KVEvent:
    kind: str
    """'stored', 'removed' or 'cleared'."""
    block_hashes: tuple[int, ...] = ()
    parent: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class Counters:
    """Cumulative figures, named after the vLLM metrics they feed."""

    prompt_tokens: int = 0
    """Prompt tokens of requests that produced a first token (cached ones included)."""
    computed_prompt_tokens: int = 0
    """Prompt tokens actually prefilled (neither cached nor loaded from the pool)."""
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    external_queries: int = 0
    external_hits: int = 0
    tier_hits: dict[str, int] = field(default_factory=lambda: {POOL: 0, DISK: 0, REMOTE: 0})
    """`external_hits` by the tier the tokens were loaded from."""
    nixl_hits: int = 0
    """`external_hits` pulled from a prefill worker instead (tokens not recomputed)."""
    pulls: int = 0
    pull_failures: int = 0
    pulled_tokens: int = 0
    pulled_blocks: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    steps: int = 0
    busy_s: float = 0.0
    kv_held_s: float = 0.0
    """Seconds of steps during which admission was held for KV blocks (`Step.kv_held`): an
    engine out of KV, not of compute, whose waiting requests wait for running ones to end."""


class BlockPool:
    """Block accounting and the prefix cache of one engine."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("an engine needs at least one KV block")
        self.num_blocks = num_blocks
        self.used = 0
        """Blocks referenced by at least one running request."""
        self.refs: dict[int, int] = {}
        """Cached block hash -> number of requests using it (0 means evictable)."""
        self.evictable: OrderedDict[int, None] = OrderedDict()
        """Cached blocks nobody uses, least recently used first."""
        self.events: list[KVEvent] = []
        self.record_events = False

    @property
    def free(self) -> int:
        """Blocks obtainable right now (never-used plus evictable)."""
        return self.num_blocks - self.used

    def cached_run(self, hashes: list[int], limit: int) -> int:
        """How many leading blocks of `hashes` (at most `limit`) are cached."""
        n = 0
        for h in hashes[:limit]:
            if h not in self.refs:
                break
            n += 1
        return n

    def acquire_cached(self, h: int) -> None:
        refs = self.refs[h]
        if refs == 0:
            del self.evictable[h]
            self.used += 1
        self.refs[h] = refs + 1

    def allocate(self, n: int) -> bool:
        """Take `n` private blocks, evicting cached ones if needed; False if impossible."""
        if n <= 0:
            return True
        if n > self.free:
            return False
        spare = self.num_blocks - self.used - len(self.evictable)
        evict = n - spare
        if evict > 0:
            removed = []
            for _ in range(evict):
                h, _ = self.evictable.popitem(last=False)
                del self.refs[h]
                removed.append(h)
            if self.record_events:
                self.events.append(KVEvent("removed", tuple(removed)))
        self.used += n
        return True

    def commit(self, h: int) -> bool:
        """Register a private block just computed under hash `h`; False if already cached."""
        if h in self.refs:
            return False
        self.refs[h] = 1
        return True

    def release(self, table: Iterable[int | None]) -> None:
        """Drop one request's references. Pass the table tail first: tails are evicted first."""
        for h in table:
            if h is None:
                self.used -= 1
                continue
            refs = self.refs[h] - 1
            self.refs[h] = refs
            if refs == 0:
                self.used -= 1
                self.evictable[h] = None

    def clear(self) -> int:
        """Forget every evictable cached block."""
        n = len(self.evictable)
        for h in self.evictable:
            del self.refs[h]
        self.evictable.clear()
        if self.record_events:
            self.events.append(KVEvent("cleared"))
        return n

    @property
    def cached_blocks(self) -> int:
        return len(self.refs)


class Engine:
    def __init__(
        self,
        cost: CostModel,
        capacity_tokens: int,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 256,
        pool_chunk_tokens: int = 256,
        has_pool: bool = False,
    ) -> None:
        self.cost = cost
        self.blocks = BlockPool(max(capacity_tokens // BLOCK_SIZE, 1))
        self.capacity_tokens = self.blocks.num_blocks * BLOCK_SIZE
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.pool_chunk_tokens = pool_chunk_tokens
        self.has_pool = has_pool
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.seqs: dict[str, Seq] = {}
        self.counters = Counters()
        self.in_step: Step | None = None
        self.held: dict[str, Seq] = {}
        """Finished `hold` requests whose blocks wait to be pulled, by id."""
        self.pulling: dict[str, Seq] = {}
        """Admitted `pull` requests whose KV is in transit, by id."""
        self.pull_starts: list[Seq] = []
        """Pulls admitted since the caller last drained them (`drain_pull_starts`)."""
        self.new_holds: list[Seq] = []
        """Holds made since the caller last drained them (`drain_new_holds`)."""

    # -- requests -----------------------------------------------------------------------

    def fits(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether a request could ever run (its whole KV fits in an empty cache)."""
        blocks = -(-(prompt_len + max_tokens) // BLOCK_SIZE)
        return prompt_len > 0 and blocks <= self.blocks.num_blocks

    def add(self, seq: Seq) -> None:
        if seq.id in self.seqs:
            raise ValueError(f"duplicate request id {seq.id!r}")
        if not self.fits(seq.prompt_len, seq.max_tokens):
            raise ValueError("request does not fit in the KV cache")
        self.seqs[seq.id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: str) -> bool:
        """Stop a request and free its blocks now; False if it is unknown or already done."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return False
        if seq.state is State.WAITING:
            self.waiting.remove(seq)
        elif seq.state is State.RUNNING:
            self.running.remove(seq)
        elif seq.state is State.PULLING:
            del self.pulling[seq.id]
        self._free(seq)
        seq.state = State.ABORTED
        self.counters.aborted += 1
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- prefill/decode disaggregation ------------------------------------------------------

    def release_held(self, seq_id: str) -> int | None:
        """Free a held request's blocks (pulled, timed out, or released); their cached
        blocks stay in the prefix cache, evictable. Returns the blocks freed, None if not held."""
        seq = self.held.pop(seq_id, None)
        if seq is None:
            return None
        n = len(seq.table)
        self._free(seq)
        seq.state = State.FINISHED
        return n

    @property
    def held_blocks(self) -> int:
        return sum(len(seq.table) for seq in self.held.values())

    def pull_done(self, seq_id: str, ok: bool) -> Seq | None:
        """The pull of a `pulling` request ended: with its KV (`ok`), or failed (it then
        recomputes everything beyond its local hit). It goes first in the queue, keeping its
        blocks. None if it is no longer pulling (aborted meanwhile)."""
        seq = self.pulling.pop(seq_id, None)
        if seq is None:
            return None
        c = self.counters
        seq.pull = False  # one transfer per request, as vLLM clears do_remote_prefill
        if ok:
            seq.num_computed = seq.prompt_len - 1
            # Tokens not recomputed thanks to the pull: all it moved but the last, which is
            # computed again to sample from (the usage's cached tokens count them).
            seq.nixl_tokens = seq.pull_tokens - 1
            c.pulls += 1
            c.pulled_tokens += seq.pull_tokens
            c.pulled_blocks += seq.pull_blocks
            c.external_hits += seq.nixl_tokens
            c.nixl_hits += seq.nixl_tokens
            self._commit_blocks(seq)
        else:
            seq.num_computed = seq.prompt_len - seq.pull_tokens
            c.pull_failures += 1
        seq.state = State.WAITING
        self.waiting.appendleft(seq)
        return seq

    def drain_pull_starts(self) -> list[Seq]:
        out, self.pull_starts = self.pull_starts, []
        return out

    def drain_new_holds(self) -> list[Seq]:
        out, self.new_holds = self.new_holds, []
        return out

    def _start_pull(self, seq: Seq) -> bool:
        """Admit a `pull` request: match its local prefix, allocate blocks for the rest of its
        prompt, and park it in `pulling`. False if the blocks are not free now."""
        limit = seq.prompt_len - 1
        hit_blocks = self.blocks.cached_run(seq.block_hashes, limit // BLOCK_SIZE)
        hits = seq.block_hashes[:hit_blocks]
        prompt_blocks = -(-seq.prompt_len // BLOCK_SIZE)
        need = prompt_blocks - hit_blocks
        if need > self.blocks.free - self._evictable_among(hits):
            return False
        for h in hits:
            self.blocks.acquire_cached(h)
        if not self.blocks.allocate(need):
            raise AssertionError("block accounting out of sync")
        seq.table = [*hits, *([None] * need)]
        gpu_hit = hit_blocks * BLOCK_SIZE
        seq.num_computed = gpu_hit
        seq.pull_tokens = seq.prompt_len - gpu_hit
        seq.pull_blocks = need
        if not seq.counted:
            seq.counted = True
            seq.gpu_hit_tokens = gpu_hit
            c = self.counters
            c.prefix_queries += seq.prompt_len
            c.prefix_hits += gpu_hit
            # vLLM counts what a connector may supply as external queries.
            c.external_queries += seq.prompt_len - gpu_hit
        seq.state = State.PULLING
        self.pulling[seq.id] = seq
        self.pull_starts.append(seq)
        return True

    def _resume(self, seq: Seq, budget: int) -> int | None:
        """Schedule a waiting request that already holds its prompt's blocks (back from a
        pull): the tokens it computes now, or None if its next blocks are not free."""
        want = min(seq.total_tokens - seq.num_computed, budget)
        need = self._blocks_needed(seq, seq.num_computed + want)
        if not self.blocks.allocate(need):
            return None
        seq.table.extend([None] * need)
        return want

    # -- scheduling ---------------------------------------------------------------------

    def _blocks_needed(self, seq: Seq, upto_tokens: int) -> int:
        return max(-(-upto_tokens // BLOCK_SIZE) - len(seq.table), 0)

    def _free(self, seq: Seq) -> None:
        self.blocks.release(reversed(seq.table))
        seq.table = []

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.state = State.WAITING
        seq.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(seq)

    def _admit(self, seq: Seq, budget: int) -> tuple[dict[str, int], int] | None:
        """Match a waiting request against the GPU cache and the pool and give it blocks for
        its first chunk. Returns (tokens to load from each tier, chunk tokens), or None if it
        does not fit now."""
        limit = seq.prompt_len - 1
        hit_blocks = self.blocks.cached_run(seq.block_hashes, limit // BLOCK_SIZE)
        hits = seq.block_hashes[:hit_blocks]
        gpu_hit = hit_blocks * BLOCK_SIZE
        external = max(min(seq.pool_hit_tokens, limit) - gpu_hit, 0) if self.has_pool else 0
        start = gpu_hit + external
        want = min(seq.total_tokens - start, budget)
        need = -(-(start + want) // BLOCK_SIZE) - hit_blocks
        if need > self.blocks.free - self._evictable_among(hits):
            return None
        for h in hits:
            self.blocks.acquire_cached(h)
        if not self.blocks.allocate(need):
            raise AssertionError("block accounting out of sync")
        seq.table = [*hits, *([None] * need)]
        seq.num_computed = start
        loads = self._loads(seq, gpu_hit, start)
        if not seq.counted:
            seq.counted = True
            seq.gpu_hit_tokens = gpu_hit
            seq.pool_loaded_tokens = external
            seq.tier_loaded_tokens = loads
            c = self.counters
            c.prefix_queries += seq.prompt_len
            c.prefix_hits += gpu_hit
            if self.has_pool:
                c.external_queries += seq.prompt_len - gpu_hit
                c.external_hits += external
                for tier, tokens in loads.items():
                    c.tier_hits[tier] += tokens
        seq.pool_stored_chunks = max(seq.pool_stored_chunks, seq.pool_hit_tokens // self.pool_chunk_tokens)
        # Pool-loaded blocks are computed now: cache them like prefilled ones.
        self._commit_blocks(seq)
        return loads, want

    @staticmethod
    def _loads(seq: Seq, start: int, end: int) -> dict[str, int]:
        """Tokens start..end of the pool hit split by the tier each is loaded from."""
        out: dict[str, int] = {}
        if end <= start:
            return out
        at = 0
        for tier, tokens in seq.pool_runs or [(POOL, seq.pool_hit_tokens)]:
            lo, hi = max(at, start), min(at + tokens, end)
            if hi > lo:
                out[tier] = out.get(tier, 0) + hi - lo
            at += tokens
            if at >= end:
                break
        return out

    def _evictable_among(self, hashes: list[int]) -> int:
        """Blocks about to be reused that currently count as free (evictable)."""
        return sum(1 for h in hashes if self.blocks.refs.get(h) == 0)

    def schedule(self) -> Step | None:
        """Form the next step, allocating its blocks. None if nothing can run."""
        if self.in_step is not None:
            raise RuntimeError("complete() the previous step first")
        budget = self.max_num_batched_tokens
        items: list[Scheduled] = []
        prefill_chunks: list[tuple[int, int]] = []
        decode_contexts: list[int] = []
        loaded = {POOL: 0, DISK: 0, REMOTE: 0}
        preempted = False
        scheduled_ids: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # All tokens not yet computed (the prompt's rest, or after a preemption the prompt
            # and the tokens generated so far); a decoding request needs exactly one.
            want = min(seq.total_tokens - seq.num_computed, budget)
            need = self._blocks_needed(seq, seq.num_computed + want)
            while not self.blocks.allocate(need):
                victim = self.running[-1]
                if victim is seq or id(victim) in scheduled_ids:
                    victim = seq
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.state is not State.RUNNING:
                continue  # preempted itself; running[i] is now the next request
            seq.table.extend([None] * need)
            items.append(Scheduled(seq, seq.num_computed, want))
            scheduled_ids.add(id(seq))
            if seq.decoding:
                decode_contexts.append(seq.num_computed)
            else:
                prefill_chunks.append((seq.num_computed, seq.num_computed + want))
            budget -= want
            i += 1
        # Like vLLM, a step that had to preempt admits nobody new, unless it has nothing else
        # to do (everyone was preempted), or the engine would idle with work waiting.
        kv_held = preempted
        if not preempted or not items:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if seq.pull:
                    if not self._start_pull(seq):
                        kv_held = True
                        break
                    self.waiting.popleft()
                    continue
                if seq.table:
                    resumed = self._resume(seq, budget)
                    if resumed is None:
                        kv_held = True
                        break
                    self.waiting.popleft()
                    seq.state = State.RUNNING
                    self.running.append(seq)
                    items.append(Scheduled(seq, seq.num_computed, resumed))
                    prefill_chunks.append((seq.num_computed, seq.num_computed + resumed))
                    budget -= resumed
                    continue
                admitted = self._admit(seq, budget)
                if admitted is None:
                    kv_held = True
                    break  # head-of-line: the oldest waiting request does not fit yet
                loads, want = admitted
                self.waiting.popleft()
                seq.state = State.RUNNING
                self.running.append(seq)
                for tier, tokens in loads.items():
                    loaded[tier] += tokens
                items.append(Scheduled(seq, seq.num_computed, want))
                prefill_chunks.append((seq.num_computed, seq.num_computed + want))
                budget -= want
        if not items:
            return None
        duration = self.cost.step_s(prefill_chunks, decode_contexts, loaded[POOL], loaded[DISK], loaded[REMOTE])
        step = Step(
            items=items,
            duration=duration,
            prefill_tokens=sum(e - s for s, e in prefill_chunks),
            decode_tokens=len(decode_contexts),
            pool_tokens=loaded[POOL],
            kv_held=kv_held,
            disk_tokens=loaded[DISK],
            remote_tokens=loaded[REMOTE],
        )
        self.in_step = step
        return step

    def _commit_blocks(self, seq: Seq) -> None:
        """Register the prompt blocks `seq` has fully computed in the prefix cache."""
        full = min(seq.num_computed // BLOCK_SIZE, len(seq.block_hashes))
        stored: list[int] = []
        first_new = -1
        for b in range(full):
            if seq.table[b] is None and self.blocks.commit(seq.block_hashes[b]):
                seq.table[b] = seq.block_hashes[b]
                if first_new < 0:
                    first_new = b
                stored.append(b)
        if stored and self.blocks.record_events:
            # One BlockStored per contiguous run, as vLLM emits per request and step.
            run: list[int] = [stored[0]]
            for b in stored[1:]:
                if b == run[-1] + 1:
                    run.append(b)
                else:
                    self._emit_stored(seq, run)
                    run = [b]
            self._emit_stored(seq, run)

    def _emit_stored(self, seq: Seq, run: list[int]) -> None:
        start, end = run[0], run[-1] + 1
        parent = seq.block_hashes[start - 1] if start > 0 else None
        ids = token_ids_of(seq.data[start * BLOCK_BYTES : end * BLOCK_BYTES])
        self.blocks.events.append(KVEvent("stored", tuple(seq.block_hashes[start:end]), parent, tuple(ids)))

    def complete(self, step: Step, now: float) -> list[TokenOut]:
        """Apply a step's effects at simulated time `now` (its end). Returns tokens produced."""
        if step is not self.in_step:
            raise RuntimeError("not the step in flight")
        self.in_step = None
        c = self.counters
        c.steps += 1
        c.busy_s += step.duration
        if step.kv_held:
            c.kv_held_s += step.duration
        out: list[TokenOut] = []
        for item in step.items:
            seq = item.seq
            if seq.state is not State.RUNNING:
                continue  # aborted while the step ran
            if seq.scheduled_at is None:
                seq.scheduled_at = now - step.duration
            seq.num_computed = item.start + item.tokens
            in_prompt = min(seq.num_computed, seq.prompt_len) - min(item.start, seq.prompt_len)
            if in_prompt > 0:
                c.computed_prompt_tokens += in_prompt
                self._commit_blocks(seq)
            if seq.num_computed < seq.total_tokens:
                continue  # a prefill chunk: nothing to sample from yet
            seq.generated += 1
            c.generation_tokens += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
                c.prompt_tokens += seq.prompt_len
            finished = seq.generated >= seq.max_tokens
            out.append(TokenOut(seq, seq.generated - 1, finished))
            if finished:
                self.running.remove(seq)
                del self.seqs[seq.id]
                c.finished += 1
                if seq.hold:
                    # The prefill side of a disaggregated request: its KV waits for a pull.
                    seq.state = State.HELD
                    self.held[seq.id] = seq
                    self.new_holds.append(seq)
                else:
                    self._free(seq)
                    seq.state = State.FINISHED
        return out

    def pool_stores(self, step: Step) -> list[tuple[Seq, int, int]]:
        """After `complete(step)`: (request, first, end) of the full prompt chunks each of
        the step's live requests has newly computed, to store in the pool."""
        out = []
        for item in step.items:
            if item.seq.state is not State.ABORTED:
                first, end = self.pool_chunks_to_store(item.seq)
                if end > first:
                    out.append((item.seq, first, end))
        return out

    def pool_chunks_to_store(self, seq: Seq) -> tuple[int, int]:
        """(first, end) indices of newly computed full prompt chunks to store in the pool."""
        done = min(seq.num_computed, seq.prompt_len) // self.pool_chunk_tokens
        first = seq.pool_stored_chunks
        if done > first:
            seq.pool_stored_chunks = done
            return first, done
        return first, first

    # -- observation --------------------------------------------------------------------

    @property
    def kv_usage(self) -> float:
        return self.blocks.used / self.blocks.num_blocks

    def drain_events(self) -> list[KVEvent]:
        events, self.blocks.events = self.blocks.events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block, like vLLM: only possible while no request holds blocks."""
        if self.blocks.used > 0:
            return False
        self.blocks.clear()
        return True
