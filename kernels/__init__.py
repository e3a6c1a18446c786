"""Move paged KV-cache blocks between caches and contiguous staging buffers, on any device.

One entry point per operation; each picks an implementation per call:

- ``kernels.kv_copy`` (Triton) when every tensor is on CUDA, or a CPU side is pinned next to a
  CUDA side, or ``AGENTGW_KERNELS=triton`` (CPU tensors then need ``TRITON_INTERPRET=1`` set
  before the first call);
- ``kernels.host_copy`` (one JIT-compiled row copier with streaming stores, through ``llvmlite``)
  when every tensor is on the CPU, or ``AGENTGW_KERNELS=stream``; it hands what it cannot move
  (layouts whose blocks are not contiguous runs, no ``llvmlite``) to the reference;
- ``kernels.reference`` (torch ``index_select`` / ``index_copy_``) otherwise, or whenever
  ``AGENTGW_KERNELS=torch``.

Triton is imported only when chosen, so ``import kernels`` works without it. Layouts, the staging
format and the meaning of ``block_dim`` are documented in ``kernels/reference.py``.

``quantize_fp8`` / ``dequantize_fp8`` (``kernels/fp8.py``): e4m3 with one scale per group of
values, the store tier's optional compact object format; torch operations on every device.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

import torch

from kernels import host_copy, reference
from kernels.fp8 import dequantize_fp8, fp8_nbytes, quantize_fp8
from kernels.reference import block_nbytes

__all__ = [
    "block_nbytes",
    "copy_blocks",
    "dequantize_fp8",
    "fp8_nbytes",
    "gather_blocks",
    "quantize_fp8",
    "scatter_blocks",
]

_BACKEND_ENV = "AGENTGW_KERNELS"


class _Backend(Protocol):
    """What each implementation module (``kv_copy``, ``host_copy``, ``reference``) provides."""

    def gather_blocks(
        self,
        kv_caches: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        out: torch.Tensor,
        *,
        block_dim: int = 0,
    ) -> torch.Tensor: ...

    def scatter_blocks(
        self,
        src: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        block_ids: torch.Tensor,
        *,
        block_dim: int = 0,
    ) -> None: ...

    def copy_blocks(
        self,
        src_caches: Sequence[torch.Tensor],
        dst_caches: Sequence[torch.Tensor],
        src_ids: torch.Tensor,
        dst_ids: torch.Tensor,
        *,
        block_dim: int = 0,
    ) -> None: ...


def _backend(tensors: Sequence[torch.Tensor]) -> _Backend:
    choice = os.environ.get(_BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice == "torch":
        return reference
    if choice == "stream":
        if not host_copy.available():
            raise RuntimeError(f"{_BACKEND_ENV}=stream but the streaming row copier is not available")
        return host_copy
    if choice == "auto":
        if all(t.device.type == "cpu" for t in tensors):
            return host_copy
        if not all(t.is_cuda or t.is_pinned() for t in tensors):
            return reference
    elif choice != "triton":
        raise ValueError(f"{_BACKEND_ENV} must be 'auto', 'triton', 'stream' or 'torch', not {choice!r}")
    from kernels import kv_copy

    return kv_copy


def gather_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor, *, block_dim: int = 0
) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into the staging rows of ``out``; returns ``out``."""
    return _backend([*kv_caches, out]).gather_blocks(kv_caches, block_ids, out, block_dim=block_dim)


def scatter_blocks(
    src: torch.Tensor, kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor, *, block_dim: int = 0
) -> None:
    """Write the staging rows of ``src`` into blocks ``block_ids`` of every layer (gather's inverse)."""
    _backend([*kv_caches, src]).scatter_blocks(src, kv_caches, block_ids, block_dim=block_dim)


def copy_blocks(
    src_caches: Sequence[torch.Tensor],
    dst_caches: Sequence[torch.Tensor],
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    *,
    block_dim: int = 0,
) -> None:
    """Copy block ``src_ids[i]`` of each source layer to block ``dst_ids[i]`` of the destination layer."""
    _backend([*src_caches, *dst_caches]).copy_blocks(
        src_caches, dst_caches, src_ids, dst_ids, block_dim=block_dim
    )
