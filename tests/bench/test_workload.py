"""The bench workload: deterministic, growing, shared where it should be, and varied only in
bytes that canonicalization removes."""

from __future__ import annotations

import itertools
import statistics

import orjson
import pytest

from loadtests.benchmark.random_lb import SessionShape, replay_random
from loadtests.benchmark.workload import (
    CLIENT_STYLES,
    SCENARIOS,
    Conversation,
    build_workload,
    derive_rates,
    make_group,
    make_session,
    session_tokens,
    zero_load_timeline,
)
from loadtests.sim.costs import DEFAULT_PROFILE, build_cost_model
from normalizer.canonical import canonicalize_body
from normalizer.prefix import chat_segments

SEED = SCENARIOS["seed"]


def _prompt_bytes(body: dict) -> bytes:
    return b"".join(chat_segments(body))


def _bodies(session, group) -> list[dict]:
    return [body for _, body in Conversation(session, group).bodies()]


def test_same_seed_same_workload_other_seed_other_workload() -> None:
    a = build_workload(SEED, 3, 1.0, warmup_s=5, window_s=20)
    b = build_workload(SEED, 3, 1.0, warmup_s=5, window_s=20)
    c = build_workload(SEED, 4, 1.0, warmup_s=5, window_s=20)
    assert [s.start_s for s in a.sessions] == [s.start_s for s in b.sessions]
    assert len(a.sessions) > 5

    def first_bodies(w) -> list[bytes]:
        out = []
        for s in w.sessions[:5]:
            group = w.groups.get(s.group) if s.group is not None else None
            out.append(orjson.dumps(_bodies(s, group)[-1]))
        return out

    assert first_bodies(a) == first_bodies(b)
    assert first_bodies(a) != first_bodies(c)


def test_contexts_grow_turn_after_turn_to_tens_of_thousands_of_tokens() -> None:
    finals = []
    for i in range(40):
        s = make_session(1, SEED, i)
        group = make_group(1, SEED, s.group)
        toks = session_tokens(s, group)
        assert all(b > a for a, b in zip(toks.prompts, toks.prompts[1:], strict=False))
        finals.append(toks.prompts[-1])
    assert max(finals) > 30_000
    assert statistics.median(finals) > 8_000


def test_token_counts_match_what_router_and_simulator_count() -> None:
    s = make_session(2, SEED, 5)
    group = make_group(2, SEED, s.group)
    toks = session_tokens(s, group)
    for body, expected in zip(_bodies(s, group), toks.prompts, strict=True):
        assert len(_prompt_bytes(canonicalize_body(body))) // 4 == expected


def test_tool_calls_are_short_and_final_answers_longer() -> None:
    calls, answers = [], []
    for i in range(60):
        for turn in make_session(1, SEED, i).turns:
            (calls if turn.kind == "tool_call" else answers).append(turn.max_tokens)
    assert statistics.median(answers) > 3 * statistics.median(calls)


def test_sessions_of_a_group_share_tools_and_system_prompt_after_canonicalization() -> None:
    sessions = [make_session(1, SEED, i) for i in range(30)]
    by_group: dict[int, list] = {}
    for s in sessions:
        by_group.setdefault(s.group, []).append(s)
    shared_heads = {}
    for g, members in by_group.items():
        group = make_group(1, SEED, g)
        heads = set()
        for s in members:
            first = canonicalize_body(_bodies(s, group)[0])
            tools_seg, system_seg = chat_segments(first)[:2]
            heads.add(tools_seg + system_seg)
        assert len(heads) == 1, f"group {g}: sessions disagree on the canonical shared prefix"
        shared_heads[g] = heads.pop()
        assert len(shared_heads[g]) > 8_000  # a multi-kB system prompt plus tool schemas
    assert len(set(shared_heads.values())) == len(shared_heads) >= 2


def test_client_styles_change_bytes_but_canonicalize_equal() -> None:
    base = next(make_session(1, SEED, i) for i in range(50) if any(t.kind == "tool_call" for t in make_session(1, SEED, i).turns))
    group = make_group(1, SEED, base.group)
    raw: dict[str, list[bytes]] = {}
    canon: dict[str, list[bytes]] = {}
    for style in CLIENT_STYLES:
        base.style = style
        bodies = _bodies(base, group)
        raw[style.name] = [_prompt_bytes(b) for b in bodies]
        canon[style.name] = [_prompt_bytes(canonicalize_body(b)) for b in bodies]
    last_raw = {name: prompts[-1] for name, prompts in raw.items()}
    assert len(set(last_raw.values())) == len(CLIENT_STYLES), "every SDK style serialises differently"
    assert len({tuple(c) for c in canon.values()}) == 1, "canonical forms must be identical"
    # Each style differs from the canonical form already in its first segments (the tools
    # or the system prompt), so a non-canonicalizing path shares no prefix across styles.
    reference = next(iter(canon.values()))[0]
    for name, prompts in raw.items():
        if prompts[0] != reference:
            mismatch = next(i for i, (x, y) in enumerate(zip(prompts[0], reference, strict=False)) if x != y)
            assert mismatch < 20_000, name


def test_a_session_is_consistent_with_itself_in_every_style() -> None:
    s = make_session(1, SEED, 3)
    group = make_group(1, SEED, s.group)
    for style in CLIENT_STYLES:
        s.style = style
        prompts = [_prompt_bytes(b) for b in _bodies(s, group)]
        for before, after in itertools.pairwise(prompts):
            assert after.startswith(before), style.name


def test_system_prompt_variants_cover_line_endings_trailing_spaces_and_unicode_form() -> None:
    group = make_group(1, SEED, 0)
    texts = {}
    for style in CLIENT_STYLES:
        s = make_session(1, SEED, 0)
        s.style = style
        texts[style.name] = Conversation(s, group).messages[0]["content"]
    assert "\r\n" in texts["dotnet-windows"]
    assert any(line.endswith("  ") for line in texts["langchain"].split("\n"))
    assert texts["macos-cli"] != texts["openai-python"] and "e\u0301" in texts["macos-cli"]


def test_arrival_rate_is_derived_from_the_cost_model() -> None:
    cost = build_cost_model()
    r8 = derive_rates(SEED, 8, cost=cost)
    r4 = derive_rates(SEED, 4, cost=cost)
    assert r8.arrival_rate_per_s == pytest.approx(SEED.load * r8.capacity_sessions_per_s_random_lb)
    assert r8.capacity_sessions_per_s_cache_blind == pytest.approx(8 / r8.prefill_s_per_session_cache_blind)
    # A random balancer's capacity: where its prefill work fills the fleet (within the
    # bisection's resolution), between cache-blind and ideal reuse.
    for r, workers in ((r8, 8), (r4, 4)):
        work = r.capacity_sessions_per_s_random_lb * r.prefill_s_per_session_random_lb
        assert work == pytest.approx(workers, rel=0.01)
        assert r.capacity_sessions_per_s_cache_blind < r.capacity_sessions_per_s_random_lb
        assert r.capacity_sessions_per_s_random_lb < r.capacity_sessions_per_s_ideal
    # Over fewer workers a random pick more often finds the conversation's last worker.
    assert r4.random_lb_reused_fraction > r8.random_lb_reused_fraction
    # Reusing the previous turn makes sessions several times cheaper to serve.
    assert r8.capacity_sessions_per_s_ideal > 5 * r8.capacity_sessions_per_s_cache_blind
    # The seed does not change the offered load (a fixed reference sample derives it).
    assert derive_rates(SEED, 8, cost=cost).arrival_rate_per_s == r8.arrival_rate_per_s


def test_no_reuse_is_single_turn_and_unique() -> None:
    spec = SCENARIOS["no-reuse"]
    heads = set()
    for i in range(20):
        s = make_session(1, spec, i)
        assert len(s.turns) == 1 and s.group is None
        heads.add(_prompt_bytes(canonicalize_body(_bodies(s, None)[0]))[:2000])
    assert len(heads) == 20
    r = derive_rates(spec, 8)
    assert r.prefill_s_per_session_ideal == pytest.approx(r.prefill_s_per_session_cache_blind)


def test_hot_prefix_shares_one_long_system_prompt() -> None:
    spec = SCENARIOS["hot-prefix"]
    sessions = [make_session(1, spec, i) for i in range(10)]
    assert {s.group for s in sessions} == {0}
    group = make_group(1, spec, 0)
    assert len(group.system_prompt) >= 30_000


def test_lone_agent_plays_one_session_at_a_time() -> None:
    spec = SCENARIOS["lone-agent"]
    cost = build_cost_model(DEFAULT_PROFILE)
    rates = derive_rates(spec, 8)
    wl = build_workload(spec, 1, rates.arrival_rate_per_s, cost=cost)
    assert len(wl.sessions) >= 2 and wl.prepopulate_s == 0
    assert wl.sessions[0].start_s == 0 and all(s.start_turn == 0 for s in wl.sessions)
    # Each session starts after the previous one's last answer on an idle fleet.
    for before, after in itertools.pairwise(wl.sessions):
        timeline = zero_load_timeline(before, session_tokens(before, wl.groups[before.group]), cost)
        assert after.start_s > before.start_s + timeline[-1]
    assert wl.sessions[-1].start_s < wl.window_end_s
    # Long conversations: contexts grow past 20k tokens.
    assert rates.p90_final_context_tokens > 20_000
    assert rates.expected_concurrent_sessions == pytest.approx(1.0)


def test_runs_start_in_steady_state() -> None:
    rates = derive_rates(SEED, 8)
    wl = build_workload(SEED, 1, rates.arrival_rate_per_s, warmup_s=20, window_s=30)
    under_way = [s for s in wl.sessions if s.start_turn > 0]
    assert under_way, "sessions already under way at time 0 join mid-conversation"
    # Little's law: about rate × mean session duration are active at any time, so also at 0.
    active_at_0 = [s for s in wl.sessions if s.arrival_s < 0]
    assert len(active_at_0) == pytest.approx(rates.expected_concurrent_sessions, rel=0.35)
    assert len({s.index for s in wl.sessions}) == len(wl.sessions)
    assert all(s.start_s >= 0 for s in wl.sessions)
    assert all(s.arrival_s < wl.window_end_s for s in wl.sessions)
    assert wl.prepopulate_s > 60


def test_the_window_leaves_out_the_warm_up_and_the_histories_sent_cold() -> None:
    rates = derive_rates(SEED, 8)
    wl = build_workload(SEED, 1, rates.arrival_rate_per_s, warmup_s=20, window_s=30)
    joiner = next(s for s in wl.sessions if s.start_turn > 0 and s.start_turn + 1 < len(s.turns))
    fresh = next(s for s in wl.sessions if s.start_turn == 0 and len(s.turns) > 1)
    inside = wl.warmup_s + 1.0
    # A session under way at time 0 sends its whole history cold with its first request:
    # never measured, wherever it falls; its later turns are, like every other request.
    assert not wl.measures(joiner, joiner.start_turn, inside)
    assert wl.measures(joiner, joiner.start_turn + 1, inside)
    assert wl.measures(fresh, 0, inside) and wl.measures(fresh, 1, inside)
    assert not wl.measures(fresh, 1, wl.warmup_s - 0.1)
    # Some of those histories fall inside the window: a long pause before the next turn.
    assert any(s.start_turn > 0 and wl.warmup_s <= s.start_s < wl.window_end_s for s in wl.sessions)


def test_random_lb_reuse_falls_as_caches_fill() -> None:
    """The random-balancer model: reuse comes from the conversation's earlier worker, and
    shrinks when more conversations compete for each worker's cache."""
    cost = build_cost_model()
    # Two turns 1 s apart, 10k then 12k tokens, 1k shared.
    shape = SessionShape(1_000, (10_000, 12_000), (100, 100), (0.0, 1.0))
    one_worker = replay_random([shape], 0.5, 1, 10**9, cost)
    # With one worker and room for everything, turn 2 reuses turn 1's prompt + output.
    assert one_worker.reused_fraction == pytest.approx((1_000 + 10_100) / 22_000)
    many = replay_random([shape], 0.5, 8, 10**9, cost)
    assert many.reused_fraction < one_worker.reused_fraction
    # A cache too small for more than a few conversations keeps less.
    tiny = replay_random([shape], 50.0, 1, 30_000, cost)
    assert tiny.reused_fraction < one_worker.reused_fraction
    assert tiny.prefill_s_per_session > one_worker.prefill_s_per_session
