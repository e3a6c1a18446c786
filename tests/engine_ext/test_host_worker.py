"""HostCopyWorker moves exact bytes between device pages and host chunks (random data)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from engine_ext.host_worker import HostCopyWorker

PAGE = 4096


def make_worker(blocks_per_chunk: int, num_chunks: int = 16) -> tuple[HostCopyWorker, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(blocks_per_chunk)
    device = [torch.randint(-128, 127, (32, PAGE), dtype=torch.int8, generator=gen) for _ in range(2)]
    # group 0 uses both tensors; group 1 only the first 1024 bytes of tensor 1's pages
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, PAGE) for t in device],
        [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)], [CanonicalKVCacheRef(1, 1024)]],
    )
    chunk_bytes = 2 * PAGE * blocks_per_chunk
    region = SharedOffloadRegion(
        f"test-hw-{os.getpid()}-{blocks_per_chunk}", num_chunks, 0, chunk_bytes, chunk_bytes
    )
    return HostCopyWorker(caches, blocks_per_chunk, region), device


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_store_then_load_restores_exact_bytes(blocks_per_chunk: int) -> None:
    worker, device = make_worker(blocks_per_chunk)
    try:
        original = [t.clone() for t in device]
        # group 0: device blocks 3,4,9 from logical block 1; group 1: block 20 from logical block 0
        dev_ids = [3, 4, 9, 20]
        group_sizes, block_indices = [3, 1], [1, 0]
        # with 2 blocks per chunk, 3 blocks from offset 1 span 2 chunks; 1 block at offset 0 spans 1
        chunks = [5, 6, 7, 2] if blocks_per_chunk == 1 else [5, 6, 2]
        dev_spec = GPULoadStoreSpec(dev_ids, group_sizes, block_indices)
        assert worker.submit_store(1, dev_spec, CPULoadStoreSpec(chunks))
        for t in device:
            t.zero_()
        assert worker.submit_load(2, CPULoadStoreSpec(chunks), dev_spec)
        results = {r.job_id: r for r in worker.get_finished()}
        assert results[1].success and results[2].success
        assert results[1].transfer_size == 3 * 2 * PAGE + 1024
        for i in (3, 4, 9):
            for t, ref in zip(device, original, strict=True):
                assert torch.equal(t[i], ref[i])
        assert torch.equal(device[1][20, :1024], original[1][20, :1024])
        assert not device[1][20, 1024:].any() and not device[0][20].any()
        untouched = np.setdiff1d(np.arange(32), dev_ids)
        assert not device[0][untouched].any()
    finally:
        worker.shutdown()
