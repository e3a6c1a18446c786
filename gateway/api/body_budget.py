"""The request-body bytes the gateway holds, all requests together, bounded.

``limits.max_body_bytes`` bounds one body; nothing bounded their sum: a client that announces a
32 MiB body, sends all but its last byte and waits out ``server.body_timeout_s`` made the gateway
hold 32 MiB, and a few hundred such connections (far fewer than ``server.max_connections``) held
gigabytes (``benchmarks/hostile.py``, half-bodies phase). Each body read takes its bytes from
one :class:`BodyBudget` per app (``limits.max_buffered_body_bytes``) as they arrive, through a
:class:`Claim`; a chunk that would take it past the limit ends the read with a 503 ``overloaded``
and ``Retry-After`` (the client may retry once others are done). A generation request gives its
bytes back when its response is over (the body lives as long as the request); the session API
and the other short routes when the read ends.
"""

from __future__ import annotations

from gateway.errors import ApiError

__all__ = ["BodyBudget", "Claim"]


class BodyBudget:
    def __init__(self, limit: int, retry_after_s: int) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.held = 0
        """Bytes of request bodies held now."""
        self.peak = 0
        self.refused = 0
        """Reads ended by the limit."""

    def claim(self) -> Claim:
        return Claim(self)


class Claim:
    """One request's share of the budget; :meth:`release` gives it back (idempotent)."""

    __slots__ = ("budget", "bytes")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.bytes = 0

    def take(self, n: int) -> None:
        """Take ``n`` more bytes, or raise the 503 when the budget cannot hold them."""
        b = self.budget
        if b.held + n > b.limit:
            b.refused += 1
            raise ApiError(
                503,
                f"the gateway holds {b.limit} bytes of request bodies (limits.max_buffered_body_bytes); retry",
                None,
                "overloaded",
                retry_after=b.retry_after_s,
            )
        b.held += n
        self.bytes += n
        b.peak = max(b.peak, b.held)

    def release(self) -> None:
        self.budget.held -= self.bytes
        self.bytes = 0
