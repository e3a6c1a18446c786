"""The engine registry: configured engines, their health and their load, kept fresh by tasks.

Active health: every ``health_interval_s`` each engine's ``/health`` is probed. An engine that
has never passed a probe is *starting*: its first failed probe takes it out of routing at once
(a gateway started before its engines answers 503 ``no_healthy_engine``, with Retry-After, and
``/ready`` names what it waits for, instead of trying engines that do not answer yet: vLLM binds
its port before its engine is built, so a starting engine's probe times out rather than being
refused, and even a panicking pool leaves it out). After that, after
``eject_after_failures`` consecutive failures it is ejected (routing skips it), after
``readmit_after_successes`` consecutive successes it is re-admitted. Passive health: a connection
failure seen by the proxy counts as a failed probe.

Panic (as Envoy's panic threshold): when the fraction of a pool's engines passing probes is at
or below ``limits.panic_threshold`` (default 0: none passes), the pool is *panicking* and its
views report every engine that has answered before and did not refuse a connection as healthy, so a pool whose live
engines are merely slow to answer probes under load keeps serving instead of answering 502/503.
Engines that refused a connection (nothing listens) stay out. Every ejection calls the
``on_eject`` callbacks with the engine's name (the re-homer moves its sessions). Load:
``/metrics`` is scraped every ``metrics_interval_s`` for ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc``; the gateway's own in-flight count is kept exactly, and by phase
(:class:`gateway.core.load.InflightLoad`: sent and not yet answered, with their uncached prompt
tokens, vs past their first byte), which fills the views' ``prefill_backlog_tokens`` and
``decoding`` for the cost split and the role controller. ``set_role`` applies a role change.

Device soft pins: for engines with a ``control_url`` (engine_ext), the control server's
``GET /metrics`` (bearer ``migration.control_token``) is scraped on the same period for
``agentgw_kv_device_pinned_share``, the share of the device cache held by soft pins, which vLLM's
usage gauge counts as used; the kv_usage scorer discounts it. That scrape is its own task, each
call bounded by ``health_timeout_s`` as a whole; a failed or refused one reads as no pins (the
undiscounted gauge). Routing only reads the last values and never waits for a scrape.

Membership: :meth:`Cluster.apply_pools` takes a new pool list while the gateway runs (SIGHUP, the
admin API, a discovery file). A new engine joins unhealthy and is routed to after its first good
probe; an engine that left is out of routing at once (its sessions are re-homed through the
``on_eject`` callbacks) and its state is dropped once its requests in flight have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import httpx

from gateway.config import EngineConfig, GatewayConfig, PoolConfig
from gateway.core.load import EngineCounts, InflightLoad, Ticket, merge
from gateway.core.types import EngineView, PoolRole
from gateway.errors import Refused
from gateway.service.loop_lag import LoopLag

log = logging.getLogger("agentgw.cluster")

_GAUGES = {
    b"vllm:num_requests_running": "running",
    b"vllm:num_requests_waiting": "waiting",
    b"vllm:kv_cache_usage_perc": "kv_usage",
}
_PINNED_SHARE = b"agentgw_kv_device_pinned_share "
_MAX_CONTROL_METRICS_BYTES = 64 << 10


@dataclass(slots=True)
class EngineState:
    config: EngineConfig
    pool: str
    role: PoolRole
    healthy: bool = True
    failures: int = 0
    successes: int = 0
    refused: bool = False
    """The last failure was a refused connection (the engine is down, not merely slow)."""
    refused_at: float = 0.0
    """When (the cluster's wall clock) a refused connection was last seen."""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    inflight: int = 0
    capacity_blocks: int = 0
    models: frozenset[str] = field(default_factory=frozenset)
    pinned_share: float = 0.0
    """Share of the device cache held by engine_ext soft pins (control server's /metrics)."""
    pins_refused: bool = False
    """The control API refused the last pin scrape (wrong token): logged once per episode."""
    seen: bool = False
    """It has passed a probe since the gateway started (until then it is starting)."""
    removed: bool = False
    """Left the configuration: never routed to again; dropped once nothing is in flight there."""

    @property
    def name(self) -> str:
        return self.config.name

    def view(self, panic: bool = False) -> EngineView:
        return EngineView(
            name=self.config.name,
            pool=self.pool,
            role=self.role,
            models=self.models,
            healthy=not self.removed and (self.healthy or (panic and self.seen and not self.refused)),
            running=self.running,
            waiting=self.waiting,
            kv_usage=self.kv_usage,
            inflight=self.inflight,
            capacity_blocks=self.capacity_blocks,
            pinned_share=self.pinned_share,
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


def parse_pinned_share(text: bytes) -> float | None:
    """``agentgw_kv_device_pinned_share`` from engine_ext's control-server metrics, clamped to
    [0, 1]; None when absent (the engine runs no pinning scheduler)."""
    for line in text.splitlines():
        if line.startswith(_PINNED_SHARE):
            with contextlib.suppress(ValueError):
                return min(1.0, max(0.0, float(line[len(_PINNED_SHARE) :])))
    return None


class Cluster:
    """Owns the engine states and the background tasks that refresh them."""

    def __init__(
        self, config: GatewayConfig, client: httpx.AsyncClient, clock: Callable[[], float] = time.time
    ) -> None:
        self._config = config
        self.clock = clock
        self._client = client
        self.engines: dict[str, EngineState] = {}
        for pool in config.pools:
            for e in pool.engines:
                self.engines[e.name] = EngineState(
                    config=e,
                    pool=pool.name,
                    role=PoolRole(pool.role),
                    models=frozenset({e.model, *e.aliases}),
                )
        self.pools: dict[str, list[str]] = {p.name: [e.name for e in p.engines] for p in config.pools}
        self._tasks: list[asyncio.Task[None]] = []
        self.loop_lag = LoopLag()
        """The event loop's lag: a timeout it explains is not held against an engine."""
        self._views: tuple[EngineView, ...] | None = None
        self.load = InflightLoad(self.engines)
        self.on_eject: list[Callable[[str], None]] = []
        self.shared: Callable[[str], EngineCounts | None] | None = None
        """The other replicas' in-flight counts per engine, when they share them."""

    # -- membership ----------------------------------------------------------------------------
    def apply_pools(self, pools: list[PoolConfig]) -> dict[str, list[str]]:
        """Make ``pools`` the engine list, while requests flow. Returns the engine names
        ``added``, ``removed`` and ``updated`` (same name, another URL, model, KV-event endpoint,
        control URL, pool or role). New engines start unhealthy (a probe admits them); removed
        ones leave routing at once (the caller re-homes their sessions); their state stays until
        their requests in flight end (:meth:`sweep`)."""
        wanted = {e.name: (p, e) for p in pools for e in p.engines}
        added, removed, updated = [], [], []
        for name, state in self.engines.items():
            if name not in wanted and not state.removed:
                state.removed, state.healthy = True, False
                removed.append(name)
        for name, (pool, e) in wanted.items():
            role = PoolRole(pool.role)
            s = self.engines.get(name)
            if s is None or s.removed:
                self.engines[name] = EngineState(
                    config=e, pool=pool.name, role=role, models=frozenset({e.model}), healthy=False
                )
                if s is not None:  # left and came back before its requests ended: keep their count
                    self.engines[name].inflight = s.inflight
                self.load.counts[name] = self.load.counts.get(name) or EngineCounts()
                added.append(name)
            elif s.config != e or s.pool != pool.name or s.role != role:
                if s.config.url != e.url:  # another server: what was known of the old one is void
                    s.healthy, s.failures, s.successes = False, 0, 0
                    s.running = s.waiting = 0
                    s.kv_usage = 0.0
                s.config, s.pool, s.role, s.models = e, pool.name, role, frozenset({e.model})
                updated.append(name)
        self.pools = {p.name: [e.name for e in p.engines] for p in pools}
        self._changed()
        for name in removed:
            log.warning("engine %s left the configuration", name)
        for name in added:
            log.warning("engine %s joined pool %s", name, self.engines[name].pool)
        return {"added": added, "removed": removed, "updated": updated}

    def sweep(self) -> list[str]:
        """Drop the states of removed engines with nothing in flight; returns their names."""
        gone = [
            n
            for n, s in self.engines.items()
            if s.removed and s.inflight <= 0 and self.load.of(n) == EngineCounts()
        ]
        for n in gone:
            del self.engines[n]
            self.load.counts.pop(n, None)
        if gone:
            self._changed()
        return gone

    # -- reading -------------------------------------------------------------------------------
    def views(self) -> tuple[EngineView, ...]:
        """The routing snapshot's engine list; rebuilt only after something changed."""
        if self._views is None:
            panic = self.panicking()
            # an engine that left stays in the views (never healthy) until it is dropped, so the
            # re-homing of its sessions knows its pool
            self._views = tuple(self._view(s, panic[s.pool]) for s in self.engines.values())
        return self._views

    def _view(self, s: EngineState, panic: bool) -> EngineView:
        own = self.load.of(s.name)
        others = self.shared(s.name) if self.shared is not None else None
        if others is None:
            return merge(s.view(panic), own)
        # the other replicas' in-flight requests too (gateway/service/shared_load.py)
        total = EngineCounts(
            own.prefilling + others.prefilling,
            own.backlog_tokens + others.backlog_tokens,
            own.decoding + others.decoding,
            own.tokens + others.tokens,
        )
        view = s.view(panic)
        return merge(replace(view, inflight=view.inflight + others.prefilling + others.decoding), total)

    def panicking(self) -> dict[str, bool]:
        """Per pool: is it in panic (too few engines pass probes, so health is ignored)?"""
        threshold = self._config.limits.panic_threshold
        out = {}
        for pool, names in self.pools.items():
            healthy = sum(1 for n in names if self.engines[n].healthy)
            out[pool] = healthy / len(names) <= threshold
        for s in self.engines.values():  # a removed engine's pool may be gone
            out.setdefault(s.pool, False)
        return out

    def routable(self, name: str) -> bool:
        """May a request (or a retry) be sent to ``name`` now? Healthy, or in a panicking pool
        and not known to refuse connections."""
        s = self.engines.get(name)
        if s is None or s.removed:
            return False
        return s.healthy or (s.seen and not s.refused and self.panicking()[s.pool])

    def owner_unavailable(
        self, name: str, field: str, timed_out: bool = False, stored_at: float | None = None
    ) -> None:
        """``name`` holds state a request continues (a stored response, named by the request's
        ``field``) and is not healthy, or (``timed_out``) a request to it just ran out of time:
        raise Refused (a 503 ``owner_unavailable`` to retry) when it may still hold it: it is
        failing probes or not answering in time (paused, overloaded) or has not answered since
        the gateway started. Return when it is known gone (refusing connections: the process is
        down, and vLLM kept the state in its memory; or removed): the caller answers that the
        state is not found. ``stored_at``: when the state was recorded (by any replica); stored
        after this replica last saw the engine refuse, it was made by the engine restarted,
        which this replica's probes have not seen yet: a 503 to retry, not gone."""
        s = self.engines.get(name)
        if s is None or s.removed or (s.healthy and not timed_out):
            return
        restarted = s.refused and stored_at is not None and stored_at > s.refused_at
        if s.refused and not restarted:
            return
        why = (
            "restarted since this replica saw it refuse connections"
            if restarted
            else "starting"
            if not s.seen
            else ("failing probes" if not s.healthy else "not answering in time")
        )
        message = f"the engine that holds it, '{name}', is not answering now ({why}); retry"
        raise Refused(message, "owner_unavailable", 2, field=field)

    def models(self) -> list[str]:
        return sorted({m for v in self.views() if v.healthy for m in v.models})

    def ready(self) -> dict[str, bool]:
        """Per pool: does it have a healthy engine?"""
        return {p: any(self.engines[n].healthy for n in names) for p, names in self.pools.items()}

    def waiting(self) -> dict[str, str]:
        """The engines routing skips, each with why: ``starting`` (it has not answered a probe
        since the gateway started), ``refusing connections`` or ``failing probes``."""
        out = {}
        for name, s in self.engines.items():
            if s.healthy:
                continue
            out[name] = (
                "starting" if not s.seen else "refusing connections" if s.refused else "failing probes"
            )
        return out

    def starting(self) -> list[str]:
        """The engines that have not passed a probe yet (none once all have answered once)."""
        return [name for name, s in self.engines.items() if not s.seen]

    # -- updating ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Something the views read changed outside the cluster (the other replicas' load)."""
        self._changed()

    def _changed(self) -> None:
        self._views = None

    def begin(self, name: str) -> None:
        self.engines[name].inflight += 1
        self._changed()

    def end(self, name: str) -> None:
        s = self.engines.get(name)
        if s is not None:
            s.inflight -= 1
            self._changed()

    def sent(self, name: str, uncached_tokens: int, prompt_tokens: int = 0) -> Ticket:
        """A request went to ``name``; it prefills ``uncached_tokens`` until its first byte and
        holds ``prompt_tokens`` of KV until it finishes."""
        t = self.load.sent(name, uncached_tokens, prompt_tokens)
        self._changed()
        return t

    def first_byte(self, t: Ticket, decoding: bool = True) -> None:
        if self.load.first_byte(t, decoding):
            self._changed()

    def finished(self, t: Ticket) -> None:
        if self.load.finished(t):
            self._changed()

    def set_role(self, name: str, role: PoolRole) -> None:
        """The role controller moved ``name`` to ``role`` (its pool name stays)."""
        self.engines[name].role = role
        self._changed()

    def record_probe(self, name: str, ok: bool, refused: bool = False) -> None:
        s = self.engines.get(name)
        if s is None or s.removed:
            return
        limits = self._config.limits
        if ok:
            s.failures, s.successes, s.refused = 0, s.successes + 1, False
            if not s.seen:
                s.seen = True
                if not s.healthy:  # starting, now up: admitted at its first answer
                    s.healthy = True
                    log.warning("engine %s is up", name)
                    self._changed()
                    return
            if not s.healthy and s.successes >= limits.readmit_after_successes:
                s.healthy = True
                log.warning("engine %s re-admitted", name)
                self._changed()
        else:
            s.successes, s.failures = 0, s.failures + 1
            if refused:
                s.refused_at = self.clock()
            if s.refused != refused:
                s.refused = refused
                self._changed()
            if not s.seen:  # starting: out of routing until it answers (nothing to eject)
                if s.healthy:
                    s.healthy = False
                    self._changed()
                return
            if s.healthy and s.failures >= limits.eject_after_failures:
                s.healthy = False
                log.warning("engine %s ejected after %d failed probes", name, s.failures)
                self._changed()
                self._ejected(name)

    def record_connect_failure(self, name: str, timeout_s: float | None = None, refused: bool = True) -> bool:
        """Passive health: a refused or reset connection ejects at once (no need to wait for
        probes). A timeout (``timeout_s``: the limit that ran out, on the connect or the response
        headers) is weaker evidence: it counts as one failure towards ``eject_after_failures``,
        and none at all when the event loop's own lag explains it (a saturated gateway, not a
        slow engine). Returns whether the lag excused it.
        ``refused``: nothing listens (ECONNREFUSED), so even a panicking pool leaves it out; a
        timeout, a reset or a stream that broke off does not prove that (under a loop stall every
        engine's connects time out: marking them all refused emptied the pool, 503
        ``no_healthy_engine`` with every engine alive), and the next probe says."""
        s = self.engines.get(name)
        if s is None or s.removed:
            return False
        if timeout_s is not None:
            if self.loop_lag.excuses(timeout_s):
                return True
            s.successes = 0
            s.failures += 1
            if s.healthy and s.failures >= self._config.limits.eject_after_failures:
                s.healthy = False
                log.warning("engine %s ejected after %d timeouts", name, s.failures)
                self._changed()
                self._ejected(name)
            return False
        s.successes = 0
        s.refused = refused
        if refused:
            s.refused_at = self.clock()
        self._changed()
        s.failures = max(s.failures + 1, self._config.limits.eject_after_failures)
        if s.healthy:
            s.healthy = False
            log.warning("engine %s ejected after a connection failure", name)
            self._changed()
            self._ejected(name)
        return False

    def _ejected(self, name: str) -> None:
        for callback in self.on_eject:
            callback(name)

    # -- tasks ---------------------------------------------------------------------------------
    async def probe_once(self) -> None:
        self.sweep()
        await asyncio.gather(*(self._probe(s) for s in list(self.engines.values()) if not s.removed))

    async def probe_engine(self, name: str) -> None:
        """Probe one engine now (a new member is routed to after its first good probe)."""
        s = self.engines.get(name)
        if s is not None and not s.removed:
            await self._probe(s)
            if s.healthy:
                await self._scrape(s)

    async def _probe(self, s: EngineState) -> None:
        try:
            r = await self._client.get(
                f"{s.config.url}/health", timeout=self._config.timeouts.health_timeout_s
            )
            ok, refused = r.status_code == 200, False
        except httpx.ConnectError:
            ok, refused = False, True
        except httpx.TimeoutException:
            if self.loop_lag.excuses(self._config.timeouts.health_timeout_s):
                return  # the probe waited on the gateway's own loop: no verdict on the engine
            ok, refused = False, False
        except httpx.HTTPError:
            ok, refused = False, False
        self.record_probe(s.name, ok, refused)

    async def scrape_once(self) -> None:
        panic = self.panicking()
        await asyncio.gather(
            *(self._scrape(s) for s in list(self.engines.values()) if s.healthy or panic[s.pool])
        )

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

    async def scrape_pins_once(self) -> None:
        panic = self.panicking()
        await asyncio.gather(
            *(
                self._scrape_pins(s)
                for s in list(self.engines.values())
                if s.config.control_url and (s.healthy or panic[s.pool])
            )
        )

    async def _scrape_pins(self, s: EngineState) -> None:
        token = self._config.migration.control_token
        headers = {"authorization": f"Bearer {token}"} if token else {}
        share: float | None = None
        try:
            async with asyncio.timeout(self._config.timeouts.health_timeout_s):
                r = await self._client.get(f"{s.config.control_url}/metrics", headers=headers)
            if r.status_code == 200 and len(r.content) <= _MAX_CONTROL_METRICS_BYTES:
                share = parse_pinned_share(r.content)
            refused = r.status_code in (401, 403)
            if refused and not s.pins_refused:
                log.warning("engine %s: control API refused the pin scrape (%d)", s.name, r.status_code)
            s.pins_refused = refused
        except (httpx.HTTPError, TimeoutError):
            pass
        value = share or 0.0
        if value != s.pinned_share:
            s.pinned_share = value
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
        self.loop_lag.start()
        self._tasks = [
            asyncio.create_task(self._loop("probe_once", t.health_interval_s), name="health"),
            asyncio.create_task(self._loop("scrape_once", t.metrics_interval_s), name="metrics"),
        ]
        # engines with a control API may join later (apply_pools): the loop runs regardless
        self._tasks.append(
            asyncio.create_task(self._loop("scrape_pins_once", t.metrics_interval_s), name="kv-pins")
        )

    async def stop(self) -> None:
        await self.loop_lag.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
