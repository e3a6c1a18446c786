"""The one protocol every object tier speaks, and its two backends.

`ObjectStore` is deliberately small: existence, put-from-memory, get-into-memory, all batched,
all addressed by prebuilt key strings and raw host pointers (zero-copy for Mooncake once the
buffer is registered). Return values follow Mooncake: per key, `>= 0` is success (bytes for
gets), negative is an error code.

- `MooncakeObjectStore`: the real `MooncakeDistributedStore` over TCP. A call the master could
  not answer (RPC_FAIL, -900: the master is down or restarting) raises `StoreUnavailable`, so
  `engine_ext.tiers.breaker.GuardedStore` can stop calling until it is back.
- `MemoryObjectStore`: an in-process dict, for unit tests and fault injection.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Protocol

__all__ = ["RPC_FAIL", "MemoryObjectStore", "MooncakeObjectStore", "ObjectStore", "StoreUnavailable"]

RPC_FAIL = -900
"""Mooncake's error code for a call the master did not answer."""


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
    ):
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
