"""Engines joining and leaving while the gateway runs.

Three ways in, one way to apply: ``SIGHUP`` (``agentgw serve`` re-reads its ``--config`` file),
``POST /admin/reload`` (the same, over HTTP), ``PUT /admin/pools`` (a pool list in the body), and
a discovery file (``discovery.file``: a YAML or JSON file holding ``pools:``, re-read every
``discovery.interval_s`` when its modification time changes). Each gives a new pool list to
:meth:`Membership.apply`:

- a new engine starts unhealthy, its KV events are subscribed to, and it is probed at once: it
  takes traffic after its first good probe;
- an engine that left is out of routing at once; every session this replica homed there is
  re-homed on the best live engine of its pool (the same path as an ejected engine,
  :mod:`gateway.service.rehome`); its KV-event subscription stops and its prefix-index entries
  are dropped; requests in flight there finish, then its state is dropped;
- an engine whose URL or KV-event endpoint changed is treated as a new server (index entries
  dropped, subscription restarted, probed again).

Only ``pools`` is applied live; a change to any other key is logged and needs a restart. Each
replica applies its own copy: give every replica the same file (or call each one's admin API).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from gateway.config import ConfigError, GatewayConfig, PoolConfig
from gateway.service.cluster import Cluster
from gateway.service.kv_events import KvEventFeeds
from gateway.service.metrics import GatewayMetrics
from gateway.service.placement import Placement
from gateway.service.prompts import Prompts
from gateway.service.rehome import Rehomer
from gateway.service.tasks import cancel_and_wait

__all__ = ["Membership", "parse_pools", "read_pools_file"]

log = logging.getLogger("agentgw.membership")
_POOLS = TypeAdapter(list[PoolConfig])


def parse_pools(data: Any, where: str = "pools") -> list[PoolConfig]:
    """A validated pool list (unique pool and engine names); :class:`ConfigError` naming the key."""
    try:
        pools = _POOLS.validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in (where, *first["loc"]))
        raise ConfigError(f"invalid config key '{key}': {first['msg']}") from None
    names = [p.name for p in pools]
    engines = [e.name for p in pools for e in p.engines]
    if len(names) != len(set(names)):
        raise ConfigError(f"invalid config key '{where}': pool names must be unique, got {names}")
    if len(engines) != len(set(engines)):
        raise ConfigError(
            f"invalid config key '{where}': engine names must be unique across pools, got {engines}"
        )
    return pools


def read_pools_file(path: str | os.PathLike[str]) -> list[PoolConfig]:
    """The ``pools`` of a discovery file (YAML or JSON: a mapping with ``pools``, or the list)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read discovery file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"discovery file {path} is not valid YAML or JSON: {exc}") from None
    data = raw.get("pools") if isinstance(raw, dict) else raw
    if not isinstance(data, list):
        raise ConfigError(f"discovery file {path} must hold a list 'pools'")
    return parse_pools(data)


class Membership:
    """Applies pool lists to a running service and watches the discovery file."""

    def __init__(
        self,
        config: GatewayConfig,
        cluster: Cluster,
        placement: Placement,
        prompts: Prompts,
        rehomer: Rehomer,
        feeds: KvEventFeeds,
        metrics: GatewayMetrics,
        reload: Callable[[], GatewayConfig] | None = None,
    ) -> None:
        self.config = config
        """The configuration the service started with (a reload applies its ``pools`` only)."""
        self.cluster = cluster
        self.placement = placement
        self.prompts = prompts
        self.rehomer = rehomer
        self.feeds = feeds
        self.metrics = metrics
        self.reload_config = reload
        """Re-reads the configuration (``agentgw serve``: its ``--config`` file); None: no file."""
        self.changes = 0
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._mtime: float | None = None

    # -- applying ------------------------------------------------------------------------------
    async def apply(self, pools: list[PoolConfig], source: str) -> dict[str, list[str]]:
        """Make ``pools`` the engine list (see the module docstring); returns what changed."""
        async with self._lock:
            before = {n: s.config for n, s in self.cluster.engines.items() if not s.removed}
            change = self.cluster.apply_pools(pools)
            # a new server behind an old name: what this replica knew of it is void
            renewed = [
                n
                for n in change["updated"]
                if (old := before.get(n)) is not None
                and (old.url, old.kv_events)
                != (self.cluster.engines[n].config.url, self.cluster.engines[n].config.kv_events)
            ]
            for name in change["removed"] + renewed:
                await self._unsubscribe(name)
                self.placement.core.forget_engine(name)
            for name in change["added"] + renewed:
                self._subscribe(name)
            self.prompts.kv_events = any(
                s.config.kv_events for s in self.cluster.engines.values() if not s.removed
            )
            await asyncio.gather(*(self.cluster.probe_engine(n) for n in change["added"] + renewed))
            for name in change["removed"]:  # its pool is still known until the sweep below
                await self.rehomer.rehome_from(name)
            self.cluster.sweep()
            n = sum(len(v) for v in change.values())
            if n:
                self.changes += 1
                for kind, names in change.items():
                    if names:
                        self.metrics.membership_changes.labels(kind).inc(len(names))
                log.warning(
                    "engines from %s: added %s, removed %s, updated %s",
                    source,
                    change["added"] or "-",
                    change["removed"] or "-",
                    change["updated"] or "-",
                )
            return change

    def _subscribe(self, name: str) -> None:
        self.feeds.subscribe(name, self.cluster.engines[name].config.kv_events)

    async def _unsubscribe(self, name: str) -> None:
        await self.feeds.unsubscribe(name)

    async def reload(self, source: str = "reload") -> dict[str, list[str]]:
        """Re-read the configuration file (and the discovery file, which wins for ``pools``)."""
        pools: list[PoolConfig] | None = None
        if self.reload_config is not None:
            new = self.reload_config()
            self._warn_restart_keys(new)
            pools = list(new.pools)
        disc = self.config.discovery.file
        if disc is not None:
            pools = read_pools_file(disc)
        if pools is None:
            raise ConfigError("nothing to reload: the gateway runs without a config file or discovery.file")
        return await self.apply(pools, source)

    def _warn_restart_keys(self, new: GatewayConfig) -> None:
        old = self.config
        changed = [k for k in type(old).model_fields if k != "pools" and getattr(old, k) != getattr(new, k)]
        if changed:
            log.warning("config reload applies 'pools' only; changed keys %s need a restart", changed)

    # -- the discovery file --------------------------------------------------------------------
    def start(self) -> None:
        if self.config.discovery.file is not None:
            self._mtime = self._stat()
            self._task = asyncio.create_task(self._watch(), name="discovery")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    def _stat(self) -> float | None:
        path = self.config.discovery.file
        try:
            return os.stat(path).st_mtime if path is not None else None
        except OSError:
            return None

    async def _watch(self) -> None:
        d = self.config.discovery
        while True:
            await asyncio.sleep(d.interval_s)
            mtime = self._stat()
            if mtime is None or mtime == self._mtime:
                continue
            self._mtime = mtime
            try:
                assert d.file is not None
                await self.apply(read_pools_file(d.file), "discovery file")
            except ConfigError as exc:  # a half-written or bad file: keep the current engines
                log.warning("discovery: %s; engines unchanged", exc)
            except Exception:
                log.exception("discovery: applying %s failed", d.file)
