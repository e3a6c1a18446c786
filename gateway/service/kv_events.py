"""Subscribes to each engine's vLLM KV-event publisher (ZMQ PUB) and applies the events to the
precise prefix index.

Wire format: ``[topic, seq (8 bytes big-endian), msgpack([ts, [event...], dp_rank])]``; each
event is a map tagged with ``type``: ``BlockStored`` (block_hashes, medium, group_idx,
kv_cache_spec_kind, ...), ``BlockRemoved`` (block_hashes, medium, group_idx),
``AllBlocksCleared``. Only full-attention groups are indexed (sliding-window groups publish only
their tail window, and linear-attention state is not a prefix of blocks). A gap in ``seq`` means
events were lost: the engine's entries are then cleared rather than trusted.

Coverage: events are not replayed, so the index knows only what an engine stored since this
subscriber connected, or since the last gap cleared its entries (``complete_since``); blocks the
engine stored before may still be on it, unknown here (a restarted replica sees its prefix
matches come back as its engines store new blocks). ``coverage()`` says so, for ``/ready`` and
``agentgw_prefix_index_coverage_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from gateway.core.prefix_index import PrefixIndex
from gateway.core.types import Medium
from gateway.service.tasks import cancel_and_wait

log = logging.getLogger("agentgw.kv_events")

_FULL_KINDS = frozenset({None, "full_attention", "mla_attention", "sink_full_attention"})


def apply_event(index: PrefixIndex, engine: str, ev: Any, other_groups: set[int]) -> None:
    """Apply one decoded event. ``other_groups`` collects the group indexes learned to be
    non-full-attention, whose removals must not touch the full-attention entries."""
    if not isinstance(ev, dict):
        return
    kind = ev.get("type")
    group = ev.get("group_idx")
    if kind == "BlockStored":
        if ev.get("kv_cache_spec_kind") not in _FULL_KINDS:
            if group is not None:
                other_groups.add(group)
            return
        index.apply_stored(engine, ev.get("block_hashes") or [], Medium.parse(ev.get("medium")))
    elif kind == "BlockRemoved":
        if group is not None and group in other_groups:
            return
        index.apply_removed(engine, ev.get("block_hashes") or [], Medium.parse(ev.get("medium")))
    elif kind == "AllBlocksCleared":
        index.clear(engine)


class KvEventSubscriber:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        index: PrefixIndex,
        engine: str,
        endpoint: str,
        topic: str = "kv-events",
    ) -> None:
        self.ctx = ctx
        self.index = index
        self.engine = engine
        self.endpoint = endpoint
        self.topic = topic
        self.events = 0
        self.gaps = 0
        self._last_seq: int | None = None
        self._other_groups: set[int] = set()
        self._task: asyncio.Task[None] | None = None
        self.complete_since: float | None = None
        """Wall-clock time since which every event of this engine was applied (None: not started)."""
        self.last_event_at: float | None = None

    def coverage(self, now: float) -> dict[str, Any]:
        """How stale this engine's part of the index may be: events applied and gaps seen, the
        seconds it has been complete for (blocks stored before that are unknown here) and the
        seconds since its last event."""
        since = self.complete_since
        last = self.last_event_at
        return {
            "events": self.events,
            "gaps": self.gaps,
            "complete_for_s": round(now - since, 3) if since is not None else 0.0,
            "last_event_s_ago": round(now - last, 3) if last is not None else None,
        }

    def start(self) -> None:
        self.complete_since = time.time()
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.engine}")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sock.connect(self.endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    self._handle(frames)
                except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
                    log.warning("bad KV event from %s: %r", self.engine, exc)
        finally:
            sock.close(0)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 3:
            return
        seq = int.from_bytes(frames[1], "big")
        if self._last_seq is not None and seq > self._last_seq + 1:
            self.gaps += 1
            self.index.clear(self.engine)
            self.complete_since = time.time()
            log.warning(
                "KV events from %s: %d lost; its prefix entries cleared",
                self.engine,
                seq - self._last_seq - 1,
            )
        self._last_seq = seq
        self.last_event_at = time.time()
        batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        for ev in batch[1]:
            apply_event(self.index, self.engine, ev, self._other_groups)
            self.events += 1


class KvEventFeeds:
    """Every engine's KV-event subscriber into one prefix index: one ZeroMQ context (from
    :meth:`start` to :meth:`stop`), one subscriber per publishing engine, added and removed as
    engines join and leave (:mod:`gateway.service.membership`)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.subscribers: list[KvEventSubscriber] = []
        self._ctx: zmq.asyncio.Context | None = None

    def start(self, engines: dict[str, str | None]) -> None:
        """Subscribe to each engine of ``engines`` (name -> its publisher endpoint, None: none)."""
        self._ctx = zmq.asyncio.Context()
        for name, endpoint in engines.items():
            self.subscribe(name, endpoint)

    def subscribe(self, engine: str, endpoint: str | None) -> None:
        if endpoint and self._ctx is not None:
            sub = KvEventSubscriber(self._ctx, self.index, engine, endpoint)
            sub.start()
            self.subscribers.append(sub)

    async def unsubscribe(self, engine: str) -> None:
        for sub in [s for s in self.subscribers if s.engine == engine]:
            self.subscribers.remove(sub)
            await sub.stop()

    async def stop(self) -> None:
        for sub in self.subscribers:
            await sub.stop()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
