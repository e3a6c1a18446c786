"""The gateway's domain errors: what went wrong, in the gateway's terms, raised by every layer
below the HTTP edge (the wire adapters, prompt analysis, the service). The edge
(:mod:`gateway.api.errors`) maps each to a status code and to its API's error shape; nothing here
knows either."""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "DomainError",
    "ModelNotFound",
    "NoCapacity",
    "NotAuthenticated",
    "NotPermitted",
    "Refused",
    "ResponseNotFound",
    "TooLarge",
    "UpstreamFailed",
]


class DomainError(Exception):
    """Base of the gateway's errors; ``message`` is meant for the client."""

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
    at all, after the retries; ``timed_out``: the last try ran out of time, so the engine may be
    alive but not answering, rather than refusing or resetting the connection; ``refused``: the
    connection was refused, nothing listens: the only failure that says the engine is gone)."""

    def __init__(self, message: str, connect: bool, timed_out: bool = False, refused: bool = False) -> None:
        super().__init__(message)
        self.connect = connect
        self.timed_out = timed_out
        self.refused = refused


class ResponseNotFound(DomainError):
    """No engine holds the stored response (never stored, forgotten, or its engine is gone);
    ``field`` names where the id came from."""

    def __init__(self, response_id: str, field: str, why: str | None = None) -> None:
        what = "Previous response" if field == "previous_response_id" else "Response"
        super().__init__(f"{what} with id '{response_id}' not found." + (f" ({why})" if why else ""))
        self.response_id = response_id
        self.field = field


class BadRequest(DomainError):
    """The request cannot be served as sent; ``field`` names what is wrong, ``code`` says how."""

    def __init__(self, message: str, field: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.field = field
        self.code = code


class TooLarge(DomainError):
    """The request (its body) is larger than the gateway takes; ``code`` names the limit."""

    def __init__(self, message: str, code: str = "request_too_large") -> None:
        super().__init__(message)
        self.code = code


class NotAuthenticated(DomainError):
    """The caller presented no key, or one nobody has (``code`` says which)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class NotPermitted(DomainError):
    """The caller's key may not do this (``field``: the part of the request it may not use)."""

    def __init__(self, message: str, code: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


class Refused(DomainError):
    """Not now: a limit was reached; try again after ``retry_after`` s. ``own``: the caller's
    own limit (its tenant's concurrency, request or token rate); else the gateway's capacity (a
    full queue, a busy engine, a session updated concurrently). ``code`` names the limit."""

    def __init__(
        self,
        message: str,
        code: str,
        retry_after: int,
        own: bool = False,
        field: str | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after
        self.retry_after_ms = retry_after_ms
        """The same wait to the millisecond (``retry-after-ms``, read first by the OpenAI and
        Anthropic SDKs), where the gateway booked the retry's time."""
        self.own = own
        self.field = field
