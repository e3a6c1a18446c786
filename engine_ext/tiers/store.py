"""The one protocol every object tier speaks, and its two backends.

`ObjectStore` is deliberately small: existence, put-from-memory, get-into-memory, all batched,
all addressed by prebuilt key strings and raw host pointers (zero-copy for Mooncake once the
buffer is registered). Return values follow Mooncake: per key, `>= 0` is success (bytes for
gets), negative is an error code.

- `MooncakeObjectStore`: the real `MooncakeDistributedStore` over TCP. A call the master could
  not answer (RPC_FAIL, -900: the master is down or restarting) raises `StoreUnavailable`, so
  `engine_ext.tiers.breaker.GuardedStore` can stop calling until it is back. A transfer to a peer
  that accepts the connection but does not answer (stopped, or its transfer thread starved) is
  dropped after 30 s without progress by Mooncake's TCP transport, which retries it within the
  batch deadline (`MC_TRANSFER_TIMEOUT`, 60 s by default). `stall_timeout_s` (off by default:
  on a loaded machine, transfers that would have resumed were dropped at 5 s) sets the first;
  the environment sets the second. While a store to such a peer was pending, the engine's next
  requests waited with it (docs/engine_ext.md, "A stalled store").
- `MemoryObjectStore`: an in-process dict, for unit tests and fault injection.

`get_into_renewing_leases` re-reads the keys a batched get failed with a transient error:
`LEASE_EXPIRED` (Mooncake grants a read lease, the master's `default_kv_lease_ttl`, when it hands
out an object's replica and fails the get when the transfer ends after it, so a read slowed down
by a loaded machine or a peer whose transfer thread is not scheduled fails although the object is
there; a new get takes a new lease), `TRANSFER_FAIL` and `RPC_TIMEOUT` (the same slow peer or
master, seen from the transfer or the RPC), `REPLICA_IS_NOT_READY` (a put still completing) and
`NO_AVAILABLE_HANDLE`. Bounded by `retries`; any other error (`OBJECT_NOT_FOUND`: evicted or never
stored) is returned as it is, and so is a transient one that outlasts the retries.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from typing import Protocol

__all__ = [
    "LEASE_EXPIRED",
    "RPC_FAIL",
    "TRANSIENT_GET_ERRORS",
    "MemoryObjectStore",
    "MooncakeObjectStore",
    "ObjectStore",
    "StoreUnavailable",
    "get_into_renewing_leases",
    "stall_timeout_defaults",
]

RPC_FAIL = -900
"""Mooncake's error code for a call the master did not answer."""

#: Mooncake's error code for a get whose transfer finished after its read lease expired.
LEASE_EXPIRED = -707

#: Mooncake's TCP transport reads these when a client is set up: how long a transfer may make no
#: progress, and how long it may wait for the peer's status frame, before it is dropped (30 s each).
STALL_TIMEOUT_ENV = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
DEFAULT_STALL_TIMEOUT_S: float | None = None  # Mooncake's own 30 s

RETRY_BACKOFF_S = 0.05
"""Pause before the second and later re-reads (x the attempt), on the tier's I/O thread."""

#: Mooncake's error codes (mooncake-store types.h) after which the same get may succeed.
TRANSIENT_GET_ERRORS = frozenset({LEASE_EXPIRED, -800, -901, -703, -200})
"""LEASE_EXPIRED, TRANSFER_FAIL, RPC_TIMEOUT, REPLICA_IS_NOT_READY, NO_AVAILABLE_HANDLE."""


class StoreUnavailable(RuntimeError):
    """The store's master cannot be reached: nothing was stored or read (not a per-key miss)."""


def _checked(op: str, rcs: list[int]) -> list[int]:
    if RPC_FAIL in rcs:
        raise StoreUnavailable(f"mooncake {op}: master unreachable (rc={RPC_FAIL})")
    return rcs


class ObjectStore(Protocol):
    def register_buffer(self, ptr: int, size: int) -> None: ...
    def batch_exists(self, keys: list[str]) -> list[bool]: ...
    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def batch_upsert_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def batch_put_bytes(self, keys: list[str], values: list[bytes]) -> int: ...
    def batch_get_bytes(self, keys: list[str]) -> list[bytes]: ...
    def close(self) -> None: ...


def get_into_renewing_leases(
    store: ObjectStore, keys: list[str], ptrs: list[int], sizes: list[int], retries: int
) -> tuple[list[int], int]:
    """`batch_get_into`, then up to `retries` more gets of the keys that failed with a
    transient error (`TRANSIENT_GET_ERRORS`); returns the per-key results and how many keys were
    read again."""
    rcs = store.batch_get_into(keys, ptrs, sizes)
    again = 0
    for attempt in range(retries):
        idx = [i for i, rc in enumerate(rcs) if rc in TRANSIENT_GET_ERRORS]
        if not idx:
            break
        if attempt:
            time.sleep(RETRY_BACKOFF_S * attempt)  # a busy peer: give it a moment (I/O thread)
        again += len(idx)
        for i, rc in zip(
            idx,
            store.batch_get_into([keys[i] for i in idx], [ptrs[i] for i in idx], [sizes[i] for i in idx]),
            strict=True,
        ):
            rcs[i] = rc
    return rcs, again


class MemoryObjectStore:
    """Thread-safe in-memory store with Mooncake's semantics (put does not overwrite)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def register_buffer(self, ptr: int, size: int) -> None:
        return None

    def batch_exists(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [k in self.objects for k in keys]

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        with self._lock:
            for k, p, n in zip(keys, ptrs, sizes, strict=True):
                self.objects.setdefault(k, ctypes.string_at(p, n))
        return [0] * len(keys)

    def batch_upsert_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        with self._lock:
            for k, p, n in zip(keys, ptrs, sizes, strict=True):
                self.objects[k] = ctypes.string_at(p, n)
        return [0] * len(keys)

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        out = []
        with self._lock:
            for k, p, n in zip(keys, ptrs, sizes, strict=True):
                v = self.objects.get(k)
                if v is None:
                    out.append(-704)  # OBJECT_NOT_FOUND
                    continue
                ctypes.memmove(p, v, min(n, len(v)))
                out.append(len(v))
        return out

    def batch_put_bytes(self, keys: list[str], values: list[bytes]) -> int:
        with self._lock:
            for k, v in zip(keys, values, strict=True):
                self.objects[k] = bytes(v)
        return 0

    def batch_get_bytes(self, keys: list[str]) -> list[bytes]:
        with self._lock:
            return [self.objects.get(k, b"") for k in keys]

    def close(self) -> None:
        return None


def stall_timeout_defaults(stall_timeout_s: float) -> dict[str, str]:
    """Set Mooncake's stall timeouts in this process's environment unless they are set; returns
    what they are now. Whole seconds (Mooncake parses integers), at least 1."""
    seconds = max(1, math.ceil(stall_timeout_s))
    for name in STALL_TIMEOUT_ENV:
        os.environ.setdefault(name, str(seconds))
    return {name: os.environ[name] for name in STALL_TIMEOUT_ENV}


class MooncakeObjectStore:
    """`MooncakeDistributedStore` behind `ObjectStore` (TCP transport, HTTP metadata)."""

    def __init__(
        self,
        master_address: str,
        metadata_server: str,
        local_hostname: str = "127.0.0.1",
        global_segment_size: int = 64 << 20,
        local_buffer_size: int = 64 << 20,
        protocol: str = "tcp",
        stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    ):
        """`stall_timeout_s`: see the module docstring; None (the default) keeps Mooncake's own
        timeouts. The environment wins: an operator's `MC_TCP_PROGRESS_TIMEOUT_SEC` etc. are left
        as they are."""
        if stall_timeout_s is not None:
            stall_timeout_defaults(stall_timeout_s)
        from mooncake.store import MooncakeDistributedStore

        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            local_hostname,
            metadata_server,
            global_segment_size,
            local_buffer_size,
            protocol,
            "",
            master_address,
        )
        if rc != 0:
            raise RuntimeError(f"mooncake setup failed (rc={rc}) against master {master_address}")
        self._closed = False

    def register_buffer(self, ptr: int, size: int) -> None:
        rc = self._store.register_buffer(ptr, size)
        if rc != 0:
            raise RuntimeError(f"mooncake register_buffer failed (rc={rc})")

    def batch_exists(self, keys: list[str]) -> list[bool]:
        return [r == 1 for r in _checked("exists", list(self._store.batch_is_exist(keys)))]

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return _checked("put", list(self._store.batch_put_from(keys, ptrs, sizes)))

    def batch_upsert_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return _checked("upsert", list(self._store.batch_upsert_from(keys, ptrs, sizes)))

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return _checked("get", list(self._store.batch_get_into(keys, ptrs, sizes)))

    def batch_put_bytes(self, keys: list[str], values: list[bytes]) -> int:
        return _checked("upsert_batch", [int(self._store.upsert_batch(keys, values))])[0]

    def batch_get_bytes(self, keys: list[str]) -> list[bytes]:
        return list(self._store.get_batch(keys))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._store.close()
