"""Worker side: copies KV blocks between the engine's KV cache and the host tier, through `kernels`.

vLLM's `CPUOffloadingWorker` drives CUDA streams and `swap_blocks_batch`, neither of which
exists on vLLM's CPU platform. This worker implements the same `OffloadingWorker` contract with
`kernels.copy_blocks`, the one block mover of this project:

- CPU platform: "device" and "host" are both host memory, so the dispatcher takes
  `kernels.host_copy`: per group, sub-block column and tensor, one call into a JIT row copier
  with streaming stores (no Python loop over blocks, GIL released; `AGENTGW_KERNELS=torch`
  takes the torch reference instead). Copies run
  synchronously inside `submit_*` (the framework submits stores at the start of the next step,
  before the model writes again), so a store never reads a block after the scheduler could have
  reused it (store rule c).
- CUDA (opt-in, `"host_worker": "kernels"` in the connector's extra config; vLLM's own worker is
  the default there): the host region is page-locked (vLLM's `pin_mmap_region`) and the
  dispatcher takes the Triton kernels (`kernels.kv_copy`), launched on this worker's own stream;
  `get_finished` reports a job once its CUDA event has completed, `wait` synchronises. Stores
  wait for the compute stream first, loads are waited for by the model runner through `wait`.
  This path is checked for parity under Triton's interpreter only (no vLLM CUDA engine here).

Layout (direct, one worker): device tensor t is `(num_blocks, page)` int8 (block stride may
exceed the page when layers share one hybrid buffer); the host view of tensor t is
`(num_chunks, blocks_per_chunk, page)` int8 with a chunk stride set by the shared region.
Sub-block j of chunk c holds device-block-sized page j. A group may use only a prefix of a
tensor's page (`CanonicalKVCacheRef.page_size_bytes`): just that prefix is copied.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

import kernels

__all__ = ["HostCopyWorker"]


def _chunk_sub_blocks(chunk_ids: np.ndarray, blocks_per_chunk: int, skip: int, count: int) -> np.ndarray:
    """Flat sub-block indices (chunk * blocks_per_chunk + j) for `count` logical blocks."""
    flat = (chunk_ids.astype(np.int64)[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).ravel()
    return flat[skip : skip + count]


@dataclass(frozen=True)
class _DeviceBlocks:
    """The device side of one transfer: block ids in group order, blocks per group, and each
    group's first logical block index (as in vLLM's `GPULoadStoreSpec`)."""

    block_ids: np.ndarray  # int64
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


@dataclass(frozen=True)
class _GroupLayers:
    """One group's copies: per tensor, the device pages and each host sub-block column."""

    device: list[torch.Tensor]  # (num_blocks, nbytes) views
    host_columns: list[list[torch.Tensor]]  # [column j][tensor] -> (num_chunks, nbytes) views
    nbytes: int  # bytes one block of this group moves over all its tensors


class HostCopyWorker(OffloadingWorker):
    """Device<->host page copies through `kernels.copy_blocks` (CPU platform; CUDA opt-in)."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        mmap_region: SharedOffloadRegion,
        zero_on_load: tuple[Path, set[int]] | None = None,
    ):
        """``zero_on_load``: the test-only drafter mutation (`engine_ext.drafter`): while the
        file exists, every load zeroes these device tensors' rows of the blocks it loaded."""
        self._region = mmap_region
        self._blocks_per_chunk = blocks_per_chunk
        device_tensors = [canonical.tensor for canonical in kv_caches.tensors]
        self._cuda = any(t.is_cuda for t in device_tensors)
        self._zero_flag = None if zero_on_load is None else zero_on_load[0]
        self._zero_tensors = (
            [] if zero_on_load is None else [device_tensors[t] for t in sorted(zero_on_load[1])]
        )
        host_sub: list[torch.Tensor] = []
        for canonical in kv_caches.tensors:
            page = canonical.page_size_bytes
            host = mmap_region.create_next_worker_view(page * blocks_per_chunk)
            host_sub.append(
                host.as_strided(
                    (host.shape[0], blocks_per_chunk, page), (host.stride(0), page, 1), host.storage_offset()
                )
            )
        if self._cuda:
            from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region

            pin_mmap_region(mmap_region)
        else:  # compile the CPU row copier (~0.3 s) at engine start rather than in the first transfer
            kernels.host_copy.available()
        # Per group: the base address and row stride of its first data ref's tensor, as vLLM
        # resolves a block id to a device address (None for a group without data refs).
        self._group_rows: list[tuple[int, int] | None] = [
            (device_tensors[refs[0].tensor_idx].data_ptr(), device_tensors[refs[0].tensor_idx].stride(0))
            if refs
            else None
            for refs in kv_caches.group_data_refs
        ]
        # Per group: unique (tensor_idx, bytes) pairs; aliased layers share one copy.
        self._groups: list[_GroupLayers] = []
        for refs in kv_caches.group_data_refs:
            copies = sorted({(ref.tensor_idx, ref.page_size_bytes) for ref in refs})
            self._groups.append(
                _GroupLayers(
                    device=[device_tensors[t][:, :n] for t, n in copies],
                    host_columns=[
                        [host_sub[t][:, j, :n] for t, n in copies] for j in range(blocks_per_chunk)
                    ],
                    nbytes=sum(n for _, n in copies),
                )
            )
        # torch leaves Stream.__new__, Event.__new__ and Event.query unannotated
        self._stream = torch.cuda.Stream() if self._cuda else None  # type: ignore[no-untyped-call]
        self._pending: list[tuple[TransferResult, torch.cuda.Event]] = []
        self._finished: list[TransferResult] = []

    # The device side of a transfer is what the installed vLLM's connector passes: the device
    # blocks' spec (vLLM 0.32) or, from vLLM 0.34 on, the `DevicePointers` resolved from it
    # (one address per block and group data ref), which `_device_blocks` maps back to block ids.
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, self._device_blocks(src_spec), dst_spec, to_host=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any, expedited: bool = False
    ) -> bool:
        # vLLM 0.34 waits for an expedited load within the step; copies here are synchronous on
        # the CPU and in order on this worker's one stream on CUDA, so it needs nothing more
        del expedited
        return self._transfer(job_id, self._device_blocks(dst_spec), src_spec, to_host=False)

    def _device_blocks(self, spec: Any) -> _DeviceBlocks:
        if isinstance(spec, GPULoadStoreSpec):
            return _DeviceBlocks(
                np.asarray(spec.block_ids, dtype=np.int64), tuple(spec.group_sizes), tuple(spec.block_indices)
            )
        # DevicePointers: for each group, for each of its data refs, each block's address
        # (vllm.v1.kv_offload.pointer_utils.resolve_device_pointers: base + block id * row stride)
        ptrs = np.asarray(spec.ptrs, dtype=np.uint64)
        sizes = tuple(int(n) for n in spec.group_block_counts)
        assert len(sizes) == len(self._group_rows), (sizes, len(self._group_rows))
        ids: list[np.ndarray] = []
        offset = 0
        for size, num_refs, rows in zip(sizes, spec.group_data_ref_counts, self._group_rows, strict=True):
            if size == 0:
                continue
            assert rows is not None, "device pointers for a group without data refs"
            base, stride = rows
            ids.append(
                ((ptrs[offset : offset + size] - np.uint64(base)) // np.uint64(stride)).astype(np.int64)
            )
            offset += size * int(num_refs)
        assert offset == len(ptrs), (offset, len(ptrs))
        block_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        return _DeviceBlocks(block_ids, sizes, tuple(int(i) for i in spec.block_indices))

    def _transfer(
        self, job_id: int, device_blocks: _DeviceBlocks, host_spec: LoadStoreSpec, to_host: bool
    ) -> bool:
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                num_bytes = self._copy_groups(device_blocks, host_spec, to_host)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: unannotated
            event.record(self._stream)
            result = TransferResult(job_id=job_id, success=True, transfer_size=num_bytes)
            self._pending.append((result, event))
            return True
        num_bytes = self._copy_groups(device_blocks, host_spec, to_host)
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=num_bytes,
                transfer_time=time.perf_counter() - start,
            )
        )
        return True

    def _copy_groups(
        self, device_spec: _DeviceBlocks, host_spec: BlockIDsLoadStoreSpec, to_host: bool
    ) -> int:
        """One `kernels.copy_blocks` per group and host sub-block column; returns the bytes moved."""
        device_ids = device_spec.block_ids
        chunk_ids = np.asarray(host_spec.block_ids, dtype=np.int64)
        bpc = self._blocks_per_chunk
        dev_off = host_off = num_bytes = 0
        for group, size, block_idx in zip(
            self._groups, device_spec.group_sizes, device_spec.block_indices, strict=True
        ):
            if size == 0:
                continue
            skip = block_idx % bpc
            num_chunks = cdiv(size + skip, bpc)
            dev = device_ids[dev_off : dev_off + size]
            sub = _chunk_sub_blocks(chunk_ids[host_off : host_off + num_chunks], bpc, skip, size)
            rows, cols = sub // bpc, sub % bpc
            for column in range(bpc) if bpc > 1 else (0,):
                picked = cols == column if bpc > 1 else slice(None)
                dev_ids = torch.from_numpy(np.ascontiguousarray(dev[picked]))
                host_rows = torch.from_numpy(np.ascontiguousarray(rows[picked]))
                if dev_ids.numel() == 0:
                    continue
                host = group.host_columns[column]
                if to_host:
                    kernels.copy_blocks(group.device, host, dev_ids, host_rows)
                else:
                    kernels.copy_blocks(host, group.device, host_rows, dev_ids)
            num_bytes += size * group.nbytes
            dev_off += size
            host_off += num_chunks
        if not to_host and self._zero_flag is not None:
            self._zero_drafter(device_ids)
        return num_bytes

    def _zero_drafter(self, device_ids: np.ndarray) -> None:
        """The test-only mutation: zero the drafter's rows of the loaded blocks while the flag
        file exists (all of them; only the load's last block when the file says ``last``)."""
        assert self._zero_flag is not None
        try:
            mode = self._zero_flag.read_text().strip()
        except FileNotFoundError:
            return
        ids = device_ids[-1:] if mode == "last" else device_ids
        loaded = torch.from_numpy(np.ascontiguousarray(ids))
        for tensor in self._zero_tensors:
            tensor[loaded] = 0

    def get_finished(self) -> list[TransferResult]:
        still = []
        for result, event in self._pending:
            if event.query():  # type: ignore[no-untyped-call]  # torch: unannotated
                self._finished.append(result)
            else:
                still.append((result, event))
        self._pending = still
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        for result, event in self._pending:
            if result.job_id in job_ids:
                event.synchronize()

    def shutdown(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._groups.clear()
        self._region.cleanup()
