"""The engine registry: configured engines, their health and their load, kept fresh by tasks.

Active health: every ``health_interval_s`` each engine's ``/health`` is probed; after
``eject_after_failures`` consecutive failures it is ejected (routing skips it), after
``readmit_after_successes`` consecutive successes it is re-admitted. Passive health: a connection
failure seen by the proxy counts as a failed probe. Load: ``/metrics`` is scraped every
``metrics_interval_s`` for ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc``; the gateway's own in-flight count is kept exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import httpx

from gateway.config import EngineConfig, GatewayConfig
from gateway.core.types import EngineView, PoolRole

log = logging.getLogger("agentgw.cluster")

_GAUGES = {
    b"vllm:num_requests_running": "running",
    b"vllm:num_requests_waiting": "waiting",
    b"vllm:kv_cache_usage_perc": "kv_usage",
}


@dataclass(slots=True)
class EngineState:
    config: EngineConfig
    pool: str
    role: PoolRole
    healthy: bool = True
    failures: int = 0
    successes: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    inflight: int = 0
    capacity_blocks: int = 0
    models: frozenset[str] = field(default_factory=frozenset)

    @property
    def name(self) -> str:
        return self.config.name

    def view(self) -> EngineView:
        return EngineView(
            name=self.config.name,
            pool=self.pool,
            role=self.role,
            models=self.models,
            healthy=self.healthy,
            running=self.running,
            waiting=self.waiting,
            kv_usage=self.kv_usage,
            inflight=self.inflight,
            capacity_blocks=self.capacity_blocks,
        )


def parse_vllm_gauges(text: bytes) -> dict[str, float]:
    """Sum the load gauges over label sets (one engine may report per-model series); read the
    device KV capacity in blocks from ``vllm:cache_config_info``'s ``num_gpu_blocks`` label."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(b"vllm:"):
            continue
        if line.startswith(b"vllm:cache_config_info{"):
            i = line.find(b'num_gpu_blocks="')
            if i >= 0:
                j = line.find(b'"', i + 16)
                with contextlib.suppress(ValueError):
                    out["capacity_blocks"] = float(line[i + 16 : j])
            continue
        name_end = min(i for i in (line.find(b"{"), line.find(b" ")) if i >= 0)
        key = _GAUGES.get(line[:name_end])
        if key is None:
            continue
        with contextlib.suppress(ValueError):
            out[key] = out.get(key, 0.0) + float(line.rsplit(b" ", 1)[1])
    return out


class Cluster:
    """Owns the engine states and the background tasks that refresh them."""

    def __init__(self, config: GatewayConfig, client: httpx.AsyncClient) -> None:
        self._config = config
        self._client = client
        self.engines: dict[str, EngineState] = {}
        for pool in config.pools:
            for e in pool.engines:
                self.engines[e.name] = EngineState(
                    config=e, pool=pool.name, role=PoolRole(pool.role), models=frozenset({e.model})
                )
        self.pools: dict[str, list[str]] = {p.name: [e.name for e in p.engines] for p in config.pools}
        self._tasks: list[asyncio.Task[None]] = []
        self._views: tuple[EngineView, ...] | None = None

    # -- reading -------------------------------------------------------------------------------
    def views(self) -> tuple[EngineView, ...]:
        """The routing snapshot's engine list; rebuilt only after something changed."""
        if self._views is None:
            self._views = tuple(s.view() for s in self.engines.values())
        return self._views

    def models(self) -> list[str]:
        return sorted({m for s in self.engines.values() if s.healthy for m in s.models})

    def ready(self) -> dict[str, bool]:
        """Per pool: does it have a healthy engine?"""
        return {p: any(self.engines[n].healthy for n in names) for p, names in self.pools.items()}

    # -- updating ------------------------------------------------------------------------------
    def _changed(self) -> None:
        self._views = None

    def begin(self, name: str) -> None:
        self.engines[name].inflight += 1
        self._changed()

    def end(self, name: str) -> None:
        self.engines[name].inflight -= 1
        self._changed()

    def record_probe(self, name: str, ok: bool) -> None:
        s = self.engines[name]
        limits = self._config.limits
        if ok:
            s.failures, s.successes = 0, s.successes + 1
            if not s.healthy and s.successes >= limits.readmit_after_successes:
                s.healthy = True
                log.warning("engine %s re-admitted", name)
                self._changed()
        else:
            s.successes, s.failures = 0, s.failures + 1
            if s.healthy and s.failures >= limits.eject_after_failures:
                s.healthy = False
                log.warning("engine %s ejected after %d failed probes", name, s.failures)
                self._changed()

    def record_connect_failure(self, name: str) -> None:
        """Passive health: a refused connection ejects at once (no need to wait for probes)."""
        s = self.engines[name]
        s.successes = 0
        s.failures = max(s.failures + 1, self._config.limits.eject_after_failures)
        if s.healthy:
            s.healthy = False
            log.warning("engine %s ejected after a connection failure", name)
            self._changed()

    # -- tasks ---------------------------------------------------------------------------------
    async def probe_once(self) -> None:
        await asyncio.gather(*(self._probe(s) for s in self.engines.values()))

    async def _probe(self, s: EngineState) -> None:
        try:
            r = await self._client.get(
                f"{s.config.url}/health", timeout=self._config.timeouts.health_timeout_s
            )
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        self.record_probe(s.name, ok)

    async def scrape_once(self) -> None:
        await asyncio.gather(*(self._scrape(s) for s in self.engines.values() if s.healthy))

    async def _scrape(self, s: EngineState) -> None:
        try:
            r = await self._client.get(
                f"{s.config.url}/metrics", timeout=self._config.timeouts.health_timeout_s
            )
        except httpx.HTTPError:
            return
        if r.status_code != 200:
            return
        g = parse_vllm_gauges(r.content)
        s.running = int(g.get("running", 0))
        s.waiting = int(g.get("waiting", 0))
        s.kv_usage = float(g.get("kv_usage", 0.0))
        s.capacity_blocks = int(g.get("capacity_blocks", s.capacity_blocks))
        self._changed()

    async def _loop(self, fn: str, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await getattr(self, fn)()
            except Exception:  # a refresh must never kill the loop; the next one retries
                log.exception("%s failed", fn)

    def start(self) -> None:
        t = self._config.timeouts
        self._tasks = [
            asyncio.create_task(self._loop("probe_once", t.health_interval_s), name="health"),
            asyncio.create_task(self._loop("scrape_once", t.metrics_interval_s), name="metrics"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
