"""Worker side: copies KV blocks between the engine's KV cache and the host tier.

vLLM's `CPUOffloadingWorker` drives CUDA streams and `swap_blocks_batch`, neither of which
exists on vLLM's CPU platform. This worker implements the same `OffloadingWorker` contract with
plain tensor indexing: on the CPU platform "device" and "host" are both host memory, so a copy
is a gather/scatter of whole pages. It runs synchronously inside `submit_*` (the framework
submits stores at the start of the next step, before the model writes again), so a store
never reads a block after the scheduler could have reused it (store rule c).

Layout (direct, one worker): device tensor t is `(num_blocks, page)` int8; the host view of
tensor t is `(num_chunks, page * blocks_per_chunk)` int8 with a row stride set by the shared
region. Sub-block j of chunk c holds device-block-sized page j.
"""

from __future__ import annotations

import time

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

__all__ = ["HostCopyWorker"]


def _chunk_sub_blocks(chunk_ids: np.ndarray, blocks_per_chunk: int, skip: int, count: int) -> np.ndarray:
    """Flat sub-block indices (chunk * blocks_per_chunk + j) for `count` logical blocks."""
    flat = (chunk_ids.astype(np.int64)[:, None] * blocks_per_chunk + np.arange(blocks_per_chunk)).ravel()
    return flat[skip : skip + count]


class HostCopyWorker(OffloadingWorker):
    """Synchronous device<->host page copies for the CPU platform."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, mmap_region: SharedOffloadRegion):
        self._region = mmap_region
        self._blocks_per_chunk = blocks_per_chunk
        self._device: list[torch.Tensor] = []
        self._host_sub: list[torch.Tensor] = []
        for canonical in kv_caches.tensors:
            page = canonical.page_size_bytes
            device = canonical.tensor  # (num_blocks, page) int8, strided
            host = mmap_region.create_next_worker_view(page * blocks_per_chunk)
            row_stride = host.stride(0)
            # (num_chunks * blocks_per_chunk, page) view when rows are contiguous per sub-block.
            host_sub = host.as_strided(
                (host.shape[0], blocks_per_chunk, page), (row_stride, page, 1), host.storage_offset()
            )
            self._device.append(device)
            self._host_sub.append(host_sub)
        # Per group: unique (tensor_idx, bytes) pairs; aliased layers share one copy.
        self._group_copies: list[list[tuple[int, int]]] = [
            sorted({(ref.tensor_idx, ref.page_size_bytes) for ref in refs})
            for refs in kv_caches.group_data_refs
        ]
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._transfer(job_id, dst_spec, src_spec, to_host=False)

    def _transfer(
        self, job_id: int, device_spec: LoadStoreSpec, host_spec: LoadStoreSpec, to_host: bool
    ) -> bool:
        assert isinstance(device_spec, GPULoadStoreSpec)
        assert isinstance(host_spec, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        device_ids = device_spec.block_ids
        chunk_ids = host_spec.block_ids
        bpc = self._blocks_per_chunk
        dev_off = 0
        host_off = 0
        num_bytes = 0
        for g_idx, (size, block_idx) in enumerate(
            zip(device_spec.group_sizes, device_spec.block_indices, strict=True)
        ):
            if size == 0:
                continue
            skip = block_idx % bpc
            num_chunks = cdiv(size + skip, bpc)
            dev = device_ids[dev_off : dev_off + size].astype(np.int64)
            sub = _chunk_sub_blocks(chunk_ids[host_off : host_off + num_chunks], bpc, skip, size)
            rows, cols = sub // bpc, sub % bpc
            for t_idx, nbytes in self._group_copies[g_idx]:
                self._copy(self._device[t_idx], self._host_sub[t_idx], dev, rows, cols, nbytes, to_host)
                num_bytes += size * nbytes
            dev_off += size
            host_off += num_chunks
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=num_bytes,
                transfer_time=time.perf_counter() - start,
            )
        )
        return True

    @staticmethod
    def _copy(
        device: torch.Tensor,
        host_sub: torch.Tensor,
        dev: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
        nbytes: int,
        to_host: bool,
    ) -> None:
        """Copy page prefixes of `nbytes`, one slice copy per run of consecutive blocks.

        Per-slice `copy_` runs at memcpy speed; advanced indexing (index_put / index_select)
        is 5-10x slower on CPU for 64 KiB rows. Runs need consecutive device ids and
        consecutive host rows in the same sub-block column (always true for 1 block/chunk).
        """
        breaks = np.flatnonzero((np.diff(dev) != 1) | (np.diff(rows) != 1) | (np.diff(cols) != 0)) + 1
        starts = [0, *breaks.tolist()]
        ends = [*breaks.tolist(), len(dev)]
        dev_l, rows_l, cols_l = dev.tolist(), rows.tolist(), cols.tolist()
        full = nbytes == device.shape[1]
        for start, end in zip(starts, ends, strict=True):
            d0, r0, c = dev_l[start], rows_l[start], cols_l[start]
            n = end - start
            if n == 1 and full:
                dst_host, src_dev = host_sub[r0][c], device[d0]
            else:
                dst_host = host_sub[r0 : r0 + n, c, :nbytes]
                src_dev = device[d0 : d0 + n, :nbytes]
            if to_host:
                dst_host.copy_(src_dev)
            else:
                src_dev.copy_(dst_host)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # transfers complete inside submit_*

    def shutdown(self) -> None:
        self._device.clear()
        self._host_sub.clear()
        self._region.cleanup()
