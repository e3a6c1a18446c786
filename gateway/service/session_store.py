"""Session storage behind one small async protocol: in memory (default) or Redis, so several
gateway replicas agree on placement.

Memory: the core :class:`~gateway.core.sessions.SessionTable` (capacity + TTL, LRU).
Redis: one JSON value per session under ``<prefix>s:<id>`` with the TTL as its expiry, and a
sorted set ``<prefix>lru`` (score = last activity) trimmed to ``capacity`` on every write.
"""

from __future__ import annotations

from typing import Protocol

import orjson
import redis.asyncio as aioredis

from gateway.core.sessions import SessionRecord, SessionTable


class SessionStore(Protocol):
    async def get(self, session_id: str, now: float) -> SessionRecord | None: ...

    async def put(self, rec: SessionRecord) -> None: ...

    async def delete(self, session_id: str) -> SessionRecord | None: ...

    async def close(self) -> None: ...


class MemorySessionStore:
    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.table = SessionTable(capacity, ttl_s)

    async def get(self, session_id: str, now: float) -> SessionRecord | None:
        return self.table.get(session_id, now)

    async def put(self, rec: SessionRecord) -> None:
        self.table.put(rec)

    async def delete(self, session_id: str) -> SessionRecord | None:
        return self.table.remove(session_id)

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
        lru = f"{self.prefix}lru"
        async with self.redis.pipeline(transaction=True) as p:
            p.set(self._key(rec.session_id), orjson.dumps(rec.to_dict()), px=self.ttl_ms)
            p.zadd(lru, {rec.session_id: rec.last_activity})
            p.zcard(lru)
            res = await p.execute()
        excess = int(res[-1]) - self.capacity
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

    async def close(self) -> None:
        await self.redis.aclose()
