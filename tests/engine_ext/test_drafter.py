"""Which offloaded layers are a drafter's, and the test-only hook that zeroes them on load."""

from __future__ import annotations

import os
from pathlib import Path

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

from engine_ext.drafter import drafter_layers
from engine_ext.host_worker import HostCopyWorker

PAGE = 2048


def test_a_draft_models_layers_are_found_by_their_prefix() -> None:
    names = [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
        "draft_model.model.layers.0.self_attn.attn",
        "draft_model.model.layers.1.self_attn.attn",
    ]
    assert drafter_layers(names, 2) == [2, 3]


def test_an_eagle_or_mtp_heads_layers_continue_the_targets_numbering() -> None:
    names = [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
        "model.layers.2.self_attn.attn",
    ]
    assert drafter_layers(names, 2) == [2]
    assert drafter_layers(names, 3) == []


def test_without_speculative_decoding_no_layer_is_a_drafters() -> None:
    assert drafter_layers(["draft_model.model.layers.0.self_attn.attn"], None) == []


@pytest.mark.parametrize(("mode", "zeroed"), [(None, []), ("all", [3, 4, 9]), ("last", [9])])
def test_the_hook_zeroes_only_the_drafters_rows_of_loaded_blocks(
    mode: str | None, zeroed: list[int], tmp_path: Path
) -> None:
    gen = torch.Generator().manual_seed(7)
    device = [torch.randint(1, 127, (16, PAGE), dtype=torch.int8, generator=gen) for _ in range(2)]
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, PAGE) for t in device],
        [[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]],
    )
    region = SharedOffloadRegion(f"test-drafter-{os.getpid()}-{mode}", 8, 0, 2 * PAGE, 2 * PAGE)
    flag = tmp_path / "zero"
    if mode is not None:
        flag.write_text(mode)
    # tensor 1 is the drafter's layer
    worker = HostCopyWorker(caches, 1, region, zero_on_load=(flag, {1}))
    try:
        original = [t.clone() for t in device]
        spec = GPULoadStoreSpec([3, 4, 9], [3], [0])
        assert worker.submit_store(1, spec, CPULoadStoreSpec([0, 1, 2]))
        assert worker.submit_load(2, CPULoadStoreSpec([0, 1, 2]), spec)
        assert torch.equal(device[0], original[0])  # the target's layer is never touched
        for block in range(16):
            want_zero = block in zeroed
            assert (not device[1][block].any()) == want_zero, block
            if not want_zero:
                assert torch.equal(device[1][block], original[1][block])
    finally:
        worker.shutdown()
