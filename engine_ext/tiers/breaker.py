"""`GuardedStore`: a circuit breaker in front of an `ObjectStore`, so a lost Mooncake master costs
one failed call, not a client time-out per job.

Measured against a real `mooncake_master` (0.3.13) killed under a connected client: existence
checks and `batch_get_into` fail at once with RPC_FAIL (-900), but a put (`batch_put_from`,
`upsert_batch`) and `get_batch` retry for ~4.3-4.5 s each before failing. An object tier that
keeps calling them while the master is away holds every I/O thread for seconds per job, and a
load queued behind those stores (a request waiting for its KV) waits with them.

Rules (``cooldown_s``, the clock passed in):
- closed: every call goes to the store; a call that raises `StoreUnavailable` opens the breaker
  (``trips``) and re-raises;
- open: every call raises `StoreUnavailable` without touching the store (``short_circuits``)
  until ``cooldown_s`` has passed since it opened;
- half-open (after the cooldown): the next call is the probe; it goes to the store; success
  closes the breaker (``recoveries``), `StoreUnavailable` reopens it for another cooldown.

``epoch`` counts the trips: a master restart loses every key, so a tier that remembers which
keys are present forgets them when the epoch moves. Thread-safe (the tier calls from its I/O
pool and the lookup thread); the store call itself runs outside the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from engine_ext.tiers.store import ObjectStore, StoreUnavailable

__all__ = ["BreakerCounters", "GuardedStore"]

T = TypeVar("T")


class BreakerCounters:
    def __init__(self) -> None:
        self.trips = 0
        self.short_circuits = 0
        self.recoveries = 0
        self.probes = 0

    def snapshot(self) -> dict[str, int]:
        return dict(vars(self))


class GuardedStore:
    """An `ObjectStore` that stops calling the inner store for ``cooldown_s`` after it was unavailable."""

    def __init__(
        self, inner: ObjectStore, cooldown_s: float = 2.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.inner = inner
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._opened_at: float | None = None
        self._probing = False
        self.epoch = 0
        self.counters = BreakerCounters()

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._opened_at is not None

    def _enter(self, op: str) -> bool:
        """May this call reach the store? True: yes (and whether it is the probe is recorded)."""
        with self._lock:
            if self._opened_at is None:
                return False
            if self._probing or self._clock() - self._opened_at < self.cooldown_s:
                self.counters.short_circuits += 1
                raise StoreUnavailable(f"{op}: the store is unavailable (breaker open)")
            self._probing = True
            self.counters.probes += 1
            return True

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        probe = self._enter(op)
        try:
            out = fn()
        except StoreUnavailable:
            with self._lock:
                if self._opened_at is None:  # closed -> open: keys known present may be gone
                    self.epoch += 1
                    self.counters.trips += 1
                self._opened_at = self._clock()
                if probe:
                    self._probing = False
            raise
        except BaseException:
            if probe:
                with self._lock:
                    self._probing = False
            raise
        if probe:
            with self._lock:
                self._opened_at, self._probing = None, False
                self.counters.recoveries += 1
        return out

    # -- ObjectStore ---------------------------------------------------------------------------
    def register_buffer(self, ptr: int, size: int) -> None:
        self.inner.register_buffer(ptr, size)

    def batch_exists(self, keys: list[str]) -> list[bool]:
        return self._call("exists", lambda: self.inner.batch_exists(keys))

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._call("put", lambda: self.inner.batch_put_from(keys, ptrs, sizes))

    def batch_upsert_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._call("upsert", lambda: self.inner.batch_upsert_from(keys, ptrs, sizes))

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return self._call("get", lambda: self.inner.batch_get_into(keys, ptrs, sizes))

    def batch_put_bytes(self, keys: list[str], values: list[bytes]) -> int:
        return self._call("put_bytes", lambda: self.inner.batch_put_bytes(keys, values))

    def batch_get_bytes(self, keys: list[str]) -> list[bytes]:
        return self._call("get_bytes", lambda: self.inner.batch_get_bytes(keys))

    def close(self) -> None:
        self.inner.close()
