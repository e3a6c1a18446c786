"""FP8 (e4m3, per-group scales) packing of KV values: size, scales, error bound, exact cases."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.fp8 import FP8_MAX


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp(torch.randn(n, generator=gen) * 2)  # many binades, finite in fp16
    return (torch.randn(n, generator=gen) * spread).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [64, 128])
def test_round_trip_stays_within_e4m3_precision(dtype: torch.dtype, group: int) -> None:
    x = _values(32 * group, dtype, seed=group)
    packed = torch.empty(kernels.fp8_nbytes(x.numel(), group), dtype=torch.uint8)
    kernels.quantize_fp8(x, packed, group=group)
    assert packed.numel() == x.numel() * (1 + 4 / group)
    scales = packed[x.numel() :].view(torch.float32)
    amax = x.float().view(-1, group).abs().amax(1)
    assert torch.allclose(scales, amax / FP8_MAX)
    back = kernels.dequantize_fp8(packed, torch.empty_like(x), group=group)
    err = (back.float() - x.float()).abs().view(-1, group)
    # e4m3: 3 mantissa bits (half an ulp = 2^-4 relative), subnormal step 2^-9 of the scale;
    # plus the final rounding to the 16-bit cache dtype.
    bound = x.float().abs().view(-1, group) * (2**-4 + 2**-7) + scales[:, None] * 2**-9
    assert bool((err <= bound).all())


def test_values_on_the_fp8_grid_come_back_exactly() -> None:
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)][:128]  # the 128 non-negative finite e4m3 values, 0 to 448
    grid[0] = FP8_MAX  # pin the group's amax to 448 so the scale is exactly 1
    x = (grid * 0.25).to(torch.bfloat16)  # power-of-two scale: exact in bf16 and after scaling
    packed = kernels.quantize_fp8(x, torch.empty(kernels.fp8_nbytes(128, 128), dtype=torch.uint8))
    assert torch.equal(kernels.dequantize_fp8(packed, torch.empty_like(x)), x)


def test_zero_group_is_zero_and_bad_arguments_are_refused() -> None:
    x = torch.zeros(256, dtype=torch.bfloat16)
    x[128:] = 1.5
    packed = kernels.quantize_fp8(x, torch.empty(kernels.fp8_nbytes(256, 128), dtype=torch.uint8))
    assert torch.equal(kernels.dequantize_fp8(packed, torch.empty_like(x)), x)
    with pytest.raises(ValueError, match="groups of"):
        kernels.fp8_nbytes(100, 128)
    with pytest.raises(ValueError, match="bf16/fp16"):
        kernels.quantize_fp8(x.float(), packed)
    with pytest.raises(ValueError, match="contiguous bytes"):
        kernels.quantize_fp8(x, packed[:-1])


def test_scales_and_payload_are_correctly_rounded_float32_divisions() -> None:
    """The packing the H200 reproduces byte for byte: each scale is amax / 448 rounded once to
    float32 (a true division, not a multiply by a rounded reciprocal), and each payload byte is
    e4m3 of the correctly rounded quotient (float64 division rounded to float32 is exact here)."""
    x = _values(64 * 128, torch.bfloat16, seed=7)
    packed = kernels.quantize_fp8(x, torch.empty(kernels.fp8_nbytes(x.numel(), 128), dtype=torch.uint8))
    amax = x.double().view(-1, 128).abs().amax(1)
    want_scales = (amax / FP8_MAX).float()
    assert torch.equal(packed[x.numel() :].view(torch.float32), want_scales)
    quotient = (x.double().view(-1, 128) / want_scales.double()[:, None]).float()
    want_payload = quotient.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)
    assert torch.equal(packed[: x.numel()], want_payload)
