"""The request-body bytes the gateway holds, all requests together and per tenant, bounded.

``limits.max_body_bytes`` bounds one body; nothing bounded their sum: a client that announces a
32 MiB body, sends all but its last byte and waits out ``server.body_timeout_s`` made the gateway
hold 32 MiB, and a few hundred such connections (far fewer than ``server.max_connections``) held
gigabytes (``benchmarks/hostile.py``, half-bodies phase). Each body read takes its bytes from
one :class:`BodyBudget` per app (``limits.max_buffered_body_bytes``) through a :class:`Claim`.

Bytes are claimed as they arrive, never on the declared ``Content-Length``: a claim on the
declared length let 32 sockets that each announced 32 MiB and sent one byte hold the whole budget
for nothing, and every other tenant got 503s until the body timeout. And each claim is charged
to its owner (the tenant; the client's address when no API keys are configured), who may hold
at most ``limits.max_buffered_body_bytes_per_tenant`` of it: one tenant's bodies, however many,
leave room for the others.

A chunk that would take the owner past its share ends the read with a 429
``tenant_body_budget``, one that would take the whole past the budget with a 503 ``overloaded``,
both with ``Retry-After`` (the client may retry once others are done): a
:class:`~gateway.errors.Refused`, the owner's (``own``) or the gateway's. A generation request
gives its bytes back when its response is over (the body lives as long as the request); the
session API and the other short routes when the read ends.
"""

from __future__ import annotations

from gateway.errors import Refused

__all__ = ["BodyBudget", "Claim"]


class BodyBudget:
    def __init__(self, limit: int, retry_after_s: int, per_owner: int | None = None) -> None:
        self.limit = limit
        self.per_owner = min(limit, per_owner) if per_owner is not None else limit
        self.retry_after_s = retry_after_s
        self.held = 0
        """Bytes of request bodies held now."""
        self.by_owner: dict[str, int] = {}
        """Bytes held now per owner (only owners holding some: bounded by the open requests)."""
        self.peak = 0
        self.refused = 0
        """Reads ended by the global limit."""
        self.refused_owner = 0
        """Reads ended by an owner's share."""

    def claim(self, owner: str = "") -> Claim:
        return Claim(self, owner)


class Claim:
    """One request's share of the budget; :meth:`release` gives it back (idempotent)."""

    __slots__ = ("budget", "bytes", "owner")

    def __init__(self, budget: BodyBudget, owner: str = "") -> None:
        self.budget = budget
        self.owner = owner
        self.bytes = 0

    def take(self, n: int) -> None:
        """Take ``n`` more bytes, or refuse: the owner's share (``own``: a 429) or the budget (a
        503)."""
        if n <= 0:
            return
        b = self.budget
        mine = b.by_owner.get(self.owner, 0)
        if b.held + n > b.limit:
            b.refused += 1
            raise Refused(
                f"the gateway holds {b.limit} bytes of request bodies (limits.max_buffered_body_bytes); retry",
                "overloaded",
                b.retry_after_s,
            )
        if mine + n > b.per_owner:
            b.refused_owner += 1
            raise Refused(
                f"this client holds {b.per_owner} bytes of request bodies being read or served "
                "(limits.max_buffered_body_bytes_per_tenant); retry",
                "tenant_body_budget",
                b.retry_after_s,
                own=True,
            )
        b.held += n
        b.by_owner[self.owner] = mine + n
        self.bytes += n
        b.peak = max(b.peak, b.held)

    def release(self) -> None:
        if not self.bytes:
            return
        b = self.budget
        b.held -= self.bytes
        left = b.by_owner.get(self.owner, 0) - self.bytes
        if left > 0:
            b.by_owner[self.owner] = left
        else:
            b.by_owner.pop(self.owner, None)
        self.bytes = 0
