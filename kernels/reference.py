"""Torch reference for moving paged KV-cache blocks: the ground truth the Triton kernels match.

A paged KV cache is a list of tensors, one per attention layer, each holding ``num_blocks`` blocks
on dimension ``block_dim``:

- vLLM CPU platform: ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` (K then V inside each
  head row), ``block_dim=0``; with the hybrid allocator several layers may be views of one buffer.
- vLLM CUDA, FlashAttention: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, ``block_dim=1``;
  any stride order works (vLLM may store it physically as ``[num_blocks, 2, ...]``).

Everything is copied as raw bytes, so any dtype works (bf16, fp16, fp32, fp8, int8...).

Staging format (what goes to a host tier or to Mooncake as one object per block): a contiguous
tensor of any dtype holding ``len(block_ids) * block_nbytes(kv_caches, block_dim)`` bytes, read as
``[num_ids, row]`` bytes. Row ``i`` is, for each layer in list order, the bytes of
``cache.select(block_dim, block_ids[i])`` in C (logical) order. With equal layers this is the
``[num_ids, num_layers, layer_block_bytes]`` layout. Layers that alias one buffer are copied once
per entry in the list, exactly as listed.

Functions:
- ``block_nbytes(kv_caches, block_dim=0)``: bytes of one staging row.
- ``gather_blocks(kv_caches, block_ids, out, *, block_dim=0)``: blocks -> staging rows; returns ``out``.
- ``scatter_blocks(src, kv_caches, block_ids, *, block_dim=0)``: staging rows -> blocks.
- ``copy_blocks(src_caches, dst_caches, src_ids, dst_ids, *, block_dim=0)``: block ``src_ids[i]``
  of every source layer -> block ``dst_ids[i]`` of the matching destination layer; the two caches
  have the same shapes and dtypes and may live on different devices (GPU <-> pinned CPU).

The two caches of ``copy_blocks`` need the same block geometry (every dimension but
``block_dim``, and the dtype); their numbers of blocks may differ (a device cache and a host
region). Duplicate destination ids leave that block holding one of the candidates (unspecified
which).

Speed (CPU). The CPU default of ``kernels`` is ``kernels.host_copy`` (the same moves with
streaming stores, ~0.8 x memcpy where this path's ordinary stores reach ~0.6-0.7 x: see there
and docs/benchmarks.md); this module stays the ground truth, its fallback and
``AGENTGW_KERNELS=torch``. A layer whose block is one contiguous run of bytes (the CPU layout,
any block stride, so also views into one hybrid buffer) is moved as a ``[num_blocks,
block_bytes]`` view in the widest word (up to 16 bytes) that divides every address and length:
gathering is one ``index_select(..., out=<the staging rows>)`` (a libc memcpy per block inside
ATen while a block is under 32,768 words) and scattering one ``index_put_`` (a loop over words),
with no intermediate tensor and no Python loop over blocks. A copy between
two caches is one pass per run of consecutive ids on the side that has fewer runs (a contiguous
range on either side: one call), else a gather and a scatter through a bounce buffer
(``BOUNCE_BYTES``). Few, large ATen calls matter on a loaded machine: each parallel call waits
for every intra-op thread to be scheduled. Other layouts (FlashAttention's K/V split,
sliced views) take the general path: ``index_select`` into a temporary, then a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

__all__ = [
    "block_nbytes",
    "check_copy_args",
    "check_same_geometry",
    "copy_blocks",
    "gather_blocks",
    "scatter_blocks",
    "staging_rows",
]

#: Bytes of the bounce buffer a copy between two scattered id lists goes through, per step.
BOUNCE_BYTES = 16 << 20
#: Average run length (rows) below which sorted runs lose to the bounce buffer.
_MIN_RUN = 4
# complex128 moves 16 bytes per element; element copies never touch the bits (no arithmetic)
_WORDS = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def layer_block_nbytes(cache: torch.Tensor, block_dim: int) -> int:
    """Bytes that one block of one layer occupies."""
    num_blocks = cache.shape[block_dim]
    return (cache.numel() // num_blocks if num_blocks else 0) * cache.element_size()


def block_nbytes(kv_caches: Sequence[torch.Tensor], block_dim: int = 0) -> int:
    """Bytes of one staging row: one block over every layer."""
    return sum(layer_block_nbytes(cache, block_dim) for cache in kv_caches)


def staging_rows(buf: torch.Tensor, num_ids: int, row_nbytes: int) -> torch.Tensor:
    """View a contiguous staging tensor as ``[num_ids, row_nbytes]`` uint8, checking its size."""
    if not buf.is_contiguous():
        raise ValueError("the staging buffer must be contiguous")
    nbytes = buf.numel() * buf.element_size()
    if nbytes != num_ids * row_nbytes:
        raise ValueError(
            f"the staging buffer holds {nbytes} bytes, expected {num_ids} blocks x {row_nbytes} bytes"
        )
    return buf.reshape(-1).view(torch.uint8).view(num_ids, row_nbytes)


def _check_ids(ids: torch.Tensor, name: str) -> None:
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be a 1-D int64/int32 tensor, got {tuple(ids.shape)} {ids.dtype}")


def _block_geometry(cache: torch.Tensor, block_dim: int) -> tuple[list[int], torch.dtype]:
    return [size for dim, size in enumerate(cache.shape) if dim != block_dim], cache.dtype


def check_same_geometry(src: torch.Tensor, dst: torch.Tensor, block_dim: int) -> None:
    """Refuse two layers whose blocks differ in shape or dtype (their block counts may differ)."""
    if _block_geometry(src, block_dim) != _block_geometry(dst, block_dim):
        raise ValueError(
            f"layer geometry differs: {tuple(src.shape)} {src.dtype} vs {tuple(dst.shape)} {dst.dtype}"
        )


def _byte_rows(cache: torch.Tensor, block_dim: int) -> tuple[int, int] | None:
    """``(byte offset in storage, block stride in bytes)`` when each block is one contiguous run."""
    expected = 1
    for dim in range(cache.dim() - 1, -1, -1):
        if dim == block_dim or cache.shape[dim] == 1:
            continue
        if cache.stride(dim) != expected:
            return None
        expected *= cache.shape[dim]
    esize = cache.element_size()
    return _storage_offset(cache) * esize, cache.stride(block_dim) * esize


def _storage_offset(tensor: torch.Tensor) -> int:
    # torch types it ``int | SymInt``; a SymInt only appears under symbolic tracing (torch.compile),
    # which never sees these copies
    return cast(int, tensor.storage_offset())


def _word_rows(
    tensor: torch.Tensor, offset: int, stride: int, num_rows: int, nbytes: int, word: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[num_rows, nbytes // word]`` view of ``tensor``'s storage in words of ``word`` bytes."""
    view = torch.empty(0, dtype=dtype, device=tensor.device)
    return view.set_(
        tensor.untyped_storage(), offset // word, (num_rows, nbytes // word), (stride // word, 1)
    )


def _word(*values: int) -> tuple[int, torch.dtype]:
    for size, dtype in _WORDS:
        if all(v % size == 0 for v in values):
            return size, dtype
    raise AssertionError("unreachable: 1 divides everything")


def gather_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor, *, block_dim: int = 0
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into the staging rows of ``out``; returns ``out``."""
    _check_ids(block_ids, "block_ids")
    num_ids = block_ids.numel()
    rows = staging_rows(out, num_ids, block_nbytes(kv_caches, block_dim))
    if num_ids == 0:
        return out
    offset = 0
    for cache in kv_caches:
        nbytes = layer_block_nbytes(cache, block_dim)
        ids = block_ids.to(cache.device, torch.int64)
        fast = _byte_rows(cache, block_dim) if cache.device == rows.device else None
        if fast is not None and nbytes:
            src_off, src_stride = fast
            dst_off = _storage_offset(rows) + offset
            word, dtype = _word(src_off, src_stride, dst_off, rows.stride(0), nbytes)
            src_rows = _word_rows(cache, src_off, src_stride, cache.shape[block_dim], nbytes, word, dtype)
            dst_rows = _word_rows(rows, dst_off, rows.stride(0), num_ids, nbytes, word, dtype)
            torch.index_select(src_rows, 0, ids, out=dst_rows)
        else:
            picked = cache.index_select(block_dim, ids)
            picked = picked.movedim(block_dim, 0).contiguous().view(torch.uint8).reshape(num_ids, -1)
            rows[:, offset : offset + nbytes].copy_(picked)
        offset += nbytes
    return out


def scatter_blocks(
    src: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, *, block_dim: int = 0
) -> None:
    """Write the staging rows of ``src`` into blocks ``block_ids`` of every layer (gather's inverse)."""
    _check_ids(block_ids, "block_ids")
    num_ids = block_ids.numel()
    rows = staging_rows(src, num_ids, block_nbytes(kv_caches, block_dim))
    if num_ids == 0:
        return
    offset = 0
    for cache in kv_caches:
        nbytes = layer_block_nbytes(cache, block_dim)
        ids = block_ids.to(cache.device, torch.int64)
        fast = _byte_rows(cache, block_dim) if cache.device == rows.device else None
        if fast is not None and nbytes:
            dst_off, dst_stride = fast
            src_off = _storage_offset(rows) + offset
            word, dtype = _word(src_off, rows.stride(0), dst_off, dst_stride, nbytes)
            src_rows = _word_rows(rows, src_off, rows.stride(0), num_ids, nbytes, word, dtype)
            dst_rows = _word_rows(cache, dst_off, dst_stride, cache.shape[block_dim], nbytes, word, dtype)
            dst_rows.index_put_((ids,), src_rows)
        else:
            block_shape = [size for dim, size in enumerate(cache.shape) if dim != block_dim]
            chunk = rows[:, offset : offset + nbytes].to(cache.device).contiguous()
            values = chunk.view(cache.dtype).reshape(num_ids, *block_shape).movedim(0, block_dim)
            cache.index_copy_(block_dim, ids, values)
        offset += nbytes


def _runs(ids: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` positions of the maximal runs of consecutive values in sorted ``ids``."""
    breaks = (torch.nonzero(ids.diff() != 1).flatten() + 1).tolist()
    return list(zip([0, *breaks], [*breaks, ids.numel()], strict=True))


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Row ``src_ids[i]`` of ``src`` -> row ``dst_ids[i]`` of ``dst`` (2-D word views, one device).

    The pairs may be copied in any order, so they are sorted by the side whose ids then form
    fewer runs of consecutive rows; each run is one ATen call: ``index_select(out=dst[run])`` or
    ``index_put_(dst_ids, src[run])``. Ids too fragmented on both sides (runs shorter than
    ``_MIN_RUN`` on average) go through a bounce buffer instead.
    """
    num_ids = src_ids.numel()
    if src_ids.device.type != "cpu":  # sorting would synchronise: one gather, one scatter
        dst.index_put_((dst_ids,), src.index_select(0, src_ids))
        return
    dst_sorted, dst_order = torch.sort(dst_ids)
    src_sorted, src_order = torch.sort(src_ids)
    dst_runs, src_runs = _runs(dst_sorted), _runs(src_sorted)
    if len(dst_runs) <= len(src_runs) and len(dst_runs) * _MIN_RUN <= num_ids:
        by_dst = src_ids[dst_order]
        for start, end in dst_runs:
            first = int(dst_sorted[start])
            torch.index_select(src, 0, by_dst[start:end], out=dst[first : first + end - start])
        return
    if len(src_runs) * _MIN_RUN <= num_ids:
        by_src = dst_ids[src_order]
        for start, end in src_runs:
            first = int(src_sorted[start])
            dst.index_put_((by_src[start:end],), src[first : first + end - start])
        return
    row_bytes = src.shape[1] * src.element_size()
    step = max(1, BOUNCE_BYTES // max(1, row_bytes))
    bounce = torch.empty((min(step, num_ids), src.shape[1]), dtype=src.dtype, device=src.device)
    for first in range(0, num_ids, step):
        part = bounce[: min(step, num_ids - first)]
        torch.index_select(src, 0, src_ids[first : first + step], out=part)
        dst.index_put_((dst_ids[first : first + step],), part)


def check_copy_args(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    block_dim: int,
) -> None:
    """What every ``copy_blocks`` refuses before a byte moves: ids that are not 1-D integers,
    unequal id or layer counts, layers of different geometry."""
    _check_ids(src_ids, "src_ids")
    _check_ids(dst_ids, "dst_ids")
    if src_ids.numel() != dst_ids.numel():
        raise ValueError(f"{src_ids.numel()} source ids but {dst_ids.numel()} destination ids")
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"{len(src_caches)} source layers but {len(dst_caches)} destination layers")
    for src, dst in zip(src_caches, dst_caches, strict=True):
        check_same_geometry(src, dst, block_dim)


def copy_blocks(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    *,
    block_dim: int = 0,
) -> None:
    """Copy block ``src_ids[i]`` of each source layer to block ``dst_ids[i]`` of the destination layer."""
    check_copy_args(src_caches, dst_caches, src_ids, dst_ids, block_dim)
    for src, dst in zip(src_caches, dst_caches, strict=True):
        sids = src_ids.to(src.device, torch.int64)
        dids = dst_ids.to(dst.device, torch.int64)
        nbytes = layer_block_nbytes(src, block_dim)
        src_fast = _byte_rows(src, block_dim)
        dst_fast = _byte_rows(dst, block_dim)
        if (
            src_fast is not None
            and dst_fast is not None
            and src.device == dst.device
            and nbytes
            and sids.numel()
        ):
            (soff, sstride), (doff, dstride) = src_fast, dst_fast
            word, dtype = _word(soff, sstride, doff, dstride, nbytes)
            _copy_rows(
                _word_rows(src, soff, sstride, src.shape[block_dim], nbytes, word, dtype),
                _word_rows(dst, doff, dstride, dst.shape[block_dim], nbytes, word, dtype),
                sids,
                dids,
            )
        else:
            picked = src.index_select(block_dim, sids)
            dst.index_copy_(block_dim, dids, picked.to(dst.device))
