"""FP8 (e4m3) block quantization of KV bytes, for compact objects in the store tier.

A run of 16-bit float KV values (bf16 or fp16, as the CPU platform's cache holds them) is cut
into groups of ``group`` consecutive values; each group gets one float32 scale
``amax(|x|) / 448`` (1.0 for an all-zero group) and its values become
``e4m3(clamp(x / scale, -448, 448))`` (round to nearest even, torch's conversion). Packed
format, one contiguous byte run: ``[num_values fp8 bytes][num_values / group float32 scales]``,
so 16-bit KV shrinks to ``(1 + 4 / group) / 2`` of its bytes (0.516 with ``group = 128``).
Dequantization is ``fp8 * scale`` rounded back to the cache dtype. Every step is an IEEE
correctly rounded float32 operation (the scale and the quotient are true divisions), so a GPU
packs the same bytes as the CPU (checked on an H200 by ``benchmarks/kv_copy_gpu.py``). Non-finite inputs are not
supported (KV values are finite).

Implementation: torch operations, which run on CPU and, unchanged, as CUDA kernels on a GPU.
There is no Triton kernel for this: Triton 3.9's interpreter (the only way to run Triton here)
mis-rounds float32 -> e4m3 when rounding carries into the exponent (125.01 / 1.0 gives 64, not
128), so a Triton version could not be checked for parity on this machine.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "dequantize_fp8", "fp8_nbytes", "quantize_fp8"]

FP8_MAX = 448.0
_FLOAT16 = (torch.bfloat16, torch.float16)


def fp8_nbytes(num_values: int, group: int) -> int:
    """Bytes of the packed form of ``num_values`` values."""
    if group <= 0 or group % 4 or num_values % group:
        raise ValueError(f"{num_values} values do not split into groups of {group} (a multiple of 4)")
    return num_values + 4 * (num_values // group)


def _split(packed: torch.Tensor, num_values: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    nbytes = fp8_nbytes(num_values, group)
    if not packed.is_contiguous() or packed.numel() * packed.element_size() != nbytes:
        raise ValueError(f"the packed buffer must be {nbytes} contiguous bytes")
    raw = packed.reshape(-1).view(torch.uint8)
    return raw[:num_values].view(torch.float8_e4m3fn), raw[num_values:].view(torch.float32)


def quantize_fp8(values: torch.Tensor, out: torch.Tensor, *, group: int = 128) -> torch.Tensor:
    """Pack ``values`` (bf16/fp16, contiguous) into ``out`` (``fp8_nbytes`` bytes); returns ``out``."""
    if values.dtype not in _FLOAT16 or not values.is_contiguous():
        raise ValueError(f"quantize_fp8 takes contiguous bf16/fp16 values, got {values.dtype}")
    payload, scales = _split(out, values.numel(), group)
    x = values.reshape(-1, group).float()
    amax = x.abs().amax(dim=1)
    # A tensor divisor, not the Python float: CUDA divides by a scalar as a multiply by its
    # reciprocal (1 ulp off for some amax), and the bytes must not depend on the device.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    payload.view(-1, group).copy_(x.div_(scale[:, None]).clamp_(-FP8_MAX, FP8_MAX))
    scales.copy_(scale)
    return out


def dequantize_fp8(packed: torch.Tensor, out: torch.Tensor, *, group: int = 128) -> torch.Tensor:
    """Unpack ``packed`` into ``out`` (bf16/fp16, contiguous, its values in place); returns ``out``."""
    if out.dtype not in _FLOAT16 or not out.is_contiguous():
        raise ValueError(f"dequantize_fp8 writes contiguous bf16/fp16 values, got {out.dtype}")
    payload, scales = _split(packed, out.numel(), group)
    values = payload.view(-1, group).float().mul_(scales[:, None])
    out.view(-1, group).copy_(values)
    return out
