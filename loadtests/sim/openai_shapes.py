"""vLLM's OpenAI-compatible JSON shapes, and the simulator's deterministic "model output".

Shapes follow vLLM's `vllm/entrypoints/openai/protocol.py` responses: the last content
chunk of a stream carries `finish_reason`; with `stream_options.include_usage` a final
chunk with empty `choices` carries `usage`; `usage.prompt_tokens_details.cached_tokens`
counts prompt tokens served from the GPU prefix cache or the KV connector (the pool).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import orjson

# Three-letter words plus a leading space: every output token is exactly 4 bytes, so a
# reply sent back in the next turn re-tokenizes to as many tokens as were generated.
WORDS = (
    "the", "and", "for", "are", "but", "not", "you", "all", "any", "can", "had", "her", "was",
    "one", "our", "out", "day", "get", "has", "him", "his", "how", "man", "new", "now", "old",
    "see", "two", "way", "who", "boy", "did", "its", "let", "put", "say", "she", "too", "use",
    "big", "end", "far", "few", "fix", "got", "hot", "job", "key", "low", "map", "net", "odd",
    "pay", "red", "run", "set", "sun", "top", "war", "win", "yes", "air", "art", "bed", "box",
    "car", "cat", "cup", "dog", "ear", "eye", "fly", "fun", "gas", "hat", "ice",
)  # fmt: skip


class RequestError(Exception):
    """A request the simulated server rejects, rendered as an OpenAI-style error."""

    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
        self.param = param


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object, else the 400 vLLM answers."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


def check_model(body: dict[str, Any], served: str) -> None:
    """A `model` other than the one served is vLLM's 404 (absent is fine)."""
    model = body.get("model")
    if model is not None and model != served:
        raise RequestError(404, f"The model `{model}` does not exist.", param="model")


def error_body(status: int, message: str, type_: str, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": status}})


def seed_of(data: bytes, salt: str = "") -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=salt.encode()[:64]).digest(), "big")


def text_pieces(seed: int, n: int) -> list[str]:
    """`n` output tokens of deterministic text, one 4-byte piece each."""
    rng = random.Random(seed)
    return [" " + WORDS[rng.randrange(len(WORDS))] for _ in range(n)]


def _value_for(schema: Any, rng: random.Random) -> Any:
    if not isinstance(schema, dict):
        return None
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return f"sim-{rng.getrandbits(24):06x}"
    if kind == "integer":
        return rng.randrange(100)
    if kind == "number":
        return round(rng.random() * 100, 2)
    if kind == "boolean":
        return True
    if kind == "array":
        return [_value_for(schema.get("items"), rng)] if schema.get("items") else []
    if kind == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {k: _value_for(v, rng) for k, v in props.items()}
    return None


def tool_arguments(tool: dict[str, Any], seed: int) -> str:
    """Deterministic arguments that satisfy the function's JSON schema (types and enums)."""
    params = (tool.get("function") or {}).get("parameters") or {}
    value = _value_for({"type": "object", **params}, random.Random(seed))
    # json.dumps' default separators: how a model writes JSON, and stable across runs.
    return json.dumps(value if isinstance(value, dict) else {})


def split_pieces(text: str, size: int = 4) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def now_s() -> int:
    return int(time.time())


def chat_response(
    rid: str, model: str, created: int, content: str | None, tool_call: dict[str, Any] | None,
    finish_reason: str, usage: Usage,
) -> dict[str, Any]:  # fmt: skip
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [tool_call] if tool_call else [],
        "reasoning_content": None,
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage.to_dict(),
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def chat_chunk(
    rid: str, model: str, created: int, delta: dict[str, Any], finish_reason: str | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:  # fmt: skip
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    out: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice],
    }  # fmt: skip
    if usage is not None:
        out["usage"] = usage.to_dict()
    return out


def completion_response(rid: str, model: str, created: int, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        ],
        "usage": usage.to_dict(),
        "kv_transfer_params": None,
    }


def completion_chunk(
    rid: str, model: str, created: int, text: str, finish_reason: str | None = None, usage: Usage | None = None,
) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        ],
    }
    if usage is not None:
        out["usage"] = usage.to_dict()
    return out


def usage_chunk(rid: str, model: str, created: int, obj: str, usage: Usage) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage.to_dict()}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
