"""Prefix indexes for fleets of hundreds of engines, with :class:`~gateway.core.prefix_index.PrefixIndex`'s
interface (``apply_stored``, ``apply_removed``, ``clear``, ``match``, ``engine_blocks``).

:class:`PrefixIndex` keeps, per block, a dict of the engines holding it, plus a per-engine LRU:
~380 bytes per (engine, block) in CPython. Every gateway replica holds the whole index, so at a
thousand engines of 16K blocks each that is ~6 GB per replica. Two alternatives:

- :class:`EngineTables` (exact): one insertion-ordered ``dict`` per engine, block hash -> bit
  mask of the media holding it (``1 << medium``; the LRU order is the dict's order: a re-stored
  block is popped and re-inserted). ~70 bytes per (engine, block) with the hash object, ~5x less;
  the same answers as :class:`PrefixIndex` (property-tested). A match looks the first block up in
  every engine's table (one dict probe per engine, ~40 us at a thousand engines) instead of in one
  inverted table, then binary-searches the engines that hold it.
- :class:`BloomTables` (approximate): per engine a counting Bloom filter (one byte per counter,
  ``counters_per_block`` counters per block of capacity, ``k`` probes), GPU copies only. ~10
  bytes per block of capacity whatever the hash objects cost; no false negatives for blocks
  stored and not removed; a false positive (~1% at 10 counters and k=7) can lengthen a match by
  a block where the chain's next block is absent. Removals decrement; a saturated counter (255)
  stays. Bounded by construction (its size is fixed), so it needs no eviction.

Both rely on the chains being prefix closed, as :class:`PrefixIndex` does.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.core.types import Medium, PrefixMatch

__all__ = ["BloomTables", "EngineTables"]


def _weighted(gpu: int, cpu: int, n: int) -> float:
    return gpu * Medium.GPU.weight + (cpu - gpu) * Medium.CPU.weight + (n - cpu) * Medium.STORAGE.weight


class EngineTables:
    """Exact: per engine, hash -> media bit mask, in store order (see the module docstring)."""

    def __init__(self, capacity_per_engine: int = 1 << 20) -> None:
        self.capacity_per_engine = capacity_per_engine
        self._tables: dict[str, dict[int, int]] = {}
        self._tiered: set[str] = set()
        """Engines that ever announced a non-GPU copy (others need one binary search, not three)."""

    def __len__(self) -> int:
        return len({h for t in self._tables.values() for h in t})

    def engine_blocks(self, engine: str) -> int:
        return len(self._tables.get(engine, ()))

    def entries(self) -> int:
        """(engine, block) pairs held: what the memory grows with."""
        return sum(len(t) for t in self._tables.values())

    def apply_stored(self, engine: str, hashes: Sequence[int], medium: Medium = Medium.GPU) -> None:
        t = self._tables.get(engine)
        if t is None:
            t = self._tables[engine] = {}
        bit = 1 << medium
        if medium != Medium.GPU:
            self._tiered.add(engine)
        pop = t.pop
        for h in hashes:
            t[h] = pop(h, 0) | bit
        over = len(t) - self.capacity_per_engine
        if over > 0:
            for h in list(_first(t, over)):
                del t[h]

    def apply_removed(self, engine: str, hashes: Sequence[int], medium: Medium | None = None) -> None:
        t = self._tables.get(engine)
        if t is None:
            return
        for h in hashes:
            mask = t.get(h)
            if mask is None:
                continue
            if medium is not None:
                mask &= ~(1 << medium)
                if mask:
                    t[h] = mask
                    continue
            del t[h]

    def clear(self, engine: str) -> None:
        self._tables.pop(engine, None)

    def holds(self, engine: str, h: int) -> Medium | None:
        mask = self._tables.get(engine, {}).get(h, 0)
        return Medium(mask.bit_length() - 1) if mask else None

    def match(self, hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        if not hashes:
            return {}
        first = hashes[0]
        out: dict[str, PrefixMatch] = {}
        for engine, t in self._tables.items():
            if first not in t:
                continue
            n = _longest(t, hashes, 1)
            if engine in self._tiered:
                gpu = _longest(t, hashes, 1 << Medium.GPU)
                cpu = _longest(t, hashes, 1 << Medium.CPU)
            else:
                gpu = cpu = n
            out[engine] = PrefixMatch(blocks=n, gpu_blocks=gpu, weighted_blocks=_weighted(gpu, cpu, n))
        return out


def _first(t: dict[int, int], n: int) -> list[int]:
    out = []
    for h in t:
        out.append(h)
        if len(out) == n:
            break
    return out


def _longest(t: dict[int, int], hashes: Sequence[int], at_least_bit: int) -> int:
    """Largest k with hashes[k-1] held on a medium >= the one of ``at_least_bit`` (a held mask
    >= that bit means some medium at least as good holds it)."""

    def ok(i: int) -> bool:
        return t.get(hashes[i], 0) >= at_least_bit

    if not ok(0):
        return 0
    lo, hi = 1, len(hashes)
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


class BloomTables:
    """Approximate: a counting Bloom filter per engine (see the module docstring)."""

    def __init__(self, capacity_per_engine: int, counters_per_block: int = 10, k: int = 7) -> None:
        self.size = max(64, capacity_per_engine * counters_per_block)
        self.k = k
        self._filters: dict[str, bytearray] = {}
        self._count: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(self._count.values())

    def engine_blocks(self, engine: str) -> int:
        return self._count.get(engine, 0)

    def entries(self) -> int:
        return sum(self._count.values())

    def bytes(self) -> int:
        return self.size * len(self._filters)

    def _probes(self, h: int) -> list[int]:
        size = self.size
        a = h & 0xFFFFFFFF
        b = ((h >> 32) & 0xFFFFFFFF) | 1
        return [(a + i * b) % size for i in range(self.k)]

    def _has(self, f: bytearray, h: int) -> bool:
        return all(f[p] for p in self._probes(h))

    def apply_stored(self, engine: str, hashes: Sequence[int], medium: Medium = Medium.GPU) -> None:
        if medium != Medium.GPU:
            return  # device copies only: the summary answers "is it on the GPU"
        f = self._filters.get(engine)
        if f is None:
            f = self._filters[engine] = bytearray(self.size)
            self._count[engine] = 0
        added = 0
        for h in hashes:
            probes = self._probes(h)
            if all(f[p] for p in probes):
                continue  # held already (or a false positive: not counted twice)
            for p in probes:
                if f[p] < 255:
                    f[p] += 1
            added += 1
        self._count[engine] += added

    def apply_removed(self, engine: str, hashes: Sequence[int], medium: Medium | None = None) -> None:
        if medium is not None and medium != Medium.GPU:
            return
        f = self._filters.get(engine)
        if f is None:
            return
        removed = 0
        for h in hashes:
            probes = self._probes(h)
            if not all(f[p] for p in probes):
                continue
            for p in probes:
                if f[p] < 255:
                    f[p] -= 1
            removed += 1
        self._count[engine] = max(0, self._count[engine] - removed)

    def clear(self, engine: str) -> None:
        self._filters.pop(engine, None)
        self._count.pop(engine, None)

    def match(self, hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        if not hashes:
            return {}
        out: dict[str, PrefixMatch] = {}
        first = self._probes(hashes[0])
        for engine, f in self._filters.items():
            if not all(f[p] for p in first):
                continue
            lo, hi = 1, len(hashes)
            while lo < hi:
                mid = (lo + hi) // 2
                if self._has(f, hashes[mid]):
                    lo = mid + 1
                else:
                    hi = mid
            out[engine] = PrefixMatch(blocks=lo, gpu_blocks=lo, weighted_blocks=float(lo))
        return out
