"""API errors with the right status, rendered in the caller's API shape: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` or Anthropic's
``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_timeout",
}


@dataclass(slots=True)
class ApiError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.code)

    def anthropic_body(self) -> bytes:
        """This error in Anthropic's shape (for ``/v1/messages``): the message names the field."""
        return anthropic_error_body(self.status, self.message)

    def headers(self) -> list[tuple[bytes, bytes]]:
        h = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            h.append((b"retry-after", str(self.retry_after).encode()))
        return h


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
                "param": param,
                "code": code,
            }
        }
    )


#: Anthropic's error ``type`` per HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(status: int, message: str) -> bytes:
    return orjson.dumps(
        {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}
    )
