"""Replicas share their in-flight ledgers through Redis, so each routes on every replica's load.

Each replica's :class:`gateway.core.load.InflightLoad` counts only the requests it sent; the
engines' gauges (running, waiting, KV use) cover everyone's but are scraped every
``timeouts.metrics_interval_s``. Between two scrapes replicas do not see what the others just
sent, and so pile sessions onto the same engines (the fleet simulation, gateway/sim/fleet.py,
measures what that costs: docs/benchmarks_sim.md, "The fleet").

Every ``sessions.share_load_s`` a replica writes its ledger, per engine
``prefilling,backlog_tokens,decoding,tokens``, into the hash ``<prefix>load:<replica id>`` (which
expires after ``max(2 s, 8 periods)``: a replica that dies stops counting then) and registers
its id in the sorted set ``<prefix>load:replicas`` (score: the time it wrote); then it reads the
other live replicas' hashes and sums them. :meth:`SharedLoad.of` is that sum for one engine; the
cluster adds it to its own ledger in the routing views. Redis down: the others' counts are
dropped after the same expiry (the replica routes on its own ledger, as without sharing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from gateway.core.load import EngineCounts, InflightLoad
from gateway.service.tasks import cancel_and_wait

__all__ = ["SharedLoad"]

log = logging.getLogger("agentgw.shared_load")


def _encode(c: EngineCounts) -> str:
    return f"{c.prefilling},{c.backlog_tokens},{c.decoding},{c.tokens}"


def _decode(raw: bytes | str) -> EngineCounts | None:
    try:
        p, b, d, t = (int(x) for x in (raw.decode() if isinstance(raw, bytes) else raw).split(","))
    except (ValueError, UnicodeDecodeError):
        return None
    return EngineCounts(max(0, p), max(0, b), max(0, d), max(0, t))


class SharedLoad:
    def __init__(
        self,
        redis: Any,
        load: InflightLoad,
        period_s: float,
        prefix: str = "agentgw:",
        on_change: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.load = load
        self.period_s = period_s
        self.ttl_s = max(2.0, 8 * period_s)
        self.replica = uuid.uuid4().hex[:12]
        self.key = f"{prefix}load:{self.replica}"
        self.registry = f"{prefix}load:replicas"
        self.on_change = on_change
        self.clock = clock
        self.others: dict[str, EngineCounts] = {}
        """Per engine: the sum of the other live replicas' ledgers."""
        self.replicas = 0
        """Other replicas whose ledgers were read at the last refresh."""
        self._fresh_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def of(self, engine: str) -> EngineCounts | None:
        """The other replicas' in-flight counts on ``engine`` (None: none known)."""
        if self.clock() - self._fresh_at > self.ttl_s:
            return None
        return self.others.get(engine)

    async def refresh(self) -> None:
        """Write this replica's ledger, read the others' (one round of the loop)."""
        now = self.clock()
        mine = {e: _encode(c) for e, c in self.load.counts.items()}
        async with self.redis.pipeline(transaction=False) as p:
            if mine:
                p.hset(self.key, mapping=mine)
            p.pexpire(self.key, int(self.ttl_s * 1000))
            p.zadd(self.registry, {self.replica: now})
            p.zremrangebyscore(self.registry, 0, now - self.ttl_s)
            p.zrange(self.registry, 0, -1)
            res = await p.execute()
        ids = [i.decode() if isinstance(i, bytes) else i for i in res[-1]]
        others = [i for i in ids if i != self.replica]
        total: dict[str, EngineCounts] = {}
        if others:
            async with self.redis.pipeline(transaction=False) as p:
                for i in others:
                    p.hgetall(f"{self.key.rsplit(':', 1)[0]}:{i}")
                rows = await p.execute()
            for row in rows:
                for engine, raw in (row or {}).items():
                    c = _decode(raw)
                    if c is None:
                        continue
                    name = engine.decode() if isinstance(engine, bytes) else engine
                    t = total.setdefault(name, EngineCounts())
                    t.prefilling += c.prefilling
                    t.backlog_tokens += c.backlog_tokens
                    t.decoding += c.decoding
                    t.tokens += c.tokens
        changed = total != self.others
        self.others, self.replicas, self._fresh_at = total, len(others), now
        if changed and self.on_change is not None:
            self.on_change()

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
                if self._failing:
                    log.warning("shared load: Redis answers again")
                self._failing = False
            except Exception as exc:  # an outage: route on the own ledger until it is back
                if not self._failing:
                    log.warning("shared load: %s; routing on this replica's ledger", type(exc).__name__)
                self._failing = True
            await asyncio.sleep(self.period_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="shared-load")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        with contextlib.suppress(Exception):
            await self.redis.delete(self.key)
            await self.redis.zrem(self.registry, self.replica)
