"""The role driver: ticks the pure role controller (:mod:`gateway.core.roles`) on a timer and
applies its changes to the cluster's engines.

Every ``routing.role_interval_s`` it reads each engine's view (prefill backlog and decoding from
the gateway's load ledger, KV usage from the scrape; unhealthy engines left out), passes the
monotonic clock to :meth:`RoleController.step` and sets the role of the engine it moves (at most
one per tick; the pool name stays, so metrics keep their labels). Off unless
``routing.role_controller`` is set; only ``first_turn`` and ``warm`` engines take part (``any``
engines serve both already).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.config import RoutingConfig
from gateway.core.roles import EngineLoad, RoleChange, RoleController, RoleParams
from gateway.core.types import PoolRole
from gateway.service.cluster import Cluster
from gateway.service.tasks import cancel_and_wait

__all__ = ["RoleDriver", "role_params"]

log = logging.getLogger("agentgw.roles")


def role_params(cfg: RoutingConfig) -> RoleParams:
    return RoleParams(
        backlog_tokens_per_engine=cfg.role_backlog_tokens_per_engine,
        min_dwell_s=cfg.role_min_dwell_s,
        interval_s=cfg.role_interval_s,
    )


class RoleDriver:
    def __init__(
        self, cluster: Cluster, params: RoleParams, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cluster = cluster
        self.params = params
        self.clock = clock
        roles = {n: s.role for n, s in cluster.engines.items() if s.role != PoolRole.ANY}
        self.controller = RoleController(params, roles, clock())
        self.changes = 0
        self._task: asyncio.Task[None] | None = None

    def tick(self) -> tuple[RoleChange, ...]:
        """One controller step on the current views; applies and returns its changes."""
        roles = self.controller.roles
        loads = [
            EngineLoad(v.name, v.prefill_backlog_tokens, v.decoding, v.kv_usage)
            for v in self.cluster.views()
            if v.name in roles and v.healthy
        ]
        changes = self.controller.step(self.clock(), loads)
        for ch in changes:
            self.cluster.set_role(ch.engine, ch.role)
            self.changes += 1
            log.info("engine %s is now %s (first-turn demand %.2f)", ch.engine, ch.role, ch.demand)
        return changes

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.params.interval_s)
            try:
                self.tick()
            except Exception:  # a tick must never kill the loop; the next one retries
                log.exception("role controller tick failed")

    def start(self) -> None:
        if len(self.controller.roles) >= 2:
            self._task = asyncio.create_task(self._loop(), name="roles")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
