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

Duplicate destination ids leave that block holding one of the candidates (unspecified which).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["block_nbytes", "copy_blocks", "gather_blocks", "scatter_blocks", "staging_rows"]


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


def gather_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor, *, block_dim: int = 0
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into the staging rows of ``out``; returns ``out``."""
    _check_ids(block_ids, "block_ids")
    rows = staging_rows(out, block_ids.numel(), block_nbytes(kv_caches, block_dim))
    offset = 0
    for cache in kv_caches:
        nbytes = layer_block_nbytes(cache, block_dim)
        picked = cache.index_select(block_dim, block_ids.to(cache.device, torch.int64))
        picked = picked.movedim(block_dim, 0).contiguous().view(torch.uint8).reshape(block_ids.numel(), -1)
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
    offset = 0
    for cache in kv_caches:
        nbytes = layer_block_nbytes(cache, block_dim)
        block_shape = [size for dim, size in enumerate(cache.shape) if dim != block_dim]
        chunk = rows[:, offset : offset + nbytes].to(cache.device).contiguous()
        values = chunk.view(cache.dtype).reshape(num_ids, *block_shape).movedim(0, block_dim)
        cache.index_copy_(block_dim, block_ids.to(cache.device, torch.int64), values)
        offset += nbytes


def copy_blocks(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    *,
    block_dim: int = 0,
) -> None:
    """Copy block ``src_ids[i]`` of each source layer to block ``dst_ids[i]`` of the destination layer."""
    _check_ids(src_ids, "src_ids")
    _check_ids(dst_ids, "dst_ids")
    if src_ids.numel() != dst_ids.numel():
        raise ValueError(f"{src_ids.numel()} source ids but {dst_ids.numel()} destination ids")
    if len(src_caches) != len(dst_caches):
        raise ValueError(f"{len(src_caches)} source layers but {len(dst_caches)} destination layers")
    for src, dst in zip(src_caches, dst_caches, strict=True):
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(
                f"layer geometry differs: {tuple(src.shape)} {src.dtype} vs {tuple(dst.shape)} {dst.dtype}"
            )
        picked = src.index_select(block_dim, src_ids.to(src.device, torch.int64))
        dst.index_copy_(block_dim, dst_ids.to(dst.device, torch.int64), picked.to(dst.device))
