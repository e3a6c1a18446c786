"""Domain errors -> HTTP: the one place that knows which status code each service error gets."""

from __future__ import annotations

from gateway.core.hints import HintError
from gateway.errors import ApiError
from gateway.service.errors import (
    BadRequest,
    DomainError,
    ModelNotFound,
    NoCapacity,
    NotAuthenticated,
    NotPermitted,
    Refused,
    ResponseNotFound,
    UpstreamFailed,
)

__all__ = ["SERVICE_ERRORS", "to_api_error"]

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
        return ApiError(429 if exc.own else 503, exc.message, exc.field, exc.code, exc.retry_after)
    if isinstance(exc, BadRequest):
        return ApiError(400, exc.message, exc.field, exc.code)
    if isinstance(exc, NotAuthenticated):
        return ApiError(401, exc.message, None, exc.code)
    if isinstance(exc, NotPermitted):
        return ApiError(403, exc.message, exc.field, exc.code)
    if isinstance(exc, UpstreamFailed):
        return ApiError(502, exc.message, None, "upstream_connect_error" if exc.connect else "upstream_error")
    return ApiError(500, exc.message, None, "internal_error")
