"""`ObjectStoreTier`: a vLLM secondary offload tier over any `ObjectStore` (Mooncake in production).

Runs in the scheduler process next to vLLM's host (primary) tier and moves whole host chunks:
store = host chunk -> object, load (promotion) = object -> host chunk. Every method the
scheduler calls is non-blocking; I/O runs on a small thread pool.

Store rules it implements (the others live in vLLM's scheduler, see docs/engine_ext.md):
  (a) a key already being stored (by any request) or known present is not stored again:
      `duplicate_stores_skipped` counts them;
  (d) lookups are answered asynchronously: vLLM's `AsyncLookupManager` batches one
      `batch_exists` per step on a background thread; the scheduler gets RETRY meanwhile;
  (e) keys are the 36-byte `OffloadKey`s; their Mooncake strings are built once and cached
      (bounded); loads are split into `load_parallelism` concurrent `batch_get_into` calls;
  integrity: each object has a CRC32 sidecar; a missing object, a short read or a checksum
      mismatch fails the promotion from that block on, which marks the key a miss so vLLM
      recomputes (never a wrong answer).

Retention (`retention` in the tier config, see engine_ext.retention): which offered chunks are
kept; "interval" (default) keeps every turn's delta, "selective" (Marconi-style) keeps a chunk
once its prefix was seen a second time. Rejected chunks count as `retention_skipped`.

Object format (`object_format`): "raw" (default) stores the host chunk's bytes as they are,
zero-copy from the registered host region. "fp8_e4m3" stores each chunk packed by
`kernels.quantize_fp8` (e4m3 values and one float32 scale per `fp8_group` values, 0.516 of the
bytes with 128) and unpacks it with `kernels.dequantize_fp8` on load; it needs a 16-bit KV cache
dtype (bf16/fp16) and is lossy, so it suits attention KV, not Mamba state. FP8 objects carry a
".e4m3" suffix, so raw and FP8 engines sharing a namespace never read each other's objects.
`stored_object_bytes` / `loaded_object_bytes` count what went over the wire; `stored_bytes` /
`loaded_bytes` count KV bytes (host-chunk bytes) in both formats.

Store outages (the master killed or restarting): the store sits behind
`engine_ext.tiers.breaker.GuardedStore`. A store job (and an FP8 load) first asks whether
its first object exists: an existence check fails at once when the master is gone, where a put
(or `get_batch`) retries for seconds, so an outage costs one fast failed call; then the breaker
answers every call at once for `breaker_cooldown_s` (default 2 s): lookups are misses, loads
fail, stores are dropped, and vLLM recomputes. Counted in `unavailable_lookups`, `unavailable_loads`, `unavailable_stores` (chunks)
and `vllm:agentgw_tier_unavailable`; the breaker's own counters are in `stats()["breaker"]`. A
master restart loses every key, so the keys remembered as present are forgotten when the breaker
trips, and any such key a lookup finds missing is forgotten too: offload resumes after the
restart with the next stores.

Parameters (tier config): `key_namespace` (default "agentgw"), `io_threads` (4),
`load_parallelism` (4), `lease_retries` (2: keys a get failed with LEASE_EXPIRED are read
again, `lease_retries` counts them), `verify_checksum` (true), `max_key_cache` (65536), `retention`,
`object_format` ("raw"), `fp8_group` (128), `breaker_cooldown_s` (2.0).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import (
    JobId,
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

import kernels
from engine_ext.retention import make_retention, offers
from engine_ext.tiers.breaker import GuardedStore
from engine_ext.tiers.store import RETRY_BACKOFF_S, ObjectStore, StoreUnavailable, get_into_renewing_leases

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
    from vllm.v1.kv_offload.base import OffloadingSpec

__all__ = ["ObjectStoreTier", "TierCounters"]

M_STORED_BYTES = "vllm:agentgw_tier_stored_bytes"
M_LOADED_BYTES = "vllm:agentgw_tier_loaded_bytes"
M_HITS = "vllm:agentgw_tier_lookup_hits"
M_DUP_SKIPPED = "vllm:agentgw_tier_duplicate_stores_skipped"
M_LOAD_FAILURES = "vllm:agentgw_tier_load_failures"
M_STORE_LATENCY = "vllm:agentgw_tier_store_latency_seconds"
M_LOAD_LATENCY = "vllm:agentgw_tier_load_latency_seconds"
M_UNAVAILABLE = "vllm:agentgw_tier_unavailable"
_LAT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


class TierCounters:
    """Cumulative counters, readable from the control server thread (ints under the GIL)."""

    def __init__(self) -> None:
        self.stored_bytes = 0
        self.stored_object_bytes = 0
        self.stored_chunks = 0
        self.loaded_bytes = 0
        self.loaded_object_bytes = 0
        self.loaded_chunks = 0
        self.lookup_hits = 0
        self.lookup_misses = 0
        self.duplicate_stores_skipped = 0
        self.load_failures = 0
        self.retention_skipped = 0
        self.unavailable_lookups = 0
        self.unavailable_loads = 0
        self.unavailable_stores = 0
        self.lease_retries = 0
        self.checksum_put_failures = 0  # store jobs whose checksum put failed: the data was not sent
        self.store_seconds = 0.0
        self.load_seconds = 0.0

    def snapshot(self) -> dict[str, float]:
        return dict(vars(self))


class _ExistsLookup(AsyncLookupManager):
    def __init__(self, tier: ObjectStoreTier, tier_type: str):
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        try:
            return self._tier.store.batch_exists([self._tier.key_name(k) for k in keys])
        except StoreUnavailable:  # a miss: vLLM computes these blocks
            self._tier.count_unavailable("unavailable_lookups", len(keys))
            return [False] * len(keys)


class ObjectStoreTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        store: ObjectStore,
        key_namespace: str = "agentgw",
        io_threads: int = 4,
        load_parallelism: int = 4,
        lease_retries: int = 2,
        verify_checksum: bool = True,
        max_key_cache: int = 65536,
        retention: dict[str, Any] | None = None,
        enable_kv_events: bool = True,
        locality: str | None = "REMOTE",
        backpressure_detector: BackpressureDetector | None = None,
        object_format: str = "raw",
        fp8_group: int = 128,
        breaker_cooldown_s: float = 2.0,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._kv_dtype: torch.dtype | None = None  # set: objects are FP8-packed chunks of this dtype
        if object_format == "fp8_e4m3":
            dtype = str(offloading_spec.config.model.dtype)
            if dtype not in ("bfloat16", "float16"):
                raise ValueError(f"object_format fp8_e4m3 needs a bf16/fp16 KV cache, not {dtype}")
            self._kv_dtype = getattr(torch, dtype)
            self._fp8_group = fp8_group
            self._object_bytes = kernels.fp8_nbytes(self.block_size_bytes // 2, fp8_group)
        elif object_format == "raw":
            self._object_bytes = self.block_size_bytes
        else:
            raise ValueError(f"object_format must be 'raw' or 'fp8_e4m3', not {object_format!r}")
        self.locality = Locality(locality) if locality is not None else None
        self.store = store if isinstance(store, GuardedStore) else GuardedStore(store, breaker_cooldown_s)
        self._epoch = self.store.epoch
        self.counters = TierCounters()
        self.retention = make_retention(retention)
        self._verify = verify_checksum
        self._load_parallelism = max(1, load_parallelism)
        self._lease_retries = max(0, lease_retries)
        primary = np.asarray(primary_kv_view)
        self._primary = primary
        self._base_ptr = int(primary.ctypes.data)
        self.store.register_buffer(self._base_ptr, int(primary.nbytes))
        self._mapper = FileMapper.from_offloading_spec(
            root_dir=key_namespace,
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        )
        self._key_names: OrderedDict[OffloadKey, str] = OrderedDict()
        self._max_key_cache = max_key_cache
        self._known_present: OrderedDict[OffloadKey, None] = OrderedDict()
        self._storing: dict[OffloadKey, JobId] = {}
        self._overwrite: set[OffloadKey] = set()  # keys whose stored object failed a load
        self._store_keys: dict[JobId, list[OffloadKey]] = {}
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._stats: OffloadingConnectorStats | None = None
        self._stats_lock = threading.Lock()
        self._events: list[OffloadingEvent] | None = (
            [] if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events else None
        )
        self._pool = ThreadPoolExecutor(
            max_workers=max(io_threads, load_parallelism), thread_name_prefix="agentgw_tier"
        )
        self._inflight = 0
        self._inflight_cv = threading.Condition()
        self._lookup = _ExistsLookup(self, tier_type)

    # ----- keys -----------------------------------------------------------------------
    def key_name(self, key: OffloadKey) -> str:
        name = self._key_names.get(key)
        if name is None:
            name = self._mapper.get_file_name(key) + (".e4m3" if self._kv_dtype is not None else "")
            self._key_names[key] = name
            if len(self._key_names) > self._max_key_cache:
                self._key_names.popitem(last=False)
        return name

    def _forget_present_after_outage(self) -> None:
        """A trip of the breaker may mean a master restart, which loses every key."""
        if self.store.epoch != self._epoch:
            self._epoch = self.store.epoch
            self._known_present.clear()

    def _remember_present(self, keys: Iterable[OffloadKey]) -> None:
        for k in keys:
            self._known_present[k] = None
            self._known_present.move_to_end(k)
        while len(self._known_present) > self._max_key_cache:
            self._known_present.popitem(last=False)

    # ----- scheduler-side API ---------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        result = self._lookup.lookup(key, req_context)
        if result is None:
            return LookupResult.RETRY
        self.retention.observe_lookup(key)  # once per request: the resolved answer
        if result:
            self.counters.lookup_hits += 1
            self._count(M_HITS, 1)
            return LookupResult.HIT
        self.counters.lookup_misses += 1
        self._known_present.pop(key, None)  # gone (e.g. a master restart): store it again
        return LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        self._forget_present_after_outage()
        keys, chunk_ids = [], []
        offered = list(job_metadata.keys)
        kept = set(self.retention.select(offers(offered, get_offload_group_idx)))
        for key, cid in zip(offered, job_metadata.chunk_ids, strict=True):
            if key not in kept:
                self.counters.retention_skipped += 1
                continue
            if key in self._storing or key in self._known_present:
                self.counters.duplicate_stores_skipped += 1
                self._count(M_DUP_SKIPPED, 1)
                continue
            self._storing[key] = job_id
            keys.append(key)
            chunk_ids.append(int(cid))
        self._store_keys[job_id] = keys
        names = [self.key_name(k) for k in keys]
        overwrite = [k in self._overwrite for k in keys]
        self._overwrite.difference_update(keys)
        self._submit(self._run_store, job_id, names, chunk_ids, overwrite, len(names))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        self._load_keys[job_metadata.job_id] = keys
        names = [self.key_name(k) for k in keys]
        self._submit(
            self._run_load, job_metadata.job_id, names, [int(c) for c in job_metadata.chunk_ids], len(names)
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        while True:
            try:
                result = self._finished.get_nowait()
            except queue.Empty:
                break
            store_keys = self._store_keys.pop(result.job_id, None)
            if store_keys is not None:
                for k in store_keys:
                    self._storing.pop(k, None)
                if result.success:
                    self._remember_present(store_keys)
                    if self._events is not None and store_keys:
                        self._events.append(
                            OffloadingEvent(
                                keys=store_keys, medium=self.medium, removed=False, locality=self.locality
                            )
                        )
            load_keys = self._load_keys.pop(result.job_id, None)
            if load_keys is not None and not result.success:
                ok = set(result.successful_keys or ())
                failed = [k for k in load_keys if k not in ok]
                self._lookup.mark_miss(failed)
                for k in failed:  # the next store of these keys overwrites the bad object
                    self._known_present.pop(k, None)
                    self._overwrite.add(k)
                    if len(self._overwrite) > self._max_key_cache:
                        self._overwrite.pop()
            results.append(result)
        return results

    def has_pending_work(self) -> bool:
        return self._inflight > 0

    @property
    def jobs_in_flight(self) -> int:
        """Store and load jobs submitted to the I/O pool and not finished yet."""
        return self._inflight

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup.flush()

    def drain_jobs(self) -> None:
        with self._inflight_cv:
            self._inflight_cv.wait_for(lambda: self._inflight == 0)

    def shutdown(self) -> None:
        self._lookup.shutdown()
        self._pool.shutdown(wait=True)
        self.store.close()
        logger.info("object tier: store closed")

    # ----- metrics --------------------------------------------------------------------
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            M_STORED_BYTES: OffloadingCounterMetadata("Bytes stored into the object (Mooncake) tier."),
            M_LOADED_BYTES: OffloadingCounterMetadata(
                "Bytes loaded from the object tier into the host tier."
            ),
            M_HITS: OffloadingCounterMetadata("Chunk lookups answered as present by the object tier."),
            M_DUP_SKIPPED: OffloadingCounterMetadata(
                "Chunk stores skipped: an identical store was in flight or the chunk was already stored."
            ),
            M_LOAD_FAILURES: OffloadingCounterMetadata(
                "Chunk loads that failed (missing/corrupt): recomputed."
            ),
            M_STORE_LATENCY: OffloadingHistogramMetadata(
                "Object tier store job latency.", buckets=_LAT_BUCKETS
            ),
            M_LOAD_LATENCY: OffloadingHistogramMetadata(
                "Object tier load job latency.", buckets=_LAT_BUCKETS
            ),
            M_UNAVAILABLE: OffloadingCounterMetadata(
                "Chunks looked up, loaded or stored while the store was unavailable (recomputed or dropped)."
            ),
        }

    def _stats_obj(self) -> OffloadingConnectorStats:
        if self._stats is None:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
                OffloadingConnectorStats,
            )

            self._stats = OffloadingConnectorStats()
        return self._stats

    def _count(self, name: str, value: float) -> None:
        with self._stats_lock:
            self._stats_obj().increase_counter(name, value)

    def _observe(self, name: str, value: float) -> None:
        with self._stats_lock:
            self._stats_obj().observe_histogram(name, value)

    def count_unavailable(self, counter: str, n: int) -> None:
        setattr(self.counters, counter, getattr(self.counters, counter) + n)
        self._count(M_UNAVAILABLE, n)

    def stats(self) -> dict[str, Any]:
        """Counters, the breaker's state and counters, and the jobs in flight (`/v1/kv/stats`)."""
        return {
            **self.counters.snapshot(),
            "jobs_in_flight": self.jobs_in_flight,
            "breaker": {**self.store.counters.snapshot(), "open": self.store.is_open},
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._stats_lock:
            stats, self._stats = self._stats, None
        return stats

    # ----- I/O (pool threads) ---------------------------------------------------------
    def _submit(self, fn: Any, job_id: JobId, *args: Any) -> None:
        with self._inflight_cv:
            self._inflight += 1
        self._pool.submit(self._guarded, fn, job_id, *args)

    def _guarded(self, fn: Any, job_id: JobId, *args: Any) -> None:
        start = time.perf_counter()
        *fn_args, n_chunks = args
        try:
            result = fn(job_id, *fn_args, start=start)
        except StoreUnavailable:  # nothing moved: loads are recomputed, stores dropped
            kind = "unavailable_loads" if fn == self._run_load else "unavailable_stores"
            self.count_unavailable(kind, n_chunks)
            result = JobResult(job_id=job_id, success=False, transfer_time=time.perf_counter() - start)
        except Exception:  # an I/O error fails the job; the scheduler recomputes
            result = JobResult(job_id=job_id, success=False, transfer_time=time.perf_counter() - start)
        self._finished.put(result)
        with self._inflight_cv:
            self._inflight -= 1
            self._inflight_cv.notify_all()

    def _ptr(self, chunk_id: int) -> int:
        return self._base_ptr + chunk_id * self.block_size_bytes

    def _run_store(
        self, job_id: JobId, names: list[str], chunk_ids: list[int], overwrite: list[bool], *, start: float
    ) -> JobResult:
        if not names:
            return JobResult(job_id=job_id, success=True, transfer_time=0.0, transfer_bytes=0)
        self.store.batch_exists(names[:1])  # fails at once without a master; a put retries for seconds
        size = self.block_size_bytes
        if self._kv_dtype is not None:
            rcs = self._store_fp8(names, chunk_ids)
        else:
            rcs = self._store_raw(names, chunk_ids, overwrite)
        ok = all(rc >= 0 for rc in rcs)
        elapsed = time.perf_counter() - start
        stored = sum(1 for rc in rcs if rc >= 0)
        nbytes = size * stored
        self.counters.stored_bytes += nbytes
        self.counters.stored_object_bytes += self._object_bytes * stored
        self.counters.stored_chunks += stored
        self.counters.store_seconds += elapsed
        self._count(M_STORED_BYTES, nbytes)
        self._observe(M_STORE_LATENCY, elapsed)
        return JobResult(job_id=job_id, success=ok, transfer_time=elapsed, transfer_bytes=nbytes)

    def _chunk_values(self, chunk_id: int) -> torch.Tensor:
        """The host chunk's bytes as KV values (FP8 format only)."""
        assert self._kv_dtype is not None
        return torch.from_numpy(self._primary[chunk_id]).view(self._kv_dtype)

    def _store_fp8(self, names: list[str], chunk_ids: list[int]) -> list[int]:
        packed = torch.empty((len(chunk_ids), self._object_bytes), dtype=torch.uint8)
        for row, c in zip(packed, chunk_ids, strict=True):
            kernels.quantize_fp8(self._chunk_values(c), row, group=self._fp8_group)
        blobs = [row.numpy().tobytes() for row in packed]
        if self._verify:
            crcs = [zlib.crc32(b).to_bytes(4, "big") for b in blobs]
            rc = self.store.batch_put_bytes([n + ".crc" for n in names], crcs)
            if rc < 0:  # without its checksum a load would refuse the object: do not send it
                self.counters.checksum_put_failures += 1
                return [rc] * len(names)
        rc = self.store.batch_put_bytes(names, blobs)
        return [rc] * len(names)

    def _store_raw(self, names: list[str], chunk_ids: list[int], overwrite: list[bool]) -> list[int]:
        size = self.block_size_bytes
        if self._verify:
            crcs = [zlib.crc32(self._primary[c]).to_bytes(4, "big") for c in chunk_ids]
            rc = self.store.batch_put_bytes([n + ".crc" for n in names], crcs)
            if rc < 0:  # without its checksum a load would refuse the object: do not send it
                self.counters.checksum_put_failures += 1
                return [rc] * len(names)
        ptrs = [self._ptr(c) for c in chunk_ids]
        rcs = [0] * len(names)
        for upsert in (False, True):
            idx = [i for i, o in enumerate(overwrite) if o == upsert]
            if idx:
                put = self.store.batch_upsert_from if upsert else self.store.batch_put_from
                for i, rc in zip(
                    idx, put([names[i] for i in idx], [ptrs[i] for i in idx], [size] * len(idx)), strict=True
                ):
                    rcs[i] = rc
        return rcs

    def _load_slice(self, names: list[str], chunk_ids: list[int]) -> list[bool]:
        if self._kv_dtype is not None:
            return self._load_fp8(names, chunk_ids)
        size = self.block_size_bytes
        rcs, again = get_into_renewing_leases(
            self.store, names, [self._ptr(c) for c in chunk_ids], [size] * len(names), self._lease_retries
        )
        if again:
            with self._stats_lock:
                self.counters.lease_retries += again
        good = [rc == size for rc in rcs]
        if not all(good):
            logger.warning(
                "object tier: %d of %d gets failed (rc %s)",
                good.count(False),
                len(good),
                sorted({rc for rc in rcs if rc != size}),
            )
        if self._verify and any(good):
            crc_names = [n + ".crc" for n in names]
            crcs = self.store.batch_get_bytes(crc_names)
            for attempt in range(self._lease_retries):  # an empty answer: a lapsed lease, or no sidecar
                idx = [i for i in range(len(names)) if good[i] and len(crcs[i]) != 4]
                if not idx:
                    break
                if attempt:
                    time.sleep(RETRY_BACKOFF_S * attempt)
                for i, v in zip(idx, self.store.batch_get_bytes([crc_names[i] for i in idx]), strict=True):
                    crcs[i] = v
            missing = mismatched = 0
            for i, c in enumerate(chunk_ids):
                if good[i]:
                    good[i] = len(crcs[i]) == 4 and zlib.crc32(self._primary[c]) == int.from_bytes(
                        crcs[i], "big"
                    )
                    if not good[i]:
                        missing += len(crcs[i]) != 4
                        mismatched += len(crcs[i]) == 4
            if missing or mismatched:
                logger.warning(
                    "object tier: %d checksum sidecars unread, %d checksums mismatched, of %d chunks",
                    missing,
                    mismatched,
                    len(names),
                )
        return good

    def _load_fp8(self, names: list[str], chunk_ids: list[int]) -> list[bool]:
        self.store.batch_exists(names[:1])  # fails at once without a master; get_batch retries for seconds
        blobs = self.store.batch_get_bytes(names)
        good = [len(b) == self._object_bytes for b in blobs]
        if self._verify:
            crcs = self.store.batch_get_bytes([n + ".crc" for n in names])
            good = [
                g and len(crc) == 4 and zlib.crc32(b) == int.from_bytes(crc, "big")
                for g, b, crc in zip(good, blobs, crcs, strict=True)
            ]
        for g, b, c in zip(good, blobs, chunk_ids, strict=True):
            if g:
                packed = torch.frombuffer(bytearray(b), dtype=torch.uint8)
                kernels.dequantize_fp8(packed, self._chunk_values(c), group=self._fp8_group)
        return good

    def _run_load(self, job_id: JobId, names: list[str], chunk_ids: list[int], *, start: float) -> JobResult:
        n = len(names)
        step = max(1, -(-n // self._load_parallelism))
        slices = [(names[i : i + step], chunk_ids[i : i + step]) for i in range(0, n, step)]
        if len(slices) > 1:
            with ThreadPoolExecutor(max_workers=len(slices)) as fan_out:
                parts = list(fan_out.map(lambda s: self._load_slice(*s), slices))
        else:
            parts = [self._load_slice(*s) for s in slices]
        good = [g for part in parts for g in part]
        first_bad = good.index(False) if False in good else n
        elapsed = time.perf_counter() - start
        nbytes = first_bad * self.block_size_bytes
        self.counters.loaded_bytes += nbytes
        self.counters.loaded_object_bytes += first_bad * self._object_bytes
        self.counters.loaded_chunks += first_bad
        self.counters.load_seconds += elapsed
        self._count(M_LOADED_BYTES, nbytes)
        self._observe(M_LOAD_LATENCY, elapsed)
        if first_bad == n:
            return JobResult(job_id=job_id, success=True, transfer_time=elapsed, transfer_bytes=nbytes)
        self.counters.load_failures += n - first_bad
        self._count(M_LOAD_FAILURES, n - first_bad)
        keys = self._load_keys.get(job_id, [])
        return JobResult(
            job_id=job_id,
            success=False,
            successful_keys=tuple(keys[:first_bad]) or None,
            transfer_time=elapsed,
            transfer_bytes=nbytes,
        )
