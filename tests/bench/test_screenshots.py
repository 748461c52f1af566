"""The `screenshots` scenario: computer-use agents whose every request adds one screenshot
to the history it resends, counted in tokens as the simulated workers and kvroute count
them, with the arrival rate derived from those counts."""

from __future__ import annotations

import contextlib
import io
import itertools
import statistics
from dataclasses import replace
from pathlib import Path

import orjson
import pytest

from loadtests.benchmark.bench import (
    HARNESS_BODY_BYTES_PER_WALL_S,
    MIN_AUTO_TIME_SCALE,
    RunSetup,
    _kvroute_args,
    auto_time_scale,
    cli,
    parse_entries,
)
from loadtests.benchmark.screens import SCREEN_SIZES, Screenshot
from loadtests.benchmark.workload import (
    REFERENCE_SEED,
    SCENARIOS,
    Conversation,
    build_workload,
    derive_rates,
    make_group,
    make_session,
    session_tokens,
)
from loadtests.sim.costs import DEFAULT_PROFILE
from normalizer.canonical import canonicalize_body
from normalizer.media import MediaReader, MediaSettings, qwen2_vl
from normalizer.prefix import chat_prompt, prompt_bytes
from router.chain import EstimateChainBuilder

SHOTS = SCENARIOS["screenshots"]


def _images(body: dict) -> list[str]:
    return [
        p["image_url"]["url"]
        for m in body["messages"]
        if isinstance(m["content"], list)
        for p in m["content"]
        if p.get("type") == "image_url"
    ]


def _session(index: int, seed: int = 1):
    s = make_session(seed, SHOTS, index)
    return s, make_group(seed, SHOTS, s.group)


def test_the_spec_states_sizes_bytes_repeats_and_the_image_rule() -> None:
    assert SHOTS.screenshot_bytes == 300_000
    assert SHOTS.screen_sizes == SCREEN_SIZES
    assert SHOTS.screenshot_repeat_share == 0.2
    assert SHOTS.image_rule == "qwen2_vl"
    # The text scenarios send no images and tell neither side a rule.
    assert all(SCENARIOS[n].screenshot_bytes == 0 and SCENARIOS[n].image_rule is None for n in ("seed", "hot-prefix", "no-reuse"))


def test_the_workload_builds_and_each_request_carries_one_more_screenshot() -> None:
    wl = build_workload(SHOTS, 3, 2.0, warmup_s=5, window_s=20)
    assert len(wl.sessions) > 20
    for s in wl.sessions[:8]:
        group = wl.groups[s.group]
        bodies = [body for _, body in Conversation(s, group).bodies()]
        assert [len(_images(b)) for b in bodies] == list(range(1, len(s.turns) + 1))
        for body in bodies:
            assert "tools" not in body and body["messages"][0]["role"] == "system"
            last = body["messages"][-1]
            assert last["role"] == "user" and [p["type"] for p in last["content"]] == ["text", "image_url"]
        # Each turn resends the previous request byte for byte before its new messages.
        for a, b in itertools.pairwise(bodies):
            assert b["messages"][: len(a["messages"])] == a["messages"]
        # A session keeps its display's size and sends the scenario's PNG size.
        url = _images(bodies[-1])[0]
        assert len(url) == len("data:image/png;base64,") + 4 * -(-SHOTS.screenshot_bytes // 3)
        replies = [t.reply["content"] for t in s.turns]
        assert all(r.startswith("Thought: ") and "\nAction: " in r for r in replies[:-1])
        assert replies[-1].startswith("Action: finished(")


def test_a_stated_share_of_turns_resends_the_previous_screenshot_unchanged() -> None:
    repeated = later = 0
    sizes = set()
    for i in range(300):
        s = make_session(REFERENCE_SEED, SHOTS, i)
        shots = [next(p for p in t.new_messages[0]["content"] if isinstance(p, Screenshot)) for t in s.turns]
        sizes.add((shots[0].width, shots[0].height))
        assert {(x.width, x.height, x.size) for x in shots} == {(shots[0].width, shots[0].height, 300_000)}
        for a, b in itertools.pairwise(shots):
            later += 1
            repeated += a == b
        # Distinct screenshots are distinct images (a repeat is only ever the previous one).
        assert len({x.seed for x in shots}) == 1 + sum(a != b for a, b in itertools.pairwise(shots))
    assert later > 1_500
    assert repeated / later == pytest.approx(0.2, abs=0.03)
    assert sizes == set(SCREEN_SIZES)


def test_a_repeat_is_the_same_bytes_built_once() -> None:
    s, group = next(
        (s, g) for s, g in (_session(i) for i in range(50))
        if any(a.new_messages[0]["content"][1] == b.new_messages[0]["content"][1] for a, b in itertools.pairwise(s.turns))
    )  # fmt: skip
    conv = Conversation(s, group)
    bodies = [body for _, body in conv.bodies()]
    urls = _images(bodies[-1])
    shots = [t.new_messages[0]["content"][1] for t in s.turns]
    assert len(conv.images) == len(set(shots))
    for k in range(1, len(shots)):
        assert (urls[k] == urls[k - 1]) == (shots[k] == shots[k - 1])
    # Every request reuses the parts built for the earlier ones (no PNG or base64 rebuilt).
    first_part = bodies[0]["messages"][1]["content"][1]
    assert all(b["messages"][1]["content"][1] is first_part for b in bodies)
    # The same session in another run builds the same bytes (the seed fixes the PNGs).
    again = [body for _, body in Conversation(*_session(s.index)).bodies()]
    assert orjson.dumps(again[-1]) == orjson.dumps(bodies[-1])


def test_token_counts_are_the_workers_and_the_routers_image_counts() -> None:
    reader = MediaReader(MediaSettings(image_rule="qwen2_vl"))
    chain = EstimateChainBuilder(MediaReader(MediaSettings(image_rule="qwen2_vl")))
    for index in (0, 7):
        s, group = _session(index)
        toks = session_tokens(s, group)
        for body, expected in zip((b for _, b in Conversation(s, group).bodies()), toks.prompts, strict=True):
            canonical = canonicalize_body(body)
            # The simulated worker: the prompt's bytes, each image its placeholder. It counts
            # the client's system prompt as sent: its style's line endings and padding add a
            # few tokens to the canonical count.
            assert len(prompt_bytes(chat_prompt(canonical, reader)[0])) // 4 == expected
            sent = len(prompt_bytes(chat_prompt(body, reader)[0])) // 4
            assert 0 <= sent - expected <= 0.05 * toks.shared
            # kvroute's estimate chain over the canonical body.
            assert chain.build(canonical, "chat").total_tokens == expected
        # Images, not text, make up most of the prompt: Qwen2-VL's count for the display size.
        w, h = s.turns[0].new_messages[0]["content"][1].width, s.turns[0].new_messages[0]["content"][1].height
        assert toks.prompts[0] - toks.shared > qwen2_vl(w, h)
        assert toks.prompts[-1] > len(s.turns) * qwen2_vl(w, h)


def test_capacity_counts_the_image_tokens() -> None:
    rates = derive_rates(SHOTS, 8)
    # One token per image: the same sessions, nearly text only.
    tiny = derive_rates(replace(SHOTS, name="screenshots-fixed1", image_rule="fixed:1"), 8)
    images_per_request = statistics.mean(
        k + 1 for i in range(400) for k in range(len(make_session(REFERENCE_SEED, SHOTS, i).turns))
    )
    per_image = statistics.mean(qwen2_vl(w, h) for w, h in SCREEN_SIZES)
    gained = rates.prompt_tokens_per_request - tiny.prompt_tokens_per_request
    assert gained == pytest.approx(images_per_request * (per_image - 1), rel=0.1)
    assert rates.prompt_tokens_per_request > 0.8 * images_per_request * per_image
    # So the fleet takes far fewer screenshot sessions than their text alone would allow.
    assert tiny.capacity_sessions_per_s_random_lb > 5 * rates.capacity_sessions_per_s_random_lb
    assert rates.arrival_rate_per_s == pytest.approx(SHOTS.load * rates.capacity_sessions_per_s_random_lb)
    assert rates.max_prompt_tokens < 131_072


def test_the_simulator_and_kvroute_are_told_the_same_image_rule() -> None:
    setup = RunSetup(workers=2, profile=DEFAULT_PROFILE, time_scale=1.0, kv_capacity_tokens=1000,
                     pool_capacity_tokens=0, logs=Path("."), image_rule=SHOTS.image_rule)  # fmt: skip
    assert setup.image_args() == ["--image-rule", "qwen2_vl"]
    for entry in parse_entries("random,cache_aware", ""):
        args = _kvroute_args(setup, entry)
        assert args[args.index("--image-rule") + 1] == "qwen2_vl"
    plain = replace(setup, image_rule=None)
    assert plain.image_args() == [] and "--image-rule" not in _kvroute_args(plain, parse_entries("cache_aware", "")[0])


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_the_screenshots_go_through_chat_only(api: str, tmp_path: Path) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli(["--scenario", "screenshots", "--api", api, "--out", str(tmp_path)])
    assert code == 2 and "chat only" in err.getvalue()


def test_auto_time_scale_slows_the_clock_for_megabyte_bodies() -> None:
    rates = derive_rates(SHOTS, 8)
    # About 3 MB a request: the bytes, not the few output tokens, set the time scale.
    assert rates.request_bytes_per_s > 20 * rates.output_tokens_per_s * 4
    assert auto_time_scale(rates.output_tokens_per_s) == MIN_AUTO_TIME_SCALE
    scale = auto_time_scale(rates.output_tokens_per_s, rates.request_bytes_per_s)
    assert scale == pytest.approx(rates.request_bytes_per_s / HARNESS_BODY_BYTES_PER_WALL_S, abs=0.01)
    # The text scenarios' bodies are small: their scale stays the tokens'.
    seed = derive_rates(SCENARIOS["seed"], 8)
    assert auto_time_scale(seed.output_tokens_per_s, seed.request_bytes_per_s) == auto_time_scale(seed.output_tokens_per_s)
