"""Error bodies in each API's shape: OpenAI's `{"error": {"message", "type", "param", "code"}}`,
Anthropic's `{"type": "error", "error": {"type", "message"}}` (on /v1/messages), and the
events that end a stream broken after its first byte, per API."""

from __future__ import annotations

import orjson

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "server_error",
}


ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""Anthropic's error types by status (anything else: api_error)."""


class RouterError(Exception):
    """An error the router answers itself, before or instead of forwarding."""

    def __init__(self, status: int, message: str, code: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after

    def body(self, api: str = "openai") -> bytes:
        if api == "anthropic":
            return anthropic_error_body(self.status, self.message)
        return error_body(self.status, self.message, self.code)

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            headers.append((b"retry-after", str(self.retry_after).encode()))
        return headers


def error_body(status: int, message: str, code: str | None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": None, "code": code}}
    )


def anthropic_error_body(status: int, message: str) -> bytes:
    return orjson.dumps(
        {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}
    )


def sse_error_event(message: str, code: str, status: int = 502) -> bytes:
    """What ends a chat/completions stream broken after its first byte: an error, then [DONE]."""
    return b"data: " + error_body(status, message, code) + b"\n\ndata: [DONE]\n\n"


def stream_error_tail(kind: str | None, message: str, code: str) -> bytes:
    """The end of a stream broken after its first byte, as the endpoint's own clients parse it:
    Responses and Messages streams end with an `error` event (their clients stop on it and
    know no [DONE]), chat and completions streams with an error chunk and [DONE]."""
    if kind == "responses":
        event = orjson.dumps({"type": "error", "code": code, "message": message, "param": None})
        return b"event: error\ndata: " + event + b"\n\n"
    if kind == "messages":
        return b"event: error\ndata: " + anthropic_error_body(502, message) + b"\n\n"
    return sse_error_event(message, code)
