"""Executes the planner's inter-turn actions through engine_ext's control API.

After each completed turn the service asks :func:`~gateway.core.planner.plan_after_turn` what to
do, then this executor carries it out in the background: ``move`` and ``replicate`` prefetch the
session's prefix (its token ids) onto the targets (``POST /v1/kv/prefetch``: the target loads the
KV from Mooncake / its host tier through vLLM's own connector path), ``stay`` and ``demote`` pin it
(``POST /v1/kv/pin``), ``release`` unpins. A move changes the session's home only once the
prefetch is done, so the next turn never waits on a migration: until then it goes where the
prefix is. A new placement or the session's end cancels what is pending. Concurrent prefetches
are capped per target engine.

Engines with ``kv_hints`` read the turn's pin or release from the turn's own request (a KV hint
envelope action: :mod:`gateway.core.kv_hints`), applied by engine_ext as the same control call;
a migration ``carried`` that way sends no pin (``stay``, ``demote``, ``replicate``'s source) and
no unpin (``release``) of its own.

``current`` holds each live session's latest migration: the running one, else the last finished
one (the session API shows it; the next turn reads how a completed move served). A finished one
leaves when its session is gone (ended or expired: so the release after a session's end does not
stay), when the next turn or a new plan replaces it, or when more than ``MAX_FINISHED`` finished
ones are kept (oldest first). ``recent`` keeps the last ``MAX_RECENT`` finished ones.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from gateway.config import MigrationConfig
from gateway.core.planner import ActionKind, PlanAction
from gateway.core.sessions import SessionRecord
from gateway.service.cluster import Cluster
from gateway.service.metrics import GatewayMetrics
from gateway.service.session_store import SessionStore

log = logging.getLogger("agentgw.migrations")

MAX_RECENT = 1024
MAX_FINISHED = 4096  # finished migrations kept in `current` for their live sessions


@dataclass(slots=True)
class Migration:
    action: PlanAction
    started: float
    state: str = "running"
    ready: dict[str, float] = field(default_factory=dict)
    """target -> seconds from start until its prefetch completed."""
    error: str | None = None
    carried: bool = False
    """The source's pin or release rode on the turn's request (a KV hint envelope): not sent."""

    def to_dict(self) -> dict[str, object]:
        a = self.action
        return {
            "kind": a.kind.value,
            "reason": a.reason,
            "source": a.source,
            "targets": list(a.targets),
            "pin_ttl_s": a.pin_ttl_s,
            "state": self.state,
            "ready_s": self.ready,
            "error": self.error,
            "carried": self.carried,
        }


class MigrationExecutor:
    def __init__(
        self,
        config: MigrationConfig,
        client: httpx.AsyncClient,
        cluster: Cluster,
        sessions: SessionStore,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.params = config.params()
        self.client = client
        self.cluster = cluster
        self.sessions = sessions
        self.metrics = metrics
        self.clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._sems: dict[str, asyncio.Semaphore] = {}
        self.current: dict[str, Migration] = {}
        self._finished: dict[str, None] = {}  # sessions whose `current` entry has finished, oldest first
        self.recent: deque[Migration] = deque(maxlen=MAX_RECENT)
        self.on_rehome: Callable[[str, str], None] | None = None
        """Called with (session, target) when a completed move re-homed a session (the routing
        core's homes follow it)."""
        self.on_move_end: Callable[[str], None] | None = None
        """Called with the session when its migration ends (done, failed or cancelled: the routing
        core's move bounds are freed)."""

    def controllable(self, engine: str) -> bool:
        s = self.cluster.engines.get(engine)
        return bool(self.config.enabled and s is not None and s.config.control_url)

    def carries_hints(self, engine: str) -> bool:
        """A turn's pin or release rides on its request to ``engine`` (a KV hint envelope)."""
        s = self.cluster.engines.get(engine)
        return self.controllable(engine) and s is not None and s.config.kv_hints

    # -- scheduling ----------------------------------------------------------------------------
    def submit(
        self, action: PlanAction, token_ids: list[int] | None, carried: bool = False
    ) -> Migration | None:
        """Start carrying out ``action`` in the background (cancelling the session's pending one).
        ``carried``: the turn's request carried the source's pin or release (not sent again)."""
        self.cancel(action.session_id, reason="new_plan")
        engines = (action.source, *action.targets)
        if not all(self.controllable(e) for e in engines):
            return None
        if action.kind in (ActionKind.MOVE, ActionKind.REPLICATE) and not token_ids:
            return None
        sid = action.session_id
        m = Migration(action, self.clock(), carried=carried)
        self.current[sid] = m
        self.metrics.migrations.labels(action.kind.value, "started").inc()
        self._count_move(action, "started")
        task = asyncio.create_task(self._run(m, token_ids or []), name=f"migration-{sid}")
        self._tasks[sid] = task
        task.add_done_callback(functools.partial(self._forget_task, sid))
        return m

    def _count_move(self, action: PlanAction, outcome: str) -> None:
        """``agentgw_moves_total``: moves only, by the planner's reason."""
        if action.kind == ActionKind.MOVE:
            self.metrics.moves.labels(action.reason, outcome).inc()

    def _forget_task(self, session_id: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(session_id) is task:  # not a newer migration of the same session
            del self._tasks[session_id]

    def cancel(self, session_id: str, reason: str = "cancelled") -> bool:
        """Cancel the session's running migration (True if there was one) and drop its entry."""
        task = self._tasks.pop(session_id, None)
        m = self.current.pop(session_id, None)
        self._finished.pop(session_id, None)
        if task is None or task.done():
            return False
        task.cancel()
        if self.on_move_end is not None:
            self.on_move_end(session_id)
        if m is not None and m.state == "running":
            m.state = "cancelled"
            m.error = reason
            self.metrics.migrations.labels(m.action.kind.value, "cancelled").inc()
            self._count_move(m.action, f"cancelled_{reason}")
            self.recent.append(m)
        return True

    def on_next_turn(self, session_id: str, engine: str, cached_fraction: float) -> None:
        """The session's next turn was routed: a pending migration for it is moot; record how a
        completed move served it."""
        m = self.current.get(session_id)
        self.cancel(session_id, reason="next_turn_arrived")
        if m is None:
            return
        if m.action.kind == ActionKind.MOVE and m.state == "done":
            self.metrics.moved_next_turn.labels("hit" if cached_fraction >= 0.9 else "miss").inc()
            gap = self.clock() - m.started
            for ready in m.ready.values():
                self.metrics.migration_slack.observe(gap - ready)

    async def stop(self) -> None:
        for sid in list(self._tasks):
            self.cancel(sid, reason="shutdown")
        await asyncio.sleep(0)

    # -- execution -----------------------------------------------------------------------------
    def _sem(self, engine: str) -> asyncio.Semaphore:
        sem = self._sems.get(engine)
        if sem is None:
            sem = self._sems[engine] = asyncio.Semaphore(self.config.max_per_engine)
        return sem

    async def _call(self, engine: str, path: str, body: dict[str, object]) -> dict[str, object]:
        url = self.cluster.engines[engine].config.control_url
        headers = (
            {"authorization": f"Bearer {self.config.control_token}"} if self.config.control_token else {}
        )
        r = await self.client.post(
            f"{url}{path}", json=body, headers=headers, timeout=self.config.prefetch_timeout_s
        )
        if r.status_code != 200:
            raise RuntimeError(f"{engine}{path}: HTTP {r.status_code}: {r.text[:200]}")
        out: dict[str, object] = r.json()
        return out

    async def _prefetch(self, m: Migration, target: str, token_ids: list[int]) -> None:
        a = m.action
        async with self._sem(target):
            await self._call(
                target,
                "/v1/kv/prefetch",
                {"token_ids": token_ids, "session_id": a.session_id, "pin_ttl_s": a.pin_ttl_s},
            )
        m.ready[target] = self.clock() - m.started
        self.metrics.migration_ready.observe(m.ready[target])
        self.metrics.migration_bytes.inc(len(token_ids) * self.params.kv_bytes_per_token)

    async def _run(self, m: Migration, token_ids: list[int]) -> None:
        a = m.action
        try:
            if a.kind == ActionKind.RELEASE:
                if not m.carried:
                    await self._call(a.source, "/v1/kv/unpin", {"session_id": a.session_id})
            elif a.kind in (ActionKind.STAY, ActionKind.DEMOTE):
                if not m.carried:
                    pin = {"session_id": a.session_id, "ttl_s": a.pin_ttl_s}
                    await self._call(a.source, "/v1/kv/pin", pin)
            else:
                if a.kind == ActionKind.REPLICATE and not m.carried:
                    await self._call(
                        a.source, "/v1/kv/pin", {"session_id": a.session_id, "ttl_s": a.pin_ttl_s}
                    )
                results = await asyncio.gather(
                    *(self._prefetch(m, t, token_ids) for t in a.targets), return_exceptions=True
                )
                errors = [r for r in results if isinstance(r, BaseException)]
                if errors and len(errors) == len(results):
                    raise errors[0]
                if a.kind == ActionKind.MOVE:
                    rehomed = await self._rehome(a.session_id, a.source, a.targets[0])
                    self._count_move(a, "completed" if rehomed else "stale")
            m.state = "done"
            self.metrics.migrations.labels(a.kind.value, "completed").inc()
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            m.state, m.error = "failed", repr(exc)
            self.metrics.migrations.labels(a.kind.value, "failed").inc()
            self._count_move(a, "failed")
            log.warning("migration %s of %s failed: %r", a.kind.value, a.session_id, exc)
        finally:
            if m.state not in ("running", "cancelled"):  # cancel() records a cancelled one
                self.recent.append(m)
                if self.current.get(a.session_id) is m and self.on_move_end is not None:
                    self.on_move_end(a.session_id)  # not replaced by a newer plan
        await self._settle(m)

    async def _settle(self, m: Migration) -> None:
        """A finished migration stays in ``current`` only while its session lives (bounded)."""
        sid = m.action.session_id
        if self.current.get(sid) is not m:
            return  # replaced by a newer plan
        rec = await self.sessions.get(sid, self.clock())
        if self.current.get(sid) is not m:
            return
        if rec is None or rec.ended:
            del self.current[sid]
            return
        self._finished[sid] = None
        while len(self._finished) > MAX_FINISHED:
            oldest = next(iter(self._finished))
            del self._finished[oldest]
            self.current.pop(oldest, None)

    async def _rehome(self, session_id: str, source: str, target: str) -> bool:
        """Make ``target`` the session's home; False when a newer placement (or a turn in flight)
        kept it where it is."""
        pool = self.cluster.engines[target].pool

        def rehome(rec: SessionRecord | None) -> SessionRecord | None:
            if rec is None or rec.ended or rec.home != source or rec.inflight:
                return None  # ended, or a newer placement won: leave it
            rec.home, rec.pool = target, pool
            return rec

        rec = await self.sessions.update(session_id, self.clock(), rehome)
        if rec is None or rec.home != target:
            return False
        if self.on_rehome is not None:
            self.on_rehome(session_id, target)
        return True
