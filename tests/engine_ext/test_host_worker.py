"""HostCopyWorker moves exact bytes between device pages and host chunks (random data)."""

from __future__ import annotations

import os
from collections.abc import Callable

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


# ----- parity over the layouts the engines produce: streaming copier, torch reference, Triton's interpreter -----
# (tensor pages, block stride, group refs) as `CanonicalKVCaches` describes them on the CPU platform:
# - tiny Llama: 2 layers, one (num_blocks, 32 KiB) tensor each ([N, 2 heads, 128, 2*32] bf16), 1 group;
# - Gemma3 with the hybrid manager: 3 sliding + 1 full layer in 4 groups of one layer, all four
#   sharing one buffer (one tensor, 4 groups referencing it);
# - Qwen3-Next with the hybrid manager: one shared buffer whose page is the (padded) Mamba state;
#   the attention group uses only a prefix of it;
# - a block stride larger than the page (layers interleaved inside a packed block).
ENGINE_LAYOUTS: dict[str, tuple[list[int], int | None, list[list[tuple[int, int]]]]] = {
    "tiny-llama": ([32768, 32768], None, [[(0, 32768), (1, 32768)]]),
    "gemma3-hybrid": ([32768], None, [[(0, 32768)]] * 4),
    "qwen3-next-hybrid": ([69632], None, [[(0, 69632)], [(0, 32768)]]),
    "packed-stride": ([8192], 3 * 8192, [[(0, 8192)], [(0, 4096)]]),
}
NUM_DEVICE_BLOCKS = 24
NUM_CHUNKS = 32


def _layout_worker(
    name: str, blocks_per_chunk: int, num_chunks: int = NUM_CHUNKS
) -> tuple[HostCopyWorker, list[torch.Tensor], SharedOffloadRegion]:
    pages, stride, groups = ENGINE_LAYOUTS[name]
    gen = torch.Generator().manual_seed(len(name) * 10 + blocks_per_chunk)
    device = []
    for page in pages:
        row = stride or page
        buf = torch.randint(-128, 128, (NUM_DEVICE_BLOCKS, row), dtype=torch.int8, generator=gen)
        device.append(buf[:, :page])
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, page) for t, page in zip(device, pages, strict=True)],
        [[CanonicalKVCacheRef(t, n) for t, n in refs] for refs in groups],
    )
    chunk_bytes = sum(pages) * blocks_per_chunk
    region = SharedOffloadRegion(
        f"test-hwp-{os.getpid()}-{name}-{blocks_per_chunk}", num_chunks, 0, chunk_bytes, chunk_bytes
    )
    return HostCopyWorker(caches, blocks_per_chunk, region), device, region


def _spec(name: str, blocks_per_chunk: int, seed: int) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    """Random scattered device blocks per group, from a random logical offset, to random chunks."""
    rng = np.random.default_rng(seed)
    num_groups = len(ENGINE_LAYOUTS[name][2])
    sizes = [int(rng.integers(1, 5)) for _ in range(num_groups)]
    offsets = [int(rng.integers(0, 3)) for _ in range(num_groups)]
    dev_ids = rng.permutation(NUM_DEVICE_BLOCKS)[: sum(sizes)].tolist()
    num_chunks = sum(
        -(-(s + o % blocks_per_chunk) // blocks_per_chunk) for s, o in zip(sizes, offsets, strict=True)
    )
    chunks = rng.permutation(NUM_CHUNKS)[:num_chunks].tolist()
    return GPULoadStoreSpec(dev_ids, sizes, offsets), CPULoadStoreSpec(chunks)


def _naive_copy(
    worker: HostCopyWorker, dev_spec: GPULoadStoreSpec, host_spec: CPULoadStoreSpec, to_host: bool
) -> None:
    """Ground truth: one page-prefix copy per block, straight from the layout's definition."""
    bpc = worker._blocks_per_chunk
    dev_off = host_off = 0
    for group, size, idx in zip(worker._groups, dev_spec.group_sizes, dev_spec.block_indices, strict=True):
        skip = idx % bpc
        for k in range(size):
            chunk, column = divmod(skip + k, bpc)
            d = int(dev_spec.block_ids[dev_off + k])
            c = int(host_spec.block_ids[host_off + chunk])
            for dev, host in zip(group.device, group.host_columns[column], strict=True):
                if to_host:
                    host[c].copy_(dev[d])
                else:
                    dev[d].copy_(host[c])
        dev_off += size
        host_off += -(-(size + skip) // bpc)


@pytest.fixture(params=["stream", "torch", "triton-interpreter"])
def kernel_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param in ("stream", "torch"):  # stream: the CPU default, kernels.host_copy
        if request.param == "stream":
            from kernels import host_copy

            monkeypatch.setattr(host_copy, "STREAM_MIN_BYTES", 0)  # these transfers are small
        monkeypatch.setenv("AGENTGW_KERNELS", str(request.param))
    else:
        import triton  # noqa: F401  (imported before TRITON_INTERPRET is set)

        from tests.kernels.conftest import _import_interpreted_kv_copy

        _import_interpreted_kv_copy()
        monkeypatch.setenv("AGENTGW_KERNELS", "triton")
    return str(request.param)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("layout", list(ENGINE_LAYOUTS))
def test_store_and_load_match_a_per_block_copy_for_every_engine_layout(
    layout: str, blocks_per_chunk: int, kernel_backend: str
) -> None:
    worker, device, region = _layout_worker(layout, blocks_per_chunk)
    try:
        _round_trips(worker, device, region, layout, blocks_per_chunk, lambda spec: spec)
    finally:
        worker.shutdown()


def _round_trips(
    worker: HostCopyWorker,
    device: list[torch.Tensor],
    region: SharedOffloadRegion,
    layout: str,
    blocks_per_chunk: int,
    device_side: Callable[[GPULoadStoreSpec], object],
) -> None:
    """Three seeds of a store then a load through ``worker``, the device side of each passed as
    ``device_side`` makes it, each against a per-block copy."""
    host = region._base
    assert host is not None
    try:
        for seed in range(3):
            dev_spec, host_spec = _spec(layout, blocks_per_chunk, seed)
            host.zero_()
            _naive_copy(worker, dev_spec, host_spec, to_host=True)
            expected_host = host.clone()
            host.zero_()
            assert worker.submit_store(1, device_side(dev_spec), host_spec)
            assert torch.equal(host, expected_host), (layout, seed)

            host.copy_(torch.randint(-128, 128, host.shape, dtype=torch.int8))
            saved = [t.clone() for t in device]
            _naive_copy(worker, dev_spec, host_spec, to_host=False)
            expected_device = [t.clone() for t in device]
            for t, s in zip(device, saved, strict=True):
                t.copy_(s)
            assert worker.submit_load(2, host_spec, device_side(dev_spec))
            for t, e in zip(device, expected_device, strict=True):
                assert torch.equal(t, e), (layout, seed)
        assert [r.success for r in worker.get_finished()] == [True] * 6
    finally:
        del host  # the region's mapping closes only once no tensor exports it


def _as_the_connector_passes(dev_spec: GPULoadStoreSpec, caches: CanonicalKVCaches) -> object:
    """The device side as the installed vLLM's OffloadingConnector hands it to its worker: the
    spec itself in vLLM 0.32, the device pointers it resolves from the spec from vLLM 0.34 on."""
    try:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
    except ImportError:
        return dev_spec
    return resolve_device_pointers(dev_spec, caches)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("layout", list(ENGINE_LAYOUTS))
def test_the_device_side_as_the_installed_connector_passes_it(layout: str, blocks_per_chunk: int) -> None:
    worker, device, region = _layout_worker(layout, blocks_per_chunk)
    pages, _, groups = ENGINE_LAYOUTS[layout]
    caches = CanonicalKVCaches(  # the tensors the worker was built on, as the connector holds them
        [CanonicalKVCacheTensor(t, page) for t, page in zip(device, pages, strict=True)],
        [[CanonicalKVCacheRef(t, n) for t, n in refs] for refs in groups],
    )
    try:
        _round_trips(
            worker,
            device,
            region,
            layout,
            blocks_per_chunk,
            lambda spec: _as_the_connector_passes(spec, caches),
        )
    finally:
        worker.shutdown()
