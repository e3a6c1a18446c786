"""Which engine holds each stored response. vLLM keeps a stored Responses-API response (and so the
history a ``previous_response_id`` continues) in the memory of the engine that made it; a request
that continues it, and every call on ``/v1/responses/{id}``, must reach that engine.

The owner is kept in the session store (memory or Redis: replicas agree), as a record whose
``home`` is the engine: bounded and expiring with the sessions (a response idle past the
sessions' TTL is forgotten, as an idle session is). Its key is :func:`owner_key`: inside the
tenant's namespace (``<tenant>:\x1fresponse:<id>``), so the tenant's session quota covers its
stored responses and one tenant's responses never push out another's; and marked by a control
character no session id can hold (hint ids are printable), so no session id of any tenant,
whatever its name, can address an owner record.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from gateway.core.sessions import SessionRecord
from gateway.errors import Refused
from gateway.service.session_store import SessionStore

__all__ = ["RESPONSE_ID", "ResponseOwners", "find_response_id", "is_owner_key", "owner_key"]

MARK = "\x1fresponse:"
#: A response id as vLLM makes them (``resp_`` + hex); other characters are refused as ids.
RESPONSE_ID = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")
_ID_IN_BODY = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_\-]{1,120})"')
#: How far into a response the gateway looks for its id (it is in the first event or key).
SCAN_BYTES = 16_384


def find_response_id(head: bytes) -> str | None:
    """The response id in the first bytes of a Responses answer (JSON body or SSE stream)."""
    m = _ID_IN_BODY.search(head[:SCAN_BYTES])
    return m.group(1).decode() if m else None


def owner_key(stored_id: str) -> str:
    """The store key of the owner record of a (namespaced) response id: ``<ns>:<MARK><id>``."""
    ns, sep, local = stored_id.partition(":")
    return f"{ns}:{MARK}{local}" if sep else MARK + stored_id


def is_owner_key(key: str) -> bool:
    return MARK in key


class ResponseOwners:
    def __init__(self, store: SessionStore, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock

    async def remember(self, response_id: str, engine: str, pool: str) -> None:
        now = self.clock()
        await self.store.put(
            SessionRecord(owner_key(response_id), home=engine, pool=pool, created=now, last_activity=now)
        )

    async def owner(self, response_id: str, field: str = "previous_response_id") -> str | None:
        """The engine that stored it; None when no replica recorded it. Raises Refused (a 503
        ``session_store_unavailable`` to retry) when the store cannot tell: Redis is down and this replica's local view does
        not have it (another replica may have recorded it; a chain must not end on that)."""
        rec = await self.store.get(owner_key(response_id), self.clock())
        if rec is None and self.store.degraded:
            raise Refused(
                "the session store is unavailable, so the engine that holds this response is not known now; retry",
                "session_store_unavailable",
                1,
                field=field,
            )
        return rec.home if rec is not None else None
