"""The client libraries agents are built with, pointed at kvroute in front of simulated
workers: the OpenAI Agents SDK with its default model (the Responses API), fed
back with `to_input_list()` and chained with `previous_response_id`; the Anthropic SDK's
`messages.create` and `messages.stream` through a tool loop; langchain-openai's ChatOpenAI
streaming over chat completions. Every request must be a 200 and every request after a
conversation's first must reach the worker that served the first (`x-kvroute-worker`).

The simulated workers call the first tool on `tool_choice: auto` after a user turn and
answer in text after a tool result, so every agent turn is a tool call then an answer.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

pytestmark = [
    pytest.mark.sim_cluster(workers=4, time_scale=0.02, pool=False),
    pytest.mark.router_process(policy="cache_aware"),
]

@dataclass
class Seen:
    """Path, status and serving worker of every request a client sent."""

    requests: list[tuple[str, int, str | None]] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)

    def hook(self, response: httpx.Response) -> None:
        self.requests.append((response.request.url.path, response.status_code, response.headers.get("x-kvroute-worker")))
        self.reasons.append(response.headers.get("x-kvroute-route-reason"))

    async def ahook(self, response: httpx.Response) -> None:
        self.hook(response)

    def assert_all_ok_and_sticky(self, path: str, at_least: int) -> None:
        assert len(self.requests) >= at_least, self.requests
        assert {(p, s) for p, s, _ in self.requests} == {(path, 200)}, self.requests
        workers = [w for _, _, w in self.requests]
        assert workers[0] is not None
        assert workers == [workers[0]] * len(workers), list(zip(workers, self.reasons, strict=True))


@pytest.fixture(scope="module")
def model(cluster: Any) -> str:
    return cluster.model


# -- OpenAI Agents SDK ---------------------------------------------------------------------------


def _agent_and_config(base_url: str, model: str, seen: Seen) -> tuple[Any, Any, httpx.AsyncClient]:
    from agents import Agent, ModelSettings, RunConfig, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # offline: no trace export to api.openai.com

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        return f"noon in {city}"

    http = httpx.AsyncClient(event_hooks={"response": [seen.ahook]}, trust_env=False, timeout=60)
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="sk-test", http_client=http, max_retries=0)
    agent = Agent(
        name="ops",
        instructions="You are the operations assistant. Use the tools to answer.",
        tools=[get_weather, get_time],
        model=model,
        # No max_tokens: the simulator answers 32 tokens and stops ("length" would make the
        # SDK raise on the response.incomplete it gets).
        model_settings=ModelSettings(store=True),
    )
    # The provider's default model class (OpenAIResponsesModel): what an Agent gets when
    # nothing selects chat completions.
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    return agent, config, http


def _questions(tag: str) -> list[str]:
    return [f"{tag} question {i}: what is the weather and time in city {i}?" for i in range(5)]


def test_agents_sdk_to_input_list_five_turns(router: Any, model: str) -> None:
    from agents import Runner
    from agents.models.openai_responses import OpenAIResponsesModel

    seen = Seen()

    async def run() -> None:
        agent, config, http = _agent_and_config(router.url, model, seen)
        try:
            items: list[Any] = []
            for q in _questions("fed back"):
                result = await Runner.run(agent, [*items, {"role": "user", "content": q}], run_config=config)
                assert result.final_output
                assert any(item.type == "tool_call_output_item" for item in result.new_items)
                items = result.to_input_list()
            assert isinstance(config.model_provider.get_model(model), OpenAIResponsesModel)
        finally:
            await http.aclose()

    asyncio.run(run())
    # Each turn is a tool call then an answer: two requests.
    seen.assert_all_ok_and_sticky("/v1/responses", at_least=10)


def test_agents_sdk_chained_with_previous_response_id(router: Any, model: str) -> None:
    from agents import Runner

    seen = Seen()

    async def run() -> None:
        agent, config, http = _agent_and_config(router.url, model, seen)
        try:
            previous: str | None = None
            for q in _questions("chained"):
                result = await Runner.run(agent, q, run_config=config, previous_response_id=previous)
                assert result.final_output
                previous = result.last_response_id
                assert previous
        finally:
            await http.aclose()

    asyncio.run(run())
    seen.assert_all_ok_and_sticky("/v1/responses", at_least=10)


# -- Anthropic SDK -----------------------------------------------------------------------------

TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {
        "name": "get_time",
        "description": "The local time in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
]


def _anthropic(base_url: str, seen: Seen) -> Any:
    import anthropic
    import httpx2  # the HTTP library this anthropic release is built on (it refuses httpx's)

    http = httpx2.Client(event_hooks={"response": [seen.hook]}, trust_env=False, timeout=60)
    return anthropic.Anthropic(base_url=base_url, api_key="sk-ant-test", http_client=http, max_retries=0)


def _tool_loop(create: Any, turns: int, tag: str) -> None:
    """`turns` user questions, each answered through the tool loop: a tool_use reply, its
    tool_result sent back, then the text answer."""
    messages: list[dict[str, Any]] = []
    tool_uses = 0
    for i in range(turns):
        messages.append({"role": "user", "content": f"{tag} question {i}: weather in city {i}?"})
        for _ in range(4):
            content, stop = create(messages)
            messages.append({"role": "assistant", "content": content})
            if stop != "tool_use":
                break
            tool_uses += 1
            results = [
                {"type": "tool_result", "tool_use_id": b["id"], "content": f"sunny ({json.dumps(b['input'])})"}
                for b in content
                if b["type"] == "tool_use"
            ]
            messages.append({"role": "user", "content": results})
        assert stop != "tool_use"
    assert tool_uses >= turns


def test_anthropic_messages_create_tool_loop(router: Any, model: str) -> None:
    seen = Seen()
    client = _anthropic(router.url, seen)

    def create(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
        msg = client.messages.create(model=model, max_tokens=16, system="You are terse.", tools=TOOLS, messages=messages)
        return [b.model_dump(exclude_none=True) for b in msg.content], msg.stop_reason

    _tool_loop(create, 3, "create")
    seen.assert_all_ok_and_sticky("/v1/messages", at_least=6)


def test_anthropic_messages_stream_tool_loop(router: Any, model: str) -> None:
    seen = Seen()
    client = _anthropic(router.url, seen)

    def create(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
        kwargs = {"model": model, "max_tokens": 16, "system": "You are terse.", "tools": TOOLS, "messages": messages}
        with client.messages.stream(**kwargs) as stream:
            deltas = sum(1 for event in stream if event.type == "content_block_delta")
            msg = stream.get_final_message()
        assert deltas > 0
        return [b.model_dump(exclude_none=True) for b in msg.content], msg.stop_reason

    _tool_loop(create, 3, "stream")
    seen.assert_all_ok_and_sticky("/v1/messages", at_least=6)


# -- langchain-openai ---------------------------------------------------------------------------


def test_langchain_chat_openai_streaming_three_turns(router: Any, model: str) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    seen = Seen()
    http = httpx.Client(event_hooks={"response": [seen.hook]}, trust_env=False, timeout=60)
    llm = ChatOpenAI(model=model, base_url=f"{router.url}/v1", api_key="sk-test", http_client=http, max_retries=0)
    history: list[Any] = [SystemMessage("You are terse.")]
    for i in range(3):
        history.append(HumanMessage(f"langchain question {i}"))
        chunks = list(llm.stream(history))
        assert len(chunks) > 1
        text = "".join(str(c.content) for c in chunks)
        assert text
        history.append(AIMessage(text))
    seen.assert_all_ok_and_sticky("/v1/chat/completions", at_least=3)
