"""Parity of the Triton KV-block movers with the torch reference, on CPU through Triton's interpreter.

Random data, several dtypes, the vLLM CPU layout ``[N, H, bs, 2D]`` and the FlashAttention layout
``[2, N, bs, H, D]`` (contiguous and block-major stride order), a sliced layout whose blocks split
into many runs, layers that alias one buffer, and random non-contiguous block ids.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import kernels
from kernels import reference

REPO = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 12
NUM_LAYERS = 3
HEADS, BLOCK_SIZE, HEAD_DIM = 2, 4, 8

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float8_e4m3fn]
LAYOUTS = ["cpu", "flash", "flash_block_major", "k_slice"]


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    return torch.randn(shape, generator=gen).to(dtype)


def _cache(layout: str, dtype: torch.dtype, gen: torch.Generator, head_dim: int = HEAD_DIM) -> torch.Tensor:
    """One layer's cache in ``layout``; its block dimension is ``_block_dim(layout)``."""
    if layout == "cpu":
        return _random((NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * head_dim), dtype, gen)
    if layout == "flash":
        return _random((2, NUM_BLOCKS, BLOCK_SIZE, HEADS, head_dim), dtype, gen)
    if layout == "flash_block_major":
        return _random((NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, head_dim), dtype, gen).transpose(0, 1)
    if layout == "k_slice":  # K half of the CPU layout: runs of head_dim elements
        return _random((NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * head_dim), dtype, gen)[..., :head_dim]
    raise AssertionError(layout)


def _block_dim(layout: str) -> int:
    return 1 if layout.startswith("flash") else 0


def _caches(layout: str, dtype: torch.dtype, gen: torch.Generator, **kw: int) -> list[torch.Tensor]:
    return [_cache(layout, dtype, gen, **kw) for _ in range(NUM_LAYERS)]


def _ids(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(NUM_BLOCKS, generator=gen)[:n]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(_bytes(x), _bytes(y)) for x, y in zip(a, b, strict=True))


def _staging(
    caches: list[torch.Tensor], n: int, block_dim: int, dtype: torch.dtype = torch.uint8
) -> torch.Tensor:
    nbytes = reference.block_nbytes(caches, block_dim)
    return torch.full((n, nbytes), 7, dtype=torch.uint8).view(dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_matches_reference(kv_copy: ModuleType, layout: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    caches, ids, bd = _caches(layout, dtype, gen), _ids(5, gen), _block_dim(layout)
    expected = reference.gather_blocks(caches, ids, _staging(caches, 5, bd), block_dim=bd)
    got = kv_copy.gather_blocks(caches, ids, _staging(caches, 5, bd), block_dim=bd)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=str)
def test_scatter_matches_reference_and_leaves_other_blocks_alone(
    kv_copy: ModuleType, layout: str, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(2)
    caches, ids, bd = _caches(layout, dtype, gen), _ids(4, gen), _block_dim(layout)
    src = torch.randint(0, 256, (4, reference.block_nbytes(caches, bd)), generator=gen, dtype=torch.uint8)
    expected = [c.clone() for c in caches]
    reference.scatter_blocks(src, expected, ids, block_dim=bd)
    kv_copy.scatter_blocks(src, caches, ids, block_dim=bd)
    assert _same(caches, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_then_scatter_round_trips(kv_copy: ModuleType, layout: str) -> None:
    gen = torch.Generator().manual_seed(3)
    caches, ids, bd = _caches(layout, torch.bfloat16, gen), _ids(6, gen), _block_dim(layout)
    staged = kv_copy.gather_blocks(caches, ids, _staging(caches, 6, bd, torch.bfloat16), block_dim=bd)
    blank = [torch.zeros_like(c) for c in caches]
    kv_copy.scatter_blocks(staged, blank, ids, block_dim=bd)
    assert _same([c.index_select(bd, ids) for c in blank], [c.index_select(bd, ids) for c in caches])
    original = [c.clone() for c in caches]
    kv_copy.scatter_blocks(staged, caches, ids, block_dim=bd)  # writing a block back is the identity
    assert _same(caches, original)


@pytest.mark.parametrize(
    ("src_layout", "dst_layout"),
    [("cpu", "cpu"), ("flash", "flash_block_major"), ("flash_block_major", "flash"), ("cpu", "k_slice")],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_copy_between_stride_orders_matches_reference(
    kv_copy: ModuleType, src_layout: str, dst_layout: str, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(4)
    bd = _block_dim(src_layout)
    src = _caches(src_layout, dtype, gen)
    if dst_layout == "k_slice":  # same geometry as src: [N, H, bs, D] views with runs of D
        src = [c[..., :HEAD_DIM].contiguous() for c in src]
    dst = _caches(dst_layout, dtype, gen)
    src_ids, dst_ids = _ids(5, gen), _ids(5, gen)
    expected = [d.clone() for d in dst]
    reference.copy_blocks(src, expected, src_ids, dst_ids, block_dim=bd)
    kv_copy.copy_blocks(src, dst, src_ids, dst_ids, block_dim=bd)
    assert _same(dst, expected)


def test_odd_byte_sizes_use_byte_words(kv_copy: ModuleType) -> None:
    gen = torch.Generator().manual_seed(5)
    caches = _caches("cpu", torch.int8, gen, head_dim=3)
    caches = [c[..., 1:4] for c in caches]  # runs of 3 bytes at odd addresses
    ids = _ids(4, gen)
    expected = reference.gather_blocks(caches, ids, _staging(caches, 4, 0))
    assert torch.equal(kv_copy.gather_blocks(caches, ids, _staging(caches, 4, 0)), expected)


def test_layers_aliasing_one_buffer(kv_copy: ModuleType) -> None:
    """Hybrid allocator: layers are views of one buffer; each listed view is staged in turn."""
    gen = torch.Generator().manual_seed(6)
    buffer = _random((NUM_BLOCKS, HEADS * BLOCK_SIZE * 2 * HEAD_DIM), torch.bfloat16, gen)
    caches = [
        buffer.view(NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM),
        buffer.view(NUM_BLOCKS, HEADS * BLOCK_SIZE, 2, HEAD_DIM),
        buffer.view(torch.int16).view(NUM_BLOCKS, -1),
    ]
    ids = _ids(5, gen)
    staged = kv_copy.gather_blocks(caches, ids, _staging(caches, 5, 0))
    assert torch.equal(staged, reference.gather_blocks(caches, ids, _staging(caches, 5, 0)))
    original = buffer.clone()
    kv_copy.scatter_blocks(staged, caches, ids)
    assert torch.equal(buffer.view(torch.int16), original.view(torch.int16))


def test_empty_ids_touch_nothing(kv_copy: ModuleType) -> None:
    gen = torch.Generator().manual_seed(7)
    caches = _caches("flash", torch.bfloat16, gen)
    ids = torch.empty(0, dtype=torch.int64)
    out = _staging(caches, 0, 1)
    assert kv_copy.gather_blocks(caches, ids, out, block_dim=1).numel() == 0


def test_invalid_arguments_are_refused(kv_copy: ModuleType) -> None:
    gen = torch.Generator().manual_seed(8)
    caches = _caches("cpu", torch.bfloat16, gen)
    with pytest.raises(ValueError, match="staging buffer holds"):
        kv_copy.gather_blocks(caches, _ids(3, gen), _staging(caches, 2, 0))
    with pytest.raises(IndexError, match="out of range"):
        kv_copy.gather_blocks(caches, torch.tensor([0, NUM_BLOCKS]), _staging(caches, 2, 0))
    with pytest.raises(ValueError, match="geometry differs"):
        kv_copy.copy_blocks(caches, [c.float() for c in caches], _ids(2, gen), _ids(2, gen))


def test_dispatcher_uses_reference_on_cpu_and_triton_when_asked(
    kv_copy: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(9)
    caches, ids = _caches("flash", torch.float16, gen), _ids(3, gen)
    expected = reference.gather_blocks(caches, ids, _staging(caches, 3, 1), block_dim=1)
    calls: list[str] = []

    def spy(module: ModuleType) -> None:
        original = module.gather_blocks
        monkeypatch.setattr(
            module, "gather_blocks", lambda *a, **k: calls.append(module.__name__) or original(*a, **k)
        )

    spy(reference)
    spy(kv_copy)
    monkeypatch.delenv("AGENTGW_KERNELS", raising=False)
    assert torch.equal(kernels.gather_blocks(caches, ids, _staging(caches, 3, 1), block_dim=1), expected)
    monkeypatch.setenv("AGENTGW_KERNELS", "triton")
    assert torch.equal(kernels.gather_blocks(caches, ids, _staging(caches, 3, 1), block_dim=1), expected)
    assert calls == ["kernels.reference", "kernels.kv_copy"]
    monkeypatch.setenv("AGENTGW_KERNELS", "cuda")
    with pytest.raises(ValueError, match="AGENTGW_KERNELS"):
        kernels.gather_blocks(caches, ids, _staging(caches, 3, 1), block_dim=1)


def test_dispatcher_round_trip_through_reference() -> None:
    gen = torch.Generator().manual_seed(10)
    caches, ids = _caches("cpu", torch.bfloat16, gen), _ids(4, gen)
    staged = kernels.gather_blocks(caches, ids, _staging(caches, 4, 0))
    blank = [torch.zeros_like(c) for c in caches]
    kernels.scatter_blocks(staged, blank, ids)
    moved = [torch.zeros_like(c) for c in caches]
    kernels.copy_blocks(blank, moved, ids, ids)
    assert _same([c[ids] for c in moved], [c[ids] for c in caches])


def test_import_kernels_works_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in sys.modules if name == "kernels" or name.startswith("kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    fresh = importlib.import_module("kernels")
    caches = [torch.randn(4, 2, 3, 8)]
    out = fresh.gather_blocks(
        caches, torch.tensor([3, 1]), torch.empty(2, fresh.block_nbytes(caches), dtype=torch.uint8)
    )
    assert torch.equal(out.view(torch.float32).view(2, 2, 3, 8), caches[0][[3, 1]])


_COMPILE_FOR_H200 = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import kv_copy
pointers = ["src_ids_ptr", "dst_ids_ptr", "src_addr_ptr", "src_stride_ptr", "dst_addr_ptr",
            "dst_stride_ptr", "len_ptr"]
signature = {name: "*i64" for name in pointers} | {"num_pieces": "i64", "num_chunks": "i64"}
constexprs = dict(WORD=tl.int32, VEC=4, ALIGN=16, HAS_SRC_IDS=True, HAS_DST_IDS=False, BLOCK=2048)
signature |= {name: "constexpr" for name in constexprs}
source = ASTSource(fn=kv_copy._copy_pieces_kernel, signature=signature, constexprs=constexprs)
print(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"])
"""


def test_kernel_compiles_for_h200_with_128_bit_accesses() -> None:
    """Compiling needs no GPU: Triton's NVIDIA backend lowers the kernel to PTX for sm_90 here."""
    import triton.backends.nvidia.compiler  # noqa: F401  (ships with triton; no GPU needed)

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_H200],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "ld.global.v4.b32" in result.stdout
    assert "st.global.v4.b32" in result.stdout


def test_benchmark_script_runs_on_cpu() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/kv_copy_gpu.py", "--device", "cpu", "--quick", "--threads", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "GB/s" in result.stdout
