"""Session storage behind one small async protocol: in memory (default) or Redis, so several
gateway replicas agree on placement.

``update(id, now, fn)`` is the read-modify-write every writer uses: ``fn`` gets the current record
(or None) and returns the record to store (or None to leave it), so concurrent writers (the end of
one turn, the placement of the next, on different replicas) never lose each other's fields.

Memory: the core :class:`~gateway.core.sessions.SessionTable` (capacity + TTL, LRU).
Redis: one JSON value per session under ``<prefix>s:<id>`` with the TTL as its expiry, and a
sorted set ``<prefix>lru`` (score = last activity) trimmed to ``capacity`` on every write;
``update`` is an optimistic transaction (WATCH / MULTI, retried on conflict).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Protocol

import orjson
import redis.asyncio as aioredis
from redis.exceptions import WatchError

from gateway.core.sessions import SessionRecord, SessionTable

Mutation = Callable[[SessionRecord | None], SessionRecord | None]


class SessionStore(Protocol):
    async def get(self, session_id: str, now: float) -> SessionRecord | None: ...

    async def update(self, session_id: str, now: float, fn: Mutation) -> SessionRecord | None: ...

    async def put(self, rec: SessionRecord) -> None: ...

    async def delete(self, session_id: str) -> SessionRecord | None: ...

    async def recent(self, limit: int, now: float) -> list[SessionRecord]: ...

    async def close(self) -> None: ...


MAX_RECENT_LISTING = 1000
"""The most records one :meth:`SessionStore.recent` call returns (the dashboard's listing)."""


class MemorySessionStore:
    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.table = SessionTable(capacity, ttl_s)

    async def get(self, session_id: str, now: float) -> SessionRecord | None:
        return self.table.get(session_id, now)

    async def put(self, rec: SessionRecord) -> None:
        self.table.put(rec)

    async def update(self, session_id: str, now: float, fn: Mutation) -> SessionRecord | None:
        rec = fn(self.table.get(session_id, now))
        if rec is not None:
            self.table.put(rec)
        return rec

    async def delete(self, session_id: str) -> SessionRecord | None:
        return self.table.remove(session_id)

    async def recent(self, limit: int, now: float) -> list[SessionRecord]:
        """Up to ``limit`` (at most MAX_RECENT_LISTING) live records, most recently active first."""
        n = max(0, min(limit, MAX_RECENT_LISTING))
        ttl = self.table.ttl_s
        # the table is ordered by last write (LRU); read it from the newest end without copying
        newest = reversed(self.table._records.values())
        return list(itertools.islice((r for r in newest if now - r.last_activity <= ttl), n))

    async def close(self) -> None:
        return None


class RedisSessionStore:
    def __init__(self, url: str, capacity: int, ttl_s: float, prefix: str = "agentgw:") -> None:
        self.redis = aioredis.from_url(url)
        self.capacity = capacity
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.prefix = prefix

    def _key(self, session_id: str) -> str:
        return f"{self.prefix}s:{session_id}"

    async def get(self, session_id: str, now: float) -> SessionRecord | None:
        raw = await self.redis.get(self._key(session_id))
        if raw is None:
            return None
        return SessionRecord.from_dict(orjson.loads(raw))

    async def put(self, rec: SessionRecord) -> None:
        await self.update(rec.session_id, rec.last_activity, lambda _old: rec)

    async def update(self, session_id: str, now: float, fn: Mutation) -> SessionRecord | None:
        key, lru = self._key(session_id), f"{self.prefix}lru"
        async with self.redis.pipeline(transaction=True) as p:
            while True:
                try:
                    await p.watch(key)
                    raw = await p.get(key)
                    rec = fn(SessionRecord.from_dict(orjson.loads(raw)) if raw is not None else None)
                    if rec is None:
                        await p.unwatch()
                        return None
                    p.multi()
                    p.set(key, orjson.dumps(rec.to_dict()), px=self.ttl_ms)
                    p.zadd(lru, {session_id: rec.last_activity})
                    p.zcard(lru)
                    res = await p.execute()
                    break
                except WatchError:
                    continue
        await self._trim(int(res[-1]))
        return rec

    async def _trim(self, size: int) -> None:
        lru = f"{self.prefix}lru"
        excess = size - self.capacity
        if excess > 0:
            old = await self.redis.zpopmin(lru, excess)
            if old:
                await self.redis.delete(
                    *(self._key(m.decode() if isinstance(m, bytes) else m) for m, _ in old)
                )

    async def delete(self, session_id: str) -> SessionRecord | None:
        rec = await self.get(session_id, 0.0)
        await self.redis.delete(self._key(session_id))
        await self.redis.zrem(f"{self.prefix}lru", session_id)
        return rec

    async def recent(self, limit: int, now: float) -> list[SessionRecord]:
        """Up to ``limit`` (at most MAX_RECENT_LISTING) records, most recently active first: the
        top of the LRU sorted set, then one MGET (expired keys read as missing and are skipped)."""
        n = max(0, min(limit, MAX_RECENT_LISTING))
        if n == 0:
            return []
        ids = await self.redis.zrevrange(f"{self.prefix}lru", 0, n - 1)
        if not ids:
            return []
        names = [i.decode() if isinstance(i, bytes) else i for i in ids]
        raws = await self.redis.mget([self._key(i) for i in names])
        return [SessionRecord.from_dict(orjson.loads(raw)) for raw in raws if raw is not None]

    async def close(self) -> None:
        await self.redis.aclose()
