"""Re-homing: when an engine is ejected, its sessions get a new home before their next turn.

The cluster calls :meth:`Rehomer.engine_ejected` when health ejects an engine (failed probes or a
refused connection). For each session this replica homed there (the routing core's
:class:`~gateway.core.turn.HomeLedger`), the core's :func:`~gateway.core.planner.plan_rehome`
picks the best healthy engine of the same pool; the session's record moves there at once (the
next turn is sticky on it), and when the gateway kept the session's token ids and both engines
run engine_ext's control API, the migration executor prefetches the prefix on the new home
(``move``, reason ``engine_down``): the KV the dead engine offloaded to the shared tier
(Mooncake) is loaded during the gap instead of recomputed at the next turn. Without a prefetch
the next turn itself finds the prefix in Mooncake through vLLM's connector lookup.

Counted in ``agentgw_sessions_rehomed_total{reason="engine_down", outcome}``: ``prefetch`` (moved,
prefetch started), ``moved`` (moved, nothing to prefetch with), ``no_target`` (the pool has no
healthy engine left; the next turn's routing decides). One pass per ejected engine at a time.
Sessions idle past the ledger's ``live_s`` are not in it; their next turn is re-homed by the
router (reason ``rehome``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from gateway.core.planner import plan_rehome
from gateway.core.sessions import SessionRecord
from gateway.service.cluster import Cluster
from gateway.service.metrics import GatewayMetrics
from gateway.service.placement import Placement

log = logging.getLogger("agentgw.rehome")

__all__ = ["Rehomer"]


def _rehome(dead: str, target: str, pool: str) -> Callable[[SessionRecord | None], SessionRecord | None]:
    def apply(r: SessionRecord | None) -> SessionRecord | None:
        if r is None or r.ended or r.home != dead:
            return None  # ended, or a newer placement already moved it
        r.home, r.pool = target, pool
        return r

    return apply


class Rehomer:
    def __init__(
        self, cluster: Cluster, placement: Placement, metrics: GatewayMetrics, clock: Callable[[], float]
    ) -> None:
        self.cluster = cluster
        self.placement = placement
        self.metrics = metrics
        self.clock = clock
        self._tasks: dict[str, asyncio.Task[int]] = {}

    def engine_ejected(self, engine: str) -> None:
        """Start re-homing ``engine``'s sessions in the background (called on the event loop)."""
        if engine in self._tasks:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # ejected outside the service's loop (a unit test of the cluster)
            return
        task = asyncio.create_task(self.rehome_from(engine), name=f"rehome-{engine}")
        self._tasks[engine] = task
        task.add_done_callback(functools.partial(self._done, engine))

    def _done(self, engine: str, task: asyncio.Task[int]) -> None:
        self._tasks.pop(engine, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("re-homing the sessions of %s failed", engine, exc_info=task.exception())

    async def rehome_from(self, dead: str) -> int:
        """Re-home every session homed on ``dead``; returns how many moved."""
        p = self.placement
        moved = 0
        for sid in p.core.homes.on_engine(dead):
            now = self.clock()
            rec = await p.sessions.get(sid, now)
            if rec is None or rec.ended or rec.home != dead:
                continue
            model = rec.model
            action = plan_rehome(
                sid,
                dead,
                rec.context_tokens,
                p.prompts.block_size(model) if model else 128,
                self.cluster.views(),
                p.session_matches(rec),
                p.migrations.params,
                gap_s=p.planner_params.gap_s(None, rec.expected_gap()),
            )
            if action is None:
                self.metrics.sessions_rehomed.labels("engine_down", "no_target").inc()
                continue
            target = action.targets[0]
            pool = self.cluster.engines[target].pool

            if await p.sessions.update(sid, now, _rehome(dead, target, pool)) is None:
                continue
            p.core.on_moved(sid, target)
            moved += 1
            tokens = p.prompts.session_tokens(sid)
            started = tokens is not None and p.migrations.submit(action, tokens) is not None
            self.metrics.sessions_rehomed.labels("engine_down", "prefetch" if started else "moved").inc()
            log.warning("session %s re-homed from %s to %s (engine down)", sid, dead, target)
        return moved

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            try:
                await task
            except asyncio.CancelledError:
                pass
