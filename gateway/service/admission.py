"""Admission control: bounded in-flight work per tenant, for the gateway and per engine, with a
bounded priority wait queue in front of the global and per-engine limits.

The tenant's checks come first, before the request's body is read (:meth:`Admission.enter`,
with the tokens estimated from the declared ``Content-Length``; :meth:`Admission.admit` settles
them with the analysed count): a rate-limited tenant's refused request costs a header parse,
not a body read, a parse and an analysis. Order of checks (nothing is consumed unless all pass):

1. the tenant's ``max_concurrent`` (its requests admitted or waiting) -> 429 ``tenant_concurrency``;
2. the tenant's ``requests_per_s`` token bucket -> 429 ``tenant_rate_limited``;
3. the tenant's ``tokens_per_s`` bucket (the request's estimated tokens; completion tokens are
   debited afterwards with :meth:`Admission.charge`, so the bucket may go into debt) -> 429
   ``tenant_token_rate_limited``;
4. a global slot (``admission.max_inflight``): when none is free the request waits in a bounded
   queue (:class:`Slots`), interactive turns before background subagents, and within each class
   the tenants served in proportion to their ``share`` (FIFO within a tenant); a full queue
   pushes out the newest waiter of the tenant furthest over its share; a full queue the
   newcomer's own tenant fills, an estimated wait past ``queue_timeout_s`` or a wait that reaches
   it -> 503 ``gateway_busy``.

:meth:`Admission.engine_slot` does the same for one engine (``max_inflight_per_engine``,
``max_queue_per_engine``) -> 503 ``engine_busy``. Every rejection carries ``Retry-After``:
seconds until the bucket refills for rate limits; for capacity, the estimated wait for the
tenant's next slot (its waiters and share against the queue's drain rate), at least
``admission.retry_after_s``.
Buckets are refilled lazily from the clock passed in; the tables are bounded by the number of
configured tenants and engines.

:class:`Turnstile` (``admission.starts_per_tick``) spreads a burst of arrivals over event-loop
iterations before any of them parses its body: 2,000 requests arriving at once would otherwise
each run their synchronous analysis in the same iteration (~1 ms each, seconds in all), and every
timer due meanwhile (the upstream connect timeout above all) would fire before the I/O it guards
was looked at: engines ejected for the gateway's own lag, 503s to everyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gateway.config import AdmissionConfig
from gateway.errors import Refused
from gateway.service.metrics import GatewayMetrics
from gateway.service.tenants import Tenant

INTERACTIVE, BACKGROUND = 0, 1
MAX_RETRY_AFTER_S = 60


class AdmissionRejected(Refused):
    """A request refused by admission: the tenant's limit (``own``) or capacity, with
    ``retry_after``; ``code`` names the limit."""


class _QueueFull(Exception):
    """No room in the wait queue (``pushed``: the waiter was pushed out of it by a tenant under
    its share); ``wait``: the estimated seconds until the tenant's next slot."""

    def __init__(self, wait: float | None = None, pushed: bool = False) -> None:
        super().__init__()
        self.wait = wait
        self.pushed = pushed


class _Waiting(Exception):
    """The estimated wait is past the queue's timeout, or (``over_share``) the tenant has been
    served more than its share while others wait: refused at once (``wait`` seconds)."""

    def __init__(self, wait: float, over_share: bool = False) -> None:
        super().__init__()
        self.wait = wait
        self.over_share = over_share


_RATE_WINDOW_S = 30.0
_RATE_SAMPLES = 512
_CLASSES = 4  # internal classes: booked interactive, interactive, booked background, background
_EARLY_S = 0.5  # a booked retry may come this much before its time
_SHARE_WINDOW_S = 10.0  # the tenants' recent grants, against their shares


def _cls(priority: int, booked: bool) -> int:
    return 2 * priority + (0 if booked else 1)


def _rate(times: deque[float], now: float) -> float | None:
    """Events per second over the last 30 s of ``times``; None until 8 were seen."""
    while times and now - times[0] > _RATE_WINDOW_S:
        times.popleft()
    if len(times) < 8:
        return None
    span = now - times[0]
    return len(times) / span if span > 0 else None


class Slots:
    """A counting semaphore whose waiters form a bounded queue with two classes and weighted
    fair shares between tenants, and whose refusals book the retry they announce.

    - A freed slot goes to an interactive request before a background one, and within each
      class to a booked retry (below) first; then to the tenant with the least weighted service
      so far (start-time fair queueing: each grant advances the tenant's virtual time by
      ``1 / share``; a tenant that starts waiting starts at the current virtual time, so idle
      time earns no credit), FIFO within a tenant. A slot is handed over directly, so a
      newcomer never overtakes a waiter.
    - A full queue pushes out the newest unbooked waiter of the tenant furthest over its share
      of the waiters (background waiters first for an interactive newcomer); the newcomer is
      refused only when its own tenant holds the most.
    - The drain rate (slots freed per second over the last 30 s) gives each refusal its
      estimated wait, and a newcomer whose estimated wait is past the timeout is refused at once
      rather than after waiting it out.
    - A refusal of a request with a key (its tenant and session) books a time for its retry
      (:meth:`book`): each tenant's bookings in a class are spaced by its share of the rate that
      class is served at (the drain rate for interactive requests, which go first; the rate
      background ones were granted lately for those), so a refused client told
      ``Retry-After: N`` that comes back then is queued before its class's unbooked waiters, and
      unbooked newcomers count the bookings due ahead of them. The booking table is bounded
      (``max_bookings``, oldest dropped) and a booking not used within ``grace_s`` of its time
      lapses.
    """

    def __init__(
        self,
        limit: int,
        max_waiters: int,
        clock: Callable[[], float] = time.monotonic,
        max_bookings: int | None = None,
        grace_s: float = 5.0,
        on_booking: Callable[[str], None] | None = None,
    ) -> None:
        self.limit = limit
        self.max_waiters = max_waiters
        self.clock = clock
        self.max_bookings = max_bookings if max_bookings is not None else 4096
        self.grace_s = grace_s
        self.used = 0
        self.waiting = 0
        self.pushed_out = 0
        """Waiters pushed out of a full queue by a tenant under its share (a counter)."""
        self.bookings_kept = 0
        """Booked retries that came back in time and were queued first (a counter)."""
        self.on_booking = on_booking
        """Told each booking's outcome: booked, kept, missed (refused again), lapsed."""
        self._queues: tuple[dict[str, deque[asyncio.Future[None]]], ...] = tuple({} for _ in range(_CLASSES))
        self._shares: dict[str, float] = {}
        # per class: the tenants' virtual finish times (bounded by the tenants seen) and the
        # class's virtual time (the start of the last grant)
        self._finish: tuple[dict[str, float], ...] = tuple({} for _ in range(_CLASSES))
        self._vtime = [0.0] * _CLASSES
        self._freed: deque[float] = deque(maxlen=_RATE_SAMPLES)
        self._background: deque[float] = deque(maxlen=_RATE_SAMPLES)  # grants to background requests
        # key -> (when its retry may come, its priority, its tenant, the spacing it took)
        self._booked: dict[str, tuple[float, int, str, float]] = {}
        self._horizon: dict[tuple[str, int], float] = {}  # (tenant, priority) -> next free booking time
        self._recent: dict[str, deque[float]] = {}  # tenant -> its grants lately (bounded per tenant)

    # -- reading -------------------------------------------------------------------------------
    def drain_rate(self) -> float | None:
        """Slots freed per second lately; None until enough were seen."""
        return _rate(self._freed, self.clock())

    @property
    def bookings(self) -> int:
        return len(self._booked)

    def estimated_wait(
        self, priority: int, tenant: str = "", share: float = 1.0, within: float = 0.0
    ) -> float | None:
        """Seconds until a new unbooked waiter of ``tenant`` in class ``priority`` would get a
        slot, from the waiters ahead of it (its tenant's share of its class), the bookings of
        its class or above due within ``within`` s and the drain rate."""
        rate = self.drain_rate()
        if rate is None:
            return None
        cls = _cls(priority, False)
        ahead = float(sum(sum(len(q) for q in self._queues[c].values()) for c in range(cls)))
        if within > 0 and self._booked:
            due = self.clock() + within
            ahead += self._due(due, priority)
        queue = self._queues[cls]
        mine = len(queue.get(tenant, ())) + 1
        total = share + sum(self._shares.get(t, 1.0) for t in queue if t != tenant)
        others = sum(len(q) for t, q in queue.items() if t != tenant)
        ahead += min(others, mine * (total - share) / share) + mine
        return ahead / rate

    # -- taking and giving back ----------------------------------------------------------------
    async def acquire(
        self, priority: int, timeout: float, tenant: str = "", share: float = 1.0, key: str | None = None
    ) -> None:
        """Take a slot, waiting up to ``timeout`` s. Raises _QueueFull, _Waiting or TimeoutError.
        ``key``: the request's booking key (a booked retry is queued before its class)."""
        booked = key is not None and bool(self._booked) and self._use_booking(key)
        cls = _cls(priority, booked)
        if booked:
            self.bookings_kept += 1
            self._tell("kept")
            if self.used < self.limit and not any(self._queues[c] for c in range(cls + 1)):
                self._grant(priority, tenant)
                return
        elif self.contended(timeout) and self._over_share(tenant, share):
            raise _Waiting(self.estimated_wait(priority, tenant, share, timeout) or 0.0, over_share=True)
        elif self.used < self.limit and self.waiting == 0:
            self._grant(priority, tenant)
            return
        else:
            wait = self.estimated_wait(priority, tenant, share, timeout)
            if wait is not None and wait > timeout:
                raise _Waiting(wait)
            if self._unbooked_waiting() >= self.max_waiters and not self._push_out(cls, tenant, share):
                raise _QueueFull(wait)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queues = self._queues[cls]
        queue = queues.get(tenant)
        if queue is None:
            queue = queues[tenant] = deque()
            finish = self._finish[cls]
            finish[tenant] = max(finish.get(tenant, 0.0), self._vtime[cls])
        queue.append(fut)
        self._shares[tenant] = share
        self.waiting += 1
        try:
            async with asyncio.timeout(timeout):
                await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()  # handed a slot just as the wait ended: pass it on
            elif not fut.done() or fut.cancelled():
                fut.cancel()
                self._drop(cls, tenant, fut)
            if booked:
                self._tell("missed")
            raise

    def release(self) -> None:
        now = self.clock()
        self._freed.append(now)
        for cls in range(_CLASSES):
            queues = self._queues[cls]
            while queues:
                finish = self._finish[cls]
                tenant = min(queues, key=lambda t: finish[t])
                queue = queues[tenant]
                fut = queue.popleft()
                self.waiting -= 1
                if not queue:
                    del queues[tenant]
                if fut.done():
                    continue
                start = finish[tenant]
                self._vtime[cls] = start
                finish[tenant] = start + 1.0 / self._shares.get(tenant, 1.0)
                if cls >= 2:
                    self._background.append(now)
                self._served(tenant, now)
                fut.set_result(None)  # the slot changes hands; ``used`` stays
                return
        self.used -= 1

    def book(
        self, key: str | None, tenant: str, share: float, wait: float | None, priority: int = 0
    ) -> float | None:
        """Book a time for the retry of a refused request (``key``: its tenant and session):
        the later of its estimated ``wait`` and its tenant's next free booking time in its
        class, each tenant's bookings spaced by its share of the rate the class is served at.
        Returns the seconds until it (``retry-after-ms``; ``Retry-After`` rounds it up to whole
        seconds, and a retry then is still in time), or ``wait`` when nothing can be booked (no
        key, no rate yet; a background request while none is served: at least until the
        interactive bookings are)."""
        now = self.clock()
        self._lapse(now)
        rate = self.drain_rate() if priority == 0 else _rate(self._background, now)
        if priority and rate is None:
            # background requests are not being served (interactive ones take every slot):
            # nothing to book by; not before the interactive bookings made so far are served
            ahead = [h for (_, p), h in self._horizon.items() if p == 0 and h > now]
            return max(wait or 0.0, max(ahead, default=now) - now) if ahead else wait
        if key is None or rate is None or self.max_bookings == 0:
            return wait
        held = self._booked.get(key)
        if held is not None and held[0] > now:
            return held[0] - now  # came back early: its booking stands
        horizon = self._horizon
        for k in [k for k, h in horizon.items() if h <= now]:
            del horizon[k]  # bounded by the tenants with bookings ahead
        active = share + sum(self._shares.get(t, 1.0) for t, p in horizon if p == priority and t != tenant)
        spacing = active / (share * rate)
        at = max(now + (wait or 0.0), horizon.get((tenant, priority), now))
        horizon[(tenant, priority)] = at + spacing
        self._shares[tenant] = share
        if key in self._booked:
            self._unbook(key, now)
        self._booked[key] = (at, priority, tenant, spacing)
        self._tell("booked")
        while len(self._booked) > self.max_bookings:
            self._unbook(next(iter(self._booked)), now)
            self._tell("lapsed")
        return at - now

    # -- internals -----------------------------------------------------------------------------
    def contended(self, within: float) -> bool:
        """Are requests waiting, or are the free slots no more than the booked retries due
        within ``within`` s (so a newcomer would take one a booked retry needs)?"""
        if self.waiting > 0:
            return True
        free = self.limit - self.used
        return bool(self._booked) and self._due(self.clock() + within, 1, stop=free) >= free

    def _due(self, until: float, priority: int, stop: int | None = None) -> int:
        """Booked retries of ``priority`` or above due by ``until`` and not lapsed (counting
        stops at ``stop``)."""
        start = self.clock() - self.grace_s
        n = 0
        for at, p, _, _ in self._booked.values():
            if p <= priority and start <= at <= until:
                n += 1
                if stop is not None and n >= stop:
                    break
        return n

    def _unbook(self, key: str, now: float) -> None:
        """Drop ``key``'s booking unused: its tenant's later bookings need not wait for it."""
        _, priority, tenant, spacing = self._booked.pop(key)
        h = self._horizon.get((tenant, priority))
        if h is not None:
            self._horizon[(tenant, priority)] = max(now, h - spacing)

    def _grant(self, priority: int, tenant: str) -> None:
        self.used += 1
        now = self.clock()
        if priority:
            self._background.append(now)
        self._served(tenant, now)

    def _served(self, tenant: str, now: float) -> None:
        recent = self._recent.get(tenant)
        if recent is None:
            recent = self._recent[tenant] = deque(maxlen=_RATE_SAMPLES)
        recent.append(now)

    def _over_share(self, tenant: str, share: float) -> bool:
        """Has ``tenant`` had more than its share of the grants of the last 10 s, among the
        tenants served or booked in that time?"""
        now = self.clock()
        counts: dict[str, int] = {}
        for t, times in self._recent.items():
            while times and now - times[0] > _SHARE_WINDOW_S:
                times.popleft()
            if times:
                counts[t] = len(times)
        total = sum(counts.values())
        if total < 8 or tenant not in counts:
            return False
        active = set(counts) | {t for (t, _) in self._horizon}
        shares = share + sum(self._shares.get(t, 1.0) for t in active if t != tenant)
        return counts[tenant] / total > share / shares

    def _drop(self, cls: int, tenant: str, fut: asyncio.Future[None]) -> None:
        queues = self._queues[cls]
        queue = queues.get(tenant)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(fut)
            self.waiting -= 1
        if not queue:
            del queues[tenant]

    def _unbooked_waiting(self) -> int:
        return sum(len(q) for c in (1, 3) for q in self._queues[c].values())

    def _use_booking(self, key: str) -> bool:
        """Take ``key``'s booking when it has one and it is due (not early, not lapsed)."""
        held = self._booked.get(key)
        if held is None:
            return False
        now = self.clock()
        if now < held[0] - _EARLY_S:
            return False  # came back before it was told to: not the booked retry
        if now > held[0] + self.grace_s:
            self._unbook(key, now)
            self._tell("lapsed")
            return False
        del self._booked[key]
        return True

    def _lapse(self, now: float) -> None:
        """Drop the bookings whose retry did not come back in time, among the oldest 64 (each
        refusal looks again, so they all go)."""
        late = [k for k, b in itertools.islice(self._booked.items(), 64) if now > b[0] + self.grace_s]
        for key in late:
            self._unbook(key, now)
            self._tell("lapsed")

    def _tell(self, outcome: str) -> None:
        if self.on_booking is not None:
            self.on_booking(outcome)

    def _push_out(self, newcomer: int, tenant: str, share: float) -> bool:
        """Make room for an unbooked newcomer of class ``newcomer`` in a full queue: the newest
        unbooked waiter of the tenant furthest over its share (of the background class first,
        for an interactive newcomer). False when no one holds more than the newcomer's tenant
        would."""
        mine = (len(self._queues[newcomer].get(tenant, ())) + 1) / share
        for cls in (3, 1) if newcomer == 1 else (3,):
            queues = self._queues[cls]
            if not queues:
                continue
            victim = max(queues, key=lambda t: len(queues[t]) / self._shares.get(t, 1.0))
            over = len(queues[victim]) / self._shares.get(victim, 1.0)
            if cls == newcomer and (victim == tenant or over <= mine):
                return False
            fut = queues[victim].pop()
            self.waiting -= 1
            if not queues[victim]:
                del queues[victim]
            self.pushed_out += 1
            if not fut.done():
                fut.set_exception(_QueueFull(pushed=True))
            return True
        return False


class Turnstile:
    """Lets at most ``per_tick`` callers of :meth:`enter` through per event-loop iteration; the
    others wait, FIFO, for the next iterations. Nothing is held after ``enter`` returns, so a
    request waiting on an analysis worker or an engine blocks nobody. Costs nothing while fewer
    than ``per_tick`` arrive in one iteration."""

    def __init__(self, per_tick: int) -> None:
        self.per_tick = per_tick
        self.passed = 0
        """Callers let through in the current iteration."""
        self.deferred = 0
        """Callers that had to wait for a later iteration (a counter, for tests and metrics)."""
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._tick_armed = False

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def enter(self) -> None:
        if self.passed < self.per_tick and not self._waiters:
            self.passed += 1
            self._arm()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.deferred += 1
        self._arm()
        try:
            await fut
        except BaseException:
            if not fut.done():
                fut.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(fut)
            raise

    def _arm(self) -> None:
        """Reset the count at the start of the next iteration (a ``call_soon`` runs then)."""
        if not self._tick_armed:
            self._tick_armed = True
            asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self._tick_armed = False
        self.passed = 0
        # the ones woken now run in the following iteration: count them against it
        while self._waiters and self.passed < self.per_tick:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self.passed += 1
        if self._waiters or self.passed:
            self._arm()


@dataclass(slots=True)
class Bucket:
    """A token bucket: ``rate`` per second up to ``capacity``; may go into debt."""

    rate: float
    capacity: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self.at) * self.rate)
        self.at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` (capped at the capacity) is available; 0 when it is now."""
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 1e-9 else need / self.rate


@dataclass(slots=True)
class _TenantState:
    inflight: int = 0
    requests: Bucket | None = None
    tokens: Bucket | None = None
    admitted: int = 0
    rejected: int = 0


@dataclass(slots=True)
class TenantPass:
    """A request counted against its tenant's limits (:meth:`Admission.enter`) until
    :meth:`leave`: its concurrency, its request, and ``tokens`` estimated tokens."""

    tenant: Tenant
    state: _TenantState
    tokens: int
    left: bool = False

    def leave(self) -> None:
        """The request is over (idempotent)."""
        if not self.left:
            self.left = True
            self.state.inflight -= 1


@dataclass(slots=True)
class Ticket:
    """An admitted request (what :meth:`Admission.admit` yields)."""

    tenant: str
    interactive: bool
    waited: bool = False


@dataclass(slots=True)
class AdmissionStats:
    admitted: int = 0
    queued: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


class Admission:
    """Owns the global, per-tenant and per-engine limits (one per app, on its lifespan)."""

    def __init__(
        self,
        config: AdmissionConfig,
        clock: Callable[[], float] = time.monotonic,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics
        self.global_slots = Slots(
            config.max_inflight, config.max_queue, clock, config.max_retry_bookings, on_booking=self._booking
        )
        self.turnstile = Turnstile(config.starts_per_tick)
        self.engines: dict[str, Slots] = {}
        self.tenants: dict[str, _TenantState] = {}
        self.stats = AdmissionStats()

    # -- reading -------------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return self.global_slots.used

    @property
    def waiting(self) -> int:
        return self.global_slots.waiting

    def tenant_inflight(self, tenant: Tenant) -> int:
        s = self.tenants.get(tenant.name)
        return s.inflight if s else 0

    # -- admitting -----------------------------------------------------------------------------
    def enter(self, tenant: Tenant, tokens: int = 0) -> TenantPass:
        """Count a request against its tenant's limits before its body is read: its concurrency
        (held until :meth:`TenantPass.leave`), its request, ``tokens`` estimated tokens. Raises
        AdmissionRejected (429) past one of them."""
        ts = self._tenant(tenant)
        self._check_tenant(tenant, ts, tokens)
        ts.inflight += 1
        return TenantPass(tenant, ts, tokens)

    def enter_body(self, tenant: Tenant, declared_bytes: int | None) -> TenantPass:
        """:meth:`enter` with the tokens estimated from the body's declared length (4 bytes a
        token; none when no length is declared), settled once the body is analysed."""
        return self.enter(tenant, (declared_bytes or 0) // 4)

    def settle(self, entered: TenantPass, tokens: int) -> None:
        """The request's tokens are known (analysed): debit the difference from the estimate
        (a refund when it was lower; never a rejection now)."""
        bucket = entered.state.tokens
        if bucket is not None and tokens != entered.tokens:
            bucket.refill(self.clock())
            bucket.level = min(bucket.capacity, bucket.level - (tokens - entered.tokens))
        entered.tokens = tokens

    @contextlib.asynccontextmanager
    async def admit(
        self,
        tenant: Tenant,
        interactive: bool = True,
        tokens: int = 0,
        entered: TenantPass | None = None,
        key: str | None = None,
    ) -> AsyncIterator[Ticket]:
        """Hold a global slot for the body of the ``async with`` (raises AdmissionRejected).
        ``entered``: the request already passed its tenant's checks (:meth:`enter`); its
        estimate is settled with ``tokens``. Else they are made here. ``key``: what identifies
        the request's retry (its session): a refusal books the time its ``Retry-After`` names."""
        own = entered is None
        if entered is None:
            entered = self.enter(tenant, tokens)
        else:
            self.settle(entered, tokens)
        ticket = Ticket(tenant.name, interactive)
        try:
            ticket.waited = await self._acquire(
                self.global_slots, interactive, "gateway_busy", "the gateway", tenant, key
            )
            entered.state.admitted += 1
            self.stats.admitted += 1
            try:
                yield ticket
            finally:
                self.global_slots.release()
                self._gauge()
        finally:
            if own:
                entered.leave()

    @contextlib.asynccontextmanager
    async def engine_slot(
        self, engine: str, interactive: bool = True, tenant: Tenant | None = None
    ) -> AsyncIterator[None]:
        """Hold one of ``engine``'s in-flight slots (raises AdmissionRejected 503 ``engine_busy``);
        ``tenant``: whose share of the engine's queue the request waits in."""
        slots = self.engines.get(engine)
        if slots is None:
            slots = self.engines[engine] = Slots(
                self.config.max_inflight_per_engine, self.config.max_queue_per_engine, self.clock
            )
        await self._acquire(slots, interactive, "engine_busy", f"engine '{engine}'", tenant)
        try:
            yield
        finally:
            slots.release()

    def engine_has_room(self, engine: str) -> bool:
        """Would :meth:`engine_slot` be granted without waiting? (for routing around busy engines)"""
        s = self.engines.get(engine)
        return s is None or (s.used < s.limit and s.waiting == 0)

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """Debit tokens learnt after admission (completion tokens) from the tenant's bucket."""
        ts = self.tenants.get(tenant.name)
        if ts is not None and ts.tokens is not None and tokens > 0:
            ts.tokens.refill(self.clock())
            ts.tokens.level -= tokens

    # -- internals -----------------------------------------------------------------------------
    def _tenant(self, tenant: Tenant) -> _TenantState:
        ts = self.tenants.get(tenant.name)
        if ts is None:
            now = self.clock()
            ts = self.tenants[tenant.name] = _TenantState(
                requests=_bucket(tenant.requests_per_s, tenant.burst_s, now),
                tokens=_bucket(tenant.tokens_per_s, tenant.burst_s, now),
            )
        return ts

    def _check_tenant(self, tenant: Tenant, ts: _TenantState, tokens: int) -> None:
        if tenant.max_concurrent is not None and ts.inflight >= tenant.max_concurrent:
            self._reject(
                ts,
                "tenant_concurrency",
                f"too many concurrent requests for this API key (limit {tenant.max_concurrent})",
                self.config.retry_after_s,
            )
        now = self.clock()
        for bucket, amount, code, what in (
            (ts.requests, 1.0, "tenant_rate_limited", "requests"),
            (ts.tokens, float(tokens), "tenant_token_rate_limited", "tokens"),
        ):
            if bucket is None:
                continue
            bucket.refill(now)
            wait = bucket.wait_for(amount)
            if wait > 0:
                self._reject(
                    ts,
                    code,
                    f"rate limit reached for {what} per second ({bucket.rate:g}/s)",
                    max(1, math.ceil(wait)),
                )
        if ts.requests is not None:
            ts.requests.level -= 1.0
        if ts.tokens is not None:
            ts.tokens.level -= tokens

    async def _acquire(
        self,
        slots: Slots,
        interactive: bool,
        code: str,
        what: str,
        tenant: Tenant | None = None,
        key: str | None = None,
    ) -> bool:
        queued = not (slots.used < slots.limit and slots.waiting == 0)
        if queued and slots.waiting < slots.max_waiters:
            self.stats.queued += 1
        priority = INTERACTIVE if interactive else BACKGROUND
        name, share = (tenant.name, tenant.share) if tenant is not None else ("", 1.0)
        timeout = self.config.queue_timeout_s
        if key is not None:
            key = f"{name}\0{key}"
        try:
            await slots.acquire(priority, timeout, name, share, key)
        except _Waiting as exc:
            self._reject(
                None,
                code,
                f"{what} is at capacity and this tenant has had more than its share of it lately"
                if exc.over_share
                else f"{what} is at capacity (estimated wait {exc.wait:.1f} s, past {timeout:g} s)",
                self._retry_after(slots.book(key, name, share, exc.wait, priority)),
            )
        except _QueueFull as exc:
            why = (
                "its wait queue is full of requests of tenants under their share"
                if exc.pushed
                else ("its wait queue is full")
            )
            wait = exc.wait if exc.wait is not None else slots.estimated_wait(priority, name, share, timeout)
            self._reject(
                None,
                code,
                f"{what} is at capacity and {why}",
                self._retry_after(slots.book(key, name, share, wait, priority)),
            )
        except TimeoutError:
            wait = slots.estimated_wait(priority, name, share, timeout)
            self._reject(
                None,
                code,
                f"{what} is at capacity (waited {timeout:g} s)",
                self._retry_after(slots.book(key, name, share, wait, priority)),
            )
        finally:
            self._gauge()
        return queued

    def _retry_after(self, wait: float | None) -> tuple[int, int | None]:
        """``Retry-After`` of a capacity refusal: the estimated (or booked) wait, at least
        ``retry_after_s``, and the same to the millisecond (none without an estimate)."""
        floor = self.config.retry_after_s
        if wait is None:
            return floor, None
        wait = min(max(0.0, wait), float(MAX_RETRY_AFTER_S))
        return max(floor, math.ceil(wait - 1e-6)), max(1, round(wait * 1000))

    def _reject(
        self, ts: _TenantState | None, code: str, message: str, retry_after: int | tuple[int, int | None]
    ) -> None:
        """Refuse: ``ts`` the tenant whose own limit it is (None: the gateway's capacity)."""
        retry_ms = None
        if isinstance(retry_after, tuple):
            retry_after, retry_ms = retry_after
        if ts is not None:
            ts.rejected += 1
        self.stats.rejected[code] = self.stats.rejected.get(code, 0) + 1
        if self.metrics is not None:
            self.metrics.admission_rejections.labels(code).inc()
        raise AdmissionRejected(message, code, retry_after, own=ts is not None, retry_after_ms=retry_ms)

    def _booking(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.admission_retries.labels(outcome).inc()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.admission_waiting.set(self.global_slots.waiting)
            self.metrics.admission_inflight.set(self.global_slots.used)


def _bucket(rate: float | None, burst_s: float, now: float) -> Bucket | None:
    if rate is None:
        return None
    capacity = max(1.0, rate * burst_s)
    return Bucket(rate=rate, capacity=capacity, level=capacity, at=now)
