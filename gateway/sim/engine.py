"""A modeled vLLM engine: chunked-prefill scheduler, block KV cache with LRU prefix caching,
KV events, and a pass-time model. Virtual time only: the caller owns the clock.

Scheduler (one pass): every decoding sequence takes one token of the ``max_batched_tokens``
budget; then running prefills continue FCFS, each chunk capped by the budget and by
``long_prefill_token_threshold`` (0 = no cap); then waiting requests are admitted FCFS while the
budget, ``max_seqs`` and free blocks allow. As in vLLM 0.32's scheduler
(``--long-prefill-token-threshold``), the cap is lifted while the engine holds a single request
(there is nobody to starve). A new request's cached prefix is the longest prefix of
its block chain resident on this engine, capped so that at least its last token is computed (a
fully cached prompt recomputes its last block); a partial last block has no hash and is never
reused. When a decoding sequence needs a block and none is free, the most recently admitted
sequence is preempted and recomputed later.

KV cache: ``num_blocks`` device blocks. Blocks of running sequences are pinned (ref-counted);
freed blocks stay cached in an LRU (a request's blocks are freed tail first, so its prefix is
evicted last) and are evicted head first when an allocation needs room. ``Stored`` fires when a
hash first becomes resident, ``Removed`` when it is evicted; both are delivered at the end of
the pass, like vLLM's KV events.

Pass time (ms), :class:`PerfModel`: ``prefill = p0 + p1*T + p2*T^2 + p_attn*A`` over the pass's
uncached tokens ``T`` (and ``A`` = sum over chunks of chunk tokens x tokens before the chunk, in
millions: attention to the cached prefix; 0 in Dynamo's mocker), plus, when any sequence decodes,
``decode = max(floor, d0 + d1*u + d2*u^2) + d_seq*batch + d_kv*kv_tokens/1e6`` with ``u`` the
fraction of KV blocks held by decoding sequences. The first token of a prefill adds no decode
time. :data:`DYNAMO_MOCKER` is Dynamo 1.6.1's mocker default (see shared/ANCHORS.md).

Decode-only stretches are advanced as one macro pass of ``n`` steps (until the next sequence
finishes); an arrival interrupts it at the next step boundary (:meth:`Engine.interrupt`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.sim.tiers import Tiers

__all__ = ["DYNAMO_MOCKER", "Engine", "EngineConfig", "PerfModel", "Seq"]


@dataclass(frozen=True, slots=True)
class PerfModel:
    p0: float = 16.50142
    p1: float = 1.518344e-02
    p2: float = 4.209989e-07
    p_attn: float = 0.0
    d0: float = 5.74
    d1: float = 54.01
    d2: float = -25.74
    d_seq: float = 0.0
    d_kv: float = 0.0
    floor_ms: float = 1.0

    def prefill_ms(self, tokens: int, attn_mtok2: float = 0.0) -> float:
        if tokens <= 0:
            return 0.0
        return self.p0 + self.p1 * tokens + self.p2 * tokens * tokens + self.p_attn * attn_mtok2

    def decode_ms(self, u: float, batch: int, kv_tokens: int) -> float:
        base = max(self.floor_ms, self.d0 + self.d1 * u + self.d2 * u * u)
        return base + self.d_seq * batch + self.d_kv * kv_tokens / 1e6


@dataclass(frozen=True, slots=True)
class EngineConfig:
    name: str = "dynamo-mocker"
    block_size: int = 64
    num_blocks: int = 16_384
    max_batched_tokens: int = 8_192
    max_seqs: int = 256
    long_prefill_token_threshold: int = 0
    perf: PerfModel = field(default_factory=PerfModel)
    kv_bytes_per_token: int = 0
    """For KV bytes moved (planner); 0 when the model is abstract."""
    host_blocks: int = 0
    """Host (CPU) tier capacity in blocks; the tiers themselves are :mod:`gateway.sim.tiers`
    (``SimConfig.tiers``), these three fields are their defaults for this engine model."""
    host_gbps: float = 50.0
    store_gbps: float = 2.3

    def with_(self, **kw: object) -> EngineConfig:
        return replace(self, **kw)  # type: ignore[arg-type]


DYNAMO_MOCKER = EngineConfig()


class Seq:
    """One request on one engine."""

    __slots__ = (
        "admitted",
        "cached_tokens",
        "chunk",
        "computed",
        "hashes",
        "loaded",
        "max_out",
        "out_done",
        "own",
        "pinned",
        "prompt",
        "ready_at",
        "recomputed",
        "rid",
        "t_arrive",
        "t_first",
        "t_last",
    )

    def __init__(self, rid: int, prompt: int, max_out: int, hashes: list[int], t_arrive: float) -> None:
        self.rid = rid
        self.prompt = prompt
        self.max_out = max_out
        self.hashes = hashes
        self.t_arrive = t_arrive
        self.computed = 0
        """Prompt tokens in KV (cached or computed)."""
        self.cached_tokens = -1
        """Prefix-cache hit at first admission (-1: not yet admitted)."""
        self.recomputed = 0
        self.out_done = 0
        self.pinned = 0
        """Leading hashes this sequence holds a reference to."""
        self.own = 0
        """Unhashed blocks it holds (partial prompt block, decode blocks)."""
        self.chunk = 0
        self.admitted = 0
        self.t_first = -1.0
        self.t_last = -1.0
        self.loaded = 0
        """Prompt tokens loaded from the host tier / store instead of recomputed."""
        self.ready_at = 0.0
        """While loading: when the load completes."""


class Engine:
    def __init__(
        self,
        name: str,
        cfg: EngineConfig,
        on_kv_events: Callable[[str, list[int], list[int]], None] | None = None,
        tiers: Tiers | None = None,
    ) -> None:
        self.name = name
        self.cfg = cfg
        self.bs = cfg.block_size
        self.on_kv_events = on_kv_events
        self.on_first: Callable[[Seq], None] | None = None
        """Called when a sequence produces its first token (the gateway's first byte)."""
        self.tiers = tiers
        if tiers is not None:
            tiers.set_block_size(cfg.block_size)
        self.now = 0.0
        self.soft: dict[int, float] = {}
        """Soft device pins: hash -> pinned until (skipped by eviction while other blocks are
        free; evicted anyway when only pinned blocks are left)."""
        self.loading: list[Seq] = []
        """Admitted requests whose prefix is being loaded from the host tier / store."""  # Block cache, kept in C-level bulk operations (a turn touches ~1,600 blocks):
        self.stamp: dict[int, int] = {}
        """Every resident hashed block -> the id of the LRU record that last freed it (0: never)."""
        self.pinned: set[int] = set()
        """Blocks referenced by at least one running sequence."""
        self.ref2: dict[int, int] = {}
        """References beyond the first, for blocks shared by running sequences."""
        self._lru: deque[list[Any]] = deque()
        """Release records ``[id, hashes tail first, next position]``, oldest first; an entry is
        stale when its block was freed again later (its stamp moved on) or is pinned."""
        self._lru_id = 0
        self.own_blocks = 0
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self._stored: list[int] = []
        self._removed: list[int] = []
        self._admit_seq = 0
        # the pass in flight
        self.busy = False
        self.pass_start = 0.0
        self.pass_end = 0.0
        self.pass_steps = 0
        self.step_ms = 0.0
        self._prefill: list[Seq] = []
        self._decode: list[Seq] = []
        # counters
        self.busy_s = 0.0
        self.prefill_tokens = 0
        self.preemptions = 0

    # -- views -----------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        return len(self.pinned) + self.own_blocks

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.cfg.num_blocks

    @property
    def cached_free_blocks(self) -> int:
        return len(self.stamp) - len(self.pinned)

    @property
    def decoding(self) -> int:
        """Running sequences past their prefill."""
        return sum(1 for s in self.running if s.computed >= s.prompt)

    def prefill_backlog_tokens(self) -> int:
        """Prompt tokens still to compute: running prefills' rest, and waiting requests' prompt
        beyond their resident prefix (what the gateway knows as the decisions' uncached tokens)."""
        n = sum(s.prompt - s.computed for s in self.running if s.computed < s.prompt)
        bs = self.bs
        for s in self.waiting:
            done = s.computed if (s.computed or s.pinned) else self.hit_blocks(s.hashes) * bs
            n += max(0, s.prompt - done)
        return n

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.loading)

    def next_ready(self) -> float | None:
        """When the next load completes (the caller wakes the engine then)."""
        return min((s.ready_at for s in self.loading), default=None)

    def remove_waiting(self, rid: int) -> bool:
        """Drop a request not yet admitted (a cancelled prefetch)."""
        for s in self.waiting:
            if s.rid == rid and s.computed == 0 and s.pinned == 0:
                self.waiting.remove(s)
                return True
        return False

    def soft_pin(self, hashes: list[int], until: float) -> int:
        """Keep the resident ``hashes`` from LRU eviction until ``until``; returns how many."""
        soft, stamp = self.soft, self.stamp
        n = 0
        for h in hashes:
            if h in stamp:
                if soft.get(h, 0.0) < until:
                    soft[h] = until
                n += 1
        return n

    def unpin(self, hashes: list[int]) -> None:
        soft = self.soft
        if soft:
            for h in hashes:
                soft.pop(h, None)

    def resident(self, h: int) -> bool:
        return h in self.stamp

    def hit_blocks(self, hashes: list[int]) -> int:
        """Longest resident prefix (binary search: resident chains are prefix closed)."""
        stamp = self.stamp
        if not hashes or hashes[0] not in stamp:
            return 0
        lo, hi = 1, len(hashes)
        while lo < hi:
            mid = (lo + hi) // 2
            if hashes[mid] in stamp:
                lo = mid + 1
            else:
                hi = mid
        return lo

    # -- blocks ----------------------------------------------------------------------------
    def _spare(self) -> int:
        return self.cfg.num_blocks - self.own_blocks - len(self.stamp)

    def _has_room(self, s: Seq, k: int, need: int) -> bool:
        """Whether ``need`` blocks can be had for ``s`` beside its ``k`` hit blocks (pinning the
        hit takes its free blocks out of the evictable set)."""
        room = self._spare() + self.cached_free_blocks - k
        if room < need:
            room += len(self.pinned.intersection(s.hashes[:k]))
        return room >= need

    def _room(self, n: int) -> bool:
        """Make ``n`` free blocks, evicting cached ones LRU first; False (nothing evicted) if
        impossible."""
        need = n - self._spare()
        if need <= 0:
            return True
        if need > self.cached_free_blocks:
            return False
        stamp, pinned, removed, lru = self.stamp, self.pinned, self._removed, self._lru
        soft, now = self.soft, self.now
        deferred: list[int] = []
        while need > 0 and lru:
            rec = lru[0]
            rid, hs, pos = rec
            n_hs = len(hs)
            while pos < n_hs and need > 0:
                h = hs[pos]
                pos += 1
                if stamp.get(h) == rid and h not in pinned:
                    if soft:
                        if soft.get(h, 0.0) > now:
                            deferred.append(h)
                            continue
                        soft.pop(h, None)
                    del stamp[h]
                    removed.append(h)
                    need -= 1
            if pos >= n_hs:
                lru.popleft()
            else:
                rec[2] = pos
        if deferred:
            i = 0
            while need > 0:  # only soft-pinned blocks are left: the oldest go anyway
                h = deferred[i]
                i += 1
                soft.pop(h, None)
                del stamp[h]
                removed.append(h)
                need -= 1
            if i < len(deferred):
                self._lru_id += 1
                rest = deferred[i:]
                stamp.update(dict.fromkeys(rest, self._lru_id))
                lru.append([self._lru_id, rest, 0])
        return True

    def _pin_prefix(self, s: Seq, k: int) -> None:
        hs = s.hashes[s.pinned : k]
        pinned = self.pinned
        if pinned.isdisjoint(hs):
            pinned.update(hs)
        else:
            ref2 = self.ref2
            for h in hs:
                if h in pinned:
                    ref2[h] = ref2.get(h, 0) + 1
                else:
                    pinned.add(h)
        s.pinned = max(s.pinned, k)

    def _hold(self, hs: list[int]) -> None:
        """Running blocks with hashes ``hs`` (computed or loaded) become pinned cache entries."""
        stamp, pinned = self.stamp, self.pinned
        if stamp.keys().isdisjoint(hs):
            stamp.update(dict.fromkeys(hs, 0))
            pinned.update(hs)
            self._stored.extend(hs)
            return
        ref2, stored = self.ref2, self._stored
        for h in hs:
            if h in pinned:
                ref2[h] = ref2.get(h, 0) + 1  # stored meanwhile by another sequence: share it
            elif h in stamp:
                pinned.add(h)
            else:
                stamp[h] = 0
                pinned.add(h)
                stored.append(h)

    def _blocks_for(self, s: Seq, tokens: int) -> int:
        """New blocks ``s`` needs to hold ``tokens`` tokens."""
        return max(0, -(-tokens // self.bs) - s.pinned - s.own)

    def _release(self, s: Seq) -> None:
        hs = s.hashes[: s.pinned]
        if hs:
            ref2 = self.ref2
            if ref2 and not ref2.keys().isdisjoint(hs):
                freed = []
                for h in hs:
                    c = ref2.get(h)
                    if c is None:
                        freed.append(h)
                    elif c > 1:
                        ref2[h] = c - 1
                    else:
                        del ref2[h]
                hs = freed
            self.pinned.difference_update(hs)
            self._lru_id += 1
            self.stamp.update(dict.fromkeys(hs, self._lru_id))
            self._lru.append([self._lru_id, hs[::-1], 0])
        s.pinned = 0
        self.own_blocks -= s.own
        s.own = 0

    def _store_full_blocks(self, s: Seq) -> None:
        """Blocks of ``s`` completed by its prefill become hashed (pinned) cache entries."""
        full = min(s.computed // self.bs, len(s.hashes))
        if full <= s.pinned:
            return
        self._hold(s.hashes[s.pinned : full])
        n = full - s.pinned
        s.pinned = full
        s.own -= n
        self.own_blocks -= n

    # -- requests --------------------------------------------------------------------------
    def add(self, s: Seq) -> None:
        self.waiting.append(s)

    def _preempt(self) -> bool:
        if not self.running:
            return False
        victim = max(self.running, key=lambda x: x.admitted)
        self.running.remove(victim)
        self._release(victim)
        victim.recomputed += victim.computed
        victim.computed = 0
        victim.chunk = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return True

    # -- passes ----------------------------------------------------------------------------
    def start_pass(self, now: float) -> float | None:
        """Schedule the next pass; returns its end time, or None when idle."""
        cfg, bs = self.cfg, self.bs
        self.now = now
        if self.loading:
            ready = [s for s in self.loading if s.ready_at <= now]
            if ready:
                self.loading = [s for s in self.loading if s.ready_at > now]
                self.waiting.extendleft(reversed(ready))
        budget = cfg.max_batched_tokens
        cap = cfg.long_prefill_token_threshold or budget
        if len(self.running) + len(self.waiting) <= 1:
            cap = budget
        decode = [s for s in self.running if s.computed >= s.prompt]
        budget -= len(decode)
        prefill: list[Seq] = []
        new_tokens = 0
        attn = 0.0
        for s in self.running:
            if s.computed >= s.prompt or budget <= 0:
                continue
            c = min(s.prompt - s.computed, budget, cap)
            if not self._room(self._blocks_for(s, s.computed + c)):
                continue
            self._grow(s, s.computed + c)
            s.chunk = c
            budget -= c
            new_tokens += c
            attn += c * s.computed
            prefill.append(s)
        tiers = self.tiers
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < cfg.max_seqs:
            s = self.waiting[0]
            if s.computed == 0 and s.pinned == 0:
                limit = min((s.prompt - 1) // bs, len(s.hashes))
                k = min(self.hit_blocks(s.hashes), limit)
                if tiers is not None and k < limit:
                    k2, n_host, n_store = tiers.probe(self.name, s.hashes, k, limit)
                    if k2 > k:
                        # load the rest of the prefix from the host tier / store (engine_ext)
                        need = k2 - k
                        if not self._has_room(s, k, need):
                            break
                        self._pin_prefix(s, k)
                        self._room(need)
                        hs = s.hashes[k:k2]
                        self._hold(hs)
                        s.pinned = k2
                        s.computed = k2 * bs
                        s.loaded += need * bs
                        if s.cached_tokens < 0:
                            s.cached_tokens = k2 * bs
                        s.ready_at = tiers.load(self.name, hs, n_host, n_store, now)
                        self.waiting.popleft()
                        self.loading.append(s)
                        continue
                c = min(s.prompt - k * bs, budget, cap)
                need = -(-(k * bs + c) // bs) - k
                if not self._has_room(s, k, need):
                    break
                self._pin_prefix(s, k)
                s.computed = k * bs
                if s.cached_tokens < 0:
                    s.cached_tokens = k * bs
            else:
                c = min(s.prompt - s.computed, budget, cap)
            if not self._room(self._blocks_for(s, s.computed + c)):
                break
            self.waiting.popleft()
            self._grow(s, s.computed + c)
            self._admit_seq += 1
            s.admitted = self._admit_seq
            self.running.append(s)
            s.chunk = c
            budget -= c
            new_tokens += c
            attn += c * s.computed
            prefill.append(s)
        if not prefill and not decode:
            # loaded requests waiting for room hold their blocks: if nothing can run, the last of
            # them gives its blocks back (recomputed / reloaded later), else the engine would stall
            held = [s for s in self.waiting if s.pinned or s.own]
            if held:
                victim = held[-1]
                self._release(victim)
                victim.recomputed += victim.computed
                victim.computed = 0
                victim.chunk = 0
                self.preemptions += 1
                return self.start_pass(now)
            self.busy = False
            return None
        perf = cfg.perf
        steps = 1
        ms = perf.prefill_ms(new_tokens, attn / 1e6) if prefill else 0.0
        if decode:
            held_blocks = sum(s.pinned + s.own for s in decode)
            kv_tokens = sum(s.prompt + s.out_done for s in decode)
            dms = perf.decode_ms(held_blocks / cfg.num_blocks, len(decode), kv_tokens)
            if not prefill and not self.waiting:
                steps = min(s.max_out - s.out_done for s in decode)
            ms += dms
            self.step_ms = dms
        else:
            self.step_ms = ms
        self._prefill, self._decode = prefill, decode
        self.busy = True
        self.pass_start = now
        self.pass_steps = max(1, steps)
        self.pass_end = now + (ms + (self.pass_steps - 1) * self.step_ms) / 1000.0
        self.prefill_tokens += new_tokens
        return self.pass_end

    def _grow(self, s: Seq, tokens: int) -> None:
        n = self._blocks_for(s, tokens)
        s.own += n
        self.own_blocks += n

    def interrupt(self, now: float) -> float | None:
        """A request arrived: end a multi-step decode pass at the next step boundary. Returns the
        new end time if it changed."""
        if not self.busy or self.pass_steps <= 1 or now >= self.pass_end:
            return None
        step_s = self.step_ms / 1000.0
        done = int((now - self.pass_start) / step_s) + 1 if step_s > 0 else 1
        if done >= self.pass_steps:
            return None
        self.pass_steps = done
        self.pass_end = self.pass_start + done * step_s
        return self.pass_end

    def finish_pass(self, now: float) -> list[Seq]:
        """Apply the pass that ends at ``now``; returns the sequences that finished."""
        self.busy = False
        self.now = now
        self.busy_s += now - self.pass_start
        n = self.pass_steps
        done: list[Seq] = []
        for s in self._decode:
            s.out_done += n
            s.t_last = now
        for s in self._prefill:
            s.computed += s.chunk
            s.chunk = 0
            self._store_full_blocks(s)
            if s.computed >= s.prompt:
                s.out_done += 1
                if s.t_first < 0:
                    s.t_first = now
                    if self.on_first is not None:
                        self.on_first(s)
                s.t_last = now
        keep = []
        for s in self.running:
            if s.out_done >= s.max_out and s.computed >= s.prompt:
                self._release(s)
                done.append(s)
            else:
                keep.append(s)
        self.running = keep
        # decode growth: one block per bs tokens; preempt LIFO when none is free
        for s in list(self.running):
            if s.computed < s.prompt or s not in self.running:
                continue
            need = self._blocks_for(s, s.prompt + s.out_done)
            while need and not self._room(need):
                if not self._preempt() or s not in self.running:
                    break
            if s in self.running and need:
                s.own += need
                self.own_blocks += need
        if self.tiers is not None and self._stored:
            self.tiers.stored(self.name, self._stored, now)
        if self.on_kv_events is not None and (self._stored or self._removed):
            self.on_kv_events(self.name, self._stored, self._removed)
        self._stored, self._removed = [], []
        self._prefill, self._decode = [], []
        return done
