"""`get_into_renewing_leases`: keys a get failed with a transient error are read again, within a bound.

The store is `MemoryObjectStore` with faults injected the way Mooncake reports them: a key's
first reads answer -707 (the transfer outlived its read lease) although the object is there.
"""

from __future__ import annotations

import ctypes

import pytest

from engine_ext.tiers.store import LEASE_EXPIRED, MemoryObjectStore, get_into_renewing_leases

SIZE = 64


class LapsingStore(MemoryObjectStore):
    """Answers `code` (LEASE_EXPIRED by default) for the first `lapses[key]` reads of a key."""

    def __init__(self, lapses: dict[str, int], code: int = LEASE_EXPIRED) -> None:
        super().__init__()
        self.code = code
        self.lapses = dict(lapses)
        self.reads: list[list[str]] = []

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.reads.append(list(keys))
        out = super().batch_get_into(keys, ptrs, sizes)
        for i, k in enumerate(keys):
            if self.lapses.get(k, 0) > 0:
                self.lapses[k] -= 1
                out[i] = self.code
        return out


def _setup(store: MemoryObjectStore, keys: list[str]) -> tuple[ctypes.Array[ctypes.c_char], list[int]]:
    for i, k in enumerate(keys):
        store.objects[k] = bytes([i + 1]) * SIZE
    buf = ctypes.create_string_buffer(SIZE * len(keys))
    return buf, [ctypes.addressof(buf) + i * SIZE for i in range(len(keys))]


def test_lapsed_leases_are_read_again_and_the_data_arrives() -> None:
    keys = ["a", "b", "c"]
    store = LapsingStore({"b": 1, "c": 2})
    buf, ptrs = _setup(store, keys)
    rcs, again = get_into_renewing_leases(store, keys, ptrs, [SIZE] * 3, retries=2)
    assert rcs == [SIZE, SIZE, SIZE]
    assert again == 3  # b once, c twice
    assert store.reads == [["a", "b", "c"], ["b", "c"], ["c"]]
    assert buf.raw == b"\x01" * SIZE + b"\x02" * SIZE + b"\x03" * SIZE


def test_the_retries_are_bounded_and_other_errors_are_not_retried() -> None:
    keys = ["a", "gone"]
    store = LapsingStore({"a": 5})
    buf, ptrs = _setup(store, keys[:1])
    ptrs.append(ctypes.addressof(buf))  # "gone" is not in the store: -704, not retried
    rcs, again = get_into_renewing_leases(store, keys, ptrs, [SIZE] * 2, retries=2)
    assert rcs == [LEASE_EXPIRED, -704]
    assert again == 2
    assert store.reads == [["a", "gone"], ["a"], ["a"]]


def test_no_retries_is_one_get() -> None:
    store = LapsingStore({"a": 1})
    _, ptrs = _setup(store, ["a"])
    assert get_into_renewing_leases(store, ["a"], ptrs, [SIZE], retries=0) == ([LEASE_EXPIRED], 0)


@pytest.mark.parametrize(
    ("code", "retried"),
    [
        (-800, True),  # TRANSFER_FAIL: a peer too slow to serve its segment
        (-901, True),  # RPC_TIMEOUT
        (-703, True),  # REPLICA_IS_NOT_READY: a put still completing
        (-200, True),  # NO_AVAILABLE_HANDLE
        (-704, False),  # OBJECT_NOT_FOUND: evicted, a second get cannot find it either
        (-600, False),  # INVALID_PARAMS
    ],
)
def test_transient_errors_are_read_again_and_final_ones_are_not(code: int, retried: bool) -> None:
    store = LapsingStore({"a": 1}, code=code)
    _buf, ptrs = _setup(store, ["a"])  # the buffer the gets write into, kept alive
    rcs, again = get_into_renewing_leases(store, ["a"], ptrs, [SIZE], retries=2)
    assert (rcs, again) == (([SIZE], 1) if retried else ([code], 0))
    assert len(store.reads) == (2 if retried else 1)
