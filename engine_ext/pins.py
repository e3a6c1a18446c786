"""Soft pins: a pure table of (session -> pinned keys, deadline). No I/O, no clock.

A pin protects a session's offloaded chunks from eviction until `now >= until`; after that the
chunks fall back to plain LRU. Time is passed in by the caller. Bounded: at most
`max_sessions` sessions; pinning one more drops the pin with the earliest deadline.

Hints (from `kv_transfer_params["agentgw"]`, set by the gateway):
    session_id: str      the session the request belongs to
    pin_ttl_s: float     keep the session's chunks this long after the turn (0 = release)
    release: bool        the session ended; drop its pin now

The same hint drives the host-tier pins (engine_ext.pinned_policy) and, with the pinning
scheduler, the device pins (engine_ext.device_pins); there, `pin_ttl_s == 0` releases the pin.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HINTS_KEY", "PinHint", "PinTable", "parse_pin_hint"]

HINTS_KEY = "agentgw"


@dataclass(frozen=True)
class PinHint:
    session_id: str
    ttl_s: float | None = None
    release: bool = False


def parse_pin_hint(kv_transfer_params: dict[str, Any] | None) -> PinHint | None:
    """Read the gateway's hint from kv_transfer_params; None when absent or malformed."""
    raw = (kv_transfer_params or {}).get(HINTS_KEY)
    if not isinstance(raw, dict) or not isinstance(raw.get("session_id"), str):
        return None
    ttl = raw.get("pin_ttl_s")
    ttl_s = float(ttl) if isinstance(ttl, int | float) and ttl >= 0 else None
    return PinHint(session_id=raw["session_id"], ttl_s=ttl_s, release=bool(raw.get("release", False)))


@dataclass
class _Pin:
    until: float
    keys: set[bytes] = field(default_factory=set)


class PinTable:
    """session -> (keys, deadline). All methods take `now`; nothing reads a clock."""

    def __init__(self, max_sessions: int = 4096):
        self.max_sessions = max_sessions
        self._pins: dict[str, _Pin] = {}

    def pin(self, session_id: str, keys: Iterable[bytes], until: float) -> None:
        pin = self._pins.get(session_id)
        if pin is None:
            if len(self._pins) >= self.max_sessions:
                oldest = min(self._pins, key=lambda s: self._pins[s].until)
                del self._pins[oldest]
            pin = self._pins[session_id] = _Pin(until=until)
        pin.until = until
        pin.keys.update(keys)

    def extend(self, session_id: str, until: float) -> bool:
        pin = self._pins.get(session_id)
        if pin is None:
            return False
        pin.until = until
        return True

    def add_keys(self, session_id: str, keys: Iterable[bytes]) -> None:
        pin = self._pins.get(session_id)
        if pin is not None:
            pin.keys.update(keys)

    def unpin(self, session_id: str) -> bool:
        return self._pins.pop(session_id, None) is not None

    def expire(self, now: float) -> list[str]:
        expired = [s for s, p in self._pins.items() if p.until <= now]
        for s in expired:
            del self._pins[s]
        return expired

    def pinned_keys(self, now: float) -> set[bytes]:
        keys: set[bytes] = set()
        for pin in self._pins.values():
            if pin.until > now:
                keys |= pin.keys
        return keys

    def session(self, session_id: str, now: float) -> dict[str, Any] | None:
        pin = self._pins.get(session_id)
        if pin is None or pin.until <= now:
            return None
        return {"session_id": session_id, "num_keys": len(pin.keys), "ttl_left_s": round(pin.until - now, 3)}

    def sessions(self) -> list[str]:
        return list(self._pins)

    def __len__(self) -> int:
        return len(self._pins)
