"""Session storage behind one small async protocol: in memory (default) or Redis, so several
gateway replicas agree on placement.

``update(id, now, fn)`` is the read-modify-write every writer uses: ``fn`` gets the current record
(or None) and returns the record to store (or None to leave it), so concurrent writers (the end of
one turn, the placement of the next, on different replicas) never lose each other's fields.

Memory: the core :class:`~gateway.core.sessions.SessionTable` (capacity + TTL, LRU, per-tenant
quotas).
Redis: one JSON value per session under ``<prefix>s:<id>`` with the TTL as its expiry, and a
sorted set ``<prefix>lru`` (score = last activity) trimmed to ``capacity`` on every write;
with tenant quotas (``auth.tenants[].max_sessions``) also one sorted set per namespace,
``<prefix>ns:<tenant>`` (``<prefix>ns:`` for ids of no tenant), each trimmed to its tenant's quota
by evicting that tenant's own oldest sessions; the capacity trim then takes ids of no tenant
first, so one tenant's writes never evict another tenant's sessions;
``update`` is an optimistic transaction (WATCH / MULTI, retried on conflict at most
``max_conflicts`` times, then :class:`SessionStoreBusy`, a 503 with ``Retry-After``).

Redis outage: every record read or written through Redis is also kept in a bounded local view
(a :class:`SessionTable`). When a Redis call fails (connection refused, timeout) the store turns
*degraded*: reads and writes use the local view, the ids written or deleted meanwhile are
remembered (bounded), and Redis is tried again at most every ``retry_s``. When it answers, the
remembered writes are pushed back (the newer ``last_activity`` wins against what another
replica wrote meanwhile), deletions are replayed, and the store leaves degraded mode; calls
arriving while that push runs wait for it (at most ``retry_s``) rather than answer from the local
view, which lacks the sessions other replicas served. Callers
never see a Redis error; ``degraded`` and the metrics say what is happening.

Redis data loss: a Redis that restarts without persistence comes back empty, and a replica may
not have called it while it was down (so it never turned degraded). Each store therefore keeps an
epoch marker in Redis (``<prefix>epoch``, set once by whichever replica writes it first) and reads
it beside every record it misses. A missing or changed marker means Redis lost what it held: the
store writes a new marker (or adopts the one another replica just wrote) and pushes every live
record of its local view back (with what is left of its TTL; a newer record another replica wrote
meanwhile wins, but a copy only hints made, on a replica that missed the session, never
replaces one a turn placed), then reads again; every store also watches the marker every ``retry_s``, and a
miss within ``2 * retry_s`` of a loss waits one watch period for the other replicas' records
before it answers (so does a miss of a store that started while Redis was down, once it finds
the marker missing). So a session's next turn keeps the home a replica knew, and a Responses chain
its owner. (A session another replica deleted before the loss may come back
until its TTL: the store holds soft state.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar, cast

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import WatchError

from gateway.core.sessions import Mutation, SessionRecord, SessionTable, hints_only, namespace_of, reconcile
from gateway.errors import Refused
from gateway.service.metrics import GatewayMetrics
from gateway.service.tasks import cancel_and_wait

REDIS_MAX_CONNECTIONS = 256
"""Connections to Redis per gateway replica (commands beyond wait for one)."""

log = logging.getLogger("agentgw.sessions")
T = TypeVar("T")
OUTAGE_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


class SessionStoreBusy(Refused):
    """An update kept conflicting with concurrent writers (the gateway's capacity: retry)."""


class SessionStore(Protocol):
    async def get(self, session_id: str, now: float) -> SessionRecord | None: ...

    async def update(self, session_id: str, now: float, fn: Mutation) -> SessionRecord | None: ...

    async def put(self, rec: SessionRecord) -> None: ...

    async def delete(self, session_id: str) -> SessionRecord | None: ...

    async def recent(self, limit: int, now: float) -> list[SessionRecord]: ...

    async def close(self) -> None: ...

    def start(self) -> None:
        """Start what watches the store in the background (on the app's lifespan)."""
        ...

    async def probe(self) -> bool:
        """Is the store degraded (serving from a local view)? May try to recover first."""
        ...

    @property
    def degraded(self) -> bool:
        """Serving from a local view now: a miss is not an answer (another replica may hold it)."""
        ...


MAX_RECENT_LISTING = 1000
"""The most records one :meth:`SessionStore.recent` call returns (the dashboard's listing)."""


def _count_evictions(table: SessionTable, before: tuple[int, int], metrics: GatewayMetrics | None) -> None:
    if metrics is None:
        return
    quota, capacity = table.evicted_quota - before[0], table.evicted_capacity - before[1]
    if quota:
        metrics.session_evictions.labels("tenant_quota").inc(quota)
    if capacity:
        metrics.session_evictions.labels("capacity").inc(capacity)


class MemorySessionStore:
    def __init__(
        self,
        capacity: int,
        ttl_s: float,
        quotas: dict[str, int] | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.table = SessionTable(capacity, ttl_s, quotas)
        self.metrics = metrics

    @property
    def degraded(self) -> bool:
        return False

    async def get(self, session_id: str, now: float) -> SessionRecord | None:
        return self.table.get(session_id, now)

    async def put(self, rec: SessionRecord) -> None:
        self._put(rec)

    def _put(self, rec: SessionRecord) -> None:
        t = self.table
        before = (t.evicted_quota, t.evicted_capacity)
        t.put(rec)
        _count_evictions(t, before, self.metrics)

    async def update(self, session_id: str, now: float, fn: Mutation) -> SessionRecord | None:
        t = self.table
        before = (t.evicted_quota, t.evicted_capacity)
        rec = t.update(session_id, now, fn)
        _count_evictions(t, before, self.metrics)
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

    def start(self) -> None:
        return None

    async def probe(self) -> bool:
        return False


class RedisSessionStore:
    def __init__(
        self,
        url: str,
        capacity: int,
        ttl_s: float,
        prefix: str = "agentgw:",
        *,
        timeout_s: float = 0.5,
        retry_s: float = 1.0,
        max_conflicts: int = 16,
        local_capacity: int | None = None,
        clock: Callable[[], float] = time.time,
        metrics: GatewayMetrics | None = None,
        quotas: dict[str, int] | None = None,
    ) -> None:
        # a blocking pool: past REDIS_MAX_CONNECTIONS concurrent commands wait (up to timeout_s)
        # for a connection; redis-py's default pool raised MaxConnectionsError at its 100th, which
        # read as an outage (the soak's 200 sessions put the store in degraded mode at once)
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=REDIS_MAX_CONNECTIONS,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # an outage is handled here, not by waiting it out
        )
        self.redis = aioredis.Redis.from_pool(pool)
        self.capacity = capacity
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.prefix = prefix
        self.retry_s = retry_s
        self.max_conflicts = max_conflicts
        self.clock = clock
        self.metrics = metrics
        self.quotas = dict(quotas or {})
        self.local = SessionTable(local_capacity or capacity, ttl_s, self.quotas)
        self.degraded = False
        self.fallbacks = 0
        self.resyncs = 0
        self._retry_at = 0.0
        self._dirty: OrderedDict[str, SessionRecord | None] = OrderedDict()  # None: deleted
        self._recovering = asyncio.Lock()
        self._pushing = False
        """A recovery found Redis answering and is pushing the local view back."""
        self._epoch_key = f"{prefix}epoch"
        self._epoch: bytes | str | None = None
        """The epoch marker this store last saw in Redis (None: not read yet)."""
        self._reseeding = asyncio.Lock()
        self.reseeds = 0
        self._watch: asyncio.Task[None] | None = None
        self._closing = False
        self._loss_at: float | None = None
        """When this store last found that Redis had lost its data."""
        """Times Redis was found to have lost its data and the local view was pushed back."""

    def _key(self, session_id: str) -> str:
        return f"{self.prefix}s:{session_id}"

    def _ns_key(self, session_id: str) -> str | None:
        """The sorted set of the id's namespace (None without quotas)."""
        if not self.quotas:
            return None
        return f"{self.prefix}ns:{namespace_of(session_id, self.quotas)}"

    # -- public operations: Redis when it answers, the local view when it does not --------------
    async def get(self, session_id: str, now: float) -> SessionRecord | None:
        async def remote() -> SessionRecord | None:
            rec = await self._get(session_id)
            if rec is None:
                self.local.remove(session_id)
            else:
                self.local.put(rec)
            return rec

        async def local() -> SessionRecord | None:
            return self.local.get(session_id, now)

        return await self._either("get", remote, local)

    async def put(self, rec: SessionRecord) -> None:
        await self.update(rec.session_id, rec.last_activity, lambda _old: rec)

    async def update(self, session_id: str, now: float, fn: Mutation) -> SessionRecord | None:
        async def remote() -> SessionRecord | None:
            rec = await self._update(session_id, fn)
            if rec is not None:
                self.local.put(rec)
            return rec

        async def local() -> SessionRecord | None:
            rec = fn(self.local.get(session_id, now))
            if rec is not None:
                self.local.put(rec)
                self._mark(session_id, rec)
            return rec

        return await self._either("update", remote, local)

    async def delete(self, session_id: str) -> SessionRecord | None:
        async def remote() -> SessionRecord | None:
            rec = await self._get(session_id)
            await self._forget(session_id)
            local = self.local.remove(session_id)
            return rec or local

        async def local() -> SessionRecord | None:
            self._mark(session_id, None)
            return self.local.remove(session_id)

        return await self._either("delete", remote, local)

    async def recent(self, limit: int, now: float) -> list[SessionRecord]:
        """Up to ``limit`` (at most MAX_RECENT_LISTING) records, most recently active first: the
        top of the LRU sorted set, then one MGET (expired keys read as missing and are skipped).
        While Redis is down: this replica's local view."""
        n = max(0, min(limit, MAX_RECENT_LISTING))
        if n == 0:
            return []

        async def remote() -> list[SessionRecord]:
            # redis types ZREVRANGE's reply as with or without scores; without, it is the members
            ids = cast(list[bytes | str], await self.redis.zrevrange(f"{self.prefix}lru", 0, n - 1))
            if not ids:
                return []
            names = [i.decode() if isinstance(i, bytes) else i for i in ids]
            raws = await self.redis.mget([self._key(i) for i in names])
            return [SessionRecord.from_dict(orjson.loads(raw)) for raw in raws if raw is not None]

        async def local() -> list[SessionRecord]:
            newest = reversed(list(self.local._records.values()))
            ttl = self.local.ttl_s
            return list(itertools.islice((r for r in newest if now - r.last_activity <= ttl), n))

        return await self._either("recent", remote, local)

    def start(self) -> None:
        """Watch the epoch marker every ``retry_s``: when another replica found Redis empty and
        wrote a new one, this replica pushes its local view back at once, not at its own next
        miss (a session whose last turns went through this replica would be missed meanwhile)."""
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_epoch())

    async def _watch_epoch(self) -> None:
        # the flag ends the loop too: a cancellation can come out as a Redis call's
        # TimeoutError (an outage here; see cancel_and_wait)
        while not self._closing:
            await asyncio.sleep(self.retry_s)
            try:
                if self.degraded:
                    await self._try_recover()
                    continue
                epoch = await self.redis.get(self._epoch_key)
                if self._epoch is not None and epoch != self._epoch:
                    await self._reseed()
            except (*OUTAGE_ERRORS, SessionStoreBusy) as exc:
                self._enter_degraded(exc)
            except Exception:  # a watcher must outlive a bad reply
                log.exception("session store: epoch watch failed")

    async def close(self) -> None:
        self._closing = True
        watch, self._watch = self._watch, None
        await cancel_and_wait(watch)
        await self.redis.aclose()

    async def probe(self) -> bool:
        """Readiness hook: while degraded, try to resynchronise (at most every ``retry_s``).
        Returns whether the store is (still) degraded."""
        if self.degraded:
            await self._try_recover()
        return self.degraded

    # -- degraded mode ------------------------------------------------------------------------
    async def _either(
        self, op: str, remote: Callable[[], Awaitable[T]], local: Callable[[], Awaitable[T]]
    ) -> T:
        if self.degraded and not await self._try_recover() and not await self._recovered():
            return await self._fallback(op, local)
        try:
            return await remote()
        except OUTAGE_ERRORS as exc:
            self._enter_degraded(exc)
            return await self._fallback(op, local)

    async def _recovered(self) -> bool:
        """Another task is pushing the local view back (Redis answers again): wait for it, at
        most ``retry_s``, rather than answer from the local view, which misses every session
        another replica served (their records are coming back to Redis meanwhile)."""
        if not self._pushing:  # no push, or still trying whether Redis answers: no wait
            return False
        try:
            async with asyncio.timeout(self.retry_s), self._recovering:
                pass
        except TimeoutError:
            return False
        return not self.degraded

    async def _fallback(self, op: str, local: Callable[[], Awaitable[T]]) -> T:
        self.fallbacks += 1
        if self.metrics is not None:
            self.metrics.session_store_fallbacks.labels(op).inc()
        return await local()

    def _enter_degraded(self, exc: BaseException) -> None:
        self._retry_at = self.clock() + self.retry_s
        if not self.degraded:
            self.degraded = True
            log.warning(
                "session store: Redis unreachable (%s); routing on the local view", type(exc).__name__
            )
            if self.metrics is not None:
                self.metrics.session_store_degraded.set(1)

    def _mark(self, session_id: str, rec: SessionRecord | None) -> None:
        self._dirty[session_id] = rec
        self._dirty.move_to_end(session_id)
        while len(self._dirty) > self.local.capacity:
            self._dirty.popitem(last=False)

    async def _try_recover(self) -> bool:
        """While degraded: at most every ``retry_s``, push the local writes back to Redis.
        True when Redis is back (and the store no longer degraded)."""
        if self.clock() < self._retry_at or self._recovering.locked():
            return False
        async with self._recovering:
            try:
                await self.redis.ping()
                self._pushing = True  # Redis answers: calls wait for the push (_recovered)
                epoch = await self.redis.get(self._epoch_key)
                if epoch is None or epoch != self._epoch:
                    # it came back empty: the whole local view, not only the writes; a loss even
                    # for a store that never saw a marker (it started while Redis was down)
                    await self._reseed(loss=True)
                while self._dirty:
                    session_id, rec = next(iter(self._dirty.items()))
                    left_ms = (
                        int((self.ttl_ms / 1000 - (self.clock() - rec.last_activity)) * 1000) if rec else 0
                    )
                    if rec is not None and left_ms > 0:
                        # what is left of its TTL, not a new one (it was idle through the outage)
                        await self._update(session_id, _newer(rec), left_ms)
                    else:  # deleted, or expired meanwhile
                        await self._forget(session_id)
                    if session_id in self._dirty and self._dirty[session_id] is rec:
                        del self._dirty[session_id]
            except (*OUTAGE_ERRORS, SessionStoreBusy) as exc:
                self._enter_degraded(exc)
                return False
            finally:
                self._pushing = False
            self.degraded = False
            self.resyncs += 1
            log.warning("session store: Redis is back; local writes resynchronised")
            if self.metrics is not None:
                self.metrics.session_store_degraded.set(0)
                self.metrics.session_store_resyncs.inc()
            return True

    # -- Redis ----------------------------------------------------------------------------------
    async def _forget(self, session_id: str) -> None:
        await self.redis.delete(self._key(session_id))
        await self.redis.zrem(f"{self.prefix}lru", session_id)
        ns = self._ns_key(session_id)
        if ns is not None:
            await self.redis.zrem(ns, session_id)

    async def _get(self, session_id: str) -> SessionRecord | None:
        raw, epoch = await self.redis.mget([self._key(session_id), self._epoch_key])
        if epoch is None or epoch != self._epoch:
            # also when the record is there: another replica may have written it since the loss
            # (hints for a session it did not know) before this one pushed its copy back
            await self._reseed()
            raw = await self.redis.get(self._key(session_id))
        rec = SessionRecord.from_dict(orjson.loads(raw)) if raw is not None else None
        recent = self._loss_at is not None and self.clock() - self._loss_at < 2 * self.retry_s
        if recent and (rec is None or hints_only(rec)):
            # Redis lost its data a moment ago: the other replicas push their local views back
            # within their next epoch watch (every retry_s); a record only they held is missed
            # now, or found as only the hints another replica took meanwhile
            await asyncio.sleep(1.2 * self.retry_s)
            raw = await self.redis.get(self._key(session_id))
            rec = SessionRecord.from_dict(orjson.loads(raw)) if raw is not None else None
        return rec

    async def _reseed(self, loss: bool = False) -> None:
        """Redis holds no epoch marker, or another than this store last saw: it lost its data
        (or this store is new). Adopt the marker (writing one if there is none) and push every
        live record of the local view back, so that a miss of a record this replica knew is not
        answered as a new session. ``loss``: found on recovering from an outage, so a data loss
        even when this store had seen no marker yet (it started while Redis was down): its
        misses wait for the other replicas' records too."""
        async with self._reseeding:
            current: bytes | str | None = await self.redis.get(self._epoch_key)
            if current is not None and current == self._epoch:
                return  # another task of this store did it meanwhile
            if current is None:
                await self.redis.set(self._epoch_key, secrets.token_hex(8), nx=True)
                current = await self.redis.get(self._epoch_key)
            now, ttl_s, pushed = self.clock(), self.ttl_ms / 1000, 0
            for rec in list(self.local._records.values()):
                left_ms = int((ttl_s - (now - rec.last_activity)) * 1000)
                if left_ms > 0:
                    await self._update(rec.session_id, _newer(rec), left_ms, check_epoch=False)
                    pushed += 1
            first = self._epoch is None
            self._epoch = current
            if loss or not first:
                self._loss_at = self.clock()
            if not first:
                self.reseeds += 1
                log.warning("session store: Redis lost its data; %d live sessions pushed back", pushed)
                if self.metrics is not None:
                    self.metrics.session_store_resyncs.inc()

    async def _update(
        self, session_id: str, fn: Mutation, ttl_ms: int | None = None, *, check_epoch: bool = True
    ) -> SessionRecord | None:
        key, lru, ns = self._key(session_id), f"{self.prefix}lru", self._ns_key(session_id)
        async with self.redis.pipeline(transaction=True) as p:
            conflicts = 0
            while True:
                try:
                    await p.watch(key)
                    raw = await p.get(key)
                    if raw is None and check_epoch:
                        check_epoch = False  # once: a new session's first write reads the marker
                        epoch = await p.get(self._epoch_key)
                        if epoch is None or epoch != self._epoch:
                            await p.unwatch()  # type: ignore[no-untyped-call]  # redis leaves it unannotated
                            await self._reseed()
                            continue
                    rec = fn(SessionRecord.from_dict(orjson.loads(raw)) if raw is not None else None)
                    if rec is None:
                        await p.unwatch()  # type: ignore[no-untyped-call]  # redis leaves it unannotated
                        return None
                    p.multi()  # type: ignore[no-untyped-call]  # redis leaves it unannotated
                    p.set(key, orjson.dumps(rec.to_dict()), px=ttl_ms or self.ttl_ms)
                    p.zadd(lru, {session_id: rec.last_activity})
                    if ns is not None:
                        p.zadd(ns, {session_id: rec.last_activity})
                        p.zcard(ns)
                    p.zcard(lru)
                    res = await p.execute()
                    break
                except WatchError:
                    conflicts += 1
                    if conflicts < self.max_conflicts:
                        continue
                    log.warning("session store: update of a session conflicted %d times", self.max_conflicts)
                    raise SessionStoreBusy(
                        "the session is being updated concurrently; retry",
                        "session_busy",
                        1,
                        field="session_id",
                    ) from None
        if ns is not None:
            limit = self.quotas.get(namespace_of(session_id, self.quotas))
            if limit is not None and int(res[-2]) > limit:
                await self._evict(ns, int(res[-2]) - limit, "tenant_quota")
        await self._trim(int(res[-1]))
        return rec

    async def _trim(self, size: int) -> None:
        """Past the capacity: ids of no tenant go first (with quotas), then the oldest of all."""
        excess = size - self.capacity
        if excess > 0 and self.quotas:
            excess -= await self._evict(f"{self.prefix}ns:", excess, "capacity")
        if excess > 0:
            await self._evict(f"{self.prefix}lru", excess, "capacity")

    async def _evict(self, zset: str, n: int, reason: str) -> int:
        """Forget the ``n`` oldest members of ``zset`` (from every set they are in)."""
        # redis types ZPOPMIN's reply as any range reply; it is (member, score) pairs
        old = cast(list[tuple[bytes | str, float]], await self.redis.zpopmin(zset, n))
        ids = [m.decode() if isinstance(m, bytes) else m for m, _ in old]
        if not ids:
            return 0
        await self.redis.delete(*(self._key(i) for i in ids))
        await self.redis.zrem(f"{self.prefix}lru", *ids)
        if self.quotas:
            by_ns: dict[str, list[str]] = {}
            for i in ids:
                by_ns.setdefault(f"{self.prefix}ns:{namespace_of(i, self.quotas)}", []).append(i)
            for zs, members in by_ns.items():
                await self.redis.zrem(zs, *members)
        for i in ids:
            self.local.remove(i)
        if self.metrics is not None:
            self.metrics.session_evictions.labels(reason).inc(len(ids))
        return len(ids)


def _newer(rec: SessionRecord) -> Mutation:
    """Resync merge: write the local record unless Redis holds a more recent one (a copy only
    hints made never wins over one a turn placed: :func:`~gateway.core.sessions.reconcile`)."""

    def merge(remote: SessionRecord | None) -> SessionRecord | None:
        return reconcile(rec, remote)

    return merge
