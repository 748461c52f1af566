"""Multi-turn agent workloads for `kvroute bench`, deterministic under a seed.

A *session* is one agent conversation. It belongs to a *group* (one agent application: a
multi-kB system prompt and a set of tool schemas shared by every session of the group) and
is sent by one *client style* (the SDK that serialises it). A session is one or more
*tasks*; a task starts with a user message, continues with assistant tool calls and the
tool results that come back (each one LLM request), and ends with a longer final answer.
Every request resends the whole conversation so far, so contexts grow turn after turn to
tens of thousands of tokens. Between requests the client waits: a tool's run time after a
tool call, a person's think time after a final answer. Sessions arrive as a Poisson
process.

Client styles reproduce how real SDKs serialise the same conversation differently: key
order of the tool schemas (declaration order, sorted as Go's encoding/json does, the
reverse), whitespace and escaping of tool-call argument strings (Python's `json.dumps`
default separators and ASCII escapes, JavaScript's compact `JSON.stringify`, pretty
printing), and system-prompt line endings, trailing spaces and Unicode normal form (a
prompt file checked out on Windows, a template that pads lines, a file read from a macOS
file system in NFD). Each session is consistent with itself (turn N+1 extends turn N byte
for byte); sessions of one group differ only in these meaningless ways, which
`normalizer.canonicalize_body` removes.

Arrival rates are derived, not tuned: `ScenarioSpec.load` is the offered prefill work as a
fraction of the cluster's prefill capacity behind a *random load balancer* (the incident's
baseline): each request recomputes what the worker it lands on does not hold, with the
group's shared system prompt and tools cached everywhere, and with what a random
placement over LRU caches of the workers' KV capacity keeps (`loadtests.benchmark.random_lb`). The
prefill work comes from the simulator's own cost model (`loadtests.sim.costs`) over a
fixed reference sample of sessions; see `derive_rates` and docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import string
import sys
import unicodedata
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from loadtests.benchmark.random_lb import RandomReuse, SessionShape, random_lb_capacity
from loadtests.benchmark.screens import SCREEN_SIZES, Screenshot
from loadtests.sim.costs import DEFAULT_PROFILE, CostModel, build_cost_model
from normalizer.media import Media, MediaReader, MediaSettings
from normalizer.prefix import message_segments, render_message, render_tools
from normalizer.tokens import CHARS_PER_TOKEN

MODEL = "sim-llama3-8b"
"""The model name the simulated workers serve."""

REFERENCE_SEED = 20_240_601
REFERENCE_SESSIONS = 400
"""The rate derivation uses this fixed sample, so a scenario's arrival rate does not move
with `--seed` (the seed changes which sessions are drawn, not how much load is offered)."""


# -- distributions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LogNormal:
    """A log-normal draw given by its median, clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: float
    hi: float

    def draw(self, rng: random.Random) -> float:
        return min(max(rng.lognormvariate(math.log(self.median), self.sigma), self.lo), self.hi)

    def draw_int(self, rng: random.Random) -> int:
        return round(self.draw(rng))


@dataclass(frozen=True)
class ScenarioSpec:
    name: str
    description: str
    groups: int
    group_skew: float
    """Zipf exponent of group popularity (0: uniform)."""
    system_prompt_bytes: LogNormal
    tools_per_group: tuple[int, int]
    extra_tasks_mean: float
    """Tasks per session = 1 + Poisson(extra_tasks_mean), at most max_tasks."""
    max_tasks: int
    tool_steps_mean: float
    """Tool calls per task: geometric with this mean (at least min_tool_steps)."""
    min_tool_steps: int
    max_tool_steps: int
    user_message_bytes: LogNormal
    attachment_probability: float
    attachment_bytes: LogNormal
    tool_result_bytes: LogNormal
    """A tool result's bytes (screenshot sessions: the text beside each later screenshot)."""
    tool_call_tokens: LogNormal
    """A tool call's tokens (screenshot sessions: an action, thought included)."""
    answer_tokens: LogNormal
    tool_think_s: LogNormal
    """Client-side wait after a tool call: the tool runs (screenshot sessions: the action
    runs, the page settles and the next screenshot is taken)."""
    user_think_s: LogNormal
    """Wait after a final answer before the next task's user message."""
    load: float
    """Offered prefill work as a fraction of the fleet's prefill capacity behind a random
    load balancer (see `derive_rates`)."""
    warmup_s: float
    """Simulated seconds at the start whose requests warm the caches, unmeasured."""
    window_s: float
    """Requests sent in [warmup_s, warmup_s + window_s) are measured."""
    grace_s: float
    """After the window, at most this long for requests in flight to finish."""
    screenshot_bytes: int = 0
    """Each screenshot's PNG in bytes; above 0 the sessions are computer-use agents, every
    request adding one screenshot (`_screenshot_session`); 0: text agents."""
    screen_sizes: tuple[tuple[int, int], ...] = SCREEN_SIZES
    """Display resolutions, one drawn per session (an agent's display keeps its size)."""
    screenshot_repeat_share: float = 0.0
    """Chance that a turn after the first resends the previous screenshot unchanged (the
    action changed nothing on screen): the same bytes, so the same media key."""
    image_rule: str | None = None
    """The served model's image rule (normalizer/media.py), given as `--image-rule` to the
    simulated workers and to kvroute alike, so that both count an image's tokens as the
    workload's derivation does (None: neither is told; both use `auto`)."""
    sequential: bool = False
    """One session at a time instead of Poisson arrivals: each starts a person's think time
    (`user_think_s`) after the previous one's zero-load timeline ends, from time 0, with no
    sessions under way before it (`build_workload`); `load` is then unused."""


SCENARIOS: dict[str, ScenarioSpec] = {
    # The incident: many concurrent coding/ops agents, each conversation accumulating tool
    # output until it holds tens of thousands of tokens.
    "seed": ScenarioSpec(
        name="seed",
        description="many concurrent agent sessions; tool results grow contexts to tens of thousands of tokens",
        groups=4,
        group_skew=1.0,
        system_prompt_bytes=LogNormal(9_000, 0.25, 5_000, 16_000),
        tools_per_group=(8, 16),
        extra_tasks_mean=0.8,
        max_tasks=4,
        tool_steps_mean=6.0,
        min_tool_steps=1,
        max_tool_steps=16,
        user_message_bytes=LogNormal(500, 0.8, 60, 6_000),
        attachment_probability=0.3,
        attachment_bytes=LogNormal(8_000, 0.7, 1_000, 40_000),
        tool_result_bytes=LogNormal(2_400, 1.0, 80, 48_000),
        tool_call_tokens=LogNormal(60, 0.6, 16, 300),
        answer_tokens=LogNormal(350, 0.6, 80, 1_200),
        tool_think_s=LogNormal(1.5, 0.8, 0.1, 20.0),
        user_think_s=LogNormal(20.0, 0.8, 3.0, 120.0),
        # The incident's fleet ran where its random balancer ran out of prefill: its mean
        # TTFT was ten times the unloaded figure (3.98 s against under 0.4 s), which queues
        # only do at saturation. So `seed` offers exactly the random balancer's capacity.
        # (At 0.8 of it random stays at 2.3x its unloaded TTFT; docs/benchmark.md has both.)
        load=1.0,
        warmup_s=30.0,
        window_s=60.0,
        grace_s=30.0,
    ),
    # One long system prompt (a product manual, a code base summary) shared by every
    # session; short conversations. The trap: the worker that cached the prefix first
    # looks cheapest for everyone.
    "hot-prefix": ScenarioSpec(
        name="hot-prefix",
        description="one long system prompt shared by all sessions; short conversations",
        groups=1,
        group_skew=0.0,
        system_prompt_bytes=LogNormal(40_000, 0.0, 40_000, 40_000),
        tools_per_group=(6, 6),
        extra_tasks_mean=0.3,
        max_tasks=2,
        tool_steps_mean=1.5,
        min_tool_steps=0,
        max_tool_steps=4,
        user_message_bytes=LogNormal(400, 0.7, 60, 4_000),
        attachment_probability=0.5,
        attachment_bytes=LogNormal(6_000, 0.6, 1_000, 24_000),
        tool_result_bytes=LogNormal(1_500, 0.8, 80, 16_000),
        tool_call_tokens=LogNormal(50, 0.5, 16, 200),
        answer_tokens=LogNormal(150, 0.5, 40, 600),
        tool_think_s=LogNormal(1.0, 0.7, 0.1, 10.0),
        user_think_s=LogNormal(15.0, 0.7, 3.0, 60.0),
        load=0.7,
        warmup_s=10.0,
        window_s=20.0,
        grace_s=10.0,
    ),
    # Single-turn unique prompts (summarise this document): nothing to reuse, so routing
    # by cache can only cost; it must not.
    "no-reuse": ScenarioSpec(
        name="no-reuse",
        description="single-turn unique prompts: nothing to reuse",
        groups=0,
        group_skew=0.0,
        system_prompt_bytes=LogNormal(1, 0.0, 1, 1),
        tools_per_group=(0, 0),
        extra_tasks_mean=0.0,
        max_tasks=1,
        tool_steps_mean=0.0,
        min_tool_steps=0,
        max_tool_steps=0,
        user_message_bytes=LogNormal(300, 0.5, 60, 2_000),
        attachment_probability=1.0,
        attachment_bytes=LogNormal(24_000, 0.6, 4_000, 120_000),
        tool_result_bytes=LogNormal(1, 0.0, 1, 1),
        tool_call_tokens=LogNormal(1, 0.0, 1, 1),
        answer_tokens=LogNormal(200, 0.5, 40, 800),
        tool_think_s=LogNormal(1, 0.0, 1, 1),
        user_think_s=LogNormal(1, 0.0, 1, 1),
        load=0.7,
        warmup_s=5.0,
        window_s=20.0,
        grace_s=15.0,
    ),
    # Computer-use / browser agents (UI-TARS, Operator-style loops): each step sends the
    # screen as a PNG screenshot with a line of text, the model answers with one short
    # action, and the whole history, every earlier screenshot included, is resent. A
    # request carries megabytes of base64 but only thousands of tokens: Qwen2.5-VL counts a
    # 1920×1080 screenshot as 2,693 tokens, a 1280×800 one as 1,336.
    "screenshots": ScenarioSpec(
        name="screenshots",
        description="computer-use agents: one screenshot per turn, the whole history of screenshots resent",
        groups=3,
        group_skew=1.0,
        system_prompt_bytes=LogNormal(3_000, 0.3, 1_500, 6_000),
        tools_per_group=(0, 0),  # actions are text (UI-TARS' action space), not tool calls
        extra_tasks_mean=0.0,
        max_tasks=1,
        tool_steps_mean=8.0,
        min_tool_steps=2,
        max_tool_steps=24,
        user_message_bytes=LogNormal(300, 0.6, 60, 2_000),
        attachment_probability=0.0,
        attachment_bytes=LogNormal(1, 0.0, 1, 1),
        tool_result_bytes=LogNormal(60, 0.5, 20, 300),
        tool_call_tokens=LogNormal(40, 0.5, 12, 160),
        answer_tokens=LogNormal(80, 0.5, 20, 300),
        tool_think_s=LogNormal(2.5, 0.5, 0.5, 15.0),
        user_think_s=LogNormal(1, 0.0, 1, 1),
        # As `seed`: the random balancer's prefill capacity, counting image tokens as the
        # workers do (`session_tokens`).
        load=1.0,
        warmup_s=30.0,
        window_s=60.0,
        grace_s=30.0,
        screenshot_bytes=300_000,
        screenshot_repeat_share=0.2,
        image_rule="qwen2_vl",  # the family computer-use agents (UI-TARS) are built on
    ),
    # One agent alone on the fleet: a long coding session (several tasks of many tool calls
    # each, contexts growing past 20k tokens), then another, never two at once. Whatever
    # the policy does for a crowded fleet must not cost a lone conversation its cache: its
    # worker is always the least queued, and its own turns are all the recent traffic.
    "lone-agent": ScenarioSpec(
        name="lone-agent",
        description="one agent session at a time: long multi-turn conversations in sequence on an idle fleet",
        groups=1,
        group_skew=0.0,
        system_prompt_bytes=LogNormal(9_000, 0.0, 9_000, 9_000),
        tools_per_group=(12, 12),
        extra_tasks_mean=2.0,
        max_tasks=4,
        tool_steps_mean=8.0,
        min_tool_steps=3,
        max_tool_steps=16,
        user_message_bytes=LogNormal(500, 0.8, 60, 6_000),
        attachment_probability=0.3,
        attachment_bytes=LogNormal(8_000, 0.7, 1_000, 40_000),
        tool_result_bytes=LogNormal(2_400, 1.0, 80, 48_000),
        tool_call_tokens=LogNormal(60, 0.6, 16, 300),
        answer_tokens=LogNormal(350, 0.6, 80, 1_200),
        tool_think_s=LogNormal(1.5, 0.8, 0.1, 20.0),
        user_think_s=LogNormal(5.0, 0.5, 1.0, 20.0),
        load=1.0,
        warmup_s=5.0,
        window_s=90.0,
        grace_s=20.0,
        sequential=True,
    ),
}


# -- client styles ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientStyle:
    """How one SDK serialises the parts of a request that carry no meaning in their bytes."""

    name: str
    tool_key_order: str
    """'authored', 'sorted' (Go's encoding/json, pydantic dumps) or 'reversed'."""
    args_separators: tuple[str, str]
    args_indent: int | None
    args_sort_keys: bool
    args_ensure_ascii: bool
    line_ending: str
    trailing_spaces: bool
    unicode_form: str


CLIENT_STYLES: tuple[ClientStyle, ...] = (
    ClientStyle("openai-python", "authored", (", ", ": "), None, False, True, "\n", False, "NFC"),
    ClientStyle("openai-node", "authored", (",", ":"), None, False, False, "\n", False, "NFC"),
    ClientStyle("langchain", "sorted", (", ", ": "), None, True, True, "\n", True, "NFC"),
    ClientStyle("dotnet-windows", "reversed", (",", ":"), None, False, False, "\r\n", False, "NFC"),
    ClientStyle("go", "sorted", (",", ":"), None, True, False, "\n", False, "NFC"),
    ClientStyle("macos-cli", "authored", (",", ": "), 2, False, False, "\n", True, "NFD"),
)


def _reorder(value: Any, order: str) -> Any:
    """Reorder object keys at every depth; list order is meaning and is kept."""
    if isinstance(value, dict):
        keys = list(value)
        if order == "sorted":
            keys.sort()
        elif order == "reversed":
            keys.reverse()
        return {k: _reorder(value[k], order) for k in keys}
    if isinstance(value, list):
        return [_reorder(v, order) for v in value]
    return value


def style_tools(tools: list[dict[str, Any]], style: ClientStyle) -> list[dict[str, Any]]:
    return _reorder(tools, style.tool_key_order) if tools else tools


def style_arguments(args: dict[str, Any], style: ClientStyle) -> str:
    return json.dumps(
        args,
        separators=style.args_separators,
        indent=style.args_indent,
        sort_keys=style.args_sort_keys,
        ensure_ascii=style.args_ensure_ascii,
    )


def style_system_text(text: str, style: ClientStyle) -> str:
    """`text` is authored canonical (NFC, LF, no trailing spaces); re-dress it."""
    lines = text.split("\n")
    if style.trailing_spaces:
        # Markdown hard breaks / templates that pad lines: two spaces on every third line.
        lines = [line + "  " if i % 3 == 2 and line else line for i, line in enumerate(lines)]
    out = style.line_ending.join(lines)
    return unicodedata.normalize(style.unicode_form, out)


# -- text ----------------------------------------------------------------------------------

_ACCENTED = ("café", "naïve", "résumé", "façade", "über", "coöperate", "déjà-vu", "piñata")


def _vocabulary(rng: random.Random, n: int = 1500) -> list[str]:
    letters = string.ascii_lowercase
    words = []
    for _ in range(n):
        length = max(2, min(11, int(rng.gauss(6, 2.2))))
        words.append("".join(rng.choice(letters) for _ in range(length)))
    return words


_VOCAB = _vocabulary(random.Random(7))


def prose(rng: random.Random, nbytes: int, accents: bool = False) -> str:
    """About `nbytes` of sentence-like text in lines of ~80 bytes, no trailing spaces."""
    out: list[str] = []
    size = 0
    line: list[str] = []
    line_len = 0
    while size < nbytes:
        word = rng.choice(_ACCENTED) if accents and rng.random() < 0.01 else rng.choice(_VOCAB)
        if rng.random() < 0.08:
            word += rng.choice(".,:;")
        line.append(word)
        line_len += len(word) + 1
        size += len(word.encode()) + 1
        if line_len > 80:
            out.append(" ".join(line))
            line, line_len = [], 0
    if line:
        out.append(" ".join(line))
    return "\n".join(out)


def code_like(rng: random.Random, nbytes: int) -> str:
    """Tool output: file contents, logs or search results."""
    kind = rng.random()
    lines: list[str] = []
    size = 0
    n = 0
    while size < nbytes:
        n += 1
        if kind < 0.4:
            ident = rng.choice(_VOCAB)
            line = f"{' ' * (4 * rng.randrange(3))}{ident} = {rng.choice(_VOCAB)}({rng.choice(_VOCAB)}, {rng.randrange(1000)})"
        elif kind < 0.7:
            line = f"2024-06-01T12:{n % 60:02d}:{rng.randrange(60):02d}Z {rng.choice(('INFO', 'WARN', 'DEBUG'))} {rng.choice(_VOCAB)}: {' '.join(rng.choice(_VOCAB) for _ in range(6))}"
        else:
            line = f"src/{rng.choice(_VOCAB)}/{rng.choice(_VOCAB)}.py:{rng.randrange(1, 900)}: {' '.join(rng.choice(_VOCAB) for _ in range(7))}"
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


# -- groups and sessions ---------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    index: int
    system_prompt: str
    """Authored canonical text: NFC, LF line ends, no trailing whitespace."""
    tools: list[dict[str, Any]]
    """Authored tool schemas (declaration key order)."""


def make_group(seed: int, scenario: ScenarioSpec, index: int) -> Group:
    rng = random.Random(f"{seed}:{scenario.name}:group:{index}")
    size = int(scenario.system_prompt_bytes.draw(rng))
    header = f"You are agent #{index} of the operations team. Follow the rules below.\n"
    system = header + prose(rng, max(size - len(header), 0), accents=True)
    n_tools = rng.randint(*scenario.tools_per_group)
    tools = []
    for t in range(n_tools):
        params: dict[str, Any] = {}
        required: list[str] = []
        for p in range(rng.randint(2, 7)):
            name = f"{rng.choice(_VOCAB)}_{p}"
            kind = rng.choice(("string", "integer", "boolean", "string"))
            spec: dict[str, Any] = {"type": kind, "description": prose(rng, rng.randint(30, 120)).replace("\n", " ")}
            if kind == "string" and rng.random() < 0.25:
                spec["enum"] = [rng.choice(_VOCAB) for _ in range(3)]
            params[name] = spec
            if rng.random() < 0.6:
                required.append(name)
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": f"{rng.choice(_VOCAB)}_{t}",
                    "description": prose(rng, rng.randint(60, 240)).replace("\n", " "),
                    "parameters": {"type": "object", "properties": params, "required": required},
                },
            }
        )
    return Group(index, system, tools)


@dataclass
class Turn:
    """One LLM request: what the client appends before it, and what it appends after."""

    kind: str
    """'tool_call' (short generation, followed by a tool result) or 'answer'."""
    new_messages: list[dict[str, Any]]
    """Authored (style-free) messages appended to the history before this request."""
    max_tokens: int
    think_s: float
    """Simulated seconds the client waits after the previous response before sending."""
    reply: dict[str, Any]
    """The assistant message the client appends after the response (authored)."""
    tool_args: dict[str, Any] | None = None


@dataclass
class Session:
    index: int
    id: str
    group: int | None
    style: ClientStyle
    arrival_s: float
    turns: list[Turn]
    start_turn: int = 0
    """First request this run sends (> 0 for sessions already under way at time 0)."""
    start_s: float = 0.0
    """Simulated time of that request."""
    image_rule: str | None = None
    """How the served model counts its screenshots (the scenario's `image_rule`)."""


def _zipf_choice(rng: random.Random, n: int, skew: float) -> int:
    weights = [1.0 / (i + 1) ** skew for i in range(n)]
    return rng.choices(range(n), weights=weights)[0]


def _geometric(rng: random.Random, mean: float, lo: int, hi: int) -> int:
    if mean <= 0:
        return lo
    p = 1.0 / (mean + 1.0)
    k = 0
    while rng.random() > p and k < hi:
        k += 1
    return max(lo, min(k, hi))


def _poisson(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    limit, k, prod = math.exp(-mean), 0, rng.random()
    while prod > limit:
        k += 1
        prod *= rng.random()
    return k


def _sized_args(rng: random.Random, tokens: int) -> dict[str, Any]:
    """Tool-call arguments whose canonical JSON is about `tokens` tokens long."""
    target = max(tokens * CHARS_PER_TOKEN - 40, 8)
    args: dict[str, Any] = {
        "path": f"src/{rng.choice(_VOCAB)}/{rng.choice(_VOCAB)}.py",
        "limit": rng.randrange(10, 500),
        "reason": "",
    }
    reason = prose(rng, target).replace("\n", " ")
    if rng.random() < 0.3:
        reason = rng.choice(_ACCENTED) + " " + reason  # non-ASCII: escaped by some SDKs
    args["reason"] = reason[: max(target, 1)]
    return args


def make_session(seed: int, scenario: ScenarioSpec, index: int, arrival_s: float = 0.0) -> Session:
    """Session `index` of the scenario; independent of every other session and of the rate."""
    rng = random.Random(f"{seed}:{scenario.name}:session:{index}")
    group = _zipf_choice(rng, scenario.groups, scenario.group_skew) if scenario.groups else None
    style = CLIENT_STYLES[rng.randrange(len(CLIENT_STYLES))]
    if scenario.screenshot_bytes > 0:
        shots = _screenshot_turns(rng, scenario)
        return Session(index, f"s{seed}-{scenario.name}-{index}", group, style, arrival_s, shots, image_rule=scenario.image_rule)
    turns: list[Turn] = []
    n_tasks = min(1 + _poisson(rng, scenario.extra_tasks_mean), scenario.max_tasks)
    call_no = 0
    for task in range(n_tasks):
        text = prose(rng, scenario.user_message_bytes.draw_int(rng))
        if rng.random() < scenario.attachment_probability:
            text += "\n\n" + code_like(rng, scenario.attachment_bytes.draw_int(rng))
        pending: list[dict[str, Any]] = [{"role": "user", "content": text}]
        think = 0.0 if task == 0 else scenario.user_think_s.draw(rng)
        steps = _geometric(rng, scenario.tool_steps_mean, scenario.min_tool_steps, scenario.max_tool_steps)
        for _ in range(steps):
            n = scenario.tool_call_tokens.draw_int(rng)
            call_id = f"call_{index}_{call_no}"
            call_no += 1
            args = _sized_args(rng, n)
            reply = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": f"tool_{call_no % 7}", "arguments": args}}
                ],
            }
            turns.append(Turn("tool_call", pending, n, think, reply, args))
            result = code_like(rng, scenario.tool_result_bytes.draw_int(rng))
            pending = [{"role": "tool", "tool_call_id": call_id, "content": result}]
            think = scenario.tool_think_s.draw(rng)
        n = scenario.answer_tokens.draw_int(rng)
        # Output tokens are 4 bytes each: the answer re-tokenizes to as many tokens as generated.
        answer = prose(rng, n * CHARS_PER_TOKEN).replace("\n", " ")
        turns.append(Turn("answer", pending, n, think, {"role": "assistant", "content": answer}))
    return Session(index, f"s{seed}-{scenario.name}-{index}", group, style, arrival_s, turns)


_ACTIONS = ("click", "left_double", "right_single", "drag", "type", "hotkey", "scroll", "wait")


def _action(rng: random.Random, width: int, height: int, tokens: int) -> str:
    """A UI-TARS-style step, `tokens` long at four bytes a token (as the engine generates
    it): a thought, then one action on the screen's coordinates."""
    kind = rng.choice(_ACTIONS)
    x, y = rng.randrange(width), rng.randrange(height)
    if kind == "type":
        call = f"type(content='{prose(rng, 24).replace(chr(10), ' ')}')"
    elif kind == "hotkey":
        call = f"hotkey(key='{rng.choice(('ctrl c', 'ctrl v', 'enter', 'ctrl l', 'tab'))}')"
    elif kind == "scroll":
        call = f"scroll(start_box='({x},{y})', direction='{rng.choice(('down', 'up'))}')"
    elif kind == "drag":
        call = f"drag(start_box='({x},{y})', end_box='({rng.randrange(width)},{rng.randrange(height)})')"
    elif kind == "wait":
        call = "wait()"
    else:
        call = f"{kind}(start_box='({x},{y})')"
    size = tokens * CHARS_PER_TOKEN
    tail = f"\nAction: {call}"
    thought = prose(rng, max(size - len(tail) - 9, 8)).replace("\n", " ")
    return ("Thought: " + thought)[: max(size - len(tail), 9)] + tail


def _screenshot_turns(rng: random.Random, scenario: ScenarioSpec) -> list[Turn]:
    """A computer-use task: the user's instruction with the first screenshot, then each
    step's short action and the screenshot after it, until the agent says it finished.
    Every request carries one more screenshot than the last; a turn resends the previous
    screenshot unchanged with probability `screenshot_repeat_share`."""
    width, height = rng.choice(scenario.screen_sizes)
    steps = _geometric(rng, scenario.tool_steps_mean, scenario.min_tool_steps, scenario.max_tool_steps)
    turns: list[Turn] = []
    shot: Screenshot | None = None
    for step in range(steps + 1):
        if shot is None or rng.random() >= scenario.screenshot_repeat_share:
            shot = Screenshot(width, height, scenario.screenshot_bytes, rng.getrandbits(62))
        if step == 0:
            text = prose(rng, scenario.user_message_bytes.draw_int(rng)).replace("\n", " ")
            think = 0.0
        else:
            text = f"Step {step}. " + prose(rng, scenario.tool_result_bytes.draw_int(rng)).replace("\n", " ")
            think = scenario.tool_think_s.draw(rng)
        message = {"role": "user", "content": [{"type": "text", "text": text}, shot]}
        last = step == steps
        n = (scenario.answer_tokens if last else scenario.tool_call_tokens).draw_int(rng)
        if last:
            room = max(n * CHARS_PER_TOKEN - len("Action: finished(content='')"), 8)
            reply_text = f"Action: finished(content='{prose(rng, room).replace(chr(10), ' ')[:room]}')"
        else:
            reply_text = _action(rng, width, height, n)
        turns.append(Turn("answer" if last else "tool_call", [message], n, think, {"role": "assistant", "content": reply_text}))
    return turns


# -- wire format -----------------------------------------------------------------------------


class Conversation:
    """The wire messages of one session as its client sends them, built turn by turn."""

    def __init__(self, session: Session, group: Group | None, model: str = MODEL) -> None:
        self.session = session
        self.model = model
        self.style = session.style
        self.tools = style_tools(group.tools, self.style) if group else []
        self.messages: list[dict[str, Any]] = []
        if group is not None:
            self.messages.append({"role": "system", "content": style_system_text(group.system_prompt, self.style)})
        self.next_turn = 0
        self.images: dict[Screenshot, dict[str, Any]] = {}
        """Each screenshot's content part, built once: every later request resends it, and
        rebuilding megabytes of PNG and base64 per request would make the client the
        run's bottleneck. A repeated screenshot is the same part object."""

    def _part(self, part: Any) -> Any:
        if not isinstance(part, Screenshot):
            return part
        built = self.images.get(part)
        if built is None:
            built = self.images[part] = part.part()
        return built

    def _wire(self, msg: dict[str, Any]) -> dict[str, Any]:
        content = msg.get("content")
        if isinstance(content, list):
            return {**msg, "content": [self._part(p) for p in content]}
        if msg.get("tool_calls"):
            calls = []
            for call in msg["tool_calls"]:
                fn = call["function"]
                calls.append({**call, "function": {"name": fn["name"], "arguments": style_arguments(fn["arguments"], self.style)}})
            return {**msg, "tool_calls": calls}
        return msg

    def request(self, turn: Turn) -> dict[str, Any]:
        """The body of `turn`'s request (appends its new messages to the history)."""
        self.messages.extend(self._wire(m) for m in turn.new_messages)
        body: dict[str, Any] = {"model": self.model, "messages": list(self.messages)}
        if self.tools:
            body["tools"] = self.tools
        body.update(
            {
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": turn.max_tokens,
                "temperature": 0,
            }
        )
        return body

    def answered(self, turn: Turn) -> None:
        self.messages.append(self._wire(turn.reply))

    def bodies(self) -> Iterator[tuple[Turn, dict[str, Any]]]:
        for turn in self.session.turns:
            yield turn, self.request(turn)
            self.answered(turn)


# -- token accounting and the rate derivation -------------------------------------------------


@dataclass
class SessionTokens:
    """Prompt tokens of each request of a session, as the router and workers count them."""

    shared: int
    """Tokens of the group's tools + system prompt (cached on every worker once hot)."""
    prompts: list[int]
    outputs: list[int]


def session_tokens(session: Session, group: Group | None) -> SessionTokens:
    """Exact estimate-mode token counts (bytes // 4 of the canonical rendering, each
    screenshot its image rule's tokens, as the router and the simulated workers count it)."""
    tools_bytes = len(render_tools(group.tools)) if group else 0
    history = tools_bytes
    shared = tools_bytes
    if group is not None:
        history += len(render_message({"role": "system", "content": group.system_prompt}))
        shared = history
    counter = _screenshot_counter(session.image_rule)
    prompts, outputs = [], []
    for turn in session.turns:
        for msg in turn.new_messages:
            history += _rendered_len(msg, counter)
        prompts.append(history // CHARS_PER_TOKEN)
        outputs.append(turn.max_tokens)
        history += _rendered_len(turn.reply, counter)
    return SessionTokens(shared // CHARS_PER_TOKEN, prompts, outputs)


DATA_URL_HEAD = len("data:image/png;base64,")


def screenshot_wire_bytes(session: Session) -> list[int]:
    """Per request of the session: the bytes its screenshots add to the body beyond their
    tokens' four bytes each (a 300 KB PNG is a 400 KB data URL, and some 2,000 tokens)."""
    counter = _screenshot_counter(session.image_rule)
    extra = 0
    out = []
    for turn in session.turns:
        for msg in turn.new_messages:
            for part in msg["content"] if isinstance(msg.get("content"), list) else ():
                if isinstance(part, Screenshot):
                    media = counter.media({"screenshot": part}, MODEL)
                    assert media is not None
                    extra += DATA_URL_HEAD + 4 * -(-part.size // 3) - media.tokens * CHARS_PER_TOKEN
        out.append(extra)
    return out


class _ScreenshotCounter(MediaReader):
    """Counts a `Screenshot` from its description as `MediaReader` counts its PNG (the rule
    from its header's size), without building the PNG: the rate derivation counts
    thousands of them."""

    def media(self, part: dict[str, Any], model: str) -> Media | None:
        shot = part.get("screenshot")
        if not isinstance(shot, Screenshot):
            return super().media(part, model)
        rule = self.image_rule(model)
        tokens = max(rule(shot.width, shot.height), 1) if rule is not None else self.settings.image_tokens_default
        return Media("image", shot.seed.to_bytes(16, "big"), tokens)


_COUNTERS: dict[str | None, _ScreenshotCounter] = {}


def _screenshot_counter(image_rule: str | None) -> _ScreenshotCounter:
    if image_rule not in _COUNTERS:
        _COUNTERS[image_rule] = _ScreenshotCounter(MediaSettings(image_rule=image_rule or "auto"))
    return _COUNTERS[image_rule]


def _rendered_len(msg: dict[str, Any], counter: MediaReader) -> int:
    """Bytes of a message's canonical rendering, a screenshot counting its tokens' bytes
    (`normalizer.prefix.prompt_bytes`)."""
    content = msg.get("content")
    if not isinstance(content, list):
        return len(render_message(_canonical_message(msg)))
    parts = [{"type": "image_url", "screenshot": p} if isinstance(p, Screenshot) else p for p in content]
    segments = message_segments({**msg, "content": parts}, MODEL, counter)
    return sum(len(s) if isinstance(s, bytes) else s.tokens * CHARS_PER_TOKEN for s in segments)


def _canonical_message(msg: dict[str, Any]) -> dict[str, Any]:
    if not msg.get("tool_calls"):
        return msg
    calls = [
        {**c, "function": {"name": c["function"]["name"], "arguments": orjson.dumps(c["function"]["arguments"], option=orjson.OPT_SORT_KEYS).decode()}}
        for c in msg["tool_calls"]
    ]
    return {**msg, "tool_calls": calls}


@dataclass
class Rates:
    """The load derivation for one scenario on one simulated cluster."""

    scenario: str
    profile: str
    workers: int
    load: float
    reference_sessions: int
    requests_per_session: float
    prompt_tokens_per_request: float
    output_tokens_per_session: float
    max_prompt_tokens: int
    p90_final_context_tokens: float
    prefill_s_per_session_cache_blind: float
    """Σ over a session's requests of prefill(shared prefix cached → whole prompt)."""
    prefill_s_per_session_ideal: float
    """Σ of prefill(previous prompt cached → whole prompt): every turn reuses the last."""
    capacity_sessions_per_s_cache_blind: float
    capacity_sessions_per_s_ideal: float
    kv_capacity_tokens: int
    """Each worker's KV cache, which bounds what a random balancer's workers keep."""
    random_lb_reused_fraction: float
    """Prompt tokens a random balancer finds cached at its capacity (`loadtests.benchmark.random_lb`)."""
    prefill_s_per_session_random_lb: float
    capacity_sessions_per_s_random_lb: float
    """The arrival rate at which a random balancer's prefill work fills the fleet; `load`
    is a fraction of it."""
    arrival_rate_per_s: float
    mean_session_duration_s: float
    """Zero-load estimate (decode at batch 1 plus client think times), for Little's law."""
    expected_concurrent_sessions: float
    output_tokens_per_s: float
    """Offered decode tokens per simulated second (what the harness must stream)."""
    request_bytes_per_s: float = 0.0
    """Offered request bodies' bytes per simulated second (what the harness sends and the
    router and the workers parse): four bytes a text token, each screenshot its data URL."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def derive_rates(
    scenario: ScenarioSpec,
    workers: int,
    profile: str = DEFAULT_PROFILE,
    cost: CostModel | None = None,
    load: float | None = None,
    kv_capacity_tokens: int | None = None,
) -> Rates:
    cost = cost or build_cost_model(profile)
    load = scenario.load if load is None else load
    kv_capacity = kv_capacity_tokens or cost.default_capacity_tokens
    groups = {g: make_group(REFERENCE_SEED, scenario, g) for g in range(scenario.groups)}
    blind = ideal = 0.0
    n_req = 0
    prompt_sum = 0
    out_sum = 0
    max_prompt = 0
    finals = []
    durations = []
    shapes = []
    body_bytes = 0
    decode_step = cost.step_s([], [4096])
    for i in range(REFERENCE_SESSIONS):
        session = make_session(REFERENCE_SEED, scenario, i)
        group = groups.get(session.group) if session.group is not None else None
        toks = session_tokens(session, group)
        body_bytes += sum(toks.prompts) * CHARS_PER_TOKEN + sum(screenshot_wire_bytes(session))
        sends = zero_load_timeline(session, toks, cost)[:-1]
        shapes.append(SessionShape(toks.shared, tuple(toks.prompts), tuple(toks.outputs), tuple(sends)))
        prev = toks.shared
        duration = 0.0
        for turn, prompt, out in zip(session.turns, toks.prompts, toks.outputs, strict=True):
            blind += cost.prefill_s(toks.shared, prompt)
            ideal += cost.prefill_s(min(prev, prompt), prompt)
            prev = prompt
            n_req += 1
            prompt_sum += prompt
            out_sum += out
            max_prompt = max(max_prompt, prompt)
            duration += turn.think_s + cost.prefill_s(0, prompt) + out * decode_step
        finals.append(toks.prompts[-1])
        durations.append(duration)
    n = REFERENCE_SESSIONS
    blind_per, ideal_per = blind / n, ideal / n
    # One GPU (or TP group) does one second of prefill work per second.
    cap_blind, cap_ideal = workers / blind_per, workers / ideal_per
    random_lb = _random_lb_capacity(scenario, cost, workers, kv_capacity, shapes, cap_blind, cap_ideal)
    mean_duration = sum(durations) / n
    # Sequential sessions: one at a time, each lasting its zero-load duration.
    rate = 1.0 / mean_duration if scenario.sequential else load * random_lb.rate_per_s
    finals.sort()
    return Rates(
        scenario=scenario.name,
        profile=cost.profile.name,
        workers=workers,
        load=load,
        reference_sessions=n,
        requests_per_session=n_req / n,
        prompt_tokens_per_request=prompt_sum / n_req,
        output_tokens_per_session=out_sum / n,
        max_prompt_tokens=max_prompt,
        p90_final_context_tokens=finals[int(0.9 * (n - 1))],
        prefill_s_per_session_cache_blind=blind_per,
        prefill_s_per_session_ideal=ideal_per,
        capacity_sessions_per_s_cache_blind=cap_blind,
        capacity_sessions_per_s_ideal=cap_ideal,
        kv_capacity_tokens=kv_capacity,
        random_lb_reused_fraction=random_lb.reused_fraction,
        prefill_s_per_session_random_lb=random_lb.prefill_s_per_session,
        capacity_sessions_per_s_random_lb=random_lb.rate_per_s,
        arrival_rate_per_s=rate,
        mean_session_duration_s=mean_duration,
        expected_concurrent_sessions=rate * mean_duration,
        output_tokens_per_s=rate * out_sum / n,
        request_bytes_per_s=rate * body_bytes / n,
        notes=[
            "capacity = workers × 1 s of prefill per s ÷ prefill seconds per session (simulator cost model)",
            "cache-blind: each request recomputes everything but its group's tools + system prompt",
            "random_lb: uniform placement over per-worker LRU caches of kv_capacity_tokens, replayed "
            "on the zero-load timeline; capacity where its prefill work fills the fleet (loadtests/benchmark/random_lb.py)",
            "arrival rate = one session at a time: 1 ÷ the mean session duration"
            if scenario.sequential
            else f"arrival rate = load {load} × random_lb capacity",
        ],
    )


_RANDOM_LB_CACHE: dict[tuple[ScenarioSpec, str, int, int], RandomReuse] = {}


def _random_lb_capacity(
    scenario: ScenarioSpec,
    cost: CostModel,
    workers: int,
    kv_capacity: int,
    shapes: list[SessionShape],
    cap_blind: float,
    cap_ideal: float,
) -> RandomReuse:
    key = (scenario, cost.profile.name, workers, kv_capacity)
    if key not in _RANDOM_LB_CACHE:
        _RANDOM_LB_CACHE[key] = random_lb_capacity(shapes, workers, kv_capacity, cost, cap_blind, cap_ideal)
    return _RANDOM_LB_CACHE[key]


# -- a whole run's workload ------------------------------------------------------------------


def zero_load_timeline(session: Session, tokens: SessionTokens, cost: CostModel) -> list[float]:
    """When each request would be sent (simulated seconds after arrival) on an idle cluster:
    think times plus a lone prefill and batch-1 decode for each earlier request."""
    decode_step = cost.step_s([], [4096])
    t = 0.0
    starts = []
    for turn, prompt, out in zip(session.turns, tokens.prompts, tokens.outputs, strict=True):
        t += turn.think_s
        starts.append(t)
        t += cost.prefill_s(0, prompt) + out * decode_step
    starts.append(t)  # the end of the last response
    return starts


@dataclass
class Workload:
    """Sessions of one run, in arrival order, all deterministic under `seed`.

    The run starts in steady state: sessions also arrive during the `prepopulate_s` before
    time 0, and those still active at 0 join at the request their zero-load timeline has
    reached, with the conversation so far already in their history. Caches start cold,
    so the first `warmup_s` are not measured, nor the first request of a session already
    under way (its history, sent cold: `measures`); the other requests sent during the
    window that follows are. No request is sent after the window; requests in flight then
    get `grace_s` to finish.
    """

    scenario: ScenarioSpec
    seed: int
    rate_per_s: float
    groups: dict[int, Group]
    sessions: list[Session]
    warmup_s: float
    window_s: float
    grace_s: float
    prepopulate_s: float

    @property
    def window_end_s(self) -> float:
        return self.warmup_s + self.window_s

    def measures(self, session: Session, turn_index: int, sent_s: float) -> bool:
        """Whether the window measures this request: sent after the warm-up, and not the
        first request of a session already under way at time 0. That one carries the whole
        conversation so far, which no worker has seen (caches start cold): it is the cold
        start the warm-up is for, wherever the session's timeline puts it (a long pause
        puts some well inside the window), not the steady state the window measures, where
        that history would have been computed turn by turn. About 1% of a `seed` window's
        requests, they were its slowest for every router until 4 December 2026."""
        if sent_s < self.warmup_s:
            return False
        return not (session.start_turn > 0 and turn_index == session.start_turn)


def build_workload(
    scenario: ScenarioSpec,
    seed: int,
    rate_per_s: float,
    *,
    warmup_s: float | None = None,
    window_s: float | None = None,
    grace_s: float | None = None,
    prepopulate: bool = True,
    profile: str = DEFAULT_PROFILE,
    cost: CostModel | None = None,
) -> Workload:
    cost = cost or build_cost_model(profile)
    warmup = scenario.warmup_s if warmup_s is None else warmup_s
    window = scenario.window_s if window_s is None else window_s
    grace = scenario.grace_s if grace_s is None else grace_s
    groups = {g: make_group(seed, scenario, g) for g in range(scenario.groups)}
    rng = random.Random(f"{seed}:{scenario.name}:arrivals")
    if scenario.sequential:
        sessions = _sequential_sessions(scenario, seed, groups, warmup + window, cost, rng)
        return Workload(scenario, seed, rate_per_s, groups, sessions, warmup, window, grace, 0.0)
    prepop = _p99_session_span(scenario, cost) if prepopulate else 0.0
    sessions: list[Session] = []
    t = -prepop
    end = warmup + window
    # Every arrival gets its own index, also those that end before time 0 and are dropped:
    # the index seeds the session's content, so reusing it would redraw the same session.
    for index in itertools.count():
        t += rng.expovariate(rate_per_s)
        if t >= end:
            break
        s = make_session(seed, scenario, index, arrival_s=t)
        if t < 0:
            group = groups.get(s.group) if s.group is not None else None
            starts = zero_load_timeline(s, session_tokens(s, group), cost)
            k = next((i for i, st in enumerate(starts[:-1]) if t + st >= 0), None)
            if k is None:
                continue  # finished before the run starts
            s.start_turn = k
            s.start_s = t + starts[k]
        else:
            s.start_s = t + (s.turns[0].think_s if s.turns else 0.0)
        sessions.append(s)
    sessions.sort(key=lambda s: s.start_s)
    return Workload(scenario, seed, rate_per_s, groups, sessions, warmup, window, grace, prepop)


def _sequential_sessions(
    scenario: ScenarioSpec, seed: int, groups: dict[int, Group], end_s: float, cost: CostModel, rng: random.Random
) -> list[Session]:
    """Sessions one at a time from time 0: each arrives a person's think time after the
    previous one's zero-load timeline ends; the last is the one under way at `end_s`."""
    sessions: list[Session] = []
    t = 0.0
    for index in itertools.count():
        s = make_session(seed, scenario, index, arrival_s=t)
        s.start_s = t + (s.turns[0].think_s if s.turns else 0.0)
        if s.start_s >= end_s:
            break
        sessions.append(s)
        group = groups.get(s.group) if s.group is not None else None
        t += zero_load_timeline(s, session_tokens(s, group), cost)[-1] + scenario.user_think_s.draw(rng)
    return sessions


_SPAN_CACHE: dict[tuple[str, str], float] = {}


def _p99_session_span(scenario: ScenarioSpec, cost: CostModel) -> float:
    """99th percentile of a session's zero-load duration (reference sample): sessions that
    arrived longer ago than this before time 0 have all finished."""
    key = (scenario.name, cost.profile.name)
    if key not in _SPAN_CACHE:
        groups = {g: make_group(REFERENCE_SEED, scenario, g) for g in range(scenario.groups)}
        spans = []
        for i in range(REFERENCE_SESSIONS):
            s = make_session(REFERENCE_SEED, scenario, i)
            group = groups.get(s.group) if s.group is not None else None
            spans.append(zero_load_timeline(s, session_tokens(s, group), cost)[-1])
        spans.sort()
        _SPAN_CACHE[key] = spans[int(0.99 * (len(spans) - 1))]
    return _SPAN_CACHE[key]


# -- command line: print a scenario's derivation -----------------------------------------------


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.benchmark.workload", description="describe a bench scenario")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="seed")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sample", action="store_true", help="also print the first request of one session per style")
    args = p.parse_args(argv)
    scenario = SCENARIOS[args.scenario]
    rates = derive_rates(scenario, args.workers, args.profile)
    print(json.dumps(rates.to_dict(), indent=2))
    if args.sample:
        wl = build_workload(scenario, args.seed, rates.arrival_rate_per_s)
        print(len(wl.sessions), "sessions,", sum(len(s.turns) - s.start_turn for s in wl.sessions), "requests at most")
        for s in wl.sessions[:6]:
            conv = Conversation(s, wl.groups.get(s.group) if s.group is not None else None)
            body = conv.request(s.turns[0])
            print(s.id, s.style.name, len(orjson.dumps(body)), "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
