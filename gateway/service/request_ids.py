"""Request ids: one id per request, from the client to the engine and back, in every log line.

The id is the client's ``x-request-id`` when it is a sane token (1-128 characters of letters,
digits and ``-_.:/+=@``), else one made here (32 hex digits): a header that is too long or
carries other bytes is replaced, not refused (it is a tracing aid, not part of the request). The
edge puts it in the request's headers, so the engine gets it (vLLM 0.32 takes ``X-Request-Id``
as its own request id: the response's ``id`` is ``chatcmpl-<id>`` / ``cmpl-<id>``), returns it as
``x-request-id`` on every response, and sets :data:`REQUEST_ID` for the request's task, which
:class:`RequestIdFilter` writes into each log record (``%(request_id)s``; ``-`` outside a request).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence
from contextvars import ContextVar

__all__ = ["REQUEST_ID", "RequestIdFilter", "take_request_id"]

HEADER = b"x-request-id"
REQUEST_ID: ContextVar[str] = ContextVar("agentgw_request_id", default="-")
_VALID = re.compile(rb"^[A-Za-z0-9\-_.:/+=@]{1,128}$")


def take_request_id(headers: Sequence[tuple[bytes, bytes]]) -> tuple[bytes, bool]:
    """The request's id and whether it is the client's own (a valid ``x-request-id``)."""
    for k, v in headers:
        if k == HEADER:
            if _VALID.match(v):
                return v, True
            break
    return uuid.uuid4().hex.encode(), False


def with_request_id(headers: list[tuple[bytes, bytes]], rid: bytes) -> list[tuple[bytes, bytes]]:
    """``headers`` with exactly one ``x-request-id``: ``rid``."""
    return [*(kv for kv in headers if kv[0] != HEADER), (HEADER, rid)]


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (the current request's id, ``-`` outside one) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


def install_log_filter(handlers: Sequence[logging.Handler] | None = None) -> None:
    """Put the filter on ``handlers`` (default: the root logger's), so every line can name its
    request, whichever logger emitted it."""
    for h in handlers if handlers is not None else logging.getLogger().handlers:
        if not any(isinstance(f, RequestIdFilter) for f in h.filters):
            h.addFilter(RequestIdFilter())
