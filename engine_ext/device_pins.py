"""Device soft pins: hold a session's prefix blocks in the engine's device cache until a deadline.

A pin is one extra reference on each cached block of the session's last finished request
(`BlockPool.touch`), so vLLM's own eviction, which only takes blocks whose reference count is
0, skips them; releasing a pin drops those references (`BlockPool.free_blocks`) and the
blocks go back to vLLM's LRU free queue. Nothing else in vLLM changes.

Rules (parameters: `max_blocks` = the configured fraction of the device cache, `max_sessions`):
- a session holds at most one pin; re-pinning moves it to the session's newest prefix and
  resets its deadline (oldest order = order of the last (re)pin);
- distinct pinned blocks <= `max_blocks`: past the bound the oldest pins yield
  (`yielded_to_bound`); a pin that alone exceeds the bound is refused (`refused_over_bound`);
- `release_oldest()` is what the scheduler calls when a request cannot get blocks, before
  vLLM preempts anything (`released_for_admission`); `expire(now)` drops pins past their
  deadline (`expired`); `release(session)` and `release_all()` (reset_prefix_cache) the rest.

Threads: every method that touches blocks runs on the engine-core thread (the scheduler's).
The control server's threads only `submit()` commands, applied by `apply_commands()` at the
next `schedule()`, and read `snapshot()`; both take `lock`. Time is passed in (`now`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["DevicePins", "PinCommand"]

_REASONS = ("yielded_to_bound", "released_for_admission", "expired", "released", "reset")


class Block(Protocol):
    """The part of vLLM's `KVCacheBlock` this module reads."""

    block_id: int
    ref_cnt: int
    is_null: bool

    @property
    def block_hash(self) -> Any: ...


class Pool(Protocol):
    """The part of vLLM's `BlockPool` this module calls."""

    num_gpu_blocks: int

    def touch(self, blocks: Sequence[Any]) -> None: ...
    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None: ...


@dataclass(frozen=True)
class PinCommand:
    """A control-API request, applied on the engine-core thread.

    `until` set: pin the session's last prefix until then; None: release its pin (and, with
    `end`, forget its recorded prefix: the session is over)."""

    session_id: str
    until: float | None = None
    end: bool = False


@dataclass(frozen=True)
class _Pin:
    until: float
    blocks: list[Any] = field(default_factory=list)


def cacheable(groups: Iterable[Iterable[Any]]) -> list[tuple[int, Any, Any]]:
    """(group, block, its hash now) for each block, per KV cache group in prefix order, that
    holds a cached block (not null, hashed)."""
    return [
        (g, b, b.block_hash)
        for g, blocks in enumerate(groups)
        for b in blocks
        if not b.is_null and b.block_hash is not None
    ]


def _leading_live(recorded: Iterable[tuple[int, Any, Any]]) -> list[Any]:
    """Per group, the recorded blocks up to the first one evicted since (a prefix hit stops there)."""
    live, broken = [], set()
    for g, b, h in recorded:
        if g in broken:
            continue
        if b.block_hash == h:
            live.append(b)
        else:
            broken.add(g)
    return live


class DevicePins:
    def __init__(self, pool: Pool, max_blocks: int, max_sessions: int = 4096, max_commands: int = 1024):
        self.pool = pool
        self.max_blocks = max_blocks
        self.max_sessions = max_sessions
        self.lock = threading.Lock()
        self._pins: OrderedDict[str, _Pin] = OrderedDict()
        self._held: dict[int, int] = {}  # block_id -> number of pins holding it
        # session -> (block, hash) of its last finished request, for pins asked later (control API)
        self._last: OrderedDict[str, list[tuple[int, Any, Any]]] = OrderedDict()
        self._commands: deque[PinCommand] = deque()
        self._max_commands = max_commands
        self.counters = dict.fromkeys((*_REASONS, "pinned", "refused_over_bound", "stale_blocks"), 0)
        self._snapshot: dict[str, Any] = {}
        self._publish()

    # ---- engine-core thread -------------------------------------------------------------------

    def finished(
        self, session_id: str, groups: Iterable[Iterable[Any]], ttl_s: float | None, now: float
    ) -> None:
        """A request of the session ended holding `groups` (its blocks per KV cache group).

        `ttl_s > 0` pins that prefix until `now + ttl_s`; `ttl_s == 0` releases the pin; None
        keeps a live pin's deadline and moves it to this newer prefix."""
        self._last[session_id] = cacheable(groups)
        self._last.move_to_end(session_id)
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)
        pin = self._pins.get(session_id)
        if ttl_s:
            self.pin(session_id, now + ttl_s)
        elif ttl_s == 0:
            self.release(session_id)
        elif pin is not None:
            self.pin(session_id, pin.until)

    def pin(self, session_id: str, until: float) -> int:
        """Pin the session's last recorded prefix until `until`; returns the blocks pinned."""
        recorded = self._last.get(session_id, [])
        live = _leading_live(recorded)
        self.counters["stale_blocks"] += len(recorded) - len(live)
        old = self._pins.pop(session_id, None)
        if old is not None:
            self._drop(old.blocks)
        ids = {b.block_id for b in live}
        if len(ids) > self.max_blocks:
            self.counters["refused_over_bound"] += 1
            self._publish()
            return 0
        while self._pins and len(self._held.keys() | ids) > self.max_blocks:
            self._release(next(iter(self._pins)), "yielded_to_bound")
        if not live:
            self._publish()
            return 0
        self.pool.touch(live)
        for b in live:
            self._held[b.block_id] = self._held.get(b.block_id, 0) + 1
        self._pins[session_id] = _Pin(until=until, blocks=live)
        while len(self._pins) > self.max_sessions:
            self._release(next(iter(self._pins)), "yielded_to_bound")
        self.counters["pinned"] += 1
        self._publish()
        return len(live)

    def release(self, session_id: str, reason: str = "released") -> bool:
        found = session_id in self._pins
        if found:
            self._release(session_id, reason)
            self._publish()
        return found

    def forget(self, session_id: str) -> None:
        """The session ended: release its pin and its recorded prefix."""
        self.release(session_id)
        self._last.pop(session_id, None)

    def release_oldest(self) -> bool:
        """Yield the oldest pin (a request needs its blocks); False when none is left."""
        if not self._pins:
            return False
        self._release(next(iter(self._pins)), "released_for_admission")
        self._publish()
        return True

    def expire(self, now: float) -> int:
        expired = [s for s, p in self._pins.items() if p.until <= now]
        for s in expired:
            self._release(s, "expired")
        if expired:
            self._publish()
        return len(expired)

    def release_all(self, reason: str = "reset") -> int:
        n = len(self._pins)
        for s in list(self._pins):
            self._release(s, reason)
        self._last.clear()
        self._publish()
        return n

    def apply_commands(self) -> None:
        with self.lock:
            commands, self._commands = list(self._commands), deque()
        for c in commands:
            if c.until is not None:
                self.pin(c.session_id, c.until)
            elif c.end:
                self.forget(c.session_id)
            else:
                self.release(c.session_id)

    def known_blocks(self, session_id: str) -> int:
        """Blocks recorded for the session's last prefix (any thread: one dict read)."""
        return len(self._last.get(session_id, ()))

    def session(self, session_id: str, now: float) -> dict[str, Any] | None:
        """The session's pin (any thread: one dict read of an object replaced, never mutated)."""
        pin = self._pins.get(session_id)
        if pin is None:
            return None
        return {"blocks": len(pin.blocks), "ttl_left_s": round(max(0.0, pin.until - now), 3)}

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._held)

    def _release(self, session_id: str, reason: str) -> None:
        pin = self._pins.pop(session_id)
        self._drop(pin.blocks)
        self.counters[reason] += 1

    def _drop(self, blocks: list[Any]) -> None:
        for b in blocks:
            n = self._held[b.block_id] - 1
            if n:
                self._held[b.block_id] = n
            else:
                del self._held[b.block_id]
        # tail blocks first, like vLLM frees a request's blocks
        self.pool.free_blocks(reversed(blocks))

    def _publish(self) -> None:
        usable = max(1, self.pool.num_gpu_blocks - 1)  # block 0 is vLLM's null block
        snap = {
            "pinned_sessions": len(self._pins),
            "pinned_blocks": len(self._held),
            "max_pinned_blocks": self.max_blocks,
            "blocks_total": usable,
            "pinned_share": round(len(self._held) / usable, 6),
            "sessions": {s: {"blocks": len(p.blocks), "until": p.until} for s, p in self._pins.items()},
            **self.counters,
        }
        with self.lock:
            self._snapshot = snap

    # ---- any thread ---------------------------------------------------------------------------

    def submit(self, command: PinCommand) -> bool:
        """Queue a control-API command for the engine-core thread; False when the queue is full."""
        with self.lock:
            if len(self._commands) >= self._max_commands:
                return False
            self._commands.append(command)
            return True

    def snapshot(self, now: Callable[[], float] | None = None) -> dict[str, Any]:
        """The last published state (JSON-able); with `now`, deadlines become `ttl_left_s`."""
        with self.lock:
            snap = dict(self._snapshot)
            pending = len(self._commands)
        sessions = snap.pop("sessions")
        snap["commands_pending"] = pending
        if now is not None:
            t = now()
            snap["sessions"] = {
                s: {"blocks": v["blocks"], "ttl_left_s": round(max(0.0, v["until"] - t), 3)}
                for s, v in list(sessions.items())[:64]
            }
        return snap
