"""Parity of the CPU streaming-store block mover (`kernels.host_copy`) with the torch reference.

Every layout and dtype of the Triton parity tests, with streaming stores and with ordinary ones
(the copier picks by bytes moved), rows at every alignment and of odd lengths, random ids; the
layouts it cannot move (FlashAttention's K/V split, sliced views) must reach the reference.
"""

from __future__ import annotations

import sys

import pytest
import torch

import kernels
from kernels import host_copy, reference
from tests.kernels.test_kv_copy import (
    DTYPES,
    LAYOUTS,
    NUM_BLOCKS,
    _block_dim,
    _caches,
    _ids,
    _same,
    _staging,
    _strided_cpu_layer,
)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def test_the_copier_compiles_here() -> None:
    """llvmlite comes with vLLM (numba): without it the CPU engines would take the slower reference."""
    assert host_copy.available(), host_copy._compiled.get("error")


@pytest.fixture(params=["streaming", "ordinary"])
def stores(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Force the copier's store kind through its size threshold."""
    monkeypatch.setattr(host_copy, "STREAM_MIN_BYTES", 0 if request.param == "streaming" else 1 << 62)
    return str(request.param)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_matches_reference(layout: str, dtype: torch.dtype, stores: str) -> None:
    gen = torch.Generator().manual_seed(41)
    caches, ids, bd = _caches(layout, dtype, gen), _ids(7, gen), _block_dim(layout)
    expected = reference.gather_blocks(caches, ids, _staging(caches, 7, bd), block_dim=bd)
    assert torch.equal(host_copy.gather_blocks(caches, ids, _staging(caches, 7, bd), block_dim=bd), expected)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float32], ids=str)
def test_scatter_and_copy_match_reference(layout: str, dtype: torch.dtype, stores: str) -> None:
    gen = torch.Generator().manual_seed(42)
    caches, ids, bd = _caches(layout, dtype, gen), _ids(7, gen), _block_dim(layout)
    src = torch.randint(0, 256, (7, reference.block_nbytes(caches, bd)), generator=gen, dtype=torch.uint8)
    want = [c.clone() for c in caches]
    reference.scatter_blocks(src, want, ids, block_dim=bd)
    host_copy.scatter_blocks(src, caches, ids, block_dim=bd)
    assert _same(caches, want)

    dst = _caches(layout, dtype, gen)
    want = [d.clone() for d in dst]
    dst_ids = _ids(7, gen)
    reference.copy_blocks(caches, want, ids, dst_ids, block_dim=bd)
    host_copy.copy_blocks(caches, dst, ids, dst_ids, block_dim=bd)
    assert _same(dst, want)


@pytest.mark.parametrize("row_bytes", [1, 3, 63, 64, 65, 200, 4096 + 17])
@pytest.mark.parametrize("misalign", [0, 1, 13, 48])
def test_rows_at_every_alignment_and_length_copy_exactly(row_bytes: int, misalign: int, stores: str) -> None:
    """Head, 64-byte body and tail of each row; bytes around the rows stay as they were."""
    gen = torch.Generator().manual_seed(row_bytes * 100 + misalign)
    stride = row_bytes + 70
    src_buf = torch.randint(0, 256, (NUM_BLOCKS * stride + 128,), generator=gen, dtype=torch.uint8)
    dst_buf = torch.randint(0, 256, (40 * stride + 128,), generator=gen, dtype=torch.uint8)
    src = src_buf[misalign : misalign + NUM_BLOCKS * stride].view(NUM_BLOCKS, stride)[:, 5 : 5 + row_bytes]
    dst = dst_buf[7 : 7 + 40 * stride].view(40, stride)[:, 3 : 3 + row_bytes]
    src_ids, dst_ids = _ids(9, gen), torch.randperm(40, generator=gen)[:9]
    want = dst_buf.clone()
    want_rows = want[7 : 7 + 40 * stride].view(40, stride)[:, 3 : 3 + row_bytes]
    for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        want_rows[d].copy_(src[s])
    host_copy.copy_blocks([src], [dst], src_ids, dst_ids)
    assert torch.equal(dst_buf, want)


def test_large_transfer_streams_and_equals_index_select() -> None:
    """Above STREAM_MIN_BYTES: 8 MiB of 64 KiB pages, scattered both ways, engine int8 layout."""
    gen = torch.Generator().manual_seed(43)
    device = torch.randint(-128, 128, (256, 65536), generator=gen, dtype=torch.int8)
    host = torch.zeros(200, 65536, dtype=torch.int8)
    dev_ids, host_ids = torch.randperm(256, generator=gen)[:128], torch.randperm(200, generator=gen)[:128]
    assert host_copy.STREAM_MIN_BYTES <= 128 * 65536
    host_copy.copy_blocks([device], [host], dev_ids, host_ids)
    assert torch.equal(host[host_ids], device[dev_ids])
    assert not host[[i for i in range(200) if i not in set(host_ids.tolist())]].any()
    back = torch.zeros_like(device)
    host_copy.copy_blocks([host], [back], host_ids, dev_ids)
    assert torch.equal(back[dev_ids], device[dev_ids])


def test_hybrid_views_and_strided_layers(stores: str) -> None:
    gen = torch.Generator().manual_seed(44)
    caches = [_strided_cpu_layer(gen) for _ in range(2)]
    ids = _ids(6, gen)
    staged = host_copy.gather_blocks(caches, ids, _staging(caches, 6, 0))
    assert torch.equal(staged, reference.gather_blocks(caches, ids, _staging(caches, 6, 0)))
    blank = [_strided_cpu_layer(torch.Generator().manual_seed(50 + i)) for i in range(2)]
    want = [_strided_cpu_layer(torch.Generator().manual_seed(50 + i)) for i in range(2)]  # same bytes
    reference.scatter_blocks(staged, want, ids)
    host_copy.scatter_blocks(staged, blank, ids)
    for b, w in zip(blank, want, strict=True):  # the whole buffers, bytes between the views included
        assert torch.equal(_storage_bytes(b), _storage_bytes(w))


def test_bad_ids_are_refused_before_any_byte_moves() -> None:
    gen = torch.Generator().manual_seed(45)
    caches = _caches("cpu", torch.bfloat16, gen)
    before = [c.clone() for c in caches]
    with pytest.raises(IndexError, match="out of range"):
        host_copy.gather_blocks(caches, torch.tensor([0, NUM_BLOCKS]), _staging(caches, 2, 0))
    with pytest.raises(IndexError, match="out of range"):
        host_copy.scatter_blocks(_staging(caches, 2, 0), caches, torch.tensor([1, -1]))
    with pytest.raises(IndexError, match="out of range"):
        host_copy.copy_blocks(caches, caches[::-1], torch.tensor([0]), torch.tensor([NUM_BLOCKS]))
    with pytest.raises(ValueError, match="staging buffer holds"):
        host_copy.gather_blocks(caches, _ids(3, gen), _staging(caches, 2, 0))
    with pytest.raises(ValueError, match="1-D int64/int32"):
        host_copy.gather_blocks(caches, torch.tensor([[0]]), _staging(caches, 1, 0))
    assert _same(caches, before)


def test_cpu_dispatch_takes_the_copier_and_hands_other_layouts_to_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    moved: list[int] = []
    original = host_copy.move_rows
    monkeypatch.setattr(host_copy, "move_rows", lambda *a, **k: moved.append(a[4]) or original(*a, **k))
    fallback: list[str] = []
    ref_gather = reference.gather_blocks
    monkeypatch.setattr(
        reference, "gather_blocks", lambda *a, **k: fallback.append("reference") or ref_gather(*a, **k)
    )
    monkeypatch.delenv("AGENTGW_KERNELS", raising=False)
    gen = torch.Generator().manual_seed(46)
    cpu, ids = _caches("cpu", torch.bfloat16, gen), _ids(4, gen)
    out = kernels.gather_blocks(cpu, ids, _staging(cpu, 4, 0))
    assert torch.equal(out, ref_gather(cpu, ids, _staging(cpu, 4, 0)))
    assert moved == [reference.layer_block_nbytes(c, 0) for c in cpu] and fallback == []
    flash = _caches("flash", torch.bfloat16, gen)
    kernels.gather_blocks(flash, ids[:2], _staging(flash, 2, 1), block_dim=1)
    assert fallback == ["reference"] and len(moved) == len(cpu)
    monkeypatch.setenv("AGENTGW_KERNELS", "torch")
    kernels.gather_blocks(cpu, ids, _staging(cpu, 4, 0))
    assert fallback == ["reference", "reference"] and len(moved) == len(cpu)
    monkeypatch.setenv("AGENTGW_KERNELS", "stream")
    kernels.gather_blocks(cpu, ids, _staging(cpu, 4, 0))
    assert len(moved) == 2 * len(cpu)


def test_without_llvmlite_the_reference_moves_the_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_copy, "_compiled", {})
    monkeypatch.setitem(sys.modules, "llvmlite", None)  # `import llvmlite.binding` now fails
    monkeypatch.delenv("AGENTGW_KERNELS", raising=False)
    assert not host_copy.available()
    gen = torch.Generator().manual_seed(47)
    caches, ids = _caches("cpu", torch.float32, gen), _ids(5, gen)
    out = kernels.gather_blocks(caches, ids, _staging(caches, 5, 0))
    assert torch.equal(out, reference.gather_blocks(caches, ids, _staging(caches, 5, 0)))
    monkeypatch.setenv("AGENTGW_KERNELS", "stream")
    with pytest.raises(RuntimeError, match="not available"):
        kernels.gather_blocks(caches, ids, _staging(caches, 5, 0))
