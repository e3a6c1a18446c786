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

When the record is missing (Redis restarted empty, or its last writer had not yet pushed it back)
the engines may still hold the response. Where no tenants are configured (every caller shares one
namespace, so an engine's answer cannot belong to another tenant), the owner is then found by
asking the engines (:attr:`ResponseOwners.find`, ``sessions.discover_response_owners``) and
remembered again. Found nowhere, the id is remembered as missing for a few seconds, so a client
repeating an unknown id does not send a call to every engine each time.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from gateway.core.sessions import SessionRecord
from gateway.errors import Refused, UpstreamFailed
from gateway.service.session_store import SessionStore

__all__ = [
    "RESPONSE_ID",
    "Finder",
    "ResponseOwners",
    "engine_search",
    "find_response_id",
    "is_owner_key",
    "owner_key",
]

MARK = "\x1fresponse:"
#: A response id as vLLM makes them (``resp_`` + hex); other characters are refused as ids.
RESPONSE_ID = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")
_ID_IN_BODY = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_\-]{1,120})"')
#: How far into a response the gateway looks for its id (it is in the first event or key).
SCAN_BYTES = 16_384
#: Ids found on no engine, remembered this long (and at most ``MISSES`` of them).
MISS_TTL_S = 5.0
MISSES = 4096
#: Searches of the engines in flight at once per replica (more wait for one to end).
SEARCHES = 8

Finder = Callable[[str, str], Awaitable[tuple[str, str] | None]]
"""Asks the engines for a stored response (its id, and the request's field that named it): its
(engine, pool), or None when none holds it (raises Refused when one that may hold it cannot answer
now)."""


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
    def __init__(
        self,
        store: SessionStore,
        clock: Callable[[], float] = time.time,
        find: Finder | None = None,
        on_search: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.find = find
        """Where set, a missing record is looked for on the engines (see the module's docstring)."""
        self._missing: OrderedDict[str, float] = OrderedDict()
        self._searches = asyncio.Semaphore(SEARCHES)
        self.on_search = on_search
        """Told each search's outcome: found, not_found, remembered_missing
        (``agentgw_response_owner_searches_total``)."""

    async def remember(self, response_id: str, engine: str, pool: str) -> None:
        now = self.clock()
        await self.store.put(
            SessionRecord(owner_key(response_id), home=engine, pool=pool, created=now, last_activity=now)
        )

    async def owner(self, response_id: str, field: str = "previous_response_id") -> str | None:
        """The engine that stored it; None when no replica recorded it (see :meth:`lookup`)."""
        found = await self.lookup(response_id, field)
        return found[0] if found is not None else None

    async def lookup(self, response_id: str, field: str = "previous_response_id") -> tuple[str, float] | None:
        """(the engine that stored it, when that was recorded); None when no replica recorded it.
        Raises Refused (a 503 ``session_store_unavailable`` to retry) when the store cannot
        tell: Redis is down and this replica's local view does not have it (another replica may
        have recorded it; a chain must not end on that)."""
        rec = await self.store.get(owner_key(response_id), self.clock())
        if rec is None and self.store.degraded:
            raise Refused(
                "the session store is unavailable, so the engine that holds this response is not known now; retry",
                "session_store_unavailable",
                1,
                field=field,
            )
        if rec is None and self.find is not None:
            engine = await self._search(response_id, field)
            return (engine, self.clock()) if engine is not None else None
        if rec is None or rec.home is None:
            return None
        return rec.home, rec.created

    def _count(self, outcome: str) -> None:
        if self.on_search is not None:
            self.on_search(outcome)

    async def _search(self, response_id: str, field: str) -> str | None:
        assert self.find is not None
        now = self.clock()
        until = self._missing.get(response_id)
        if until is not None and until > now:
            self._count("remembered_missing")
            return None
        async with self._searches:
            found = await self.find(response_id, field)
        if found is None:
            self._count("not_found")
            self._missing[response_id] = self.clock() + MISS_TTL_S
            self._missing.move_to_end(response_id)
            while len(self._missing) > MISSES:
                self._missing.popitem(last=False)
            return None
        self._count("found")
        self._missing.pop(response_id, None)
        engine, pool = found
        await self.remember(response_id, engine, pool)
        return engine


Call = Callable[[str, str, str, bytes | None], Awaitable[tuple[int, bytes]]]
"""One whole request to one engine: (engine, method, path, body) -> (status, body)."""


def engine_search(engines: Callable[[], list[tuple[str, str]]], call: Call, timeout_s: float) -> Finder:
    """A :data:`Finder` that asks every engine ``engines()`` lists ((name, pool), those that may
    hold state: not removed, not refusing connections) for ``GET /v1/responses/{id}`` at once, and
    answers with the first that has it. None when every one answered without it (vLLM's 404)
    or refused the connection (gone, its store with it); Refused (a 503 ``owner_unavailable`` to
    retry) when none had it but one did not answer within ``timeout_s`` or failed otherwise
    (paused, overloaded, a reset connection: it may be the one)."""

    async def ask(name: str, path: str, response_id: str) -> bool:
        status, body = await call(name, "GET", path, None)
        return status == 200 and response_id.encode() in body

    async def find(response_id: str, field: str) -> tuple[str, str] | None:
        asked = engines()
        if not asked:
            return None
        path = "/v1/responses/" + response_id
        tasks = {asyncio.create_task(ask(name, path, response_id)): (name, pool) for name, pool in asked}
        silent: list[str] = []
        try:
            pending = set(tasks)
            deadline = asyncio.get_running_loop().time() + timeout_s
            while pending:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    exc = t.exception()
                    if exc is None and t.result():
                        return tasks[t]
                    # refusing connections: known gone; removed meanwhile (KeyError): gone too;
                    # a timeout, a reset or a request it could not be sent (a stale keep-alive
                    # connection under load) says nothing: alive but not answering now
                    if isinstance(exc, UpstreamFailed) and not exc.refused:
                        silent.append(tasks[t][0])
            silent += [tasks[t][0] for t in pending]
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if silent:
            raise Refused(
                f"no record says which engine holds this response, and '{silent[0]}', which may hold it, "
                "is not answering now; retry",
                "owner_unavailable",
                2,
                field=field,
            )
        return None

    return find
