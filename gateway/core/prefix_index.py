"""A bounded, event-sourced index of which engine holds which KV block, and on what medium.

Fed by vLLM KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) for the
full-attention cache group, or by routing decisions for the approximate (text) variant.

``match(hashes)`` answers, per engine, the longest prefix of the request's block chain it holds.
vLLM frees a request's blocks tail first and only ever reuses a prefix, so a held chain is prefix
closed in practice; ``match`` relies on that and binary-searches, which makes a decision
O(engines * log(blocks)) instead of O(context). :func:`match_linear` is the naive reference the
property tests compare against.

Bounded: each engine keeps at most ``capacity_per_engine`` blocks; beyond that the least
recently stored are forgotten (an engine cannot hold more than its KV capacity anyway).

Recency: by default every store moves the whole chain it extends to the recent end (a strict
LRU). That costs O(context) per turn, and it is memory-bound: a 1,200-block chain in an index of a
million blocks took ~270 us of the event loop, for an order that matters only once the index is
full. With ``recency_slack`` > 0 each block also carries a floor: a store count at or before which
every block of its chain, from the head to it, was last moved to the recent end. A turn whose
held part ends in a block with a floor fewer than ``recency_slack`` stores old adds only its new
blocks (they inherit the floor); an older floor moves the whole held part as before and renews
it. So a chain in use sits at most ``recency_slack`` stores further from the recent end than the
strict LRU would keep it: the index behaves as a strict LRU of ``capacity_per_engine -
recency_slack`` blocks for the chains in use. The gateway's indexes use a quarter of their
capacity; the simulator keeps the strict order. An engine whose blocks were ever removed (KV
events' ``BlockRemoved``: a hole can open inside a held chain, which only the strict path refills)
keeps the strict order; the index fed by routing decisions never removes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from gateway.core.types import Medium, PrefixMatch


class _Solo(dict[str, int]):
    """The holders of a block one engine holds: one shared, never mutated, mapping per (engine,
    media mask), instead of a small dict per block (most blocks have one holder: a million of
    them were ~200 MB and a third of a new block's store). Writers replace it, never change it."""

    __slots__ = ()


class PrefixIndex:
    def __init__(self, capacity_per_engine: int = 1 << 20, recency_slack: int = 0) -> None:
        self.capacity_per_engine = capacity_per_engine
        self.recency_slack = max(0, min(recency_slack, capacity_per_engine // 2))
        self._holders: dict[int, dict[str, int]] = {}
        """block hash -> engine -> bit mask of the media holding it (bit ``1 << medium``)."""
        self._lru: dict[str, OrderedDict[int, int]] = {}
        """engine -> block hash -> its floor (``recency_slack``), least recently stored first."""
        self._stores: dict[str, int] = {}
        """engine -> blocks stored on it so far (the clock of ``recency_slack``)."""
        self._solos: dict[tuple[str, int], _Solo] = {}
        self._removed_from: set[str] = set()
        """Engines that had blocks removed (KV events): a removal can leave a hole inside a held
        chain, which only the strict path refills, so they keep the strict order."""
        self._tiered: set[str] = set()
        """Engines that ever announced a non-GPU copy (others need one binary search, not three)."""

    def __len__(self) -> int:
        return len(self._holders)

    def engine_blocks(self, engine: str) -> int:
        return len(self._lru.get(engine, ()))

    # -- updates -------------------------------------------------------------------------------
    def apply_stored(self, engine: str, hashes: Sequence[int], medium: Medium = Medium.GPU) -> None:
        lru = self._lru.get(engine)
        if lru is None:
            lru = self._lru[engine] = OrderedDict()
        now = self._stores.get(engine, 0)
        floor = now
        if medium != Medium.GPU:
            self._tiered.add(engine)
        elif engine not in self._tiered and hashes and hashes[0] in lru:
            # A turn that extends a chain this engine holds (every routed turn of a session):
            # the held part only moves to the recent end of the LRU, in C (an engine that never
            # announced another medium holds all its blocks on the GPU, so no mask changes), or
            # stays where it is while its floor is within the slack.
            k = self._held(lru, hashes)
            slack = self.recency_slack
            if slack and now - lru[hashes[k - 1]] < slack and engine not in self._removed_from:
                floor = lru[hashes[k - 1]]
            else:
                touch = lru.move_to_end
                try:
                    deque(map(touch, hashes[:k]), maxlen=0)
                    if slack:
                        lru.update(dict.fromkeys(hashes[:k], now))
                except KeyError:  # a hole in the chain after all: do it block by block
                    k = 0
            hashes = hashes[k:]
        bit = 1 << medium
        holders_of = self._holders
        solo = self._solo(engine, bit)
        for h in hashes:
            holders = holders_of.get(h)
            if holders is None:
                holders_of[h] = solo
            else:
                mask = holders.get(engine, 0) | bit
                if type(holders) is _Solo:
                    if engine not in holders:
                        holders_of[h] = {**holders, engine: mask}
                    elif mask != holders[engine]:
                        holders_of[h] = self._solo(engine, mask)
                else:
                    holders[engine] = mask
            if h in lru:
                lru.move_to_end(h)
            lru[h] = floor
        self._stores[engine] = now + len(hashes)
        while len(lru) > self.capacity_per_engine:
            old, _ = lru.popitem(last=False)
            self._drop(old, engine)

    def _solo(self, engine: str, mask: int) -> _Solo:
        solo = self._solos.get((engine, mask))
        if solo is None:
            solo = self._solos[engine, mask] = _Solo({engine: mask})
        return solo

    @staticmethod
    def _held(lru: OrderedDict[int, int], hashes: Sequence[int]) -> int:
        """Length of the prefix of ``hashes`` in ``lru`` if it is prefix closed (binary search;
        the caller checks every block of it as it touches them)."""
        return bisect_left(range(len(hashes)), True, key=lambda i: hashes[i] not in lru)

    def apply_removed(self, engine: str, hashes: Sequence[int], medium: Medium | None = None) -> None:
        """Forget blocks on ``engine``. With a medium, only the copy on that medium goes: a block
        evicted from device memory may still sit in the CPU tier."""
        lru = self._lru.get(engine)
        if lru is None:
            return
        if hashes:
            self._removed_from.add(engine)
        for h in hashes:
            holders = self._holders.get(h)
            if holders is None or engine not in holders:
                continue
            if medium is not None:
                mask = holders[engine] & ~(1 << medium)
                if mask:
                    if type(holders) is _Solo:
                        self._holders[h] = self._solo(engine, mask)
                    else:
                        holders[engine] = mask
                    continue
            lru.pop(h, None)
            self._drop(h, engine)

    def clear(self, engine: str) -> None:
        self._stores.pop(engine, None)
        self._removed_from.discard(engine)
        for h in self._lru.pop(engine, OrderedDict()):
            self._drop(h, engine)

    def _drop(self, h: int, engine: str) -> None:
        holders = self._holders.get(h)
        if holders is None or engine not in holders:
            return
        if type(holders) is _Solo:
            del self._holders[h]
            return
        del holders[engine]
        if not holders:
            del self._holders[h]

    # -- queries -------------------------------------------------------------------------------
    def holds(self, engine: str, h: int) -> Medium | None:
        """The best medium holding block ``h`` on ``engine``, or None."""
        holders = self._holders.get(h)
        mask = holders.get(engine, 0) if holders else 0
        return Medium(mask.bit_length() - 1) if mask else None

    def match(self, hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        if not hashes:
            return {}
        first = self._holders.get(hashes[0])
        if not first:
            return {}
        out: dict[str, PrefixMatch] = {}
        plain = first.keys() - self._tiered
        if len(plain) > 1:
            # engines with device copies only: one search for all of them, splitting the set at
            # each probe (set operations in C: a fleet of hundreds of engines that all hold a
            # shared system prompt costs O(log blocks) probes, not O(engines * log blocks))
            for engine, n in self._longest_all(plain, hashes).items():
                out[engine] = PrefixMatch(blocks=n, gpu_blocks=n, weighted_blocks=n * Medium.GPU.weight)
            rest: Iterable[str] = first.keys() & self._tiered
        else:
            rest = first
        for engine in rest:
            n = self._longest(engine, hashes, Medium.STORAGE)
            if engine in self._tiered:
                gpu = self._longest(engine, hashes, Medium.GPU)
                cpu = self._longest(engine, hashes, Medium.CPU)
            else:
                gpu = cpu = n
            weighted = (
                gpu * Medium.GPU.weight + (cpu - gpu) * Medium.CPU.weight + (n - cpu) * Medium.STORAGE.weight
            )
            out[engine] = PrefixMatch(blocks=n, gpu_blocks=gpu, weighted_blocks=weighted)
        return out

    def _longest_all(self, engines: set[str], hashes: Sequence[int]) -> dict[str, int]:
        """Per engine of ``engines`` (each holds ``hashes[0]`` on the GPU only), the length of the
        prefix it holds: a binary search over the chain that splits the engine set at each probe
        (prefix closed: an engine holding block ``mid`` holds every block before it)."""
        out: dict[str, int] = {}
        get = self._holders.get
        empty: dict[str, int] = {}
        stack: list[tuple[int, int, set[str]]] = [(1, len(hashes), engines)]
        while stack:
            lo, hi, group = stack.pop()  # every engine of group holds hashes[lo - 1]
            if lo >= hi:
                for e in group:
                    out[e] = lo
                continue
            mid = (lo + hi) // 2
            right = group & (get(hashes[mid]) or empty).keys()
            if right:
                stack.append((mid + 1, hi, right))
            if len(right) < len(group):
                stack.append((lo, mid, group - right))
        return out

    def _longest(self, engine: str, hashes: Sequence[int], at_least: Medium) -> int:
        """Largest k such that hashes[k-1] is held by ``engine`` on a medium >= ``at_least``
        (binary search over a prefix-closed chain)."""

        def ok(i: int) -> bool:
            m = self.holds(engine, hashes[i])
            return m is not None and m >= at_least

        if not ok(0):
            return 0
        lo, hi = 1, len(hashes)  # ok(lo - 1) holds; find the first failing index in [lo, hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid + 1
            else:
                hi = mid
        return lo


def match_linear(index: PrefixIndex, hashes: Sequence[int]) -> dict[str, int]:
    """Reference: per engine, the longest prefix held (any medium), by a linear scan."""
    engines = {e for h in hashes[:1] for e in (index._holders.get(h) or {})}
    out: dict[str, int] = {}
    for e in engines:
        n = 0
        for h in hashes:
            if index.holds(e, h) is None:
                break
            n += 1
        out[e] = n
    return out
