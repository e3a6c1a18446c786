"""Domain errors of the service layer: what went wrong, in the service's terms. The HTTP edge
(:mod:`gateway.api.errors`) maps each to a status code and to its API's error shape."""

from __future__ import annotations

__all__ = ["DomainError", "ModelNotFound", "NoCapacity", "ResponseNotFound", "UpstreamFailed"]


class DomainError(Exception):
    """Base of the service's errors; ``message`` is meant for the client."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ModelNotFound(DomainError):
    """No pool serves the requested model."""


class NoCapacity(DomainError):
    """Nothing can take the request now (no healthy engine); try again after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class UpstreamFailed(DomainError):
    """The engine failed before the first byte of its response (``connect``: could not be reached
    at all, after the retries)."""

    def __init__(self, message: str, connect: bool) -> None:
        super().__init__(message)
        self.connect = connect


class ResponseNotFound(DomainError):
    """No engine holds the stored response (never stored, forgotten, or its engine is gone);
    ``field`` names where the id came from."""

    def __init__(self, response_id: str, field: str, why: str | None = None) -> None:
        what = "Previous response" if field == "previous_response_id" else "Response"
        super().__init__(f"{what} with id '{response_id}' not found." + (f" ({why})" if why else ""))
        self.response_id = response_id
        self.field = field
