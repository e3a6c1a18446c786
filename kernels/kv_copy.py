"""Triton kernels that move paged KV-cache blocks as raw bytes; ``reference.py`` is their ground truth.

Same operations, layouts and staging format as ``kernels.reference``: ``gather_blocks`` (blocks of
every layer -> contiguous staging rows), ``scatter_blocks`` (the inverse) and ``copy_blocks``
(between two caches of the same block geometry, e.g. a GPU cache and a pinned CPU cache; their
numbers of blocks may differ).

How it works. On the host, each layer's block is described by its contiguous *runs*: the block is
``cache.select(block_dim, b)``; the innermost dimensions whose strides chain up to 1 form one run,
the remaining outer dimensions enumerate the runs (CPU layout ``[N, H, bs, 2D]``: one run per
block; FlashAttention ``[2, N, bs, H, D]``: two runs, K and V). Source and destination runs are
refined to a common length, giving *pieces*: ``(src_addr, src_block_stride, dst_addr,
dst_block_stride, nbytes)`` with absolute byte addresses. One kernel, ``_copy_pieces_kernel``,
then copies, for every (id i, piece p, chunk c) program, ``BLOCK`` words from
``src_addr[p] + src_id[i] * src_stride[p]`` to ``dst_addr[p] + dst_id[i] * dst_stride[p]``; the
staging side uses ``i`` itself as its id. Words are int32, int16 or int8, the widest that divides
every address, stride and length, and the kernel is told the alignment (up to 16 bytes) so the
compiler emits 128-bit loads and stores.

Parameters: ``TILE_BYTES`` (bytes one program copies, 8 KiB), ``MAX_RUNS_PER_LAYER`` (a layout
that fragments a block into more runs is refused: use the reference), ``num_warps`` 4.

Where it runs: CUDA tensors (a CPU side must be pinned, it is read through unified addressing),
or CPU tensors when ``TRITON_INTERPRET=1`` was set before this module was imported (Triton's
interpreter, for tests). Block ids held on the CPU are bounds-checked; ids already on the GPU are
not (that would synchronise).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs

from kernels.reference import (
    block_nbytes,
    check_copy_args,
    layer_block_nbytes,
    staging_rows,
)

__all__ = ["INTERPRETED", "copy_blocks", "gather_blocks", "scatter_blocks"]

TILE_BYTES = 8192
MAX_RUNS_PER_LAYER = 4096
_MAX_ALIGN = 16

#: True when the kernel was built for Triton's interpreter (CPU tensors) rather than compiled.
INTERPRETED: bool = bool(knobs.runtime.interpret)


# Triton reads the parameters' annotations (tl.constexpr), so the others stay unannotated; triton
# ships no type information, so its decorator is untyped.
@triton.jit  # type: ignore[untyped-decorator]
def _copy_pieces_kernel(  # type: ignore[no-untyped-def]
    src_ids_ptr,
    dst_ids_ptr,
    src_addr_ptr,
    src_stride_ptr,
    dst_addr_ptr,
    dst_stride_ptr,
    len_ptr,
    num_pieces,
    num_chunks,
    WORD: tl.constexpr,
    VEC: tl.constexpr,
    ALIGN: tl.constexpr,
    HAS_SRC_IDS: tl.constexpr,
    HAS_DST_IDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    chunk = pid % num_chunks
    rest = pid // num_chunks
    piece = rest % num_pieces
    i = rest // num_pieces

    src_block = tl.load(src_ids_ptr + i).to(tl.int64) if HAS_SRC_IDS else i
    dst_block = tl.load(dst_ids_ptr + i).to(tl.int64) if HAS_DST_IDS else i

    src_addr = tl.load(src_addr_ptr + piece) + src_block * tl.load(src_stride_ptr + piece)
    dst_addr = tl.load(dst_addr_ptr + piece) + dst_block * tl.load(dst_stride_ptr + piece)
    src = tl.multiple_of(src_addr.to(tl.pointer_type(WORD)), ALIGN)
    dst = tl.multiple_of(dst_addr.to(tl.pointer_type(WORD)), ALIGN)
    num_words = tl.multiple_of(tl.load(len_ptr + piece), VEC)

    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
    mask = offs < num_words
    words = tl.load(src + offs, mask=mask)
    tl.store(dst + offs, words, mask=mask)


@dataclass(frozen=True)
class _Side:
    """Where one layer's blocks live: ``base + block * block_stride + run_offsets[r]``, in bytes."""

    base: int
    block_stride: int
    run_offsets: list[int]
    run_nbytes: int


def _cache_side(cache: torch.Tensor, block_dim: int) -> _Side:
    """Describe one layer's blocks as contiguous runs, in C order of the block's elements."""
    esize = cache.element_size()
    dims = [
        (size, stride)
        for dim, (size, stride) in enumerate(zip(cache.shape, cache.stride(), strict=True))
        if dim != block_dim and size != 1
    ]
    run_elems = 1
    while dims and dims[-1][1] == run_elems:
        run_elems *= dims.pop()[0]
    num_runs = math.prod(size for size, _ in dims)
    if num_runs > MAX_RUNS_PER_LAYER:
        raise ValueError(
            f"a block of this layout splits into {num_runs} runs (> {MAX_RUNS_PER_LAYER}): "
            f"shape {tuple(cache.shape)} stride {cache.stride()}; use kernels.reference"
        )
    offsets = [0]
    for size, stride in dims:
        offsets = [offset + index * stride * esize for offset in offsets for index in range(size)]
    return _Side(
        base=cache.data_ptr(),
        block_stride=cache.stride(block_dim) * esize,
        run_offsets=offsets,
        run_nbytes=run_elems * esize,
    )


def _staging_sides(rows: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_dim: int) -> list[_Side]:
    """Each layer's slice of a staging row: one run per layer, block stride = the row."""
    sides, offset = [], 0
    for cache in kv_caches:
        nbytes = layer_block_nbytes(cache, block_dim)
        sides.append(_Side(rows.data_ptr() + offset, rows.shape[1], [0], nbytes))
        offset += nbytes
    return sides


@dataclass(frozen=True)
class _Plan:
    tables: torch.Tensor  # [5, num_pieces] int64: src_addr, src_stride, dst_addr, dst_stride, len (words)
    word: torch.dtype
    word_size: int
    align: int
    max_words: int


_WORDS = {4: (torch.int32, tl.int32), 2: (torch.int16, tl.int16), 1: (torch.int8, tl.int8)}


def _plan(src_sides: Sequence[_Side], dst_sides: Sequence[_Side]) -> _Plan:
    """Refine matching source/destination runs to common pieces and choose the word size."""
    rows: list[tuple[int, int, int, int, int]] = []
    for src, dst in zip(src_sides, dst_sides, strict=True):
        length = min(src.run_nbytes, dst.run_nbytes)
        total = src.run_nbytes * len(src.run_offsets)
        if length == 0 or total == 0:
            continue
        if max(src.run_nbytes, dst.run_nbytes) % length or total != dst.run_nbytes * len(dst.run_offsets):
            raise ValueError("source and destination blocks have different geometries")
        for pos in range(0, total, length):
            src_addr = src.base + src.run_offsets[pos // src.run_nbytes] + pos % src.run_nbytes
            dst_addr = dst.base + dst.run_offsets[pos // dst.run_nbytes] + pos % dst.run_nbytes
            rows.append((src_addr, src.block_stride, dst_addr, dst.block_stride, length))
    common = math.gcd(*(value for row in rows for value in row))
    align = min(common & -common, _MAX_ALIGN) if common else _MAX_ALIGN
    word_size = min(align, 4)
    rows = [(*row[:4], row[4] // word_size) for row in rows]
    tables = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5).T.contiguous()
    max_words = max((row[4] for row in rows), default=0)
    return _Plan(tables, _WORDS[word_size][0], word_size, align, max_words)


def _launch_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """The device the kernel runs on; CPU memory must be pinned when the kernel runs on a GPU."""
    gpu = next((t.device for t in tensors if t.device.type != "cpu"), None)
    if gpu is None:
        if not INTERPRETED:
            raise RuntimeError(
                "Triton KV-copy kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
                "kernels.kv_copy is imported (CPU tensors through Triton's interpreter)"
            )
        return torch.device("cpu")
    if gpu.type != "cuda":
        raise RuntimeError(f"Triton KV-copy kernels run on CUDA, not {gpu.type}")
    for t in tensors:
        if t.device.type == "cpu" and not t.is_pinned():
            raise RuntimeError("a CPU tensor read or written by a GPU kernel must be in pinned memory")
        if t.device.type == "cuda" and t.device != gpu:
            raise RuntimeError(f"tensors on two GPUs: {gpu} and {t.device}")
    return gpu


def _prepare_ids(ids: torch.Tensor, num_blocks: int, name: str, device: torch.device) -> torch.Tensor:
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be a 1-D int64/int32 tensor, got {tuple(ids.shape)} {ids.dtype}")
    if ids.device.type == "cpu" and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise IndexError(f"{name} out of range [0, {num_blocks})")
    return ids.to(device=device, dtype=torch.int64, non_blocking=True)


def _run(
    plan: _Plan,
    device: torch.device,
    num_ids: int,
    src_ids: torch.Tensor | None,
    dst_ids: torch.Tensor | None,
) -> None:
    num_pieces = plan.tables.shape[1]
    if num_ids == 0 or num_pieces == 0 or plan.max_words == 0:
        return
    tables = plan.tables.to(device, non_blocking=True)
    block = min(triton.next_power_of_2(plan.max_words), TILE_BYTES // plan.word_size)
    num_chunks = triton.cdiv(plan.max_words, block)
    dummy = tables[0]
    grid = (num_ids * num_pieces * num_chunks,)
    _copy_pieces_kernel[grid](
        src_ids if src_ids is not None else dummy,
        dst_ids if dst_ids is not None else dummy,
        tables[0],
        tables[1],
        tables[2],
        tables[3],
        tables[4],
        num_pieces,
        num_chunks,
        WORD=_WORDS[plan.word_size][1],
        VEC=plan.align // plan.word_size,
        ALIGN=plan.align,
        HAS_SRC_IDS=src_ids is not None,
        HAS_DST_IDS=dst_ids is not None,
        BLOCK=block,
        num_warps=4,
    )


def _common_num_blocks(kv_caches: Sequence[torch.Tensor], block_dim: int) -> int:
    return min((cache.shape[block_dim] for cache in kv_caches), default=0)


def gather_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor, *, block_dim: int = 0
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into the staging rows of ``out``; returns ``out``."""
    rows = staging_rows(out, block_ids.numel(), block_nbytes(kv_caches, block_dim))
    device = _launch_device([*kv_caches, out])
    ids = _prepare_ids(block_ids, _common_num_blocks(kv_caches, block_dim), "block_ids", device)
    src_sides = [_cache_side(cache, block_dim) for cache in kv_caches]
    plan = _plan(src_sides, _staging_sides(rows, kv_caches, block_dim))
    _run(plan, device, ids.numel(), ids, None)
    return out


def scatter_blocks(
    src: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, *, block_dim: int = 0
) -> None:
    """Write the staging rows of ``src`` into blocks ``block_ids`` of every layer (gather's inverse)."""
    rows = staging_rows(src, block_ids.numel(), block_nbytes(kv_caches, block_dim))
    device = _launch_device([*kv_caches, src])
    ids = _prepare_ids(block_ids, _common_num_blocks(kv_caches, block_dim), "block_ids", device)
    dst_sides = [_cache_side(cache, block_dim) for cache in kv_caches]
    plan = _plan(_staging_sides(rows, kv_caches, block_dim), dst_sides)
    _run(plan, device, ids.numel(), None, ids)


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
    device = _launch_device([*src_caches, *dst_caches])
    sids = _prepare_ids(src_ids, _common_num_blocks(src_caches, block_dim), "src_ids", device)
    dids = _prepare_ids(dst_ids, _common_num_blocks(dst_caches, block_dim), "dst_ids", device)
    plan = _plan(
        [_cache_side(cache, block_dim) for cache in src_caches],
        [_cache_side(cache, block_dim) for cache in dst_caches],
    )
    _run(plan, device, sids.numel(), sids, dids)
