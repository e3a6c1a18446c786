"""The HTTP edge's errors: :class:`ApiError` (a status and the error's body), rendered in the
caller's API shape: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` or Anthropic's
``{"type": "error", "error": {"type", "message"}}``; and the mapping of the gateway's domain errors
(:mod:`gateway.errors`) to them: the one place that knows which status code each error gets."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from gateway.core.hints import HintError
from gateway.errors import (
    BadRequest,
    DomainError,
    ModelNotFound,
    NoCapacity,
    NotAuthenticated,
    NotPermitted,
    Refused,
    ResponseNotFound,
    TooLarge,
    UpstreamFailed,
)

__all__ = [
    "SERVICE_ERRORS",
    "ApiError",
    "anthropic_error_body",
    "anthropic_error_type",
    "error_body",
    "reshape_upstream_error",
    "to_api_error",
]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",  # OpenAI's type for an unknown model, route or id (vLLM's too)
    408: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    414: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
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
    retry_after_ms: int | None = None

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.code)

    def anthropic_body(self) -> bytes:
        """This error in Anthropic's shape (for ``/v1/messages``): the message names the field."""
        return anthropic_error_body(self.status, self.message)

    def headers(self) -> list[tuple[bytes, bytes]]:
        h = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            h.append((b"retry-after", str(self.retry_after).encode()))
        if self.retry_after_ms is not None:
            h.append((b"retry-after-ms", str(self.retry_after_ms).encode()))
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


def reshape_upstream_error(status: int, body: bytes) -> bytes:
    """An engine's error body in the OpenAI shape.

    OpenAI-shaped with vLLM's own ``type`` and ``code`` (``{"error": {"message": ..., "type":
    "BadRequestError", "code": 400}}``): the message and a string ``param`` kept, ``type`` the
    gateway's for the status (``invalid_request_error`` for a 400), ``code`` the engine's when it
    is a string (OpenAI's codes are), else ``upstream_error``. vLLM/FastAPI's
    ``{"detail": "..."}`` or ``{"detail": [{"loc": [...], "msg": ...}, ...]}``, a bare
    ``{"message": ...}``, ``{"error": "text"}``, any other JSON or plain text: re-shaped, the
    message kept (truncated to 2,000 characters) and ``param`` taken from a validation error's
    location when there is one. Pure: no I/O, never raises.
    """
    try:
        doc = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        doc = None
        text = body.decode("utf-8", "replace").strip()
    else:
        text = ""
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            param_in, code_in = err.get("param"), err.get("code")
            return error_body(
                status,
                _clip(err["message"]) or _default(status),
                param_in if isinstance(param_in, str) and param_in else None,
                code_in if isinstance(code_in, str) and code_in else "upstream_error",
            )
        param: str | None = None
        detail = doc.get("detail", doc.get("message", err))
        if isinstance(detail, list) and detail and isinstance(detail[0], dict):
            first = detail[0]
            loc = (
                [str(p) for p in first.get("loc", ()) if p != "body"]
                if isinstance(first.get("loc"), list)
                else []
            )
            param = ".".join(loc) or None
            text = f"{param + ': ' if param else ''}{first.get('msg', 'invalid request')}"
        elif isinstance(detail, str):
            text = detail
        elif detail is not None:
            text = orjson.dumps(detail).decode()
        else:
            text = orjson.dumps(doc).decode()
        return error_body(status, _clip(text) or _default(status), param, "upstream_error")
    if doc is not None:
        text = orjson.dumps(doc).decode()
    return error_body(status, _clip(text) or _default(status), None, "upstream_error")


def _clip(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _default(status: int) -> str:
    return f"engine answered {status}"


# -- domain errors -> HTTP ----------------------------------------------------------------------

#: What the service raises for the edge to map (catch these, then call :func:`to_api_error`).
SERVICE_ERRORS = (DomainError, HintError)


def to_api_error(exc: DomainError | HintError) -> ApiError:
    if isinstance(exc, HintError):
        return ApiError(400, str(exc), exc.field, "invalid_hint")
    if isinstance(exc, ModelNotFound):
        return ApiError(404, exc.message, "model", "model_not_found")
    if isinstance(exc, NoCapacity):
        return ApiError(503, exc.message, None, "no_healthy_engine", retry_after=exc.retry_after)
    if isinstance(exc, ResponseNotFound):
        if exc.field == "previous_response_id":  # OpenAI's answer: a 400, not a 404
            return ApiError(400, exc.message, exc.field, "previous_response_not_found")
        return ApiError(404, exc.message, exc.field, "response_not_found")
    if isinstance(exc, Refused):  # the caller's own limit: 429; the gateway's capacity: 503
        return ApiError(
            429 if exc.own else 503, exc.message, exc.field, exc.code, exc.retry_after, exc.retry_after_ms
        )
    if isinstance(exc, BadRequest):
        return ApiError(400, exc.message, exc.field, exc.code)
    if isinstance(exc, TooLarge):
        return ApiError(413, exc.message, None, exc.code)
    if isinstance(exc, NotAuthenticated):
        return ApiError(401, exc.message, None, exc.code)
    if isinstance(exc, NotPermitted):
        return ApiError(403, exc.message, exc.field, exc.code)
    if isinstance(exc, UpstreamFailed):
        return ApiError(502, exc.message, None, "upstream_connect_error" if exc.connect else "upstream_error")
    return ApiError(500, exc.message, None, "internal_error")
