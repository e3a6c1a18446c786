"""Host-memory block moves with streaming stores: the CPU backend of ``kernels``.

Same functions, arguments and staging format as ``kernels.reference`` (which documents them); the
difference is how the bytes move. A layer whose block is one contiguous run of bytes (the vLLM
CPU layout, also views into a hybrid buffer) is moved by one call into a row copier that LLVM
compiles for this CPU at first use (through ``llvmlite``, which vLLM brings with numba): for each
pair ``(dst + dst_offsets[i], src + src_offsets[i])`` it copies ``nbytes`` with unaligned vector
loads and 64-byte-aligned non-temporal (streaming) stores, then one ``sfence``. The call releases
the GIL; block ids are checked against the cache's block count before it runs.

Why streaming stores: an ordinary store to a line that is not in the cache first reads that line
(read-for-ownership), so a copy with ordinary stores moves three bytes over the memory bus for
every byte copied (read source, read destination, write destination) and a streaming copy two.
glibc's memcpy switches to streaming stores only above ``x86_non_temporal_threshold`` (114 MiB
here), so one large memcpy streams while a copy split into KV pages (64 KiB) does not, whatever
the access order: measured in ``docs/benchmarks.md`` (offload section). Calls moving fewer than
``STREAM_MIN_BYTES`` per layer use ordinary stores (``memcpy`` per block), keeping small loads in
the cache the next forward pass reads them from.

Everything else falls back to ``kernels.reference``: other layouts (FlashAttention's K/V split,
sliced views), tensors not on the CPU, a source and destination sharing one storage, and a
machine where ``llvmlite`` cannot be imported or the copier cannot be compiled (``available()``
says which).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kernels import reference
from kernels.reference import (
    _byte_rows,
    _check_ids,
    block_nbytes,
    layer_block_nbytes,
    staging_rows,
)

__all__ = ["STREAM_MIN_BYTES", "available", "copy_blocks", "gather_blocks", "move_rows", "scatter_blocks"]

#: Bytes per layer and call from which the copier uses streaming stores (the L2 size of a core).
STREAM_MIN_BYTES = 4 << 20

# copy_rows_<kind>(dst, src, dst_offsets, src_offsets, num_rows, nbytes): row i of nbytes bytes
# from src + src_offsets[i] to dst + dst_offsets[i]. `nt`: head bytes up to the destination's next
# 64-byte boundary and the tail with llvm.memcpy, the body in 64-byte vectors stored
# !nontemporal, one sfence after the last row. `cached`: llvm.memcpy per row (libc memcpy).
_IR = r"""
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)
declare void @llvm.x86.sse.sfence()

define void @copy_rows_nt(ptr %dst, ptr %src, ptr %doff, ptr %soff, i64 %n, i64 %nbytes) {
entry:
  %any = icmp sgt i64 %n, 0
  br i1 %any, label %row, label %done
row:
  %i = phi i64 [0, %entry], [%i1, %tail]
  %dop = getelementptr i64, ptr %doff, i64 %i
  %do = load i64, ptr %dop
  %sop = getelementptr i64, ptr %soff, i64 %i
  %so = load i64, ptr %sop
  %d = getelementptr i8, ptr %dst, i64 %do
  %s = getelementptr i8, ptr %src, i64 %so
  %dint = ptrtoint ptr %d to i64
  %mis = and i64 %dint, 63
  %gap = sub i64 64, %mis
  %gap63 = and i64 %gap, 63
  %short = icmp ult i64 %gap63, %nbytes
  %head = select i1 %short, i64 %gap63, i64 %nbytes
  call void @llvm.memcpy.p0.p0.i64(ptr %d, ptr %s, i64 %head, i1 false)
  %rest = sub i64 %nbytes, %head
  %body = and i64 %rest, -64
  %d2 = getelementptr i8, ptr %d, i64 %head
  %s2 = getelementptr i8, ptr %s, i64 %head
  %hasbody = icmp ugt i64 %body, 0
  br i1 %hasbody, label %loop, label %tail
loop:
  %k = phi i64 [0, %row], [%k1, %loop]
  %sp = getelementptr i8, ptr %s2, i64 %k
  %dp = getelementptr i8, ptr %d2, i64 %k
  %v = load <8 x i64>, ptr %sp, align 1
  store <8 x i64> %v, ptr %dp, align 64, !nontemporal !0
  %k1 = add i64 %k, 64
  %more = icmp ult i64 %k1, %body
  br i1 %more, label %loop, label %tail
tail:
  %t = sub i64 %rest, %body
  %d3 = getelementptr i8, ptr %d2, i64 %body
  %s3 = getelementptr i8, ptr %s2, i64 %body
  call void @llvm.memcpy.p0.p0.i64(ptr %d3, ptr %s3, i64 %t, i1 false)
  %i1 = add i64 %i, 1
  %again = icmp slt i64 %i1, %n
  br i1 %again, label %row, label %fence
fence:
  call void @llvm.x86.sse.sfence()
  br label %done
done:
  ret void
}

define void @copy_rows_cached(ptr %dst, ptr %src, ptr %doff, ptr %soff, i64 %n, i64 %nbytes) {
entry:
  %any = icmp sgt i64 %n, 0
  br i1 %any, label %row, label %done
row:
  %i = phi i64 [0, %entry], [%i1, %row]
  %dop = getelementptr i64, ptr %doff, i64 %i
  %do = load i64, ptr %dop
  %sop = getelementptr i64, ptr %soff, i64 %i
  %so = load i64, ptr %sop
  %d = getelementptr i8, ptr %dst, i64 %do
  %s = getelementptr i8, ptr %src, i64 %so
  call void @llvm.memcpy.p0.p0.i64(ptr %d, ptr %s, i64 %nbytes, i1 false)
  %i1 = add i64 %i, 1
  %again = icmp slt i64 %i1, %n
  br i1 %again, label %row, label %done
done:
  ret void
}

!0 = !{i32 1}
"""

_RowCopier = Callable[[int, int, int, int, int, int], None]
_SIGNATURE = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64
)
_lock = threading.Lock()
_compiled: dict[str, Any] = {}  # "nt"/"cached" -> ctypes function; "engine" keeps the code alive


def _compile() -> None:
    import llvmlite.binding as llvm  # type: ignore[import-untyped]

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = llvm.parse_assembly(_IR)
    module.verify()
    target = llvm.Target.from_default_triple()
    machine = target.create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3
    )
    builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
    builder.getModulePassManager().run(module, builder)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    _compiled["engine"] = engine
    for kind in ("nt", "cached"):
        _compiled[kind] = _SIGNATURE(engine.get_function_address(f"copy_rows_{kind}"))


def available() -> bool:
    """Whether the row copier is compiled (compiling it on first call); False without llvmlite."""
    with _lock:
        if "error" not in _compiled and "nt" not in _compiled:
            try:
                _compile()
            except Exception as exc:  # no llvmlite, not x86, LLVM refused: the reference takes over
                _compiled["error"] = exc
        return "nt" in _compiled


def _copier(streaming: bool) -> _RowCopier:
    if not available():
        raise RuntimeError(f"the streaming row copier is not available: {_compiled.get('error')!r}")
    return _compiled["nt" if streaming else "cached"]  # type: ignore[no-any-return]


def _checked_ids(ids: torch.Tensor, num_blocks: int, name: str) -> torch.Tensor:
    ids = ids.to("cpu", torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise IndexError(f"{name} out of range for {num_blocks} blocks")
    return ids


def _byte_layout(cache: torch.Tensor, block_dim: int) -> tuple[int, int] | None:
    """``(byte offset, block stride)`` of a CPU layer whose blocks are contiguous runs, else None."""
    if cache.device.type != "cpu":
        return None
    return _byte_rows(cache, block_dim)


def move_rows(
    dst: torch.Tensor,
    dst_offsets: torch.Tensor,
    src: torch.Tensor,
    src_offsets: torch.Tensor,
    nbytes: int,
    *,
    streaming: bool | None = None,
) -> None:
    """Row i: ``nbytes`` from byte ``src_offsets[i]`` of src's storage to ``dst_offsets[i]`` of dst's.

    No bounds checks: the offsets (contiguous int64 CPU tensors) must lie inside both storages.
    ``streaming`` picks the stores; None: streaming from ``STREAM_MIN_BYTES`` moved in all.
    """
    num_rows = dst_offsets.numel()
    if num_rows == 0 or nbytes == 0:
        return
    if streaming is None:
        streaming = num_rows * nbytes >= STREAM_MIN_BYTES
    _copier(streaming)(
        dst.untyped_storage().data_ptr(),
        src.untyped_storage().data_ptr(),
        dst_offsets.data_ptr(),
        src_offsets.data_ptr(),
        num_rows,
        nbytes,
    )


def _row_offsets(rows: torch.Tensor, num_ids: int, row_bytes: int) -> torch.Tensor:
    """Byte offset of each staging row in its storage."""
    return torch.arange(num_ids, dtype=torch.int64).mul_(row_bytes).add_(int(rows.storage_offset()))


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _streamable(kv_caches: Sequence[torch.Tensor], staging: torch.Tensor, block_dim: int) -> bool:
    return (
        staging.device.type == "cpu"
        and all(_byte_layout(c, block_dim) is not None for c in kv_caches)
        and not any(_shares_storage(c, staging) for c in kv_caches)
        and available()
    )


def gather_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor, *, block_dim: int = 0
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into the staging rows of ``out``; returns ``out``."""
    if not _streamable(kv_caches, out, block_dim):
        return reference.gather_blocks(kv_caches, block_ids, out, block_dim=block_dim)
    _check_ids(block_ids, "block_ids")
    num_ids = block_ids.numel()
    row_bytes = block_nbytes(kv_caches, block_dim)
    rows = staging_rows(out, num_ids, row_bytes)
    rows_at = _row_offsets(rows, num_ids, row_bytes)
    offset = 0
    for cache in kv_caches:
        nbytes = layer_block_nbytes(cache, block_dim)
        src_off, src_stride = _byte_rows(cache, block_dim)  # type: ignore[misc]
        ids = _checked_ids(block_ids, cache.shape[block_dim], "block_ids")
        move_rows(rows, rows_at.add(offset), cache, ids * src_stride + src_off, nbytes)
        offset += nbytes
    return out


def scatter_blocks(
    src: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, *, block_dim: int = 0
) -> None:
    """Write the staging rows of ``src`` into blocks ``block_ids`` of every layer (gather's inverse)."""
    if not _streamable(kv_caches, src, block_dim):
        reference.scatter_blocks(src, kv_caches, block_ids, block_dim=block_dim)
        return
    _check_ids(block_ids, "block_ids")
    num_ids = block_ids.numel()
    row_bytes = block_nbytes(kv_caches, block_dim)
    rows = staging_rows(src, num_ids, row_bytes)
    rows_at = _row_offsets(rows, num_ids, row_bytes)
    offset = 0
    for cache in kv_caches:
        nbytes = layer_block_nbytes(cache, block_dim)
        dst_off, dst_stride = _byte_rows(cache, block_dim)  # type: ignore[misc]
        ids = _checked_ids(block_ids, cache.shape[block_dim], "block_ids")
        move_rows(cache, ids * dst_stride + dst_off, rows, rows_at.add(offset), nbytes)
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
    reference.check_copy_args(src_caches, dst_caches, src_ids, dst_ids, block_dim)
    for src, dst in zip(src_caches, dst_caches, strict=True):
        src_fast, dst_fast = _byte_layout(src, block_dim), _byte_layout(dst, block_dim)
        if src_fast is None or dst_fast is None or _shares_storage(src, dst) or not available():
            reference.copy_blocks([src], [dst], src_ids, dst_ids, block_dim=block_dim)
            continue
        (src_off, src_stride), (dst_off, dst_stride) = src_fast, dst_fast
        sids = _checked_ids(src_ids, src.shape[block_dim], "src_ids")
        dids = _checked_ids(dst_ids, dst.shape[block_dim], "dst_ids")
        nbytes = layer_block_nbytes(src, block_dim)
        move_rows(dst, dids * dst_stride + dst_off, src, sids * src_stride + src_off, nbytes)
