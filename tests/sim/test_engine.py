"""The simulated engine on a simulated clock: prefix cache, eviction, batching, costs."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests.sim.costs import PROFILES, build_cost_model
from loadtests.sim.engine import (
    BLOCK_SIZE,
    BlockHasher,
    Engine,
    Seq,
    State,
    TokenOut,
    block_hashes_of,
    signed_token_ids,
    token_ids_of,
)
from normalizer.prefix import completion_segments

COST = build_cost_model("h200-llama3-8b")


def text(tokens: int, tag: str) -> bytes:
    """`tokens` tokens of content unique to `tag` (4 bytes per token)."""
    out = bytearray()
    i = 0
    while len(out) < tokens * 4:
        out += hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).hexdigest().encode()
        i += 1
    return bytes(out[: tokens * 4])


_ids = iter(range(1_000_000))


def seq(data: bytes, max_tokens: int = 4, pool_hit_tokens: int = 0, arrival: float = 0.0) -> Seq:
    return Seq(
        id=f"r{next(_ids)}",
        prompt_len=len(data) // 4,
        max_tokens=max_tokens,
        block_hashes=block_hashes_of(data),
        arrival=arrival,
        pool_hit_tokens=pool_hit_tokens,
        data=data,
    )


def run(engine: Engine, clock: float = 0.0) -> tuple[float, list[TokenOut]]:
    """Run to idle; returns the final clock and every token produced."""
    outs: list[TokenOut] = []
    while engine.has_work():
        step = engine.schedule()
        assert step is not None, "work pending but nothing schedulable"
        clock += step.duration
        outs += engine.complete(step, clock)
    return clock, outs


def ttft(s: Seq) -> float:
    assert s.first_token_at is not None
    return s.first_token_at - s.arrival


def test_identical_prompt_hits_every_full_block_but_the_last_token() -> None:
    engine = Engine(COST, capacity_tokens=100_000)
    data = text(1000, "a")
    first = seq(data)
    engine.add(first)
    run(engine)
    assert first.gpu_hit_tokens == 0
    second = seq(data)
    engine.add(second)
    run(engine)
    # 1000 tokens: 62 full blocks; at most 999 reusable -> 62 blocks (992 tokens).
    assert second.gpu_hit_tokens == 992
    assert engine.counters.prefix_queries == 2000
    assert engine.counters.prefix_hits == 992
    assert engine.counters.computed_prompt_tokens == 1000 + 8


def test_prompt_of_exact_blocks_recomputes_its_last_block() -> None:
    engine = Engine(COST, capacity_tokens=100_000)
    data = text(64, "exact")
    engine.add(seq(data))
    run(engine)
    again = seq(data)
    engine.add(again)
    run(engine)
    assert again.gpu_hit_tokens == 48  # 63 reusable tokens -> 3 whole blocks


def test_shared_head_hits_only_the_shared_blocks() -> None:
    engine = Engine(COST, capacity_tokens=100_000)
    head = text(320, "system")
    engine.add(seq(head + text(100, "user-1")))
    run(engine)
    other = seq(head + text(100, "user-2"))
    engine.add(other)
    run(engine)
    assert other.gpu_hit_tokens == 320


def test_hits_make_ttft_shorter_and_report_cached_tokens() -> None:
    engine = Engine(COST, capacity_tokens=200_000)
    data = text(8000, "long")
    cold = seq(data)
    engine.add(cold)
    clock, _ = run(engine)
    warm = seq(data, arrival=clock)
    engine.add(warm)
    run(engine, clock)
    assert ttft(warm) < ttft(cold) / 10


def test_lru_evicts_least_recently_used_prompt_first() -> None:
    # Room for 3 prompts of 20 blocks (plus a few decode blocks).
    engine = Engine(COST, capacity_tokens=66 * BLOCK_SIZE)
    prompts = {name: text(20 * BLOCK_SIZE + 1, name) for name in "abcd"}
    for name in "abc":
        engine.add(seq(prompts[name], max_tokens=1))
        run(engine)
    # Touch a again: b is now the least recently used.
    engine.add(seq(prompts["a"], max_tokens=1))
    run(engine)
    engine.add(seq(prompts["d"], max_tokens=1))
    run(engine)
    hits = {}
    for name in "ac":
        s = seq(prompts[name], max_tokens=1)
        engine.add(s)
        run(engine)
        hits[name] = s.gpu_hit_tokens
    assert hits == {"a": 20 * BLOCK_SIZE, "c": 20 * BLOCK_SIZE}
    probe = seq(prompts["b"], max_tokens=1)
    assert engine.blocks.cached_run(probe.block_hashes, 20) < 20


def test_eviction_takes_a_sequence_tail_before_its_head() -> None:
    engine = Engine(COST, capacity_tokens=40 * BLOCK_SIZE)
    a = text(30 * BLOCK_SIZE + 1, "a")
    engine.add(seq(a, max_tokens=1))
    run(engine)
    # 20 new blocks need ~11 of a's 30 cached blocks: the ones at a's end go.
    engine.add(seq(text(20 * BLOCK_SIZE - 2, "b"), max_tokens=1))
    run(engine)
    hashes = block_hashes_of(a)
    kept = engine.blocks.cached_run(hashes, len(hashes))
    assert 15 <= kept < 30
    assert all(h not in engine.blocks.refs for h in hashes[kept:])


def test_running_requests_pin_their_blocks() -> None:
    engine = Engine(COST, capacity_tokens=40 * BLOCK_SIZE)
    long_runner = seq(text(30 * BLOCK_SIZE, "pinned"), max_tokens=50)
    engine.add(long_runner)
    step = engine.schedule()
    assert step is not None
    engine.complete(step, step.duration)
    assert long_runner.state is State.RUNNING
    # A request needing 20 blocks cannot evict the running one's blocks: it waits.
    blocked = seq(text(20 * BLOCK_SIZE, "blocked"), max_tokens=1)
    engine.add(blocked)
    step = engine.schedule()
    assert step is not None
    assert [item.seq for item in step.items] == [long_runner]
    engine.complete(step, 1.0)
    run(engine, 1.0)
    assert blocked.state is State.FINISHED and long_runner.state is State.FINISHED


def test_steps_that_hold_a_request_for_kv_are_told_from_steps_out_of_budget() -> None:
    # Out of budget: a second prompt waits behind a first that takes the whole step.
    engine = Engine(COST, capacity_tokens=500_000, max_num_batched_tokens=1024)
    engine.add(seq(text(2000, "first")))
    engine.add(seq(text(100, "second")))
    step = engine.schedule()
    assert step is not None and len(engine.waiting) == 1 and not step.kv_held
    engine.complete(step, step.duration)
    assert engine.counters.kv_held_s == 0.0
    # Out of KV: a request needing 20 blocks waits while a running one holds 31 of 40 and
    # decodes; every such step counts, and none once it could be admitted.
    engine = Engine(COST, capacity_tokens=40 * BLOCK_SIZE)
    engine.add(seq(text(30 * BLOCK_SIZE, "pinned"), max_tokens=50))
    step = engine.schedule()
    assert step is not None and not step.kv_held
    clock = step.duration
    engine.complete(step, clock)
    blocked = seq(text(20 * BLOCK_SIZE, "blocked"), max_tokens=5)
    engine.add(blocked)
    held = 0.0
    while blocked.state is State.WAITING:
        step = engine.schedule()
        assert step is not None
        # Held until the step that admits it, once the running request has ended.
        assert step.kv_held == (blocked.state is State.WAITING)
        held += step.duration if step.kv_held else 0.0
        clock += step.duration
        engine.complete(step, clock)
    assert engine.counters.kv_held_s == pytest.approx(held)
    run(engine, clock)
    assert engine.counters.kv_held_s == pytest.approx(held) and 0 < held < engine.counters.busy_s


def test_step_budget_is_shared_by_decodes_and_prefill_chunks() -> None:
    engine = Engine(COST, capacity_tokens=500_000, max_num_batched_tokens=1024)
    decoders = [seq(text(100, f"d{i}"), max_tokens=20) for i in range(4)]
    for s in decoders:
        engine.add(s)
    clock = 0.0
    step = engine.schedule()
    assert step is not None and step.prefill_tokens == 400
    clock += step.duration
    engine.complete(step, clock)
    big = seq(text(5000, "big"))
    engine.add(big)
    step = engine.schedule()
    assert step is not None
    assert step.decode_tokens == 4
    assert step.prefill_tokens == 1020  # the rest of the 1024-token budget
    assert sum(item.tokens for item in step.items) == 1024
    clock += step.duration
    engine.complete(step, clock)
    assert big.num_computed == 1020 and big.first_token_at is None


def test_chunked_prefill_takes_several_steps_and_one_first_token() -> None:
    engine = Engine(COST, capacity_tokens=500_000, max_num_batched_tokens=2048)
    s = seq(text(5000, "chunks"), max_tokens=3)
    engine.add(s)
    steps = 0
    clock = 0.0
    outs = []
    while engine.has_work():
        step = engine.schedule()
        assert step is not None
        steps += 1
        clock += step.duration
        outs += engine.complete(step, clock)
    assert steps == 3 + 2  # 2048 + 2048 + 904 prompt tokens, then two decodes
    assert [o.index for o in outs] == [0, 1, 2] and outs[-1].finished


def test_head_of_line_blocking_delays_a_short_request_behind_a_long_one() -> None:
    alone = Engine(COST, capacity_tokens=500_000)
    short = seq(text(200, "short"))
    alone.add(short)
    run(alone)
    loaded = Engine(COST, capacity_tokens=500_000)
    loaded.add(seq(text(30_000, "long")))
    short2 = seq(text(200, "short"))
    loaded.add(short2)
    run(loaded)
    # The short one waits for the long prompt's chunks ahead of it in FCFS order.
    assert ttft(short2) > 10 * ttft(short)


def test_prefill_cost_grows_with_context() -> None:
    for profile in PROFILES:
        cost = build_cost_model(profile)
        per_token = [cost.prefill_s(n, n + 1024) / 1024 for n in (0, 4096, 16384, 32768)]
        assert per_token == sorted(per_token)
        assert per_token[-1] > 1.5 * per_token[0]
        # Chunking does not change the total.
        whole = cost.prefill_s(0, 20_000)
        parts = cost.prefill_s(0, 7_000) + cost.prefill_s(7_000, 13_000) + cost.prefill_s(13_000, 20_000)
        assert whole == pytest.approx(parts, rel=1e-12)


def test_prefill_matches_the_calibration_within_six_percent() -> None:
    from loadtests.sim.costs import load_calibration

    cal = load_calibration()
    cost = build_cost_model("h200-llama3-8b")
    for n in (4096, 16384, 32768):
        measured = cal["prefill"][f"llama3-8b/{n}"]["model_ms_1gpu"] / 1000
        assert cost.prefill_s(0, n) == pytest.approx(measured, rel=0.06)


def test_decode_is_memory_bound_and_grows_with_batch_context() -> None:
    one = COST.step_s([], [1000])
    many = COST.step_s([], [4000] * 64)
    # Weights dominate batch 1: 16 GB / 3.84 TB/s + 1 ms overhead.
    assert one == pytest.approx(1e-3 + 16.06e9 / 3.84e12 + 1000 * 131072 / 3.84e12, rel=1e-6)
    assert many > 2 * one


def test_pool_hit_loads_instead_of_recomputing() -> None:
    data = text(4096 + 10, "pooled")
    cold_engine = Engine(COST, capacity_tokens=200_000, has_pool=True)
    cold = seq(data)
    cold_engine.add(cold)
    run(cold_engine)
    warm_engine = Engine(COST, capacity_tokens=200_000, has_pool=True)
    warm = seq(data, pool_hit_tokens=4096)
    warm_engine.add(warm)
    step = warm_engine.schedule()
    assert step is not None and step.pool_tokens == 4096 and step.prefill_tokens == 10
    warm_engine.complete(step, step.duration)
    run(warm_engine, step.duration)
    assert warm.pool_loaded_tokens == 4096
    assert warm_engine.counters.external_hits == 4096
    assert warm_engine.counters.external_queries == 4106
    assert ttft(warm) < ttft(cold) / 5
    # Loaded blocks are GPU-cached afterwards.
    again = seq(data)
    warm_engine.add(again)
    run(warm_engine)
    assert again.gpu_hit_tokens == 4096 and again.pool_loaded_tokens == 0


def test_pool_chunks_to_store_cover_newly_computed_full_chunks() -> None:
    engine = Engine(COST, capacity_tokens=200_000, has_pool=True, max_num_batched_tokens=600)
    s = seq(text(1300, "store"), pool_hit_tokens=256)
    engine.add(s)
    stored = []
    clock = 0.0
    while engine.has_work():
        step = engine.schedule()
        assert step is not None
        clock += step.duration
        engine.complete(step, clock)
        first, end = engine.pool_chunks_to_store(s)
        stored += range(first, end)
    # Chunk 0 was already pooled; 1..4 are computed here; the partial 5th is never stored.
    assert stored == [1, 2, 3, 4]


def test_abort_frees_blocks_immediately() -> None:
    engine = Engine(COST, capacity_tokens=100_000)
    s = seq(text(3000, "abort"), max_tokens=100)
    engine.add(s)
    step = engine.schedule()
    assert step is not None
    assert engine.blocks.used > 0
    assert engine.abort(s.id)
    assert engine.blocks.used == 0
    assert engine.complete(step, step.duration) == []  # the step in flight ignores it
    assert not engine.has_work() and s.state is State.ABORTED
    assert not engine.abort(s.id)


def test_decodes_that_outgrow_memory_preempt_the_newest_request() -> None:
    engine = Engine(COST, capacity_tokens=24 * BLOCK_SIZE)
    old = seq(text(10 * BLOCK_SIZE, "old"), max_tokens=60)
    new = seq(text(10 * BLOCK_SIZE, "new"), max_tokens=60)
    engine.add(old)
    engine.add(new)
    _, outs = run(engine)
    assert engine.counters.preemptions >= 1
    assert new.preemptions >= 1 and old.preemptions == 0
    assert engine.counters.kv_held_s > 0  # the preempted request waited for blocks
    assert {o.seq.id for o in outs if o.finished} == {old.id, new.id}
    # Each token is produced once; the preempted request recomputed what it had lost.
    for s in (old, new):
        assert [o.index for o in outs if o.seq is s] == list(range(60))
    assert engine.counters.computed_prompt_tokens > 2 * 10 * BLOCK_SIZE


def test_a_preempted_request_recomputes_its_generated_tokens_too() -> None:
    engine = Engine(COST, capacity_tokens=100_000)
    s = seq(text(100, "resume"), max_tokens=10)
    engine.add(s)
    clock = 0.0
    while s.generated < 4:
        step = engine.schedule()
        assert step is not None
        clock += step.duration
        engine.complete(step, clock)
    engine._preempt(s)
    step = engine.schedule()
    assert step is not None
    # The prompt is cached (96 of 100 tokens); the rest plus 4 generated tokens is prefilled
    # as one chunk, and the next token is sampled at its end.
    assert step.prefill_tokens == 100 + 4 - 96 and step.decode_tokens == 0
    clock += step.duration
    outs = engine.complete(step, clock)
    assert [o.index for o in outs] == [4]


def test_requests_that_cannot_fit_are_refused() -> None:
    engine = Engine(COST, capacity_tokens=10 * BLOCK_SIZE)
    assert not engine.fits(10 * BLOCK_SIZE, 1)
    with pytest.raises(ValueError):
        engine.add(seq(text(10 * BLOCK_SIZE, "huge")))


def test_kv_events_report_stored_and_removed_blocks() -> None:
    engine = Engine(COST, capacity_tokens=30 * BLOCK_SIZE)
    engine.blocks.record_events = True
    a = text(20 * BLOCK_SIZE + 3, "ev-a")
    engine.add(seq(a, max_tokens=1))
    run(engine)
    events = engine.drain_events()
    stored = [e for e in events if e.kind == "stored"]
    assert [h for e in stored for h in e.block_hashes] == block_hashes_of(a)
    assert stored[0].parent is None
    assert [t for e in stored for t in e.token_ids] == token_ids_of(a[: 20 * BLOCK_SIZE * 4])
    engine.add(seq(text(20 * BLOCK_SIZE, "ev-b"), max_tokens=1))
    run(engine)
    removed = [h for e in engine.drain_events() if e.kind == "removed" for h in e.block_hashes]
    assert removed and set(removed) <= set(block_hashes_of(a))


def test_token_ids_are_u32_and_round_trip_through_a_token_prompt() -> None:
    data = "Grüße, 世界! ".encode() * 10
    ids = token_ids_of(data)
    assert all(0 <= t < 2**32 for t in ids) and any(t >= 2**31 for t in ids)
    assert b"".join(completion_segments({"prompt": signed_token_ids(ids)})) == data[: len(ids) * 4]


def check_block_accounting(engine: Engine) -> None:
    refs: dict[int, int] = {}
    private = 0
    for s in engine.running:
        for h in s.table:
            if h is None:
                private += 1
            else:
                refs[h] = refs.get(h, 0) + 1
    for s in engine.waiting:
        assert s.table == []
    pool = engine.blocks
    assert {h: n for h, n in pool.refs.items() if n > 0} == refs
    assert set(pool.evictable) == {h for h, n in pool.refs.items() if n == 0}
    assert pool.used == private + len(refs)
    assert pool.used + len(pool.evictable) <= pool.num_blocks


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 200), st.integers(1, 40)),
            st.tuples(st.just("step"), st.integers(1, 5)),
            st.tuples(st.just("abort"), st.integers(0, 50)),
            st.tuples(st.just("abort_in_step"), st.integers(0, 50)),
        ),
        max_size=60,
    )
)
def test_block_accounting_survives_any_mix_of_requests_steps_and_aborts(ops: list[tuple]) -> None:
    engine = Engine(COST, capacity_tokens=30 * BLOCK_SIZE, max_num_batched_tokens=256, max_num_seqs=4)
    heads = [text(40 * k, f"head{k}") for k in range(4)]
    added: list[Seq] = []
    clock = 0.0
    for op in ops:
        if op[0] == "add":
            _, head, tail, max_tokens = op
            s = seq(heads[head] + text(tail, f"tail{len(added)}"), max_tokens=max_tokens)
            if engine.fits(s.prompt_len, s.max_tokens):
                engine.add(s)
                added.append(s)
        elif op[0] == "step":
            for _ in range(op[1]):
                step = engine.schedule()
                if step is None:
                    assert not engine.has_work()
                    break
                clock += step.duration
                engine.complete(step, clock)
        elif op[0] == "abort" and added:
            engine.abort(added[op[1] % len(added)].id)
        elif op[0] == "abort_in_step" and added:
            step = engine.schedule()
            engine.abort(added[op[1] % len(added)].id)
            if step is not None:
                clock += step.duration
                outs = engine.complete(step, clock)
                assert all(o.seq.state is not State.ABORTED for o in outs)
        check_block_accounting(engine)
    run(engine, clock)
    check_block_accounting(engine)
    assert engine.blocks.used == 0
    for s in added:
        assert s.state in (State.FINISHED, State.ABORTED)
        if s.state is State.FINISHED:
            assert s.generated == s.max_tokens


def test_block_hasher_matches_block_hashes_of_and_reuses_pieces() -> None:
    import random

    rng = random.Random(3)
    piece = BlockHasher.PIECE_BLOCKS * 64
    base = bytes(rng.randrange(256) for _ in range(3 * piece + 1000))
    hasher = BlockHasher(b"model", max_pieces=4)
    # A conversation growing turn by turn, a prompt sharing only its first piece, and
    # prompts shorter than a piece: always the plain chain, whatever was hashed before.
    grown = base + bytes(rng.randrange(256) for _ in range(piece))
    forked = base[:piece] + bytes(rng.randrange(256) for _ in range(2 * piece))
    for data in (base, grown, forked, base[:100], base[: piece + 64], grown):
        assert hasher.hashes(data) == block_hashes_of(data, b"model")
    assert len(hasher._pieces) <= 4
    # A different seed is a different chain.
    assert BlockHasher(b"other").hashes(base) != hasher.hashes(base)
