"""`PinnedLRUCachePolicy`: vLLM's host-tier LRU with soft pins from the gateway's hints.

Loaded through `eviction_policy="PinnedLRUCachePolicy"` + `cache_policy_module_path`. Every
request's chunks are recorded under its session (hint `agentgw.session_id`); when the hint
carries `pin_ttl_s`, the session's chunks are protected from eviction until the TTL ends, then
fall back to LRU. `release: true` drops the pin. `on_request_end` then sees the request (the
control server applies its KV hint envelope: engine_ext.kv_hints). The pin table itself is pure
(`engine_ext.pins.PinTable`); this adapter supplies the clock and a lock, because the control
server thread pins and unpins too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from engine_ext.pins import PinHint, PinTable, parse_pin_hint

__all__ = ["PinnedLRUCachePolicy"]


def _ranked_before(rank: Any, steps: int) -> Any:
    """A recency rank ``steps`` places before ``rank`` in LRU order (lower ranks are evicted first).
    vLLM's LRU ranks are ints in 0.32 and ``(request rank, -token position)`` tuples from 0.34 on,
    compared by the request rank first; the demoted rank takes the form of the ranks it joins."""
    if isinstance(rank, tuple):
        return (rank[0] - steps, *rank[1:])
    return rank - steps


class PinnedLRUCachePolicy(LRUCachePolicy):
    def __init__(self, cache_capacity: int, clock: Callable[[], float] = time.monotonic):
        super().__init__(cache_capacity)
        self.clock = clock
        self.pins = PinTable()
        self.lock = threading.Lock()
        # session -> its keys still in the tier (pruned at each of its requests)
        self.session_keys: dict[str, set[OffloadKey]] = {}
        self.num_pin_protected_evictions_refused = 0
        self._pending_demotions: list[OffloadKey] = []
        self.on_request_end: Callable[[ReqContext], None] | None = None
        """Called with each ended request's context once its chunks are recorded under its
        session, on the scheduler thread (the control server applies the request's KV hint
        envelope there: engine_ext.control)."""

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        super().on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)
        self._apply_demotions()
        hint = parse_pin_hint(req_context.kv_transfer_params)
        if hint is not None:
            self._record(hint, key_groups)
        if self.on_request_end is not None:
            self.on_request_end(req_context)

    def _record(self, hint: PinHint, key_groups: Sequence[Sequence[OffloadKey]]) -> None:
        """The request's chunks join its session's; the hint's pin or release applies."""
        keys = {k for group in key_groups for k in group if k in self.chunks}
        with self.lock:
            known = self.session_keys.get(hint.session_id, set())
            self.session_keys[hint.session_id] = {k for k in known if k in self.chunks} | keys
            if len(self.session_keys) > 4 * self.pins.max_sessions:
                self.session_keys.pop(next(iter(self.session_keys)))
            if hint.release:
                self.pins.unpin(hint.session_id)
            elif hint.ttl_s:
                self.pins.pin(hint.session_id, self.session_keys[hint.session_id], self.clock() + hint.ttl_s)

    def pin_session(self, session_id: str, ttl_s: float) -> int:
        with self.lock:
            keys = self.session_keys.get(session_id, set())
            self.pins.pin(session_id, keys, self.clock() + ttl_s)
            return len(keys)

    def unpin_session(self, session_id: str) -> bool:
        with self.lock:
            return self.pins.unpin(session_id)

    def demote_session(self, session_id: str) -> int:
        """Drop the session's pin and queue its host chunks to be evicted first.

        Called from the control thread; the LRU heap is only touched on the scheduler thread,
        which applies queued demotions at its next eviction or request end.
        """
        with self.lock:
            self.pins.unpin(session_id)
            keys = [k for k in self.session_keys.get(session_id, ()) if k in self.chunks]
            self._pending_demotions.extend(keys)
            return len(keys)

    def _apply_demotions(self) -> None:
        with self.lock:
            keys, self._pending_demotions = self._pending_demotions, []
        if not keys:
            return
        floor = min(self._ranks.values(), default=None)
        if floor is None:  # nothing in the tier
            return
        for i, key in enumerate(keys):
            if key not in self.chunks:
                continue
            self._ranks[key] = _ranked_before(floor, len(keys) - i)
            if key in self._evictable:
                self._push_evictable(key)

    def session_state(self, session_id: str) -> dict[str, object]:
        with self.lock:
            keys = self.session_keys.get(session_id, set())
            resident = sum(1 for k in keys if k in self.chunks)
            return {
                "host_chunks": resident,
                "known_chunks": len(keys),
                "pin": self.pins.session(session_id, self.clock()),
            }

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        self._apply_demotions()
        with self.lock:
            now = self.clock()
            self.pins.expire(now)
            pinned = self.pins.pinned_keys(now)
        if not pinned:
            return super().evict(n, protected)
        evicted = super().evict(n, protected | pinned)  # type: ignore[operator]
        if evicted is None:
            self.num_pin_protected_evictions_refused += 1
        return evicted

    def clear(self) -> None:
        super().clear()
        with self.lock:
            self.session_keys.clear()
