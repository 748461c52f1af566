"""vLLM's agent APIs in the simulator: Responses (`/v1/responses`) and Anthropic Messages
(`/v1/messages`) — request conversion, the per-worker response store, JSON shapes and events.

Both APIs are served the way vLLM 0.32 serves them: the request becomes a chat request
(`normalizer.responses.as_chat` / `normalizer.anthropic.as_chat`, the same conversion the
router's estimate uses), which the engine runs like any chat request; only the output is
reshaped. Shapes follow `vllm/entrypoints/openai/responses/{protocol,serving,
streaming_events}.py` and `vllm/entrypoints/anthropic/{protocol,serving}.py`.

Unlike vLLM (which stores only with `VLLM_ENABLE_RESPONSES_API_STORE=1`), the simulator
always keeps a response unless the request says `store: false`, so `previous_response_id`
chains work without a flag. The store is in memory, per worker, never evicted (as vLLM's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import orjson

from loadtests.sim.openai_shapes import RequestError, Usage
from normalizer import anthropic, responses

# -- request conversion -----------------------------------------------------------------------


def _responses_tool_choice(choice: Any) -> Any:
    """A Responses tool_choice in chat form (`{"type": "function", "name"}` -> named function)."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _anthropic_tool_choice(choice: Any) -> Any:
    """Anthropic's tool_choice in chat form, as vLLM's `_convert_tool_choice` maps it."""
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))


@dataclass
class Stored:
    """A stored response and the chat messages its prompt rendered (vLLM's msg_store)."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]


@dataclass
class ResponseStore:
    responses: dict[str, Stored] = field(default_factory=dict)

    def get(self, response_id: str) -> Stored | None:
        return self.responses.get(response_id)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self.responses[response["id"]] = Stored(response, messages)


def not_found(response_id: str) -> RequestError:
    return RequestError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id")


def _history(prev: Stored) -> list[dict[str, Any]]:
    """What vLLM's `construct_input_messages` prepends: the previous prompt's messages
    without system ones (instructions do not carry over), then the previous output's
    message texts as assistant turns (function_call items are skipped, as in vLLM)."""
    out = [m for m in prev.messages if m.get("role") != "system"]
    for item in prev.response.get("output", []):
        if item.get("type") == "message":
            out.extend({"role": "assistant", "content": part.get("text", "")} for part in item.get("content", []))
    return out


def responses_chat(body: dict[str, Any], store: ResponseStore) -> dict[str, Any]:
    """The chat request a Responses request runs as, with the stored conversation of its
    `previous_response_id` (404 if this worker does not hold it) prepended."""
    if body.get("input") in (None, "", []):
        raise RequestError(400, "input: a non-empty input is required", param="input")
    if body.get("background"):
        raise RequestError(400, "background responses are not supported by the simulator", param="background")
    chat = responses.as_chat(body)
    prev_id = body.get("previous_response_id")
    if prev_id is not None:
        prev = store.get(str(prev_id))
        if prev is None:
            raise not_found(str(prev_id))
        messages = chat["messages"]
        head = 1 if body.get("instructions") else 0
        chat["messages"] = [*messages[:head], *_history(prev), *messages[head:]]
    chat["tool_choice"] = _responses_tool_choice(body.get("tool_choice", "auto"))
    chat["stream"] = body.get("stream", False)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat


def messages_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request an Anthropic Messages request runs as (vLLM converts it the same way)."""
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise RequestError(400, "messages: a non-empty list is required", param="messages")
    chat = anthropic.as_chat(body)
    chat["tool_choice"] = _anthropic_tool_choice(body.get("tool_choice"))
    chat["stream"] = body.get("stream", False)
    if body.get("max_tokens") is not None:
        chat["max_tokens"] = body["max_tokens"]
    return chat


# -- Responses shapes ---------------------------------------------------------------------------


def response_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        # cache_write_tokens: vLLM reports what a KV connector reports writing; 0 without one.
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens, "cache_write_tokens": 0,
            "input_tokens_per_turn": [], "cached_tokens_per_turn": [],
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [], "tool_output_tokens_per_turn": [],
        },
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part] if text else []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id, "type": "function_call", "call_id": call_id, "name": name, "namespace": None,
        "arguments": arguments, "status": status,
    }  # fmt: skip


def response_object(
    rid: str, body: dict[str, Any], model: str, created: int, output: list[dict[str, Any]], status: str,
    max_output_tokens: int, usage: Usage | None,
) -> dict[str, Any]:  # fmt: skip
    """vLLM's `ResponsesResponse.from_request`: the request's settings echoed around the output."""
    return {
        "id": rid,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
        "background": bool(body.get("background", False)),
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": body.get("previous_response_id"),
        "prompt": body.get("prompt"),
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier", "auto"),
        "status": status,
        "text": body.get("text"),
        "top_logprobs": body.get("top_logprobs"),
        "truncation": body.get("truncation", "disabled"),
        "usage": response_usage(usage) if usage is not None else None,
        "user": body.get("user"),
        "presence_penalty": body.get("presence_penalty"),
        "frequency_penalty": body.get("frequency_penalty"),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


class ResponseEvents:
    """Numbers the Responses stream's events (`sequence_number` from 0) as vLLM does."""

    def __init__(self) -> None:
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def open_item(self, item: dict[str, Any]) -> list[bytes]:
        """`output_item.added` (+ `content_part.added` for a message), at output index 0."""
        events = [self.event("response.output_item.added", output_index=0, item=item)]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self.event("response.content_part.added", output_index=0, item_id=item["id"], content_index=0, part=part)
            )
        return events

    def delta(self, item: dict[str, Any], text: str) -> bytes:
        if item["type"] == "message":
            return self.event(
                "response.output_text.delta", content_index=0, output_index=0, item_id=item["id"], delta=text, logprobs=[]
            )
        return self.event("response.function_call_arguments.delta", output_index=0, item_id=item["id"], delta=text)

    def close_item(self, item: dict[str, Any]) -> list[bytes]:
        """The `..done` events of the item, ending with `output_item.done` (`item` is final)."""
        iid = item["id"]
        if item["type"] != "message":
            args, name = item["arguments"], item["name"]
            return [
                self.event("response.function_call_arguments.done", output_index=0, item_id=iid, arguments=args, name=name),
                self.event("response.output_item.done", output_index=0, item=item),
            ]
        text = item["content"][0]["text"] if item["content"] else ""
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
        return [
            self.event("response.output_text.done", output_index=0, content_index=0, text=text, logprobs=[], item_id=iid),
            self.event("response.content_part.done", item_id=iid, output_index=0, content_index=0, part=part),
            self.event("response.output_item.done", output_index=0, item=item),
        ]


# -- Anthropic Messages shapes --------------------------------------------------------------------


def anthropic_usage(usage: Usage) -> dict[str, Any]:
    """vLLM's `_build_anthropic_usage`: `input_tokens` excludes the cache-read ones."""
    return {
        "input_tokens": max(0, usage.prompt_tokens - usage.cached_tokens),
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def stop_reason(finish_reason: str, tool_used: bool) -> str:
    if finish_reason == "length":
        return "max_tokens"
    return "tool_use" if tool_used else "end_turn"


def tool_use_block(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments)}


def message_object(
    mid: str, model: str, content: list[dict[str, Any]], stop: str | None, usage: Usage, *, stream_start: bool = False
) -> dict[str, Any]:
    """vLLM dumps the full message with exclude_none (no stop_sequence) and message_start's
    with the fields it set (stop_reason / stop_sequence null)."""
    out: dict[str, Any] = {"id": mid, "type": "message", "role": "assistant", "content": content, "model": model}
    if stream_start:
        out.update(stop_reason=None, stop_sequence=None)
    elif stop is not None:
        out["stop_reason"] = stop
    out["usage"] = anthropic_usage(usage)
    return out


def anthropic_event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def anthropic_error(status: int, message: str, type_: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": type_, "message": message}})
