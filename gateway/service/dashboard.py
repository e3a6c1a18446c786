"""The operator dashboard's data: one read-only JSON snapshot of the gateway, and a short history.

:func:`dashboard_state` reads (never changes) what the service layer already keeps: the engine
registry (health, load, KV usage), the prefix index (blocks each engine holds, by medium), the
session store's most recent sessions (home, turns, last decision and its reason), the migration
executor (in flight and recent outcomes) and the gateway's Prometheus metrics.

:class:`DashboardHistory` adds what a snapshot cannot show, the last minutes: every
``interval_s`` it samples the gateway's TTFT histogram and request counter and scrapes each
healthy engine's prompt-token counters (``vllm:prompt_tokens``, ``vllm:prompt_tokens_cached``,
``vllm:prompt_tokens_cached_by_source``), keeping ``window_s`` of samples in a bounded deque.
Rates (requests/s, prefix-cache hit rate, TTFT mean and p95) are differences between samples.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from gateway.core.planner import ActionKind
from gateway.core.prefix_index import PrefixIndex
from gateway.core.sessions import SessionRecord
from gateway.core.turn import IndexKind
from gateway.core.types import Medium
from gateway.service.responses import is_owner_key
from gateway.service.tasks import cancel_and_wait

if TYPE_CHECKING:
    from gateway.service.gateway import GatewayService
    from gateway.service.migrations import Migration

log = logging.getLogger("agentgw.dashboard")

MAX_SESSIONS = 200
"""Sessions listed in one snapshot (most recently active first)."""
MAX_MIGRATIONS = 50
"""Recent migrations listed in one snapshot (newest first)."""
TIER_SAMPLE_BLOCKS = 4096
"""Per engine, the most recently stored blocks inspected for the by-medium split (the total is
exact; beyond this many blocks the split is extrapolated from the newest ones)."""

_PIN_KINDS = (ActionKind.STAY, ActionKind.DEMOTE, ActionKind.REPLICATE)
_ENGINE_COUNTERS = {
    b"vllm:prompt_tokens_total": "prompt",
    b"vllm:prompt_tokens_cached_total": "cached",
}
_BY_SOURCE = b"vllm:prompt_tokens_cached_by_source_total{"


def parse_prompt_counters(text: bytes) -> dict[str, float]:
    """From an engine's /metrics: prompt tokens, cached prompt tokens and cached prompt tokens by
    source (``cached:device``, ``cached:host``, ...), each summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(b"vllm:prompt_tokens"):
            continue
        head, _, value = line.rpartition(b" ")
        try:
            v = float(value)
        except ValueError:
            continue
        if head.startswith(_BY_SOURCE):
            i = head.find(b'source="')
            if i < 0:
                continue
            source = head[i + 8 : head.find(b'"', i + 8)].decode("ascii", "replace")
            key = f"cached:{source}"
        else:
            key_or_none = _ENGINE_COUNTERS.get(head.split(b"{", 1)[0])
            if key_or_none is None:
                continue
            key = key_or_none
        out[key] = out.get(key, 0.0) + v
    return out


@dataclass(slots=True)
class Sample:
    t: float
    requests: float
    ttft_count: float
    ttft_sum: float
    ttft_buckets: tuple[tuple[float, float], ...]
    """(upper bound, cumulative count) of the TTFT histogram, summed over routes."""
    engines: dict[str, dict[str, float]] = field(default_factory=dict)
    """engine -> parse_prompt_counters (only engines that answered)."""


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style histogram_quantile over (upper bound, cumulative count) pairs."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            span = c - prev_c
            return prev_le + (le - prev_le) * ((rank - prev_c) / span if span > 0 else 0.0)
        prev_le, prev_c = le, c
    return prev_le


def _delta(new: Sample, old: Sample) -> dict[str, Any]:
    dt = max(new.t - old.t, 1e-9)
    n = new.ttft_count - old.ttft_count
    old_buckets = dict(old.ttft_buckets)  # a labelled histogram has no buckets before a sample
    buckets = [(le, c - old_buckets.get(le, 0.0)) for le, c in new.ttft_buckets]
    prompt = cached = 0.0
    by_source: dict[str, float] = {}
    for name, cur in new.engines.items():
        before = old.engines.get(name)
        if before is None:
            continue
        prompt += max(0.0, cur.get("prompt", 0.0) - before.get("prompt", 0.0))
        cached += max(0.0, cur.get("cached", 0.0) - before.get("cached", 0.0))
        for k, v in cur.items():
            if k.startswith("cached:"):
                d = max(0.0, v - before.get(k, 0.0))
                by_source[k[7:]] = by_source.get(k[7:], 0.0) + d
    return {
        "t": new.t,
        "requests": new.requests - old.requests,
        "rps": (new.requests - old.requests) / dt,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_by_source": {k: v for k, v in by_source.items() if v},
        "hit_rate": cached / prompt if prompt else None,
        "ttft_count": n,
        "ttft_mean_s": (new.ttft_sum - old.ttft_sum) / n if n > 0 else None,
        "ttft_p50_s": _quantile(buckets, 0.5) if n > 0 else None,
        "ttft_p95_s": _quantile(buckets, 0.95) if n > 0 else None,
    }


class DashboardHistory:
    """A bounded ring of samples (``window_s / interval_s`` of them), refreshed by one task."""

    def __init__(
        self,
        service: GatewayService,
        interval_s: float = 2.0,
        window_s: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.service = service
        self.interval_s = interval_s
        self.window_s = window_s
        self.clock = clock
        self.samples: deque[Sample] = deque(maxlen=max(2, int(window_s / interval_s) + 1))
        self._task: asyncio.Task[None] | None = None

    async def _scrape(self, name: str, url: str) -> tuple[str, dict[str, float] | None]:
        timeout = self.service.config.timeouts.health_timeout_s
        try:
            r = await self.service.upstream.http.get(f"{url}/metrics", timeout=timeout)
        except httpx.HTTPError:
            return name, None
        return name, parse_prompt_counters(r.content) if r.status_code == 200 else None

    async def sample_once(self) -> Sample:
        m = self.service.metrics
        requests = sum(
            s.value for mf in m.requests.collect() for s in mf.samples if s.name.endswith("_total")
        )
        count = total = 0.0
        buckets: dict[float, float] = {}
        for mf in m.ttft.collect():
            for s in mf.samples:
                if s.name.endswith("_count"):
                    count += s.value
                elif s.name.endswith("_sum"):
                    total += s.value
                elif s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
        engines = self.service.cluster.engines.values()
        scraped = await asyncio.gather(*(self._scrape(s.name, s.config.url) for s in engines if s.healthy))
        sample = Sample(
            t=self.clock(),
            requests=requests,
            ttft_count=count,
            ttft_sum=total,
            ttft_buckets=tuple(sorted(buckets.items())),
            engines={name: c for name, c in scraped if c is not None},
        )
        self.samples.append(sample)
        return sample

    def series(self) -> list[dict[str, Any]]:
        """One point per sampling interval: the change since the previous sample."""
        s = list(self.samples)
        return [_delta(b, a) for a, b in itertools.pairwise(s)]

    def window(self) -> dict[str, Any] | None:
        """The change over the whole window (oldest to newest sample)."""
        if len(self.samples) < 2:
            return None
        out = _delta(self.samples[-1], self.samples[0])
        out["window_s"] = self.samples[-1].t - self.samples[0].t
        return out

    async def _loop(self) -> None:
        while True:
            try:
                await self.sample_once()
            except Exception:  # a sample must never kill the loop; the next one retries
                log.exception("dashboard sample failed")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="dashboard-history")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)


# -- the snapshot ------------------------------------------------------------------------------
def _held_by_medium(index: PrefixIndex, engine: str) -> dict[str, int]:
    """Blocks of ``engine`` in ``index`` by best medium (GPU / CPU / STORAGE)."""
    total = index.engine_blocks(engine)
    out = {m.name.lower(): 0 for m in (Medium.GPU, Medium.CPU, Medium.STORAGE)}
    if total == 0:
        return out
    # the engine's blocks in store order (newest last); the index offers no by-medium count
    lru = index._lru.get(engine)
    if lru is None:
        return out
    seen = 0
    for h in itertools.islice(reversed(lru), TIER_SAMPLE_BLOCKS):
        m = index.holds(engine, h)
        if m is not None:
            out[m.name.lower()] += 1
            seen += 1
    if seen and seen < total:
        scale = total / seen
        out = {k: round(v * scale) for k, v in out.items()}
    return out


def _migration_dict(m: Migration, now: float) -> dict[str, Any]:
    d = m.to_dict()
    d["session_id"] = m.action.session_id
    d["started"] = m.started
    d["age_s"] = round(now - m.started, 3)
    return d


def _pins(rec: SessionRecord, service: GatewayService, last: Migration | None) -> list[dict[str, Any]]:
    """What the gateway asked engines to keep for this session, and until when (gateway's view)."""
    pins: list[dict[str, Any]] = []
    if last is not None and last.state == "done" and last.action.kind in _PIN_KINDS:
        a = last.action
        pins.append(
            {"engine": a.source, "until": last.started + a.pin_ttl_s, "by": f"migration:{a.kind.value}"}
        )
    if (
        last is not None
        and last.state == "done"
        and last.action.kind in (ActionKind.MOVE, ActionKind.REPLICATE)
    ):
        for t in last.ready:
            pins.append({"engine": t, "until": last.started + last.action.pin_ttl_s, "by": "prefetch"})
    served = (rec.last_decision or {}).get("engine") or rec.home
    if served is not None and service.migrations.controllable(served) and rec.turns:
        # each request to a control-enabled engine carries a pin for the expected gap, on the
        # engine that served it (GatewayService._pin); a hinted kv_retention_ttl_s overrides it
        # and is not kept
        params = service.migrations.params
        ttl = params.pin_ttl_s(params.gap_s(None, rec.expected_gap()))
        pins.append({"engine": served, "until": rec.last_activity + ttl, "by": "request"})
    return pins


def _session_dict(
    rec: SessionRecord, now: float, service: GatewayService, last: Migration | None
) -> dict[str, Any]:
    d = rec.last_decision or {}
    return {
        "session_id": rec.session_id,
        "home": rec.home,
        "pool": rec.pool,
        "turns": rec.turns,
        "inflight": rec.inflight,
        "context_tokens": rec.context_tokens,
        "cached_tokens_est": rec.cached_tokens_est,
        "parent": rec.parent,
        "children": len(rec.children),
        "idle_s": round(max(0.0, now - rec.last_activity), 3),
        "expected_gap_s": rec.expected_gap(),
        "last_decision": {
            "engine": d.get("engine"),
            "pool": d.get("pool"),
            "reason": d.get("reason"),
            "profile": d.get("profile"),
            "cached_tokens_est": d.get("cached_tokens_est"),
            "uncached_tokens_est": d.get("uncached_tokens_est"),
        }
        if d
        else None,
        "pins": [p for p in _pins(rec, service, last) if p["until"] > now],
        "migration": None if last is None else {"kind": last.action.kind.value, "state": last.state},
    }


def _counter_values(metric: Any, *labels: str) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for mf in metric.collect():
        for s in mf.samples:
            if s.name.endswith("_total"):
                key = tuple(s.labels[k] for k in labels)
                out[key] = out.get(key, 0.0) + s.value
    return out


async def dashboard_state(
    service: GatewayService, history: DashboardHistory | None, now: float, session_limit: int = MAX_SESSIONS
) -> dict[str, Any]:
    """The whole dashboard as one JSON-ready dict (reads only)."""
    cluster, migrations = service.cluster, service.migrations
    recs = await service.sessions.recent(min(session_limit, MAX_SESSIONS), now)
    recs = [r for r in recs if not is_owner_key(r.session_id)]  # stored responses' engines

    last_by_session: dict[str, Migration] = {}
    for m in migrations.recent:
        last_by_session[m.action.session_id] = m
    last_by_session.update(migrations.current)

    homes: dict[str, int] = {}
    for r in recs:
        if r.home is not None:
            homes[r.home] = homes.get(r.home, 0) + 1

    ready = cluster.ready()
    chunk_chars = service.config.routing.approx_chunk_chars
    pools = []
    for pool_name, names in cluster.pools.items():
        engines = []
        for name in names:
            s = cluster.engines[name]
            model = s.config.model
            bs = service.prompts.block_size(model)
            # the approximate index holds text chunks (~4 characters a token) unless the model is
            # tokenized (exact hashes without KV events)
            approx_bs = bs if service.prompts.exact_for(model) else max(1, chunk_chars // 4)
            exact = _held_by_medium(service.placement.core.indexes[IndexKind.PRECISE], name)
            approx = _held_by_medium(service.placement.core.indexes[IndexKind.APPROX], name)
            tiers = {k: exact[k] * bs + approx[k] * approx_bs for k in exact}
            engines.append(
                {
                    "name": name,
                    "url": s.config.url,
                    "model": s.config.model,
                    "healthy": s.healthy,
                    "failures": s.failures,
                    "running": s.running,
                    "waiting": s.waiting,
                    "inflight": s.inflight,
                    "kv_usage": s.kv_usage,
                    "capacity_blocks": s.capacity_blocks,
                    "controllable": migrations.controllable(name),
                    "cached_tokens": {**tiers, "total": sum(tiers.values())},
                    "sessions_home": homes.get(name, 0),
                }
            )
        role = cluster.engines[names[0]].role.value if names else None
        pools.append(
            {"name": pool_name, "role": role, "ready": ready.get(pool_name, False), "engines": engines}
        )

    outcomes: dict[str, dict[str, float]] = {}
    for (kind, outcome), v in _counter_values(service.metrics.migrations, "kind", "outcome").items():
        outcomes.setdefault(kind, {})[outcome] = v
    decisions: dict[str, float] = {}
    for (reason,), v in _counter_values(service.metrics.decisions, "reason").items():
        decisions[reason] = decisions.get(reason, 0.0) + v
    moved = {k[0]: v for k, v in _counter_values(service.metrics.moved_next_turn, "outcome").items()}

    in_flight = [_migration_dict(m, now) for m in migrations.current.values() if m.state == "running"]
    recent = [_migration_dict(m, now) for m in itertools.islice(reversed(migrations.recent), MAX_MIGRATIONS)]

    return {
        "now": now,
        "profile": service.config.routing.profile,
        "session_backend": service.config.sessions.backend,
        "ready": bool(ready) and all(ready.values()),
        "pools": pools,
        "sessions": {
            "listed": len(recs),
            "limit": min(session_limit, MAX_SESSIONS),
            "items": [_session_dict(r, now, service, last_by_session.get(r.session_id)) for r in recs],
        },
        "migrations": {
            "enabled": service.config.migration.enabled,
            "in_flight": in_flight,
            "recent": recent,
            "outcomes": outcomes,
            "moved_next_turn": moved,
        },
        "traffic": {
            "decisions": decisions,
            "window": history.window() if history is not None else None,
            "series": history.series() if history is not None else [],
            "interval_s": history.interval_s if history is not None else None,
        },
    }
