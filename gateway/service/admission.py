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
   queue, interactive turns before background subagents and FIFO within each class; a full
   queue or a wait past ``queue_timeout_s`` -> 503 ``gateway_busy``.

:meth:`Admission.engine_slot` does the same for one engine (``max_inflight_per_engine``,
``max_queue_per_engine``) -> 503 ``engine_busy``. Every rejection carries ``Retry-After``
(seconds until the bucket refills for rate limits, ``admission.retry_after_s`` otherwise).
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


class AdmissionRejected(Refused):
    """A request refused by admission: the tenant's limit (``own``) or capacity, with
    ``retry_after``; ``code`` names the limit."""


class _QueueFull(Exception):
    pass


class Slots:
    """A counting semaphore whose waiters form a bounded two-class queue: a freed slot goes to
    the oldest interactive waiter, else the oldest background one (handed over directly, so a
    newcomer never overtakes a waiter)."""

    def __init__(self, limit: int, max_waiters: int) -> None:
        self.limit = limit
        self.max_waiters = max_waiters
        self.used = 0
        self._queues: tuple[deque[asyncio.Future[None]], deque[asyncio.Future[None]]] = (deque(), deque())

    @property
    def waiting(self) -> int:
        return len(self._queues[0]) + len(self._queues[1])

    async def acquire(self, priority: int, timeout: float) -> None:
        """Take a slot, waiting up to ``timeout`` s. Raises _QueueFull or TimeoutError."""
        if self.used < self.limit and self.waiting == 0:
            self.used += 1
            return
        if self.waiting >= self.max_waiters:
            raise _QueueFull
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._queues[priority]
        queue.append(fut)
        try:
            async with asyncio.timeout(timeout):
                await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release()  # handed a slot just as the wait ended: pass it on
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    queue.remove(fut)
            raise

    def release(self) -> None:
        for queue in self._queues:
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)  # the slot changes hands; ``used`` stays
                    return
        self.used -= 1


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
        self.global_slots = Slots(config.max_inflight, config.max_queue)
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
    ) -> AsyncIterator[Ticket]:
        """Hold a global slot for the body of the ``async with`` (raises AdmissionRejected).
        ``entered``: the request already passed its tenant's checks (:meth:`enter`); its
        estimate is settled with ``tokens``. Else they are made here."""
        own = entered is None
        if entered is None:
            entered = self.enter(tenant, tokens)
        else:
            self.settle(entered, tokens)
        ticket = Ticket(tenant.name, interactive)
        try:
            ticket.waited = await self._acquire(self.global_slots, interactive, "gateway_busy", "the gateway")
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
    async def engine_slot(self, engine: str, interactive: bool = True) -> AsyncIterator[None]:
        """Hold one of ``engine``'s in-flight slots (raises AdmissionRejected 503 ``engine_busy``)."""
        slots = self.engines.get(engine)
        if slots is None:
            slots = self.engines[engine] = Slots(
                self.config.max_inflight_per_engine, self.config.max_queue_per_engine
            )
        await self._acquire(slots, interactive, "engine_busy", f"engine '{engine}'")
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

    async def _acquire(self, slots: Slots, interactive: bool, code: str, what: str) -> bool:
        queued = not (slots.used < slots.limit and slots.waiting == 0)
        if queued and slots.waiting < slots.max_waiters:
            self.stats.queued += 1
        try:
            await slots.acquire(INTERACTIVE if interactive else BACKGROUND, self.config.queue_timeout_s)
        except _QueueFull:
            self._reject(
                None,
                code,
                f"{what} is at capacity and its wait queue is full",
                self.config.retry_after_s,
            )
        except TimeoutError:
            self._reject(
                None,
                code,
                f"{what} is at capacity (waited {self.config.queue_timeout_s:g} s)",
                self.config.retry_after_s,
            )
        finally:
            self._gauge()
        return queued

    def _reject(self, ts: _TenantState | None, code: str, message: str, retry_after: int) -> None:
        """Refuse: ``ts`` the tenant whose own limit it is (None: the gateway's capacity)."""
        if ts is not None:
            ts.rejected += 1
        self.stats.rejected[code] = self.stats.rejected.get(code, 0) + 1
        if self.metrics is not None:
            self.metrics.admission_rejections.labels(code).inc()
        raise AdmissionRejected(message, code, retry_after, own=ts is not None)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.admission_waiting.set(self.global_slots.waiting)
            self.metrics.admission_inflight.set(self.global_slots.used)


def _bucket(rate: float | None, burst_s: float, now: float) -> Bucket | None:
    if rate is None:
        return None
    capacity = max(1.0, rate * burst_s)
    return Bucket(rate=rate, capacity=capacity, level=capacity, at=now)
