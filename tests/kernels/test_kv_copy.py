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


def test_benchmark_script_checks_the_triton_kernels_under_the_interpreter() -> None:
    """The H200 script's Triton calls, on CPU tensors under TRITON_INTERPRET=1 (parity only)."""
    result = subprocess.run(
        [sys.executable, "benchmarks/kv_copy_gpu.py", "--device", "cpu", "--quick", "--threads", "1"],
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("triton-interp: gather, scatter, copy checked") == 2, result.stdout
    assert "parity failures: 0" in result.stdout


# ----- the torch reference's fast paths against a per-block ``select`` loop -----------------------


def _loop_gather(caches: list[torch.Tensor], ids: torch.Tensor, block_dim: int) -> torch.Tensor:
    rows = [torch.cat([_bytes(c.select(block_dim, int(i))) for c in caches]) for i in ids]
    return torch.stack(rows) if rows else torch.empty(0, reference.block_nbytes(caches, block_dim))


def _nan_heavy(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bytes with signalling/quiet NaN and -0.0 patterns planted for 16/8-byte words."""
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    flat = raw.reshape(-1)
    patterns = [0x7FF0000000000001, 0x7FF8000000000000, 0x8000000000000000, 0xFFF0000000000001]
    planted = torch.tensor([b for p in patterns for b in p.to_bytes(8, "little")], dtype=torch.uint8)
    for start in range(0, flat.numel() - planted.numel() + 1, 201):  # 201: every alignment mod 8
        flat[start : start + planted.numel()] = planted
    return raw


def _strided_cpu_layer(gen: torch.Generator, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    """A CPU-layout layer whose block stride exceeds its block (a view into a hybrid buffer)."""
    block = HEADS * BLOCK_SIZE * 2 * HEAD_DIM
    buffer = _nan_heavy((num_blocks, 3 * block * 2), gen).view(torch.bfloat16)
    return buffer[:, block : 2 * block].view(num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD_DIM)


@pytest.mark.parametrize("num_ids", [0, 1, 5, NUM_BLOCKS])
def test_reference_gather_and_scatter_equal_a_per_block_loop(num_ids: int) -> None:
    gen = torch.Generator().manual_seed(20 + num_ids)
    caches = [_strided_cpu_layer(gen) for _ in range(NUM_LAYERS)]
    caches.append(_nan_heavy((NUM_BLOCKS, 2, 3, 5), gen))  # odd sizes: byte words
    ids = _ids(num_ids, gen)
    out = reference.gather_blocks(caches, ids, _staging(caches, num_ids, 0))
    assert torch.equal(out, _loop_gather(caches, ids, 0).to(torch.uint8))
    src = _nan_heavy((num_ids, reference.block_nbytes(caches, 0)), gen)
    expected = [c.clone() for c in caches]
    for row, block in zip(src, ids.tolist(), strict=True):
        offset = 0
        for c in expected:
            n = reference.layer_block_nbytes(c, 0)
            c[block].view(-1).view(torch.uint8).copy_(row[offset : offset + n])
            offset += n
    reference.scatter_blocks(src, caches, ids)
    assert _same(caches, expected)


@pytest.mark.parametrize("ids_kind", ["dst_range", "src_range", "dst_runs", "fragmented"])
def test_reference_copy_paths_equal_a_per_block_loop(ids_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every path of the CPU copy (one range, sorted runs, bounce buffer) between caches of
    different block counts, with a bounce buffer small enough to take several steps."""
    monkeypatch.setattr(reference, "BOUNCE_BYTES", 3 * HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 2)
    gen = torch.Generator().manual_seed(30)
    src = [_strided_cpu_layer(gen, 40) for _ in range(2)]
    dst = [_strided_cpu_layer(gen, 33) for _ in range(2)]
    n = 16
    src_ids = torch.randperm(40, generator=gen)[:n]
    dst_ids = torch.randperm(33, generator=gen)[:n]
    if ids_kind == "dst_range":
        dst_ids = torch.arange(7, 7 + n)
    elif ids_kind == "src_range":
        src_ids = torch.arange(3, 3 + n)
    elif ids_kind == "dst_runs":  # 4 runs of 4 consecutive destination blocks, shuffled
        dst_ids = torch.cat([torch.arange(s, s + 4) for s in (0, 9, 18, 27)])[
            torch.randperm(n, generator=gen)
        ]
    expected = [d.clone() for d in dst]
    for s_id, d_id in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        for s, e in zip(src, expected, strict=True):
            e[d_id].copy_(s[s_id])
    reference.copy_blocks(src, dst, src_ids, dst_ids)
    assert _same(dst, expected)
    with pytest.raises(ValueError, match="geometry differs"):
        reference.copy_blocks(src, [d[:, :1] for d in dst], src_ids, dst_ids)
