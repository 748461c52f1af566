"""OpenAI-style error bodies: {"error": {"message", "type", "code"}}."""

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


class RouterError(Exception):
    """An error the router answers itself, before or instead of forwarding."""

    def __init__(self, status: int, message: str, code: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after

    def body(self) -> bytes:
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


def sse_error_event(message: str, code: str, status: int = 502) -> bytes:
    """What ends a stream that broke after its first byte: an error event, then [DONE]."""
    return b"data: " + error_body(status, message, code) + b"\n\ndata: [DONE]\n\n"
