"""KV tiers below the device cache, as engine_ext provides them: a host (CPU) tier per engine and
a shared Mooncake-like store, both written through.

- **Host tier** (per engine, ``host_blocks`` capacity, LRU): every block that becomes resident in
  the engine's device cache (computed or loaded) is stored there too (vLLM's
  ``OffloadingConnector`` with ``offload_prompt_only=False``); when full, the least recently
  stored / used block goes, skipping blocks pinned until a later time (soft: if only pinned
  blocks are left, the oldest pinned one goes anyway).
- **Store** (shared, unbounded): every host-tier block is written through once (the first writer
  publishes it; duplicates are skipped, rule (a) in docs/engine_ext.md).
- **Loads**: a request whose prefix continues past the device hit in this engine's host tier, then
  in the store, loads those blocks instead of recomputing them: ``host blocks x block bytes /
  host bandwidth + store blocks x block bytes x (1 / store bandwidth + 1 / host bandwidth)``
  (store -> host -> device, not overlapped); the loads onto one engine run one after another.
- **KV events**: host-tier stores / evictions are published with medium ``CPU``, first writes to
  the store with medium ``STORAGE`` (by the writing engine), as engine_ext's connector does; the
  device cache keeps publishing ``GPU``.

Bandwidths are GB/s (1e9 bytes per second).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice

from gateway.core.types import Medium

__all__ = ["DEFAULT_KV_BYTES_PER_TOKEN", "HostTier", "Tiers", "TiersConfig"]

#: KV bytes per token when the engine model is abstract (Dynamo's mocker): 128 KiB, e.g.
#: Llama-3.1-8B in BF16 (32 layers x 8 KV heads x 128 x 2 x 2 bytes) or Qwen3-32B in FP8.
DEFAULT_KV_BYTES_PER_TOKEN = 131_072


@dataclass(frozen=True, slots=True)
class TiersConfig:
    host_blocks: int = 32_768
    """Host tier capacity per engine, in blocks (0: no host tier)."""
    host_gbps: float = 50.0
    """Host <-> device bandwidth (PCIe 5 x16, practical)."""
    store: bool = True
    """A shared store (Mooncake) under the host tiers."""
    store_gbps: float = 2.3
    """Store -> host bandwidth (2.3 GB/s: Mooncake over loopback TCP on the dev machine,
    shared/ANCHORS.md; RDMA deployments are an order of magnitude faster)."""
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN


class HostTier:
    """One engine's host tier: an LRU of block hashes with soft pins."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.pins: dict[int, float] = {}
        """hash -> pinned until (virtual seconds)."""

    def __contains__(self, h: int) -> bool:
        return h in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    def add(self, hashes: list[int], now: float) -> tuple[list[int], list[int]]:
        """Store (or touch) ``hashes``; returns (newly stored, evicted)."""
        lru = self.lru
        new = [h for h in hashes if h not in lru]
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        evicted: list[int] = []
        over = len(lru) - self.capacity
        if over <= 0:
            return new, evicted
        pins = self.pins
        if pins:
            # at most len(pins) of the oldest are pinned: scanning over + len(pins) finds the rest
            skipped = []
            for h in list(islice(lru, over + len(pins))):
                if len(evicted) == over:
                    break
                if pins.get(h, 0.0) > now:
                    skipped.append(h)
                    continue
                del lru[h]
                pins.pop(h, None)
                evicted.append(h)
            for h in skipped:  # soft pins: only pinned blocks are left
                if len(evicted) == over:
                    break
                del lru[h]
                pins.pop(h, None)
                evicted.append(h)
        while len(evicted) < over:
            h, _ = lru.popitem(last=False)
            evicted.append(h)
        return new, evicted

    def pin(self, hashes: list[int], until: float) -> None:
        pins, lru = self.pins, self.lru
        for h in hashes:
            if h in lru:
                pins[h] = max(pins.get(h, 0.0), until)

    def unpin(self, hashes: list[int]) -> None:
        for h in hashes:
            self.pins.pop(h, None)


KvSink = Callable[[str, list[int], list[int], Medium], None]


class Tiers:
    """The host tiers of all engines and the shared store."""

    def __init__(self, cfg: TiersConfig, engines: list[str], on_kv: KvSink | None = None) -> None:
        self.cfg = cfg
        self.host = {e: HostTier(cfg.host_blocks) for e in engines} if cfg.host_blocks > 0 else {}
        self.store: set[int] | None = set() if cfg.store else None
        self.on_kv = on_kv
        self.block_bytes = 0
        """Set by the first engine (block size x KV bytes per token)."""
        # counters
        self.loaded_host_blocks = 0
        self.loaded_store_blocks = 0
        self.load_s = 0.0
        self.link_free: dict[str, float] = {}
        """engine -> when its link is free (loads are serialized per engine)."""

    def set_block_size(self, block_size: int) -> None:
        self.block_bytes = block_size * self.cfg.kv_bytes_per_token

    # -- writes -------------------------------------------------------------------------------
    def stored(self, engine: str, hashes: list[int], now: float) -> None:
        """Blocks became resident on ``engine``'s device: write them through."""
        if not hashes:
            return
        host = self.host.get(engine)
        on_kv = self.on_kv
        if host is not None:
            new, evicted = host.add(hashes, now)
            if on_kv is not None and (new or evicted):
                on_kv(engine, new, evicted, Medium.CPU)
        store = self.store
        if store is not None:
            fresh = [h for h in hashes if h not in store] if not store.isdisjoint(hashes) else hashes
            if fresh:
                store.update(fresh)
                if on_kv is not None:
                    on_kv(engine, list(fresh), [], Medium.STORAGE)

    # -- loads --------------------------------------------------------------------------------
    def probe(self, engine: str, hashes: list[int], start: int, limit: int) -> tuple[int, int, int]:
        """How far the prefix ``hashes[:limit]`` continues past ``start`` (the device hit) in the
        host tier, then the store: ``(end, host blocks, store blocks)``. No side effect."""
        host = self.host.get(engine)
        lru = host.lru if host is not None else None
        store = self.store
        k = start
        n_host = n_store = 0
        while k < limit:
            h = hashes[k]
            if lru is not None and h in lru:
                n_host += 1
            elif store is not None and h in store:
                n_store += 1
            else:
                break
            k += 1
        return k, n_host, n_store

    def load(self, engine: str, hashes: list[int], n_host: int, n_store: int, now: float) -> float:
        """Load ``hashes`` (``n_host`` from the host tier, ``n_store`` from the store) onto the
        device: touches the host blocks, counts, returns when the load completes. Loads onto one
        engine share its link: they run one after another (FIFO)."""
        host = self.host.get(engine)
        if host is not None:
            lru = host.lru
            for h in hashes:
                if h in lru:
                    lru.move_to_end(h)
        cfg = self.cfg
        bb = self.block_bytes
        t = (n_host + n_store) * bb / (cfg.host_gbps * 1e9)
        if n_store:
            t += n_store * bb / (cfg.store_gbps * 1e9)
        self.loaded_host_blocks += n_host
        self.loaded_store_blocks += n_store
        self.load_s += t
        start = max(now, self.link_free.get(engine, 0.0))
        self.link_free[engine] = start + t
        return start + t

    # -- pins ---------------------------------------------------------------------------------
    def pin_host(self, engine: str, hashes: list[int], until: float) -> None:
        host = self.host.get(engine)
        if host is not None:
            host.pin(hashes, until)

    def unpin_host(self, engine: str, hashes: list[int]) -> None:
        host = self.host.get(engine)
        if host is not None:
            host.unpin(hashes)
